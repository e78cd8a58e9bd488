"""The fused GPU step (PrepConfig.kernel): launches, device time, calling-thread time and end to end per
step, for jaxprep's XLA and Pallas paths against vLLM's own paths, in one process.

    PYTHONPATH=. python benchmarks/bench_fused_step.py [--repeats 100] [--steps 50] [--command-buffers off|on]
    PYTHONPATH=. python benchmarks/bench_fused_step.py --dry-run     # tiny shapes, any machine

Steps (bench_prepare.make_batch; max_model_len 4096, block size 16): 256 decoding requests; 256
requests / 8192 tokens; 1024 requests / 16384 tokens. Then the steps with features the kernels cover
(`mrv2_triton_baseline.make_draft_batch`: decodes schedule their last token and 0-3 drafts, K = 3):
256 decodes with spec decode (V1's ``SpecDecodeMetadata``); the same with ``runner="v2"`` (V2's
batch order and logits rows); 256 requests / 8192 tokens with ``runner="v2"``, half of them decodes
with drafts. Paths, each checked equal to jaxprep's XLA step before it is timed:

- jaxprep XLA: `prepare_padded` with ``kernel="xla"``; jaxprep Pallas: ``kernel="pallas"`` (the two
  Triton kernels of jaxprep/kernels/; Pallas' interpreter without a GPU);
- vLLM V1 + copies (plain steps): its host preparation into pinned buffers and the ``CpuGpuBuffer``
  copies (`vllm_v1_copies.VllmV1WithCopies`; without CUDA, NumPy and one ``jax.device_put``);
- MRV2 real kernels (plain steps and ``runner="v2"``): V2's own Triton kernels and host part, its
  sort and ``cu_num_logits`` included with drafts (`mrv2_triton_baseline`, sources from
  ``.vllm_src``: `vllm_sources.py`), on CUDA only;
- MRV2 torch ops (plain steps): the same step in torch ops (`mrv2_torch_baseline`).

Columns: *launches* = device operations per step (kernels, copies, memsets) in a profiler trace
(``jax.profiler`` / ``torch.profiler``); *device µs* = their summed duration; *thread µs* = the
calling thread's time per step with steps queued back to back (no wait); *end to end µs* = one
step and the wait for its results. Without a GPU the device columns read n/a.

A second table runs `serve_step` (tiny model, 2 layers, one iteration) with the plain step on XLA and on
the kernels, and its attention on ``auto`` (jaxprep's ragged kernel on CUDA), XLA and JAX's decode
kernel: its launches, those of the two prepare kernels and of the attention kernel, and its times. ``--command-buffers``
sets XLA's CUDA-graph flags before JAX starts (off: none; on: fusions, cuBLAS, custom calls, while
loops and conditionals, graphs of any size); the runbook runs both.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

COMMAND_BUFFERS = {"off": "--xla_gpu_enable_command_buffer=",
                   "on": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL,WHILE,CONDITIONAL "
                         "--xla_gpu_graph_min_graph_size=1"}
"""XLA's command buffers (CUDA graphs). "on" includes WHILE and CONDITIONAL: without them each iteration of a
loop whose trip count is data-dependent (serve_step's decode loop, the paged attention's chunk loop) copies
its condition to the host and the calling thread waits for it."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=100, help="calls per timing round (best of 5 rounds)")
    parser.add_argument("--steps", type=int, default=50, help="steps in each profiler trace")
    parser.add_argument("--command-buffers", choices=("default", *COMMAND_BUFFERS), default="default")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes: checks the script, not the GPU")
    parser.add_argument("--default-runtime", action="store_true",
                        help="keep JAX's CPU defaults (read by common.configure_benchmark_runtime)")
    return parser.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.command_buffers in COMMAND_BUFFERS:  # read by XLA when JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + COMMAND_BUFFERS[ARGS.command_buffers]).strip()

sys.path.insert(0, os.path.dirname(__file__))

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_gpu import RUNTIME, has_cuda, synchronize, torch  # noqa: E402
from bench_prepare import make_batch, v1_baseline  # noqa: E402
from common import assert_same_step, load_line, machine_line  # noqa: E402
from profile_gpu import dispatch_us, end_to_end_us, kernel_profile  # noqa: E402
from vllm_v1_copies import VllmV1WithCopies  # noqa: E402

