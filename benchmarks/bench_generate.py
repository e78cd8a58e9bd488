"""`jaxprep generate` against transformers' ``generate`` on the same machine, whole processes, random
checkpoints of real shapes built by transformers itself (`bench_real_models.build_checkpoint`).

    python benchmarks/bench_generate.py --part equality   # float32 greedy tokens, Qwen3 and Llama shapes
    python benchmarks/bench_generate.py --part speed      # the GPU table: prefill, decode, 16 concurrent, wall
    python benchmarks/bench_generate.py --part ... --dry-run   # tiny widths, a few tokens: checks the script

``--part equality``: Qwen3-0.6B's and Llama-3.2-1B's shapes cut to ``--layers`` layers (default 4),
float32, three prompts (7, 100 and 700 tokens) served together by ``jaxprep generate --budget 256``
(chunked prefill, mixed batches), and each prompt alone through transformers' ``generate`` (greedy,
EOS ignored on both sides; TF32 off) on the same device. Per model: the tokens compared up to each
prompt's first difference; a difference is a near-tie when jaxprep's token's logit is within
`NEAR_TIE` of transformers' top logit there (random weights), a mismatch otherwise (exit 1).

``--part speed`` (the issue's workloads; Qwen3-0.6B's shape, all 28 layers, bf16):

- 1 x 1500-token prompt, 64 new: prefill tokens/s and decode ms/token; `jaxprep generate` twice in a
  row with one compile cache folder (``JAXPREP_CACHE_DIR``, fresh per run): the first process
  compiles, the second finds the cache warm; transformers once. *wall* is the whole process.
- 16 x 128-token prompts, 64 new: jaxprep's decode tokens/s; transformers' one batch, its generated
  tokens over its generate time.

jaxprep's rates are its `PhaseClock` split (compiles excluded); transformers' prefill is the time to
its first token (a streamer marks it, after a device sync), its decode the rest. A goals table
follows; on CPU (or ``--dry-run``) the goals are not checked.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # this process holds no GPU memory its children need
sys.path.insert(0, os.path.dirname(__file__))

from bench_real_models import build_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEAR_TIE = 1e-4
"""A first difference whose logit gap (transformers' top minus jaxprep's token) is at most this is a near-tie."""
TINY = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 16384, "initializer_range": 0.1,
        "bos_token_id": 1, "eos_token_id": 2}
"""A dry run's widths (the shapes' families, RoPE and norms kept)."""
GOALS = {"decode_ms_per_token": 1.0, "concurrent_tokens_per_s": 10_000.0}


@dataclasses.dataclass(frozen=True)
class Run:
    """One side's run of some prompts: what to time and what came out."""

    prompt_lens: tuple[int, ...]
    max_tokens: int
    dtype: str


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("equality", "speed"), required=True)
    parser.add_argument("--dry-run", action="store_true", help="tiny widths, few tokens: checks the script")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers kept (default: equality 4, speed all; a dry run 2)")
    parser.add_argument("--budget", type=int, default=256, help="jaxprep generate --budget (tokens per step)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "jaxprep-bench-generate"))
    return parser.parse_args(argv)


# --- the two sides, each a process ---------------------------------------------------------------

def prompts_for(run: Run, vocab_size: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    low = min(1000, vocab_size // 4)  # real vocabularies: clear of the special ids at either end
    return [rng.integers(low, vocab_size - low, n).tolist() for n in run.prompt_lens]


def jaxprep_process(directory: str, run: Run, vocab_size: int, budget: int, cache_dir: str,
                    extra: tuple[str, ...] = ()) -> dict:
    """`jaxprep generate --json` in its own process: its outputs, rates and wall seconds (``extra``: more flags)."""
    argv = [sys.executable, "-m", "jaxprep", "generate", "--model", directory, "--max-tokens", str(run.max_tokens),
            "--dtype", run.dtype, "--ignore-eos", "--budget", str(budget), "--json", *extra]
    for prompt in prompts_for(run, vocab_size):
        argv += ["--prompt-ids", " ".join(map(str, prompt))]
    env = dict(os.environ, JAXPREP_CACHE_DIR=cache_dir,
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    wall_s = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"jaxprep generate exit {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return dict(outputs=result["outputs"], wall_s=wall_s, **result["rates"])


def transformers_process(directory: str, run: Run, vocab_size: int, ours: list[list[int]] | None = None) -> dict:
    """`transformers_worker` in its own process (``ours``: jaxprep's tokens, to compare against)."""
    return transformers_processes(directory, [run], vocab_size, ours)[0]


def transformers_processes(directory: str, runs: list[Run], vocab_size: int,
                           ours: list[list[int]] | None = None) -> list[dict]:
    """`transformers_worker` on ``runs`` (one dtype) one after the other in one process: a result per run, each
    with the process's wall seconds (a dry run's two speed workloads share one process and its imports)."""
    payload = json.dumps(dict(runs=[dataclasses.asdict(run) for run in runs], vocab_size=vocab_size, ours=ours))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", directory, payload], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    wall_s = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or len(lines) != len(runs):
        raise RuntimeError(f"transformers worker exit {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}")
    return [dict(json.loads(line[len("RESULT "):]), wall_s=wall_s) for line in lines]


def transformers_worker(directory: str, payload: str) -> None:
    """transformers' greedy ``generate`` on the GPU if torch sees one, for each run of the payload: each prompt
    alone when comparing (with each step's logits) or timing one prompt; all prompts as one batch otherwise."""
    import torch
    import transformers

    job = json.loads(payload)
    runs = [Run(**{**run, "prompt_lens": tuple(run["prompt_lens"])}) for run in job["runs"]]
    assert len({run.dtype for run in runs}) == 1, "one model, one dtype"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 is float32
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, runs[0].dtype)).to(device)
    model.eval().generation_config.eos_token_id = None  # EOS ignored, as jaxprep's --ignore-eos
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for run in runs:
        prompts = prompts_for(run, job["vocab_size"])
        result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu")
        if job["ours"] is not None:
            result.update(compare_tokens(model, prompts, job["ours"], run.max_tokens, device))
        elif len(prompts) == 1:
            result.update(time_one_prompt(model, prompts[0], run.max_tokens, device, sync))
        else:
            ids = torch.tensor(prompts, device=device)
            with torch.no_grad():
                sync()
                start = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=run.max_tokens,
                                     do_sample=False, pad_token_id=0)
                sync()
                seconds = time.perf_counter() - start
            generated = (out.shape[1] - ids.shape[1]) * len(prompts)
            result.update(batch_s=seconds, batch_tokens_per_s=generated / seconds)
        print("RESULT " + json.dumps(result), flush=True)


def compare_tokens(model, prompts, ours, max_tokens: int, device: str) -> dict:
    """Each prompt alone through ``generate``; jaxprep's tokens compared up to the first difference,
    whose logit gap (transformers' top logit minus that of jaxprep's token) is reported."""
    import torch

    compared, differences = 0, []
    for i, (prompt, tokens) in enumerate(zip(prompts, ours, strict=True)):
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        expected = out.sequences[0, len(prompt):].tolist()
        differ = next((j for j, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        compared += len(expected) if differ is None else differ + 1
        if differ is not None:
            logits = out.logits[differ][0].float()
            differences.append(dict(prompt=i, token=differ, ours=tokens[differ], theirs=expected[differ],
                                    gap=float(logits.max() - logits[tokens[differ]])))
        elif len(tokens) != len(expected):
            differences.append(dict(prompt=i, token=min(len(tokens), len(expected)), ours=None, theirs=None,
                                    gap=float("inf")))
    return dict(compared=compared, total=sum(map(len, ours)), differences=differences)


def time_one_prompt(model, prompt, max_tokens: int, device: str, sync) -> dict:
    """Greedy ``generate`` of one prompt: its first token's time (prefill) and the rest's (decode)."""
    import torch
    import transformers

    marks = []

    class Marks(transformers.generation.streamers.BaseStreamer):
        def put(self, value):  # the prompt, then each generated token
            sync()
            marks.append(time.perf_counter())

        def end(self):
            pass

    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        sync()
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                       pad_token_id=0, streamer=Marks())
        sync()
        end = time.perf_counter()
    prefill_s = marks[1] - start
    return dict(prefill_tokens_per_s=len(prompt) / prefill_s, decode_ms_per_token=(end - marks[1]) / (max_tokens - 1)
                * 1e3)


# --- the parts ----------------------------------------------------------------------------------------

def checkpoint(args, name: str, dtype: str) -> tuple[str, int]:
    """(directory, vocab size) of ``name``'s random checkpoint for this run."""
    from bench_real_models import SHAPES

    layers = args.layers or (2 if args.dry_run else 4 if args.part == "equality" else None)
    sizes = TINY if args.dry_run else None
    directory = build_checkpoint(name, layers, dtype, args.workdir, sizes=sizes)
    return directory, (sizes or SHAPES[name][2])["vocab_size"]


def equality(args) -> int:
    """float32 greedy tokens of `jaxprep generate` and transformers; exit 1 on a mismatch."""
    run = Run((5, 13), 4, "float32") if args.dry_run else Run((7, 100, 700), 32, "float32")
    models = ("qwen3-0.6b",) if args.dry_run else ("qwen3-0.6b", "llama-3.2-1b")  # a dry run: the path, once
    budget = 8 if args.dry_run else args.budget
    print("| model, float32 | prompts | tokens equal | first differences | result |")
    print("|---|---|---|---|---|")
    failed = False
    for name in models:
        directory, vocab = checkpoint(args, name, run.dtype)
        with tempfile.TemporaryDirectory() as cache:
            ours = jaxprep_process(directory, run, vocab, budget, cache)
        theirs = transformers_process(directory, run, vocab, ours=ours["outputs"])
        mismatches = [d for d in theirs["differences"] if d["gap"] > NEAR_TIE]
        failed |= bool(mismatches)
        result = "MISMATCH (goal missed)" if mismatches else "near-tie" if theirs["differences"] else "equal"
        differences = "; ".join(f"prompt {d['prompt']} token {d['token']}: {d['ours']} vs {d['theirs']}, logit gap "
                                f"{d['gap']:.1e}" for d in theirs["differences"]) or "none"
        print(f"| {name} ({os.path.basename(directory)}, {theirs['device']}) | {len(run.prompt_lens)} x "
              f"{'/'.join(map(str, run.prompt_lens))} tokens, {run.max_tokens} new, budget {budget} "
              f"| {theirs['compared']}/{theirs['total']} | {differences} | {result} |")
    return 1 if failed else 0


def speed(args) -> int:
    """The GPU table's rows and goals (none checked off a GPU)."""
    import jax

    one = Run((24,), 4, "bfloat16") if args.dry_run else Run((1500,), 64, "bfloat16")
    many = Run((8,) * 2, 4, "bfloat16") if args.dry_run else Run((128,) * 16, 64, "bfloat16")
    budget = 16 if args.dry_run else args.budget
    # a dry run sizes both workloads' caches alike: the concurrent run loads the single prompt's executables
    shared = ("--max-num-reqs", "2", "--max-model-len", "32", "--num-blocks", "8") if args.dry_run else ()
    directory, vocab = checkpoint(args, "qwen3-0.6b", one.dtype)
    rows = {}
    with tempfile.TemporaryDirectory() as cache:  # one compile cache: the first process fills it
        rows["jaxprep, cold cache"] = jaxprep_process(directory, one, vocab, budget, cache, shared)
        rows["jaxprep, warm cache"] = jaxprep_process(directory, one, vocab, budget, cache, shared)
        if args.dry_run:  # one transformers process runs both workloads (its wall: both rows' "process wall s")
            rows["transformers"], batch = transformers_processes(directory, [one, many], vocab)
        else:
            rows["transformers"] = transformers_process(directory, one, vocab)
        concurrent = jaxprep_process(directory, many, vocab, budget, cache, shared)
    if not args.dry_run:
        batch = transformers_process(directory, many, vocab)
    label = f"1 x {one.prompt_lens[0]}-token prompt, {one.max_tokens} new"
    print(f"model: {os.path.basename(directory)}; jaxprep on {jax.default_backend()}, transformers on "
          f"{rows['transformers']['device']}; budget {budget}")
    print("| case / side | prefill tok/s | decode ms/token | decode tok/s | process wall s |")
    print("|---|---:|---:|---:|---:|")
    for side, r in rows.items():
        ms = r.get("decode_ms_per_token") or (1e3 / r["decode_tokens_per_s"] if r.get("decode_tokens_per_s") else None)
        rate = r.get("decode_tokens_per_s") or (1e3 / ms if ms else None)
        print(f"| {label} / {side} | {cell(r.get('prefill_tokens_per_s'))} | {cell(ms, 2)} | {cell(rate)} "
              f"| {r['wall_s']:.1f} |")
    label = f"{len(many.prompt_lens)} x {many.prompt_lens[0]}-token prompts, {many.max_tokens} new"
    print(f"| {label} / jaxprep | {cell(concurrent['prefill_tokens_per_s'])} | n/a "
          f"| {cell(concurrent['decode_tokens_per_s'])} | {concurrent['wall_s']:.1f} |")
    print(f"| {label} / transformers (one batch: generated tokens / generate s) | n/a | n/a "
          f"| {cell(batch['batch_tokens_per_s'])} | {batch['wall_s']:.1f} |")
    print()
    print_goals(rows, concurrent, checked=jax.default_backend() == "gpu" and not args.dry_run)
    return 0


def print_goals(rows: dict, concurrent: dict, checked: bool) -> None:
    warm, theirs = rows["jaxprep, warm cache"], rows["transformers"]
    decode_ms = 1e3 / warm["decode_tokens_per_s"] if warm.get("decode_tokens_per_s") else None
    goals = [("prefill >= transformers'", warm["prefill_tokens_per_s"], theirs["prefill_tokens_per_s"],
              lambda ours, target: ours >= target),
             ("decode at one request <= 1.0 ms/token", decode_ms, GOALS["decode_ms_per_token"],
              lambda ours, target: ours <= target),
             ("16 concurrent >= 10k decode tok/s", concurrent["decode_tokens_per_s"], GOALS["concurrent_tokens_per_s"],
              lambda ours, target: ours >= target),
             ("process wall, warm cache <= transformers'", warm["wall_s"], theirs["wall_s"],
              lambda ours, target: ours <= target)]
    print("| goal | jaxprep | target | result |")
    print("|---|---:|---:|---|")
    for name, ours, target, holds in goals:
        result = ("not checked (not a GPU run)" if not checked else "n/a" if ours is None or target is None
                  else "met" if holds(ours, target) else "goal missed")
        print(f"| {name} | {cell(ours, 2)} | {cell(target, 2)} | {result} |")


def cell(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        transformers_worker(*argv[1:3])
        return 0
    args = parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    from common import load_line, machine_line

    print(f"machine: {machine_line()}; {load_line()}")
    return equality(args) if args.part == "equality" else speed(args)


if __name__ == "__main__":
    sys.exit(main())
