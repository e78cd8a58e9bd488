"""`transitions.apply_packed` alone at one payload rung, for several ``max_num_reqs``: its time and
the ops of its lowered program (a proxy for the kernels it launches on a GPU).

    PYTHONPATH=. python benchmarks/bench_apply_packed.py [--sizes 64,256,1024] [--words 64] [--sampling] [--drafts K]

The update is a small decode step that fits the ``--words`` rung: a dense schedule of the first
rows (one token each) and one appended block, packed by `packing.pack_step` and padded to the rung.
The state is donated and threaded through the calls, as `ServingBatch` runs it. Reported per size:
the median µs per call (best of ``--rounds`` rounds of ``--repeats`` calls, compile time apart) and
the counts of ``stablehlo.`` ops, gathers and scatters in ``apply_packed.lower(...).as_text()``, the
elements those gathers read and scatters write (from the jaxpr), the instructions of the compiled
entry computation (XLA:CPU's fusions: a proxy for GPU kernels), and the bytes XLA's cost analysis
counts as accessed (on XLA:CPU a scatter counts its whole operand, so this grows with the state).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import add_timing_arguments, configure_benchmark_runtime, load_line, machine_line, median_us

RUNTIME = configure_benchmark_runtime()

import jax  # noqa: E402
import jax.extend  # noqa: E402
import numpy as np  # noqa: E402

import jaxprep  # noqa: E402
from jaxprep.features import FeatureConfig, SamplingConfig  # noqa: E402
from jaxprep.serving import ServingConfig, StepUpdates, pack_step  # noqa: E402
from jaxprep.serving.state import ServingState  # noqa: E402
from jaxprep.serving.transitions import apply_packed  # noqa: E402
from jaxprep.serving.update_packing import HEADER_WORDS, pad_to, payload_layout  # noqa: E402


def serving_config(rows: int, sampling: bool, drafts: int = 0) -> ServingConfig:
    """The configuration of benchmarks/bench_vllm_adapter.py at ``rows`` requests (+ sampling, + K drafts)."""
    features = FeatureConfig(sampling=SamplingConfig(vocab_size=1000) if sampling else None,
                             num_speculative_tokens=drafts)
    prep = jaxprep.PrepConfig(max_num_reqs=rows, max_model_len=256, max_num_batched_tokens=max(1024, 2 * rows),
                              block_size=16, num_blocks=rows * 16 + 64, features=features)
    return ServingConfig(prep=prep, vocab_size=1000, num_speculative_tokens=drafts)


def decode_buffer(config: ServingConfig, words: int) -> np.ndarray:
    """A decode step that fits ``words``: one block appended to row 0 (5 words), a dense schedule of
    the first rows (one token each, no drafts), padded to ``words``."""
    width = len(payload_layout(config).schedule_fields) - 1  # a dense entry: no row field
    scheduled = min(config.max_num_reqs, (words - HEADER_WORDS - 5) // width)
    updates = StepUpdates.build(config, append={0: [7]},
                                num_scheduled_tokens=[1] * scheduled + [0] * (config.max_num_reqs - scheduled))
    buffer = pack_step(config, updates, np.ones((config.max_num_reqs, 1), np.int64)).step
    if len(buffer) > words:
        raise SystemExit(f"the update takes {len(buffer)} words, more than the {words}-word rung")
    return pad_to(buffer, words)


def indexed_elements(jaxpr) -> int:
    """Elements every gather reads and every scatter writes (its updates), sub-jaxprs included: the
    threads those ops launch on a GPU, whatever the size of the array they index."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "gather":
            total += int(np.prod(eqn.outvars[0].aval.shape))
        elif eqn.primitive.name.startswith("scatter"):
            total += int(np.prod(eqn.invars[2].aval.shape))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += indexed_elements(sub)
    return total


def entry_kernels(hlo: str) -> int:
    """Instructions of the compiled program's entry computation that run (fusions, scatters, copies...;
    not parameters, constants, tuples): one kernel each on a GPU."""
    entry = hlo[hlo.index("ENTRY"):]
    ops = re.findall(r"= \S+ ([a-z\-]+)\(", entry[: entry.index("\n}")])
    return sum(op not in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast") for op in ops)


def op_counts(config: ServingConfig, buffer: np.ndarray) -> dict[str, int]:
    """Ops of the lowered program, elements its gathers and scatters index, and XLA's cost analysis
    of the compiled program (bytes accessed; on XLA:CPU a scatter counts its whole operand)."""
    state = ServingState.empty(config)
    elements = indexed_elements(jax.make_jaxpr(lambda s, b: apply_packed(s, b, config=config))(state, buffer).jaxpr)
    lowered = apply_packed.lower(state, buffer, config=config)
    ops = re.findall(r"stablehlo\.([a-z_]+)", lowered.as_text())
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return dict(ops=len(ops), gather=ops.count("gather"), scatter=ops.count("scatter"), elements=elements,
                kernels=entry_kernels(compiled.as_text()),
                bytes=int(cost.get("bytes accessed", -1)), compile_s=compile_s)


def time_us(config: ServingConfig, buffer: np.ndarray, repeats: int, rounds: int) -> float:
    """The best round's median µs of apply_packed, the state threaded through the calls."""
    state, device_buffer = [ServingState.empty(config)], jax.device_put(buffer)

    def call():  # the state is donated: each call hands it to the next
        state[0] = jax.block_until_ready(apply_packed(state[0], device_buffer, config=config))

    return min(median_us(call, repeats) for _ in range(rounds))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--words", type=int, default=64, help="the payload rung (buffer length in words)")
    parser.add_argument("--sampling", action="store_true", help="FeatureConfig.sampling on (penalty bins)")
    parser.add_argument("--drafts", type=int, default=0, help="num_speculative_tokens (draft fields in the schedule)")
    add_timing_arguments(parser)
    args = parser.parse_args()
    print(machine_line())
    print(RUNTIME)
    print(f"rung {args.words} words, sampling {'on' if args.sampling else 'off'}, {args.drafts} draft tokens")
    print("| max_num_reqs | apply_packed us | compile s | stablehlo ops | gathers | scatters | elements indexed | "
          "compiled kernels | bytes accessed |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in (int(s) for s in args.sizes.split(",")):
        config = serving_config(rows, args.sampling, args.drafts)
        buffer = decode_buffer(config, args.words)
        counts = op_counts(config, buffer)
        us = time_us(config, buffer, args.repeats, args.rounds)
        print(f"| {rows} | {us:.1f} | {counts['compile_s']:.2f} | {counts['ops']} | {counts['gather']} | "
              f"{counts['scatter']} | {counts['elements']} | {counts['kernels']} | "
              f"{counts['bytes']} |", flush=True)
    print(load_line())


if __name__ == "__main__":
    main()