from jaxprep import BatchState, FeatureConfig, PrepConfig, prepare_padded  # noqa: E402

SPEC_DECODE, RUNNER_V2 = FeatureConfig(num_speculative_tokens=3), FeatureConfig(num_speculative_tokens=3, runner="v2")
SHAPES = [("256 decode", 256, 256, True), ("256 req / 8192 tok", 256, 8192, False),
          ("1024 req / 16384 tok", 1024, 16384, False),
          ("256 decode + drafts, spec decode", 256, 256, True, SPEC_DECODE),
          ("256 decode + drafts, runner V2", 256, 256, True, RUNNER_V2),
          ("256 req / 8192 tok + drafts, runner V2", 256, 8192, False, RUNNER_V2)]
DRY_RUN_SHAPES = [("16 decode", 16, 16, True), ("16 decode + drafts, runner V2", 16, 16, True, RUNNER_V2)]
MAX_MODEL_LEN, BLOCK_SIZE = 4096, 16
GOALS = dict(launches=2, decode_device_us=10.0, decode_thread_us=25.0, decode_vs_v1=3.0)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def jax_row(path: str, call, args) -> dict:
    launches, device_us = (kernel_profile(call, args.steps)[:2]) if on_gpu() else (None, None)
    if launches == 0:  # a GPU step always runs something: the trace lost its device events (n/a, not 0)
        launches = device_us = None
    return dict(path=path, launches=launches, device_us=device_us, thread_us=dispatch_us(call, args.repeats),
                e2e_us=end_to_end_us(call, args.repeats))


def torch_device_profile(call, steps: int) -> tuple[int, float]:
    """(device operations per step, their µs per step) in a torch.profiler trace of ``steps`` calls."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call()
    synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        for _ in range(steps):
            call()
        synchronize()
    device = [e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return round(len(device) / steps), sum(e.device_time for e in device) / steps


def torch_row(path: str, call, args) -> dict:
    """``call`` launches one step without waiting; `synchronize` waits (a no-op without CUDA)."""
    def step():
        call()
        synchronize()

    launches, device_us = torch_device_profile(call, args.steps) if has_cuda() else (None, None)
    return dict(path=path, launches=launches, device_us=device_us, thread_us=queued_us(call, args.repeats),
                e2e_us=best_median_us(step, args.repeats))


def queued_us(call, repeats: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - start) / repeats * 1e6)
        synchronize()
    return best


def best_median_us(call, repeats: int) -> float:
    for _ in range(3):
        call()
    best = float("inf")
    for _ in range(5):
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
        best = min(best, float(np.median(samples)) * 1e6)
    return best


@dataclasses.dataclass
class StepCase:
    """One step's batch, its padded bucket and jaxprep's XLA step (the reference every path must equal)."""
    name: str
    config: object  # kernel="xla"
    arrays: dict
    state: BatchState
    bucket: int
    reference: object

    @classmethod
    def make(cls, name: str, num_reqs: int, num_tokens: int, decode_only: bool,
             features: FeatureConfig | None = None) -> StepCase:
        if features is not None:
            from mrv2_triton_baseline import make_draft_batch

            arrays, budget = make_draft_batch(num_reqs, num_tokens, features.num_speculative_tokens, decode_only,
                                              MAX_MODEL_LEN, BLOCK_SIZE)
            config = PrepConfig(max_num_reqs=num_reqs, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=budget,
                                block_size=BLOCK_SIZE, features=features)
        else:
            config, arrays = make_batch(num_reqs, num_tokens, MAX_MODEL_LEN, BLOCK_SIZE, decode_only)
        config = dataclasses.replace(config, kernel="xla")  # the default ("auto") would be the kernels on a GPU
        state = jax.device_put(BatchState.from_numpy(**arrays))
        bucket = config.bucket_for(int(arrays["num_scheduled_tokens"].sum()))
        return cls(name, config, arrays, state, bucket, jax.device_get(prepare_padded(state, config, bucket)))


def jax_rows(case: StepCase, args) -> list[dict]:
    """jaxprep's XLA and Pallas paths. All of them run before any torch profile: once torch.profiler has
    held CUPTI in a process, jax.profiler's later traces come back without device events."""
    config, state, bucket = case.config, case.state, case.bucket
    fused = dataclasses.replace(config, kernel="pallas")
    rows = [jax_row("jaxprep XLA", lambda: prepare_padded(state, config, bucket), args)]  # config: kernel="xla"
    problem = fused_problem(case.reference, state, fused, bucket)
    rows.append(dict(path="jaxprep Pallas", note=problem) if problem else
                jax_row("jaxprep Pallas", lambda: prepare_padded(state, fused, bucket), args))
    return [dict(row, step=case.name) for row in rows]


