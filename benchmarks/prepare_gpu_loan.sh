#!/usr/bin/env bash
# Before a GPU loan, on a machine with pip and an index (here): bring what the lent machine lacks into
# git-ignored folders that the device call carries along (docs/guides/gpu-runbook.md):
#   .vllm_src  vLLM 0.33.0's model-runner-V2 sources (MRV2's real Triton kernels, no compiled extension)
#   .whl       wheels of the test-only packages its image lacks (beartype: the suite's conftest needs it)
# Then, on the lent machine (one call, about 9 minutes of its 15):
#   bash benchmarks/accelerator_check.sh --wheels .whl --budget-s 540 --log-dir "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" benchmarks/vllm_sources.py
mkdir -p .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "beartype==0.23.1"
du -sh .vllm_src .whl
