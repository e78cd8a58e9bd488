"""vLLM's scheduler output turned into a prepared step: `VllmAdapter` against vLLM V1's own runner, one process.

    PYTHONPATH=. python benchmarks/bench_vllm_adapter.py [--sizes 64,256,1024] [--steps 32] [--rounds 5]

For each size N (vLLM ``max_num_seqs`` = N requests, all arriving at once: chunked prefills, then decodes),
vLLM 0.33.0's real ``Scheduler`` (tests/support/vllm_scheduler.py) is driven by the fake model for
``--steps`` steps and its ``SchedulerOutput``s recorded. Both sides then replay the same outputs (deep
copies, made before the clock starts):

- jaxprep: ``VllmAdapter.step`` (the translation to one `StepUpdates`, its host checks, the packed
  update applied on the device, `prepare_padded` at the ladder's bucket), until the prepared step is
  ready (``block_until_ready``);
- vLLM V1: `vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._update_states` +
  ``_prepare_inputs`` on a real ``InputBatch`` (``CPUModelRunner``, as the parity test builds it). vLLM's
  slot mapping is a Triton GPU kernel (`vllm/v1/worker/block_table.py::_compute_slot_mapping_kernel`); on
  this CPU machine its formula runs as NumPy on the runner's own buffers (as
  benchmarks/vllm_v1_baseline.py does for every GPU part), not in Triton's interpreter.

Between steps, untimed on both sides: the fake model's tokens are recorded (``record_sampled`` on the
device; ``_bookkeeping_sync`` for V1). A first replay warms jaxprep up (compiles every bucket and payload
size; reported apart). Reported: per-step mean over the replayed steps, and over its decode-only steps
(no admission, one token per request), the median over ``--rounds`` replays (the two sides alternate, round
by round), and the ratios jaxprep / V1 (goal on CPU: <= 1.0x). A third replay per round times jaxprep's host
phases alone (translate + checks + pack, clocked by `phase_clock` around the functions that do them, as
benchmarks/profile_vllm_adapter.py reports them), against V1's whole step (issue 37's goal: <= 0.3x).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the support package: vLLM's scheduler and runner on the CPU

from support.vllm_scheduler import no_pinned_memory  # noqa: E402

no_pinned_memory()  # before vLLM's runner modules are imported

from common import PartClock, configure_benchmark_runtime, load_line, machine_line  # noqa: E402

RUNTIME = configure_benchmark_runtime()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import jaxprep  # noqa: E402
from jaxprep.serving import ServingConfig  # noqa: E402
from jaxprep.serving.host import batch as batch_module  # noqa: E402
from jaxprep.serving.host import checks  # noqa: E402
from jaxprep.serving.host.vllm import VllmAdapter  # noqa: E402
from support.vllm_scheduler import Requests, Workload, fake_token, make_scheduler  # noqa: E402
from support.vllm_v1_runner import V1Runner  # noqa: E402

PHASES = ("translate", "checks", "pack", "dispatch", "wait")
HOST_PHASES = ("translate", "checks", "pack")
TIMED = (  # (module or class, attribute, phase): the parts of a step, where a checkout has them
    (VllmAdapter, "_plan", "translate"),
    (checks, "check_updates", "checks"),
    ("jaxprep.serving.host.column_checks", "check_columns", "checks"),
    (batch_module, "pack_step", "pack"),
    (batch_module, "pack_columns", "pack"),
)


def phase_clock() -> PartClock:
    """A clock of the `PHASES` of `VllmAdapter.step` (`TIMED`)."""
    return PartClock(PHASES, TIMED)


def workload(size: int, steps: int) -> Workload:
    """N requests at once, prompts of 16-32 tokens, a pool that never preempts: a few steps of chunked
    prefills and admissions, then decodes."""
    budget = max(1024, 2 * size)
    return Workload(f"{size} requests", num_steps=steps, max_num_seqs=size, max_model_len=256,
                    max_num_batched_tokens=budget, block_size=16, num_blocks=size * 16 + 64, num_requests=size,
                    arrivals_per_step=size, prompt_lens=(16, 32), max_tokens=(200, 200))


def serving_config(work: Workload, package=jaxprep) -> ServingConfig:
    """The workload's configuration; ``package``: a jaxprep package to build it from (ab_vllm_adapter.py's other
    checkout)."""
    prep = package.PrepConfig(max_num_reqs=work.max_num_seqs, max_model_len=work.max_model_len,
                              max_num_batched_tokens=work.max_num_batched_tokens, block_size=work.block_size,
                              num_blocks=work.num_blocks)
    return package.serving.ServingConfig(prep=prep, vocab_size=1000)


def record_outputs(work: Workload) -> list[tuple]:
    """(scheduler output, {req_id: sampled tokens}) per step, from vLLM's scheduler and the fake model."""
    from vllm.v1.outputs import ModelRunnerOutput

    scheduler, requests = make_scheduler(work), Requests(work)
    num_tokens, recorded = {}, []
    for number in range(work.num_steps):
        for request in requests.arrivals(number):
            scheduler.add_request(request)
            num_tokens[request.request_id] = request.num_prompt_tokens
        so = scheduler.schedule()
        computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        sampled = {}
        for req_id, count in so.num_scheduled_tokens.items():
            end = computed[req_id] + count
            sampled[req_id] = [fake_token(req_id, end)] if end >= num_tokens[req_id] else []
            num_tokens[req_id] += len(sampled[req_id])
        recorded.append((copy.deepcopy(so), sampled))
        req_ids = list(so.num_scheduled_tokens)
        scheduler.update_from_output(so, ModelRunnerOutput(req_ids=req_ids,
                                                           req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                                           sampled_token_ids=[sampled[r] for r in req_ids]))
    return recorded