def torch_rows(case: StepCase, args) -> list[dict]:
    """vLLM's paths: V1's host preparation and its copies, MRV2's real kernels and its torch-ops twin; with
    drafts, MRV2's real kernels alone (under ``runner="v2"``, whose outputs are V2's)."""
    config, arrays, bucket = case.config, case.arrays, case.bucket
    if config.features.any_on:
        rows = mrv2_rows(config, arrays, case.reference, bucket, args) if config.features.runner == "v2" else []
        return [dict(row, step=case.name) for row in rows]
    num_reqs_padded, scheduled = config.num_reqs_padded(bucket), arrays["num_scheduled_tokens"]
    if has_cuda():
        v1 = VllmV1WithCopies(config, arrays, torch.device("cuda"))
        try:  # what landed on the device, read back
            assert_same_step(case.reference, v1.landed(v1.prepare_on_device(scheduled, bucket, num_reqs_padded)))
        except AssertionError as error:  # reported in the table, not timed: the other rows still run
            rows = [dict(path="vLLM V1 + CpuGpuBuffer copies", note=f"differs from jaxprep: {error}")]
        else:
            rows = [torch_row("vLLM V1 + CpuGpuBuffer copies", lambda: v1.prepare_on_device(
                scheduled, bucket, num_reqs_padded), args)]
    else:
        v1 = v1_baseline(config, arrays)
        rows = [torch_row("vLLM V1 + device_put", lambda: jax.block_until_ready(jax.device_put(np.concatenate(
            [np.asarray(v, np.int32).ravel() for k, v in v1.prepare(scheduled, bucket, num_reqs_padded).items()
             if hasattr(v, "shape")]))), args)]
    rows += mrv2_rows(config, arrays, case.reference, bucket, args)
    return [dict(row, step=case.name) for row in rows]


def fused_problem(reference, state, fused, bucket: int) -> str | None:
    """Why the Pallas row cannot be timed (its compile failed, or a field differs from XLA's), or None.
    A first run on a new GPU reports it in the table instead of losing the other rows."""
    try:
        step = jax.device_get(prepare_padded(state, fused, bucket))
    except Exception as error:  # any compile or launch failure is the finding
        return f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    names = [name for name, (a, b) in zip(_leaf_names(reference), zip(jax.tree.leaves(reference),
                                                                       jax.tree.leaves(step)))
             if not np.array_equal(a, b)]
    return f"differs from the XLA step in {names}" if names else None


def _leaf_names(step) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(step)]


