"""What compiling `prepare_padded` costs at each of bench_prepare.py's shapes: seconds and op counts.

    PYTHONPATH=. python benchmarks/prepare_compile_cost.py

Per shape, in one fresh process (no persistent compilation cache): the seconds to trace and lower
`jaxprep.prepare_padded` and to compile it for this backend; the ops of the lowered StableHLO module, the
instructions of the optimized HLO module (every computation, fusions' bodies included) and the kernels
its entry computation runs (`profile_prepare.entry_kernels`: thunks). Only the public entry point and
bench_prepare.make_batch are used, so ``PYTHONPATH=<another checkout>`` measures that checkout's step
with this script (set ``JAXPREP_COMMIT`` to name it in the report).
"""

from __future__ import annotations

import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import configure_benchmark_runtime

RUNTIME = configure_benchmark_runtime()

from bench_prepare import SHAPES, make_batch  # noqa: E402
from common import load_line, machine_line  # noqa: E402
from profile_prepare import entry_kernels  # noqa: E402

from jaxprep import BatchState, prepare_padded  # noqa: E402

STABLEHLO_OP = re.compile(r"^\s*(?:%\S+ = )?\"?(?:stablehlo|func|sdy|mhlo|chlo)\.", re.MULTILINE)
HLO_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = ", re.MULTILINE)


def cost(name, num_reqs, num_tokens, max_model_len, block_size, decode_only) -> dict:
    config, arrays = make_batch(num_reqs, num_tokens, max_model_len, block_size, decode_only)
    state = BatchState.from_numpy(**arrays)
    bucket = config.bucket_for(int(arrays["num_scheduled_tokens"].sum()))
    start = time.perf_counter()
    lowered = prepare_padded.lower(state, config, bucket)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    hlo = compiled.as_text()
    return dict(name=name, lower_s=lowered_at - start, compile_s=compiled_at - lowered_at,
                stablehlo_ops=len(STABLEHLO_OP.findall(lowered.as_text())),
                hlo_instructions=len(HLO_INSTRUCTION.findall(hlo)), kernels=len(entry_kernels(hlo)))


def main() -> int:
    rows = [cost(*shape) for shape in SHAPES]
    print(f"machine: {machine_line()}; {load_line()}")
    print(RUNTIME)
    print("| shape | trace + lower s | compile s | StableHLO ops | optimized HLO instructions | kernels |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['lower_s']:.2f} | {r['compile_s']:.2f} | {r['stablehlo_ops']} | "
              f"{r['hlo_instructions']} | {r['kernels']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
