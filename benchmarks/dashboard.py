"""Today's headline numbers: measured at one commit and written into BENCHMARKS.md's table, so that no number
there outlives its code.

    PYTHONPATH=. python benchmarks/dashboard.py              # the CPU rows (a few minutes); the table rewritten
    PYTHONPATH=. python benchmarks/dashboard.py --dry-run    # tiny shapes, one round: checks the script (CI)
    PYTHONPATH=. python benchmarks/dashboard.py --gpu-record LOG_DIR/gpu_record.json   # a new loan's GPU rows

Each CPU row runs in a fresh process the benchmark script's own functions, at the script's shapes with
fewer rounds (the command column says which), and prints one ``RESULT {json}`` line; this script turns
the results into the table between BENCHMARKS.md's ``dashboard`` markers, with the commit, date and
machine above it. ``--dry-run`` runs every row at tiny shapes and prints the table without writing it.

The GPU rows are read from `GPU_RECORD` (benchmarks/results/gpu.json), the record of the latest GPU loan
with its own date, commit and machine: the runbook (`benchmarks/accelerator_check.py`) writes it as
``LOG_DIR/gpu_record.json``; ``--gpu-record PATH`` copies a new one in before the table is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BENCHMARKS_MD = os.path.join(ROOT, "BENCHMARKS.md")
GPU_RECORD = os.path.join(HERE, "results", "gpu.json")
START = "<!-- dashboard: start (written by benchmarks/dashboard.py: edit the script, not the table) -->"
END = "<!-- dashboard: end -->"
CHILD_TIMEOUT_S = 900
PREPARE_SHAPES = ("8/512", "64/2048", "256/8192", "1024/16384", "256 decode")
"""bench_prepare.SHAPES in short: requests / scheduled tokens."""


@dataclasses.dataclass(frozen=True)
class Measure:
    """One CPU row: the child code that measures it (``{dry}`` is the dry run's True/False), its command, and
    the function that turns its result into the table's cells."""

    key: str
    code: str
    command: str
    cells: object  # result -> (what, jaxprep, peer, ratio)


PREAMBLE = """
import json, os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
dry = {dry}
def report(result):
    print("RESULT " + json.dumps([key, result]), flush=True)
"""

PREPARE = """
import bench_prepare as b
from common import time_rows
shapes = [("8 req / 64 tok", 8, 64, 256, 16, False)] if dry else b.SHAPES
setups = []
for shape in shapes:
    row, fns = b.setup_shape(*shape)
    setups.append((row, {{k: fns[k] for k in ("ours", "base")}}))
rows = time_rows(setups, 5 if dry else 100, 1 if dry else 3)
report([dict(name=r["name"], ours=r["ours_us"], base=r["base_us"]) for r in rows])
"""

SERVING_STEP = """
import bench_serving_step as b
from common import time_rows
shapes = [("8 req / 64 tok", 8, 64, 256, 16, False)] if dry else b.SHAPES
rows = time_rows([b.setup_shape(*shape, steps=2 if dry else 16) for shape in shapes], 5 if dry else 100,
                 1 if dry else 3)
report([dict(name=r["name"], ours=r["ours_us"], base=r["base_us"]) for r in rows])
"""

MRV2_TORCH = """
import bench_gpu as b
if b.torch is not None:
    b.torch.set_num_threads(1)  # as jaxprep's one XLA:CPU thread: two threads on a shared 2-core host spin
steps = [("8 req decode", 8, 8, 256, 16, True)] if dry else b.STEPS
rows = [b.bench_step(*step, repeats=5 if dry else 100, profile_steps=2 if dry else 20) for step in steps]
report([dict(name=r["name"], ours=r["host_us"], base=r["mrv2_us"]) for r in rows])
"""

DOOR = """
import numpy as np
import bench_vllm_adapter as b
rows = []
for size in ([8] if dry else [64, 256]):
    work = b.workload(size, 4 if dry else 24)
    recorded = b.record_outputs(work)
    config = b.serving_config(work)
    b.replay_jaxprep(config, recorded)  # compiles what the replay needs
    decode = np.array([not so.scheduled_new_reqs and max(so.num_scheduled_tokens.values()) == 1
                       for so, _ in recorded])
    rounds = [(b.replay_jaxprep(config, recorded), b.replay_v1(work, recorded)) for _ in range(1 if dry else 3)]
    ours, theirs = b.median_means([a for a, _ in rounds], decode), b.median_means([t for _, t in rounds], decode)
    rows.append(dict(size=size, ours=ours[0], base=theirs[0], ours_decode=ours[1], base_decode=theirs[1]))
report(rows)
"""

WARMUP = """
import tempfile
import bench_warmup as b
budget = 64 if dry else 8192
with tempfile.TemporaryDirectory() as folder:
    cold = b.run_child(budget, folder)  # compiles every bucket, filling the cache
    cached = b.run_child(budget, folder)
report(dict(budget=budget, buckets=cold["buckets"], cold=cold["seconds"], cached=cached["seconds"]))
"""

REAL_MODEL = """
import tempfile
import bench_real_models as b
from bench_generate import TINY
layers, prompt, tokens = (2, 8, 2) if dry else (4, 200, 8)
workdir = os.path.join(tempfile.gettempdir(), "jaxprep-dashboard-models")
directory = b.build_checkpoint("qwen3-0.6b", layers, "bfloat16", workdir, sizes=TINY if dry else None)
case = b.Case("qwen3-0.6b", [prompt], tokens, "bfloat16", None)
sides = {{side: b.run_side(side, directory, case) for side in ("jaxprep", "transformers")}}
report(dict(layers=layers, prompt=prompt, tokens=tokens, **{{side: {{k: v for k, v in r.items() if k != "outputs"}}
                                                            for side, r in sides.items()}}))
"""


def _us(values) -> str:
    return ", ".join(f"{v:.0f}" for v in values)


def _ratios(ours, theirs) -> str:
    ratios = [a / b for a, b in zip(ours, theirs)]
    return f"{min(ratios):.2f}x" if len(ratios) == 1 else f"{min(ratios):.2f}-{max(ratios):.2f}x"


def shapes_note(rows: list[dict], full: tuple[str, ...]) -> str:
    return ", ".join(full) if len(rows) == len(full) else ", ".join(r["name"] for r in rows)


def prepare_cells(rows):
    ours, base = [r["ours"] for r in rows], [r["base"] for r in rows]
    return (f"Prepare a step, every output fetched to the host, µs ({shapes_note(rows, PREPARE_SHAPES)})",
            _us(ours), f"vLLM V1's host path (NumPy): {_us(base)}", _ratios(ours, base))


def serving_step_cells(rows):
    ours, base = [r["ours"] for r in rows], [r["base"] for r in rows]
    return (f"The serving step: the scheduler's update applied, then prepare and fetch, µs "
            f"({shapes_note(rows, PREPARE_SHAPES)})", _us(ours), f"vLLM V1, the same update and its host path: "
            f"{_us(base)}", _ratios(ours, base))


def mrv2_cells(rows):
    ours, base = [r["ours"] for r in rows], [r["base"] for r in rows]
    names = "256 decode, 256/8192" if len(rows) == 2 else ", ".join(r["name"] for r in rows)
    return (f"Prepare on the device, outputs left there, µs ({names})", _us(ours),
            f"vLLM's model runner V2 in torch ops, CPU torch on one thread: {_us(base)}", _ratios(ours, base))


def door_cells(rows):
    sizes = ", ".join(str(r["size"]) for r in rows)
    ours = [f"{r['ours']:.0f} ({r['ours_decode']:.0f})" for r in rows]
    base = [f"{r['base']:.0f} ({r['base_decode']:.0f})" for r in rows]
    ratios = [r["ours"] / r["base"] for r in rows] + [r["ours_decode"] / r["base_decode"] for r in rows]
    return (f"The vLLM door: a real `SchedulerOutput` to a prepared step, µs per step, all steps (decode-only), "
            f"{sizes} requests", ", ".join(ours), f"vLLM V1's `_update_states` + `_prepare_inputs`: {', '.join(base)}",
            f"{min(ratios):.2f}-{max(ratios):.2f}x")


def warmup_cells(result):
    return (f"Warm-up: `jaxprep.warmup` of every one of {result['buckets']} token buckets (budget "
            f"{result['budget']}), s, a fresh process compiling (a second one reading the persistent cache)",
            f"{result['cold']:.1f} ({result['cached']:.1f})", "-", "-")


def real_model_cells(result):
    ours, theirs = result["jaxprep"], result["transformers"]
    what = (f"A Qwen3-0.6B-shaped model ({result['layers']} layers, bf16, random weights), one "
            f"{result['prompt']}-token prompt, {result['tokens']} new tokens: serve s, decode tokens/s; wall s "
            "(load + compile + serve)")
    if "error" in ours or "error" in theirs:
        return what, "failed", str(ours.get("error") or theirs.get("error")), "-"

    def side(r) -> str:
        return f"{r['serve_s']:.2f} s, {r.get('decode_tokens_per_s') or 0:.1f} tok/s; {r['wall_s']:.1f} s"

    return (what, side(ours), f"transformers `generate`, CPU torch: {side(theirs)}",
            f"serve {ours['serve_s'] / theirs['serve_s']:.2f}x")


MEASURES = (
    Measure("prepare", PREPARE, "`PYTHONPATH=. python benchmarks/bench_prepare.py --rounds 3`", prepare_cells),
    Measure("serving_step", SERVING_STEP, "`PYTHONPATH=. python benchmarks/bench_serving_step.py --rounds 3`",
            serving_step_cells),
    Measure("mrv2_torch", MRV2_TORCH, "`PYTHONPATH=. python benchmarks/bench_gpu.py` (on the CPU backend)",
            mrv2_cells),
    Measure("door", DOOR, "`PYTHONPATH=. python benchmarks/bench_vllm_adapter.py --sizes 64,256 --steps 24 "
            "--rounds 3`", door_cells),
    Measure("warmup", WARMUP, "`PYTHONPATH=. python benchmarks/bench_warmup.py --runs 1`", warmup_cells),
    Measure("real_model", REAL_MODEL, "`python benchmarks/bench_real_models.py --layers 4 --models qwen3-0.6b "
            "--prompt-lens 200 --max-tokens 8 --concurrent 0 --max-model-lens ''`", real_model_cells),
)


def run_children(measures: list[Measure], dry: bool) -> dict:
    """{key: the ``RESULT`` of each measure's code}, each in a fresh process (the benchmarks set process-wide
    runtime flags, and a row's garbage stays out of the next one's times); a dry run runs them all in one."""
    if dry:
        return run_child(measures, dry=True)
    results = {}
    for measure in measures:
        print(f"dashboard: measuring {measure.key} ...", file=sys.stderr, flush=True)
        results.update(run_child([measure], dry=False))
    return results


def child_code(measures: list[Measure], dry: bool) -> str:
    """The program that runs ``measures`` one after the other and prints each one's ``RESULT``."""
    code = textwrap.dedent(PREAMBLE).format(dry=dry)
    return code + "".join(f"\nkey = {m.key!r}\n" + textwrap.dedent(m.code).format() for m in measures)


def run_child(measures: list[Measure], *, dry: bool) -> dict:
    """{key: result} of ``measures`` run one after the other in one new process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    result = subprocess.run([sys.executable, "-c", child_code(measures, dry)], capture_output=True, text=True,
                            cwd=ROOT, env=env, timeout=CHILD_TIMEOUT_S)
    found = dict(json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT "))
    if result.returncode or set(found) != {m.key for m in measures}:
        raise RuntimeError(f"dashboard rows {[m.key for m in measures]} failed (exit {result.returncode}):\n"
                           f"{result.stderr[-3000:]}")
    return found


# --- the GPU rows, from the latest loan's record --------------------------------------------------------

def _detail(detail: str) -> dict[str, str]:
    """``launches: 2; device µs: 4.5`` -> {"launches": "2", "device µs": "4.5"}."""
    return dict(part.split(": ", 1) for part in detail.split("; ") if ": " in part)


def _number(value: str | None) -> float | None:
    match = re.match(r"\s*(-?\d+(?:\.\d+)?)", value or "")
    return float(match[1]) if match else None


def _find(table: dict, pattern: str) -> dict:
    """The detail of the first runbook row whose check matches ``pattern`` ({} if none)."""
    return next((detail for check, detail in table.items() if re.search(pattern, check)), {})


GPU_STEPS = (("256 decode", r"256 decode", r"256 req decode"), ("256/8192", r"256 req / 8192 tok", r"256 req / 8192"),
             ("1024/16384", r"1024 req / 16384 tok", r"1024 req / 16384"))
"""(short name, the fused benchmark's step, bench_gpu's step) of each GPU step."""


def gpu_cells(record: dict) -> list[tuple[str, str, str, str]]:
    """The headline GPU rows of a runbook record: the fused step's device time and launches at decode, its
    end-to-end time against vLLM V1 with its copies and MRV2's real kernels, and the door's, if measured."""
    table = {check: _detail(detail) for check, _, detail in record["rows"]}
    fused = r"^bench_fused(?: \(command buffers off\))?: "
    pallas = _find(table, fused + r"256 decode / jaxprep Pallas$")
    mrv2 = _find(table, fused + r"256 decode / MRV2 real")
    rows = [("The fused step at 256 decode: device µs and kernel launches per step",
             f"{pallas.get('device µs', 'n/a')} µs, {pallas.get('launches', 'n/a')} launches",
             f"MRV2's real Triton kernels: {mrv2.get('device µs', 'n/a')} µs, {mrv2.get('launches', 'n/a')} launches",
             _ratio(_number(pallas.get("device µs")), _number(mrv2.get("device µs"))))]
    ours, v1, kernels = [], [], []
    for _, step, gpu_step in GPU_STEPS:
        ours.append(_number(_find(table, fused + step + r" / jaxprep Pallas$").get("end to end µs")))
        v1.append(_number(_find(table, r"^bench_gpu: " + gpu_step).get("vLLM V1 + copies µs (each way)")))
        kernels.append(_number(_find(table, fused + step + r" / MRV2 real").get("end to end µs")))
    shown = lambda values: ", ".join("-" if v is None else f"{v:.0f}" for v in values)  # noqa: E731
    pairs = [(a, b) for a, b in zip(ours, v1) if a is not None and b is not None]
    rows.append((f"The fused step end to end, one step until ready, µs ({', '.join(s for s, _, _ in GPU_STEPS)})",
                 shown(ours), f"vLLM V1 + its pinned copies: {shown(v1)}; MRV2's real kernels: {shown(kernels)}",
                 "vs V1 " + ", ".join(f"{a / b:.2f}x" for a, b in pairs) if pairs else "-"))
    door = _find(table, r"^bench_door: decode256")
    rows.append(("The vLLM door on a GPU, `SchedulerOutput` to torch CUDA tensors, µs (256 decode)",
                 door.get("jaxprep e2e µs", "not measured yet"), f"vLLM V1 + copies: {door.get('V1 + copies µs', '-')}",
                 door.get("V1 / jaxprep", "-")))
    return rows


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if ours is None or not theirs else f"{ours / theirs:.2f}x"


# --- the table --------------------------------------------------------------------------------------------

def commit_line() -> str:
    """``abc1234`` (``abc1234 + uncommitted changes`` when the tree differs from it)."""
    def git(*args) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "jaxprep", "torch_bridge", "benchmarks")
    return f"{commit} + uncommitted changes" if dirty else commit


def machine() -> str:
    code = "import sys; sys.path.insert(0, 'benchmarks'); from common import machine_line; print(machine_line())"
    line = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")).stdout.strip()
    return re.sub(r"; commit \S+$", "", line)


def table(results: dict, record: dict | None, dry: bool) -> str:
    """The dashboard: a line naming the commit, date and machine, the table, and the GPU rows' own source."""
    lines = [f"Measured at commit `{commit_line()}` on {datetime.date.today().isoformat()}"
             f"{' (dry run: tiny shapes, one round)' if dry else ''}: {machine()}, load average "
             f"{os.getloadavg()[0]:.1f}. Ratio: jaxprep's time / the peer's (below 1.00x jaxprep is faster). "
             "Rerun: `PYTHONPATH=. python benchmarks/dashboard.py`.", "",
             "| what | jaxprep | the peer | ratio | command |", "|---|---|---|---|---|"]
    for measure in MEASURES:
        if measure.key in results:
            what, ours, peer, ratio = measure.cells(results[measure.key])
            lines.append(f"| {what} | {ours} | {peer} | {ratio} | {measure.command} |")
    if record is not None:
        where = f"{record['device']}, {record['date']}, `{record['commit']}`"
        for what, ours, peer, ratio in gpu_cells(record):
            lines.append(f"| {where}: {what} | {ours} | {peer} | {ratio} | the GPU runbook |")
        lines += ["", f"The GPU rows come from the latest loan's record (`benchmarks/results/gpu.json`): "
                      f"{record['machine']}, commit `{record['commit']}`, {record['date']}; "
                      f"`{record['command']}`."]
    return "\n".join(lines)


def write_table(text: str, path: str = BENCHMARKS_MD) -> None:
    with open(path, encoding="utf-8") as file:
        page = file.read()
    if START not in page or END not in page:
        raise RuntimeError(f"{path} has no dashboard markers ({START} ... {END})")
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w", encoding="utf-8") as file:
        file.write(f"{head}{START}\n{text}\n{END}{tail}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, one round; print the table, write nothing")
    parser.add_argument("--rows", default=",".join(m.key for m in MEASURES),
                        help=f"CPU rows to measure, of {','.join(m.key for m in MEASURES)} (the others are left out)")
    parser.add_argument("--gpu-record", metavar="PATH", help="a runbook's gpu_record.json: copied to "
                                                             "benchmarks/results/gpu.json first")
    parser.add_argument("--output", metavar="PATH", default=BENCHMARKS_MD, help="the page to rewrite (BENCHMARKS.md)")
    args = parser.parse_args(argv)
    args.rows = [row for row in args.rows.split(",") if row]
    unknown = sorted(set(args.rows) - {m.key for m in MEASURES})
    if unknown:
        parser.error(f"--rows takes names of {','.join(m.key for m in MEASURES)}, got {unknown}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.gpu_record and not args.dry_run:
        os.makedirs(os.path.dirname(GPU_RECORD), exist_ok=True)
        shutil.copyfile(args.gpu_record, GPU_RECORD)
    results = run_children([m for m in MEASURES if m.key in args.rows], args.dry_run)
    record = None
    if os.path.exists(args.gpu_record or GPU_RECORD):
        with open(args.gpu_record or GPU_RECORD, encoding="utf-8") as file:
            record = json.load(file)
    text = table(results, record, args.dry_run)
    print(text)
    if not args.dry_run:
        write_table(text, args.output)
        print(f"dashboard: table written to {os.path.relpath(args.output, ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

