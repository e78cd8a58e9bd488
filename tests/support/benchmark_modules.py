"""A benchmark script imported as a module by the tests."""

from __future__ import annotations

import importlib
import os
import sys
from unittest import mock

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def import_benchmark(name: str):
    """``benchmarks/<name>.py``, imported as under ``--default-runtime``: a benchmark's import would otherwise set
    this process's JAX runtime (``PJRT_NPROC``, synchronous dispatch) for every later test."""
    sys.path.insert(0, BENCHMARKS)
    try:
        with mock.patch.object(sys, "argv", [f"{name}.py", "--default-runtime"]):
            return importlib.import_module(name)
    finally:
        sys.path.remove(BENCHMARKS)