def mrv2_rows(config, arrays: dict, reference, bucket: int, args) -> list[dict]:
    """MRV2's real kernels (CUDA and copied sources only) and, on a plain step, its torch-ops twin."""
    rows = []
    scheduled = arrays["num_scheduled_tokens"]
    idx_mapping = np.flatnonzero(scheduled > 0)
    num_reqs_padded = config.num_reqs_padded(bucket)
    device = "cuda" if has_cuda() else "cpu"
    k = config.features.num_speculative_tokens
    if has_cuda():
        from mrv2_triton_baseline import Mrv2TritonPrep, mismatches, v2_batch_order
        from vllm_sources import load_mrv2_kernels

        def v2_step():  # with drafts V2 sorts its batch and sums its logits rows on the host, each step
            if not k:
                return prep.prepare(idx_mapping, scheduled[idx_mapping], bucket, num_reqs_padded)
            order, batch_scheduled, batch_drafts = v2_batch_order(scheduled, arrays["num_draft_tokens"], k)
            return prep.prepare(order, batch_scheduled, bucket, num_reqs_padded, batch_drafts)

        try:
            kernels = load_mrv2_kernels()
            prep = Mrv2TritonPrep(kernels, arrays, config.block_size, config.max_num_batched_tokens, device, k)
            wrong = mismatches(reference, v2_step())
        except Exception as error:  # missing sources, or a kernel this Triton cannot build: the finding
            rows.append(dict(path="MRV2 real kernels", note=f"{type(error).__name__}: {error}"))  # one_line cuts it
        else:
            if wrong:  # reported in the table, not timed
                rows.append(dict(path="MRV2 real kernels", note=f"differ from jaxprep in {wrong}"))
            else:
                rows.append(torch_row(f"MRV2 real kernels (vLLM {kernels.version})", v2_step, args))
    else:
        rows.append(dict(path="MRV2 real kernels", note="needs CUDA (CPU check: tests/benchmarks/"
                                                         "test_mrv2_triton_kernels.py, Triton's interpreter)"))
    if k:
        return rows
    from mrv2_torch_baseline import Mrv2TorchPrep

    torch_prep = Mrv2TorchPrep(arrays["token_ids"], arrays["block_table"], arrays["num_computed_tokens"],
                               config.block_size, config.max_num_batched_tokens, device)
    rows.append(torch_row("MRV2 torch ops", lambda: torch_prep.prepare(idx_mapping, scheduled[idx_mapping], bucket,
                                                                         num_reqs_padded), args))
    return rows


def goals(row: dict, rows: list[dict]) -> str:
    """The issues' goals, on the Pallas rows: launches, decode device/thread time and vs V1 (plain steps),
    faster than the XLA step (steps with drafts: features no longer force XLA's step) and than MRV2's."""
    if row["path"] != "jaxprep Pallas":
        return ""
    if not on_gpu():
        return "GPU goals: n/a (no GPU; the Pallas kernels ran in Pallas' interpreter)"
    same = {r["path"].split(" (")[0]: r for r in rows if r["step"] == row["step"] and "e2e_us" in r}
    v1 = next((r for p, r in same.items() if p.startswith("vLLM V1")), None)
    checks = [("≤2 launches", None if row["launches"] is None else row["launches"] <= GOALS["launches"])]
    if "decode" in row["step"] and "drafts" not in row["step"]:
        device_ok = None if row["device_us"] is None else row["device_us"] <= GOALS["decode_device_us"]
        checks += [("≤10 µs device", device_ok),
                   ("≤25 µs thread", row["thread_us"] <= GOALS["decode_thread_us"]),
                   ("≥3x V1", v1 is not None and v1["e2e_us"] / row["e2e_us"] >= GOALS["decode_vs_v1"])]
    if "drafts" in row["step"]:
        xla = same.get("jaxprep XLA")
        checks.append(("faster than XLA", None if xla is None else row["e2e_us"] < xla["e2e_us"]))
    real = same.get("MRV2 real kernels")
    checks.append(("faster than MRV2 real", None if real is None else row["e2e_us"] < real["e2e_us"]))
    return "; ".join(f"{name}: {'n/a' if ok is None else 'met' if ok else 'missed'}" for name, ok in checks)


def one_line(note: str, limit: int = 300) -> str:
    """A note as one table cell: its lines joined, no column bars, at most ``limit`` characters."""
    return " ".join(note.split()).replace("|", "/")[:limit]


