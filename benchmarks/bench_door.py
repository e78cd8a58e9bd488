"""The door end to end: vLLM's SchedulerOutput to torch tensors ready on the GPU, against vLLM V1 (issue 30).

    PYTHONPATH=. python benchmarks/bench_door.py [--shapes decode256,256/8192,1024/16384] [--rounds 3]
    PYTHONPATH=. python benchmarks/bench_door.py --dry-run    # the CPU path: the smallest shape, few steps

Each shape's ``SchedulerOutput``s come from vLLM 0.33.0's real ``Scheduler`` (bench_vllm_adapter.py's
recording: the fake model's tokens), replayed by every side (deep copies, made before the clock starts):

- jaxprep: ``VllmAdapter.step`` (the host translation and checks, then ONE jitted call: the packed update
  applied and the step prepared, the state donated, the step out as one `StepBuffer`), then
  ``torch_bridge.to_torch(step.buffer)`` (one DLPack handoff, views cut by the layout), until the device
  is done (``torch.cuda.synchronize``);
- vLLM V1: `vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._update_states` + ``_prepare_inputs`` on
  vLLM's CPU ``InputBatch`` (bench_vllm_adapter.py's runner), then the host-built fields copied to the device
  as vLLM copies its buffers (``input_ids``, ``positions``, ``query_start_loc``, ``seq_lens``, the slot
  mapping, the block table's rows; `benchmarks/vllm_v1_copies.py` copies the same fields), synchronized;
- MRV2's real kernels (CUDA, with the sources of `benchmarks/vllm_sources.py`): its prepare kernels on the
  state the first timed step leaves (`mrv2_triton_baseline.Mrv2TritonPrep`, one call timed after one
  untimed; its own state update from the ``SchedulerOutput`` is not timed, so the row flatters MRV2).

Shapes: ``decode256`` (256 requests, the decode-only steps), ``256/8192`` and ``1024/16384`` (requests /
token budget: the steps that fill at least 90% of the budget, chunked prefills). Columns: end-to-end µs per
step (the median over ``--rounds`` of each round's mean, the sides alternating round by round), the ratio
V1 / jaxprep (goal: >= 2x), the calling-thread µs of the door's one jitted call (its dispatch, timed around
`jaxprep.serving.step.update_and_prepare_buffer`) and the no-op floor (a jitted ``x + 1`` over one int32[256],
the same run; goal: step <= 1.5x floor). On the CPU (``--dry-run``) the dispatch is synchronous, so the
thread time includes the step's work: the dry run checks the table, not the goals.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_vllm_adapter as adapter_bench
import jax
import jax.numpy as jnp
import numpy as np
import torch
from common import load_line, machine_line

import jaxprep
import jaxprep.serving.host.batch as serving_batch
import torch_bridge
from jaxprep.serving import ServingConfig
from support.vllm_scheduler import Workload

SHAPES = ("decode256", "256/8192", "1024/16384")
FULL = 0.9
"""A mixed shape's timed steps fill at least this share of the token budget."""


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    work: Workload
    decode_only: bool  # time the decode-only steps; else the steps that fill the budget


