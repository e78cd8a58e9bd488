"""The runner features against vLLM 0.33.0's own code: drafter kernels, grammar bitmask, Mamba builder, ubatch slicing.

tests/support/vllm_runner_worker.py runs in a subprocess with ``TRITON_INTERPRET=1`` (vLLM's Triton kernels on
the CPU) over random batches of three feature configurations (EAGLE with K 3 and Mamba checkpoints,
Gemma4 MTP with K 2 and align-mode Mamba, no spec decode) and reports every entry where jaxprep and
vLLM differ; a negative control shifts jaxprep's values by one and every item must then differ.

Skipped unless vLLM 0.33.0, triton and xgrammar are installed (``pip install --no-deps vllm==0.33.0``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "vllm_runner_worker.py"
ITEMS = ("drafter", "grammar", "hybrid", "ubatch")


def _skip_reason() -> str | None:
    for module in ("vllm", "triton", "xgrammar", "torch"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    if importlib.metadata.version("vllm") != "0.33.0":
        return "vllm 0.33.0 is needed"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


@pytest.fixture(scope="module")
def report() -> dict:
    """One worker run: the comparison, and under ``control`` the negative control (values shifted by one)."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "PJRT_NPROC": "1", "VLLM_NO_USAGE_STATS": "1",
                   "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, str(WORKER)], check=False, cwd=ROOT, env=environment,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-6000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


def test_jaxprep_equals_vllm_on_random_batches(report):
    assert report["mismatches"] == []
    assert sum(report["cases"].values()) == 24
    assert all(count > 0 for count in report["covered"].values()), report["covered"]


def test_a_shifted_value_is_caught_in_every_item(report):
    control = report["control"]
    assert sum(control["cases"].values()) == 3  # one batch per configuration
    for item in ITEMS:
        assert any(f"] {item}:" in message for message in control["mismatches"]), item