def cell(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def print_step_table(rows: list[dict]) -> None:
    print("| step / path | launches | device µs | thread µs | end to end µs | vs V1 (end to end) | goals |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for row in rows:
        if "e2e_us" not in row:
            print(f"| {row['step']} / {row['path']} | n/a | n/a | n/a | n/a | n/a | {one_line(row['note'])} |")
            continue
        v1 = next((r for r in rows if r["step"] == row["step"] and r["path"].startswith("vLLM V1")
                   and "e2e_us" in r), None)
        vs_v1 = "n/a" if v1 is None else f"{v1['e2e_us'] / row['e2e_us']:.2f}x"
        print(f"| {row['step']} / {row['path']} | {cell(row['launches'])} | {cell(row['device_us'])} "
              f"| {cell(row['thread_us'])} | {cell(row['e2e_us'])} | {vs_v1} | {goals(row, rows)} |")


SERVE_PATHS = [("xla", "auto"), ("pallas", "auto"), ("pallas", "xla"), ("pallas", "pallas_gpu")]
"""(plain step, attention) of the serve_step rows: ``auto`` attention is jaxprep's ragged kernel on CUDA
(the XLA path on CPU); ``xla`` and JAX's decode kernel (``pallas_gpu``, GPU only) are its controls."""
ATTENTION_KERNELS = ("jaxprep_ragged_attention", "paged_attention")


def serve_rows(args) -> list[dict]:
    """`serve_step` (tiny model, one iteration, empty batch state) on each path of the plain step and
    of the attention."""
    num_reqs, tokens = (16, 64) if args.dry_run else (256, 256)
    return [serve_row(kernel, attention, num_reqs, tokens, args) for kernel, attention in SERVE_PATHS
            if attention != "pallas_gpu" or on_gpu()]


def serve_row(kernel: str, attention: str, num_reqs: int, tokens: int, args) -> dict:
    from jaxprep import PrepConfig
    from jaxprep.serving import KVCache, ModelConfig, ServingConfig, ServingState, init_params, step
    from jaxprep.serving.update_packing import packed_size

    model = ModelConfig(vocab_size=64, num_layers=2, d_model=32, num_heads=2, d_ff=64, attention=attention)
    prep = PrepConfig(max_num_reqs=num_reqs, max_model_len=256, max_num_batched_tokens=tokens, block_size=16,
                      num_blocks=num_reqs * 16 + 1, kernel=kernel)
    config = ServingConfig(prep=prep, decode_steps=1)
    carry = [ServingState.empty(config), KVCache.zeros(model, prep.num_blocks, config.block_size)]
    params, packed = init_params(model, 0), np.zeros(packed_size(config), np.int32)

    def call():  # serve_step donates the state and the cache: each step hands them to the next
        carry[0], carry[1], tokens_out = step.serve_step(carry[0], carry[1], params, packed, config=config,
                                                         model=model, num_tokens_padded=tokens)
        return tokens_out

    path = f"serve_step, plain step on {kernel}" + ("" if attention == "auto" else f", attention {attention}")
    row = jax_row(path, call, args)
    kernels = kernel_profile(call, args.steps)[2] if on_gpu() else []
    named = {label: sum(n for name, _, n in kernels if any(part in name for part in parts)) if on_gpu() else None
             for label, parts in (("prepare_kernels", ("jaxprep_prepare",)), ("attention_kernels", ATTENTION_KERNELS))}
    return dict(row, **named)


def print_serve_table(rows: list[dict], command_buffers: str) -> None:
    print(f"| serve_step (command buffers: {command_buffers}) | launches | prepare kernels | attention kernels "
          "| device µs | thread µs | end to end µs |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['path']} | {cell(r['launches'])} | {cell(r['prepare_kernels'])} | {cell(r['attention_kernels'])} "
              f"| {cell(r['device_us'])} | {cell(r['thread_us'])} | {cell(r['e2e_us'])} |")


def main() -> int:
    args = ARGS or parse_args()
    print(f"machine: {machine_line()}; {load_line()}")
    print(RUNTIME)
    print(f"measured: {jax.default_backend()} ({jax.devices()[0].device_kind}); torch CUDA: {has_cuda()}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    cases = [StepCase.make(*shape) for shape in (DRY_RUN_SHAPES if args.dry_run else SHAPES)]
    ours = [row for case in cases for row in jax_rows(case, args)]
    served = serve_rows(args)  # jax.profiler too: before the first torch profile
    theirs = [row for case in cases for row in torch_rows(case, args)]
    print_step_table([row for case in cases for row in ours + theirs if row["step"] == case.name])
    print()
    print_serve_table(served, args.command_buffers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