def shape(name: str, steps: int) -> Shape:
    if name.startswith("decode"):
        size = int(name.removeprefix("decode"))
        return Shape(name, adapter_bench.workload(size, steps), decode_only=True)
    size, budget = (int(part) for part in name.split("/"))
    prompt = (2 * budget // size, 4 * budget // size)  # about 3 budgets of prompts: full chunked-prefill steps
    max_len = 1 << int(np.ceil(np.log2(prompt[1] + 64)))
    work = Workload(f"{size}/{budget}", num_steps=steps, max_num_seqs=size, max_model_len=max_len,
                    max_num_batched_tokens=budget, block_size=16, num_blocks=size * (max_len // 16) + 64,
                    num_requests=size, arrivals_per_step=size, prompt_lens=prompt, max_tokens=(32, 32))
    return Shape(name, work, decode_only=False)


def serving_config(work: Workload) -> ServingConfig:
    prep = jaxprep.PrepConfig(max_num_reqs=work.max_num_seqs, max_model_len=work.max_model_len,
                              max_num_batched_tokens=work.max_num_batched_tokens, block_size=work.block_size,
                              num_blocks=work.num_blocks)
    return ServingConfig(prep=prep, vocab_size=1000)


def on_cuda() -> bool:
    return torch.cuda.is_available() and jax.default_backend() == "gpu"


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def door_finish(device):
    """jaxprep's end: the step's buffer to torch in one handoff, the device done."""
    def finish(step) -> None:
        inputs = torch_bridge.to_torch(step.buffer, device)
        synchronize()
        if not torch.cuda.is_available():  # the CPU path: the views are ready once the buffer is
            jax.block_until_ready(inputs.jax_buffers)
    return finish


def host_tensor(buffer) -> torch.Tensor:
    """The host tensor of a vLLM ``CpuGpuBuffer`` (its ``.cpu``), or the tensor itself."""
    cpu = getattr(buffer, "cpu", None)
    return buffer if callable(cpu) else cpu


def v1_finish(device):
    """V1's end: its host-built fields copied to the device as vLLM copies them, the device done."""
    def finish(runner, num_reqs: int, num_tokens: int) -> None:
        table = runner.input_batch.block_table.block_tables[0]
        fields = [host_tensor(runner.input_ids)[:num_tokens], host_tensor(runner.positions)[:num_tokens],
                  host_tensor(runner.query_start_loc)[:num_reqs + 1], host_tensor(runner.seq_lens)[:num_reqs],
                  host_tensor(table.slot_mapping)[:num_tokens], host_tensor(table.block_table)[:num_reqs]]
        if device is not None:
            [field.to(device, non_blocking=True) for field in fields]
        synchronize()
    return finish


def timed_call(module, name: str, times: list):
    """Wraps ``module.name`` so each call's calling-thread seconds land in ``times``; returns the undo."""
    original = getattr(module, name)

    def call(*args, **kwargs):
        start = time.perf_counter()
        out = original(*args, **kwargs)
        times.append(time.perf_counter() - start)
        return out

    setattr(module, name, call)
    return lambda: setattr(module, name, original)


def floor_us(repeats: int) -> float:
    """The one-array no-op floor: calling-thread µs of a jitted ``x + 1`` over one int32[256], queued back
    to back (the final wait not counted), median of 5 rounds."""
    plus_one = jax.jit(lambda x: x + 1)
    x = jax.block_until_ready(plus_one(jnp.zeros(256, jnp.int32)))
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        outs = [plus_one(x) for _ in range(repeats)]
        rounds.append((time.perf_counter() - start) / repeats * 1e6)
        jax.block_until_ready(outs)
    return float(np.median(rounds))


def mrv2_us(config: ServingConfig, recorded: list, timed: np.ndarray) -> str:
    """MRV2's real prepare kernels on each timed step's state (CUDA only); µs per step, or why not."""
    if not on_cuda():
        return "needs CUDA"
    try:
        from mrv2_triton_baseline import Mrv2TritonPrep
        from vllm_sources import load_mrv2_kernels

        kernels = load_mrv2_kernels()
    except Exception as error:  # missing sources: the finding
        return f"{type(error).__name__}: {error}"[:120]
    adapter, times = adapter_bench.VllmAdapter(config), []
    adapter.batch.steady_programs = True  # as the timed replays (`bench_vllm_adapter.replay_jaxprep`)
    for (so, _), keep in zip(recorded, timed):
        step = adapter.step(so)
        if not keep:
            continue
        host = step.buffer.to_numpy()
        rows = np.asarray(host.idx_mapping)[:int(host.attn_metadata.num_reqs)]
        state = jax.tree.map(np.asarray, adapter.batch.state.batch)
        arrays = dict(token_ids=state.token_ids, block_table=state.block_table,
                      num_computed_tokens=state.num_computed_tokens, num_scheduled_tokens=state.num_scheduled_tokens)
        prep = Mrv2TritonPrep(kernels, arrays, config.prep.block_size, config.prep.max_num_batched_tokens, "cuda")
        scheduled = arrays["num_scheduled_tokens"]
        bucket, padded = step.num_tokens_padded, config.prep.num_reqs_padded(step.num_tokens_padded)
        prep.prepare(rows, scheduled[rows], bucket, padded)
        synchronize()
        start = time.perf_counter()
        prep.prepare(rows, scheduled[rows], bucket, padded)
        synchronize()
        times.append(time.perf_counter() - start)
        break  # one step: the kernels' state is rebuilt (copied to the device) for each step timed
    return f"{np.median(times) * 1e6:.0f}" if times else "no step"


def row(spec: Shape, args) -> str:
    work, device = spec.work, ("cuda" if on_cuda() else None)
    recorded = adapter_bench.record_outputs(work)
    config = serving_config(work)
    budget = work.max_num_batched_tokens
    if spec.decode_only:
        timed = np.array([not so.scheduled_new_reqs and max(so.num_scheduled_tokens.values()) == 1
                          for so, _ in recorded])
    else:
        timed = np.array([so.total_num_scheduled_tokens >= FULL * budget for so, _ in recorded])
    adapter_bench.replay_jaxprep(config, recorded, door_finish(device))  # compiles every bucket and payload size
    ours, theirs, thread = [], [], []
    for _ in range(args.rounds):
        dispatch_times: list[float] = []
        undo = timed_call(serving_batch, "update_and_prepare_buffer", dispatch_times)
        try:
            ours.append(np.array(adapter_bench.replay_jaxprep(config, recorded, door_finish(device)))[timed].mean())
        finally:
            undo()
        thread.append(np.array(dispatch_times)[timed].mean())
        theirs.append(np.array(adapter_bench.replay_v1(work, recorded, v1_finish(device)))[timed].mean())
    ours_us, theirs_us, thread_us = (float(np.median(v)) * 1e6 for v in (ours, theirs, thread))
    floor = floor_us(args.repeats)
    speedup, thread_ratio = theirs_us / ours_us, thread_us / floor
    goals = []
    if on_cuda():
        goals += ["" if speedup >= 2 else "speed goal missed", "" if thread_ratio <= 1.5 else "thread goal missed"]
    note = "; ".join(g for g in goals if g) or ("ok" if on_cuda() else "CPU: goals not checked")
    tokens = np.mean([so.total_num_scheduled_tokens for (so, _), keep in zip(recorded, timed) if keep])
    return (f"| {spec.name} | {int(timed.sum())} | {tokens:.0f} | {ours_us:.0f} | {theirs_us:.0f} | {speedup:.2f}x | "
            f"{mrv2_us(config, recorded, timed)} | {thread_us:.1f} | {floor:.1f} | {thread_ratio:.2f}x | {note} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {','.join(SHAPES)} "
                        "(decodeN, N/BUDGET)")
    parser.add_argument("--steps", type=int, default=24, help="scheduler steps recorded per shape")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=200, help="calls per round of the no-op floor")
    parser.add_argument("--dry-run", action="store_true", help="the CPU check: decode16, 4 steps, 3 rounds")
    args = parser.parse_args(argv)
    names = args.shapes.split(",")
    if args.dry_run:
        names, args.steps, args.rounds, args.repeats = ["decode16"], 4, 3, 20
    print(machine_line())
    print(adapter_bench.RUNTIME, "| torch CUDA:", torch.cuda.is_available())
    print("| shape | steps timed | tokens/step | jaxprep e2e µs | V1 + copies µs | V1 / jaxprep | MRV2 kernels µs | "
          "step thread µs | no-op floor µs | step / floor | goals |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name in names:
        print(row(shape(name, args.steps), args), flush=True)
    print(load_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
