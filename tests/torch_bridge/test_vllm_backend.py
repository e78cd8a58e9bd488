"""vLLM 0.33.0's own Triton attention backend on jaxprep's steps, through `torch_bridge.vllm`.

The workload (tests/support/vllm_triton_worker.py) runs in a subprocess, since Triton's interpreter
(``TRITON_INTERPRET=1``, kernels on the CPU) must be chosen before triton is imported: a
multi-step schedule with chunked prefill, decodes, arrivals, a freed row and freed blocks reused,
two KV-cache groups (the second with 32-token manager blocks read as 16-token kernel blocks).
Every real token's output must equal dense causal attention over its request's K/V history, and
the KV cache must equal the one the test's own bookkeeping writes (padded tokens write nothing).
The negative controls corrupt one slot, one padded slot, one seq_len or one block-table entry of
one step, and that step's comparison must fail.

Skipped unless vLLM 0.33.0 and triton are installed: ``pip install -e ".[torch,test,vllm]"``, then
``pip install --no-deps vllm==0.33.0``.
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

pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "vllm_triton_worker.py"
VLLM_VERSION = "0.33.0"
TOLERANCE = 1e-4  # float32 kernels against a float64 oracle; the controls miss by more than 1e-2
CORRUPT_STEP = 2  # as in the worker
INSTALL_HINT = f'pip install -e ".[torch,test,vllm]" && pip install --no-deps vllm=={VLLM_VERSION}'


def _vllm_skip_reason() -> str | None:
    for module in ("vllm", "triton"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({INSTALL_HINT})"
    installed = importlib.metadata.version("vllm")
    if installed != VLLM_VERSION:
        return f"vllm {installed} is installed; torch_bridge.vllm is written against {VLLM_VERSION}"
    return None


needs_vllm = pytest.mark.skipif(_vllm_skip_reason() is not None, reason=str(_vllm_skip_reason()))


def _worker_env(**extra) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PJRT_NPROC": "1", "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", **extra}


@pytest.fixture(scope="module")
def report():
    env = _worker_env(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(WORKER)], check=False, cwd=ROOT, env=env, capture_output=True,
                            text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-6000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


def _fails(entry: dict) -> bool:
    return entry["max_error"] > TOLERANCE or not entry["cache_equal"]


def test_missing_vllm_raises_import_error_naming_the_extra():
    code = "import sys; sys.modules['vllm'] = None; import torch_bridge.vllm"
    result = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, env=_worker_env(), capture_output=True,
                            text=True)
    assert result.returncode != 0
    assert "ImportError: torch_bridge.vllm needs vLLM 0.33.0" in result.stderr
    assert "jaxprep[vllm]" in result.stderr and "--no-deps vllm==0.33.0" in result.stderr


@needs_vllm
@pytest.mark.parametrize("run", ["unpadded", "padded"])
def test_triton_backend_matches_dense_causal_attention(report, run):
    steps = report["runs"][run]["steps"]
    for number, entry in enumerate(steps):
        assert entry["max_error"] <= TOLERANCE, (number, entry)
        assert entry["cache_equal"], (number, entry)  # every slot right, padded tokens wrote nothing
        assert all(entry["fields"].values()), (number, entry["fields"])


@needs_vllm
def test_workload_covers_chunked_prefill_decodes_arrivals_and_reuse(report):
    run = report["runs"]["unpadded"]
    steps = run["steps"]
    assert steps[0]["scheduled"] == {"A": 32} and steps[1]["scheduled"]["A"] == 8  # A's prompt in two chunks
    assert steps[1]["scheduled"]["C"] == 4 and "C" not in steps[0]["scheduled"]  # C arrives at step 1
    assert any(entry["scheduled"].get("A") == 1 and entry["scheduled"].get("C") == 20 for entry in steps)  # mixed
    assert steps[3]["rows"]["D"] == steps[1]["rows"]["B"]  # D takes the row B freed
    assert run["reused_blocks"]  # ... and blocks B freed
    padded_steps = [entry for entry in steps if entry["num_tokens_padded"] > sum(entry["scheduled"].values())]
    assert len(padded_steps) >= 3
    assert steps[CORRUPT_STEP] in padded_steps


@needs_vllm
@pytest.mark.parametrize("corruption", ["slot", "pad_slot", "seq_len", "block_table"])
def test_one_corrupted_entry_fails_the_comparison(report, corruption):
    steps = report["runs"][corruption]["steps"]
    assert not any(_fails(entry) for entry in steps[:CORRUPT_STEP])
    assert _fails(steps[CORRUPT_STEP]), steps[CORRUPT_STEP]


@needs_vllm
def test_dcp_fast_prefill_and_group_fields(report):
    assert report["other_fields"] and all(report["other_fields"].values()), report["other_fields"]


@needs_vllm
def test_readme_snippet_runs(tmp_path):
    section = (ROOT / "docs" / "guides" / "vllm-backends.md").read_text(encoding="utf-8")
    script = tmp_path / "snippet.py"
    script.write_text(section.split("```python\n", 1)[1].split("```", 1)[0], encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], check=False, cwd=ROOT, env=_worker_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    assert result.stdout.splitlines()[-1] == "2 21 [True, False]"
