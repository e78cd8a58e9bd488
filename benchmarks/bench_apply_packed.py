"""`transitions.apply_packed` alone at one payload rung, for several ``max_num_reqs``: its time and
the ops of its lowered program (a proxy for the kernels it launches on a GPU); beside it its steady program
and the door's step (`step.update_and_prepare_buffer`, general and steady).

    PYTHONPATH=. python benchmarks/bench_apply_packed.py [--sizes 64,256,1024] [--words 64] [--sampling] [--drafts K]
                                                         [--programs apply,apply-steady,door,door-steady]

The update is a small decode step that fits the ``--words`` rung: a dense schedule of the first
rows (one token each) and one appended block, packed by `packing.pack_step` and padded to the rung: a steady
buffer (`update_packing.is_steady`), which every program takes (``-steady``: the program that reads the finish,
add and resume sections at size 0; the door's step at the bucket of the scheduled tokens).
The state is donated and threaded through the calls, as `ServingBatch` runs it. Reported per size and program:
the median µs per call (best of ``--rounds`` rounds of ``--repeats`` calls, the programs taking turns within
each round, compile time apart) and
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
from jaxprep.serving.step import update_and_prepare_buffer  # noqa: E402
from jaxprep.serving.transitions import apply_packed  # noqa: E402
from jaxprep.serving.update_packing import HEADER, HEADER_WORDS, is_steady, pad_to, payload_layout  # noqa: E402

PROGRAMS = ("apply", "apply-steady", "door", "door-steady")


def program(name: str, config: ServingConfig, buffer: np.ndarray):
    """``(jitted function, its static arguments)`` of a `PROGRAMS` name for ``buffer``'s decode step."""
    static = dict(config=config, steady=name.endswith("-steady"))
    if name.startswith("door"):
        scheduled = int(np.count_nonzero(scheduled_counts(buffer)))
        return update_and_prepare_buffer, dict(static, num_tokens_padded=config.prep.bucket_for(max(scheduled, 1)))
    return apply_packed, static


def scheduled_counts(buffer: np.ndarray) -> np.ndarray:
    """The dense schedule's counts of a `decode_buffer` (after its one 4-word segment)."""
    n = int(buffer[HEADER.index("n_schedule")])
    start = HEADER_WORDS + 4 * int(buffer[HEADER.index("n_segments")])
    return buffer[start: start + n]


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


def op_counts(config: ServingConfig, buffer: np.ndarray, name: str = "apply") -> dict[str, int]:
    """Ops of the lowered program (`PROGRAMS`), elements its gathers and scatters index, and XLA's cost analysis
    of the compiled program (bytes accessed; on XLA:CPU a scatter counts its whole operand)."""
    state = ServingState.empty(config)
    function, static = program(name, config, buffer)
    elements = indexed_elements(jax.make_jaxpr(lambda s, b: function(s, b, **static))(state, buffer).jaxpr)
    lowered = function.lower(state, buffer, **static)
    ops = re.findall(r"stablehlo\.([a-z_]+)", lowered.as_text())
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return dict(ops=len(ops), gather=ops.count("gather"), scatter=ops.count("scatter"), elements=elements,
                kernels=entry_kernels(compiled.as_text()),
                bytes=int(cost.get("bytes accessed", -1)), compile_s=compile_s)


def time_us(config: ServingConfig, buffer: np.ndarray, repeats: int, rounds: int,
            names: tuple[str, ...] = ("apply",)) -> dict[str, float]:
    """Per program (`PROGRAMS`): the best round's median µs, the state threaded through its calls, the programs
    taking turns within each round."""
    device_buffer, calls = jax.device_put(buffer), {}
    for name in names:
        function, static = program(name, config, buffer)
        state = [ServingState.empty(config)]

        def call(function=function, static=static, state=state):  # the state is donated: each call hands it on
            out = jax.block_until_ready(function(state[0], device_buffer, **static))
            state[0] = out[0] if isinstance(out, tuple) else out

        calls[name] = call
    best = {name: float("inf") for name in names}
    for _ in range(rounds):
        for name, call in calls.items():
            best[name] = min(best[name], median_us(call, repeats))
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--words", type=int, default=64, help="the payload rung (buffer length in words)")
    parser.add_argument("--sampling", action="store_true", help="FeatureConfig.sampling on (penalty bins)")
    parser.add_argument("--drafts", type=int, default=0, help="num_speculative_tokens (draft fields in the schedule)")
    parser.add_argument("--programs", default=",".join(PROGRAMS), help=f"some of {', '.join(PROGRAMS)}")
    add_timing_arguments(parser)
    args = parser.parse_args()
    names = tuple(args.programs.split(","))
    if not set(names) <= set(PROGRAMS):
        parser.error(f"--programs {args.programs}: each must be one of {', '.join(PROGRAMS)}")
    print(machine_line())
    print(RUNTIME)
    print(f"rung {args.words} words, sampling {'on' if args.sampling else 'off'}, {args.drafts} draft tokens")
    print("| max_num_reqs | program | us | compile s | stablehlo ops | gathers | scatters | elements indexed | "
          "compiled kernels | bytes accessed |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in (int(s) for s in args.sizes.split(",")):
        config = serving_config(rows, args.sampling, args.drafts)
        buffer = decode_buffer(config, args.words)
        assert is_steady(buffer)  # every program takes it
        counts = {name: op_counts(config, buffer, name) for name in names}
        us = time_us(config, buffer, args.repeats, args.rounds, names)
        for name in names:
            c = counts[name]
            print(f"| {rows} | {name} | {us[name]:.1f} | {c['compile_s']:.2f} | {c['ops']} | {c['gather']} | "
                  f"{c['scatter']} | {c['elements']} | {c['kernels']} | {c['bytes']} |", flush=True)
    print(load_line())


if __name__ == "__main__":
    main()
