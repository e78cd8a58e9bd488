#!/usr/bin/env bash
# The GPU runbook (see benchmarks/accelerator_check.py): install over the machine's own jax/torch,
# the whole test suite with JAX on the GPU, the CUDA torch_bridge tests, the GPU benchmarks (bench_gpu.py, and
# bench_fused_step.py with XLA's command buffers off and on, MRV2's real kernels from .vllm_src); one table.
#   benchmarks/accelerator_check.sh [--wheels DIR] [--workers N] [--log-dir DIR] [--dry-run]
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/accelerator_check.py "$@"
