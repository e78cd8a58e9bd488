"""Real model shapes in the JAX serving loop against transformers' ``generate`` (not run in CI).

Builds two random checkpoints with transformers itself, of real shapes: Qwen3-0.6B's (28 layers,
hidden 1024, 16 heads over 8 KV heads, head_dim 128, vocab 151936, tied embeddings) and
Llama-3.2-1B's (16 layers, hidden 2048, 32 heads over 8 KV heads, vocab 128256, llama3 RoPE, tied);
``--layers N`` keeps only the first N layers (the other sizes stay real). Then, each run in its own
subprocess (so each peak RSS is its own):

- one prompt of each ``--prompt-lens`` length: wall time (load, compile, serve), prefill and decode
  tokens/s, peak RSS, for jaxprep (`jaxprep.cli.generate.generate`'s engine) and transformers;
- ``--concurrent`` prompts at once (jaxprep serves them together, transformers generates them as one batch);
- jaxprep alone at each ``--max-model-lens`` value, with the same short prompts (memory at fixed prompts).

Rates: jaxprep's prefill/decode split is `jaxprep.cli._phases` (compiles excluded, reported apart);
transformers' prefill is the time to its first token (a streamer marks it), decode the rest.

    python benchmarks/bench_real_models.py --layers 4 --prompt-lens 5,200,1500 --max-tokens 8 --concurrent 8
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

SHAPES = {
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=151643, eos_token_id=151645)),
    "llama-3.2-1b": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=128000, eos_token_id=128001)),
}
BLOCK_SIZE = 16
BUDGET = 256
TOKEN_BUCKETS = (8, 64, 256)
"""Three executables per run: decode batches, mid-size chunks and full 256-token chunks."""


@dataclasses.dataclass
class Case:
    model: str
    prompt_lens: list[int]  # one prompt per entry, served together
    max_tokens: int
    dtype: str
    threads: int | None
    max_model_len: int | None = None  # jaxprep only; default: longest prompt + max_tokens, rounded up to a block


# --- workers (each in its own subprocess) --------------------------------------------------------------


def _status_kb(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process; ru_maxrss would carry the parent's peak over exec."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def _prompts(case: Case, vocab_size: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    margin = min(1000, vocab_size // 4)  # clear of the special ids at both ends (a tiny vocabulary: a quarter)
    return [rng.integers(margin, vocab_size - margin, n).tolist() for n in case.prompt_lens]


def jaxprep_worker(directory: str, case: Case) -> dict:
    from jaxprep.cli import configure_runtime

    configure_runtime(single_thread_cpu=False, threads=case.threads)
    from jaxprep.cli._phases import PhaseClock
    from jaxprep.config import PrepConfig, cdiv
    from jaxprep.models import load_model
    from jaxprep.serving import Engine, Request, ServingConfig

    start = time.perf_counter()
    model, params = load_model(directory, dtype=case.dtype)
    load_s = time.perf_counter() - start
    prompts = _prompts(case, model.vocab_size)
    lengths = [len(p) + case.max_tokens for p in prompts]
    max_model_len = case.max_model_len or cdiv(max(lengths), BLOCK_SIZE) * BLOCK_SIZE
    prep = PrepConfig(max_num_reqs=len(prompts), max_model_len=max_model_len, max_num_batched_tokens=BUDGET,
                      block_size=BLOCK_SIZE, num_blocks=1 + sum(cdiv(n, BLOCK_SIZE) for n in lengths),
                      token_buckets=TOKEN_BUCKETS)
    engine = Engine(ServingConfig(prep=prep, eos_token_id=-1, decode_steps=8), model, params=params,
                    keep_history=True)
    compile_s = engine.warmup()
    engine.submit([Request(request_id=i, prompt_token_ids=p, max_tokens=case.max_tokens)
                   for i, p in enumerate(prompts)])
    clock, serve_start = PhaseClock(), time.perf_counter()
    finished = sorted(engine.run(on_step=clock), key=lambda r: r.request_id)
    serve_s = time.perf_counter() - serve_start
    return dict(load_s=load_s, compile_s=compile_s, serve_s=serve_s, wall_s=time.perf_counter() - start,
                max_model_len=max_model_len, outputs=[r.output_token_ids for r in finished],
                **clock.rates(engine.stats))


def hf_worker(directory: str, case: Case) -> dict:
    import torch
    import transformers

    if case.threads:
        torch.set_num_threads(case.threads)
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, case.dtype)).eval()
    load_s = time.perf_counter() - start
    prompts = _prompts(case, model.config.vocab_size)
    assert len({len(p) for p in prompts}) == 1, "one batch of equal-length prompts (no padding)"
    ids = torch.tensor(prompts)
    marks = []

    class FirstToken(transformers.generation.streamers.BaseStreamer):
        def put(self, value):  # called with the prompt, then after each generated token
            marks.append(time.perf_counter())

        def end(self):
            pass

    serve_start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=case.max_tokens,
                             min_new_tokens=case.max_tokens, do_sample=False,
                             streamer=FirstToken() if len(prompts) == 1 else None)
    serve_s = time.perf_counter() - serve_start
    prefill_s = marks[1] - serve_start if len(marks) > 1 else None  # batches: no streamer, no split
    decode_tokens = (case.max_tokens - 1) * len(prompts)
    rates = {"prefill_tokens": sum(map(len, prompts)), "prefill_s": prefill_s, "decode_tokens": decode_tokens,
             "decode_s": None if prefill_s is None else serve_s - prefill_s}
    for phase in ("prefill", "decode"):
        seconds = rates[f"{phase}_s"]
        rates[f"{phase}_tokens_per_s"] = round(rates[f"{phase}_tokens"] / seconds, 1) if seconds else None
    return dict(load_s=load_s, compile_s=0.0, serve_s=serve_s, wall_s=time.perf_counter() - start,
                outputs=out[:, ids.shape[1]:].tolist(), **rates)


def worker_main(side: str, directory: str, case_json: str) -> None:
    base_kb = _status_kb("VmRSS")
    case = Case(**json.loads(case_json))
    result = (jaxprep_worker if side == "jaxprep" else hf_worker)(directory, case)
    result.update(peak_rss_gib=_status_kb("VmHWM") / 2**20, base_rss_gib=base_kb / 2**20)
    print("RESULT " + json.dumps(result))


# --- driver --------------------------------------------------------------------------------------------


def build_checkpoint(name: str, layers: int | None, dtype: str, workdir: str, sizes: dict | None = None) -> str:
    """The random checkpoint of ``name``'s shape (first ``layers`` layers; ``sizes`` overrides other
    fields, a dry run's tiny widths), saved by transformers in ``dtype``; built in a subprocess, reused
    if already in ``workdir``."""
    tag = "-tiny" if sizes else ""
    directory = os.path.join(workdir, f"{name}{tag}-{layers or 'all'}L-{dtype}")
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    code = f"""
import torch, transformers
config_class, model_class, sizes = {SHAPES[name]!r}
sizes = dict(sizes, **{dict(sizes or {}, **({"num_hidden_layers": layers} if layers else {}))!r})
torch.manual_seed(0)
config = getattr(transformers, config_class)(**sizes)
model = getattr(transformers, model_class)(config).to(getattr(torch, {dtype!r}))
model.save_pretrained({directory!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    return directory


def run_side(side: str, directory: str, case: Case) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
    proc = subprocess.run([sys.executable, __file__, "--worker", side, directory, json.dumps(dataclasses.asdict(case))],
                          capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(lines[-1][len("RESULT "):])


def _row(label: str, side: str, r: dict) -> str:
    if "error" in r:
        return f"| {label} | {side} | failed: {r['error']} |"
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    return (f"| {label} | {side} | {r['wall_s']:.1f} | {r['load_s']:.1f} | {r['compile_s']:.1f} | {r['serve_s']:.2f} | "
            f"{fmt(r['prefill_tokens_per_s'], '.1f')} | {fmt(r['decode_tokens_per_s'], '.2f')} | "
            f"{r['peak_rss_gib']:.2f} |")


def _agreement(ours: dict, theirs: dict) -> str:
    if "error" in ours or "error" in theirs:
        return ""
    same = sum(a == b for x, y in zip(ours["outputs"], theirs["outputs"]) for a, b in zip(x, y))
    total = sum(len(x) for x in theirs["outputs"])
    return f"greedy tokens equal: {same}/{total} (random weights: near-ties are common)"


HEADER = ("| case | side | wall s | load s | compile s | serve s | prefill tok/s | decode tok/s | peak RSS GiB |\n"
          "|---|---|---|---|---|---|---|---|---|")


def run(args) -> list[dict]:
    results = []
    print(HEADER)
    for name in args.models:
        directory = build_checkpoint(name, args.layers, args.dtype, args.workdir)
        cases = [(f"{name} {n} tokens", Case(name, [n], args.max_tokens, args.dtype, args.threads))
                 for n in args.prompt_lens]
        if args.concurrent:
            cases.append((f"{name} {args.concurrent} x {args.concurrent_prompt_len} tokens",
                          Case(name, [args.concurrent_prompt_len] * args.concurrent, args.max_tokens, args.dtype,
                               args.threads)))
        for label, case in cases:
            sides = {side: run_side(side, directory, case) for side in ("jaxprep", "transformers")}
            for side, result in sides.items():
                print(_row(label, side, result), flush=True)
                results.append(dict(case=label, side=side, **{k: v for k, v in result.items() if k != "outputs"}))
            print(f"|  | {_agreement(sides['jaxprep'], sides['transformers'])} |", flush=True)
        for max_model_len in args.max_model_lens:
            label = f"{name} 3 x 32 tokens, max_model_len {max_model_len}"
            result = run_side("jaxprep", directory, Case(name, [32] * 3, args.max_tokens, args.dtype, args.threads,
                                                         max_model_len=max_model_len))
            print(_row(label, "jaxprep", result), flush=True)
            results.append(dict(case=label, side="jaxprep", **{k: v for k, v in result.items() if k != "outputs"}))
    return results


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker_main(*sys.argv[2:5])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=lambda t: t.split(","), default=list(SHAPES), help="comma-separated")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                        help="checkpoint and compute dtype of both sides (default bfloat16)")
    parser.add_argument("--prompt-lens", type=_ints, default=[5, 100, 500, 1500])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrent", type=int, default=8, help="prompts served together (0: skip)")
    parser.add_argument("--concurrent-prompt-len", type=int, default=64)
    parser.add_argument("--max-model-lens", type=_ints, default=[2048, 4096])
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of both sides (default: theirs)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "jaxprep-bench-real-models"))
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    results = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
