"""A vLLM worker script (tests/support/vllm_*_worker.py) run in a subprocess and its JSON report read back.

vLLM's runner pieces run its Triton kernels in Triton's CPU interpreter, which must be chosen before Python
starts (``TRITON_INTERPRET=1``, no CUDA device), so each worker is a process of its own; it prints one line
``REPORT {json}`` last.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def worker_report(name: str, timeout: int = 900) -> dict:
    """The report of tests/support/``name`` (skips without vllm or triton)."""
    pytest.importorskip("vllm")
    pytest.importorskip("triton")  # V1's slot mapping and MRV2's input kernels run in Triton's interpreter
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_NO_USAGE_STATS": "1", "TRITON_INTERPRET": "1",
                   "CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / name)], check=False, cwd=ROOT,
                            env=environment, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    return json.loads(lines[-1][len("REPORT "):])