def numpy_slot_mapping(runner) -> None:
    """The V1 runner's slot mapping as NumPy on its host buffers: `_compute_slot_mapping_kernel`'s
    ``block_table[req, pos // block_size] * block_size + pos % block_size``, tail PAD_SLOT_ID (-1)."""
    for table in runner.input_batch.block_table.block_tables:
        def compute(num_reqs, query_start_loc, positions, table=table):
            qsl = query_start_loc.numpy()
            pos = positions.numpy()
            req = np.repeat(np.arange(num_reqs), np.diff(qsl[:num_reqs + 1]))
            blocks = table.block_table.np[req, pos // table.block_size]
            out = table.slot_mapping.np
            np.add(blocks * table.block_size, pos % table.block_size, out=out[:len(pos)])
            out[len(pos):].fill(-1)
        table.compute_slot_mapping = compute


def replay_jaxprep(config: ServingConfig, recorded: list, finish=None, host: list | None = None) -> list[float]:
    """Per step: ``adapter.step`` until the step is ready (``finish(step)``, default: its buffer's
    ``block_until_ready``), seconds; the fake model's tokens recorded between steps, untimed. ``host``: a
    list that gets each step's host phases (translate + checks + pack, `phase_clock`), seconds."""
    adapter, times, clock = VllmAdapter(config), [], phase_clock()
    adapter.batch.steady_programs = True  # as after `ServingBatch.warmup`: each program compiles on first use here
    outputs = copy.deepcopy([so for so, _ in recorded])
    with contextlib.nullcontext() if host is None else clock.timing():
        for so, (_, sampled) in zip(outputs, recorded):
            clock.reset()
            start = time.perf_counter()
            step = adapter.step(so)
            if finish is None:
                jax.block_until_ready(ready(step))
            else:
                finish(step)
            times.append(time.perf_counter() - start)
            if host is not None:
                host.append(sum(clock.seconds[p] for p in HOST_PHASES))
            record_step(adapter, config, step, sampled)
    return times


def record_step(adapter: VllmAdapter, config: ServingConfig, step, sampled: dict) -> None:
    """The fake model's tokens recorded on the device (untimed)."""
    rows = config.prep.num_reqs_padded(step.num_tokens_padded)
    tokens, counts = np.zeros((rows, 1), np.int32), np.zeros(rows, np.int32)
    for b, req_id in enumerate(step.req_ids):
        if sampled[req_id]:
            tokens[b, 0], counts[b] = sampled[req_id][0], 1
    adapter.record_sampled(jax.device_put(tokens), jax.device_put(counts))
    jax.block_until_ready(adapter.batch.state)


def ready(step):
    """What a step is ready with: its one buffer (`AdapterStep.buffer`), or on a checkout from before it its
    `StepInputs`."""
    return step.buffer if hasattr(step, "buffer") else step.inputs


def replay_v1(work: Workload, recorded: list, finish=None) -> list[float]:
    """Per step: V1's ``_update_states`` + ``_prepare_inputs`` (then ``finish(runner, num_reqs, num_tokens)``:
    the GPU benchmark's copies to the device), seconds; ``_bookkeeping_sync`` between steps, untimed."""
    runner, times = V1Runner(work), []
    numpy_slot_mapping(runner.runner)
    outputs = copy.deepcopy([so for so, _ in recorded])
    from support.vllm_scheduler import cpu_platform_stubs

    with cpu_platform_stubs():
        for so, (_, sampled) in zip(outputs, recorded):
            start = time.perf_counter()
            runner.runner._update_states(so)
            req_ids = runner.runner.input_batch.req_ids
            scheduled = np.array([so.num_scheduled_tokens[r] for r in req_ids], np.int32)
            runner.runner._prepare_inputs(so, scheduled)
            if finish is not None:
                finish(runner.runner, len(req_ids), int(scheduled.sum()))
            times.append(time.perf_counter() - start)
            bookkeeping(runner, so, [sampled[r] for r in req_ids], int(scheduled.sum()))
    return times


def bookkeeping(runner: V1Runner, so, sampled: list[list[int]], num_tokens: int) -> None:
    """``_bookkeeping_sync`` with the fake tokens (untimed)."""
    from vllm.v1.outputs import SamplerOutput

    table = np.array([[s[0] if s else 0] for s in sampled], np.int32)
    runner.runner.input_batch.prev_sampled_token_ids = None
    runner.runner._bookkeeping_sync(so, SamplerOutput(torch.from_numpy(table), None), None,
                                    torch.zeros(num_tokens, 1), num_tokens)


def median_means(rounds: list[list[float]], decode: np.ndarray) -> tuple[float, float]:
    """The median over rounds of each round's mean step time over all steps, and over the decode-only
    steps (us)."""
    times = np.array(rounds) * 1e6
    return (float(np.median(times.mean(axis=1))),
            float(np.median(times[:, decode].mean(axis=1))) if decode.any() else np.nan)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(machine_line())
    print(RUNTIME)
    print("| requests | steps (decode-only) | tokens/step | jaxprep us/step | vLLM V1 us/step | ratio | "
          "decode-only: jaxprep | V1 | ratio | host phases us/step: mixed | / V1 | decode-only | / V1 | "
          "jaxprep warm-up s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        work = workload(size, args.steps)
        recorded = record_outputs(work)
        config = serving_config(work)
        start = time.perf_counter()
        replay_jaxprep(config, recorded)  # compiles every bucket and payload size of the replay
        warmup = time.perf_counter() - start
        decode = np.array([not so.scheduled_new_reqs and max(so.num_scheduled_tokens.values()) == 1
                           for so, _ in recorded])
        rounds = []
        for _ in range(args.rounds):  # the sides interleaved, round by round
            host: list[float] = []
            rounds.append((replay_jaxprep(config, recorded), replay_v1(work, recorded),
                           replay_jaxprep(config, recorded, host=host) and host))
        ours, theirs, phases = (median_means([r[i] for r in rounds], decode) for i in range(3))
        tokens = np.mean([so.total_num_scheduled_tokens for so, _ in recorded])
        print(f"| {size} | {len(recorded)} ({decode.sum()}) | {tokens:.0f} | {ours[0]:.0f} | {theirs[0]:.0f} | "
              f"{ours[0] / theirs[0]:.2f}x | {ours[1]:.0f} | {theirs[1]:.0f} | {ours[1] / theirs[1]:.2f}x | "
              f"{phases[0]:.0f} | {phases[0] / theirs[0]:.2f}x | {phases[1]:.0f} | {phases[1] / theirs[1]:.2f}x | "
              f"{warmup:.1f} |", flush=True)
    print(load_line())


if __name__ == "__main__":
    main()
