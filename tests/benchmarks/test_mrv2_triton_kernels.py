"""The runbook's MRV2 anchor on CPU: vLLM's real V2 Triton kernels, copied from the installed wheel
(`benchmarks/vllm_sources.py`) and loaded without importing vLLM, run under Triton's interpreter at
a tiny shape by `benchmarks/mrv2_triton_baseline.py` and compared with jaxprep's step: a decode step, a
mixed step, and a mixed step with draft tokens in V2's batch order (``FeatureConfig(runner="v2")``:
``cu_num_logits``, ``expanded_idx_mapping``, ``expanded_local_pos`` and the logits rows compared too).

The subprocess sets ``TRITON_INTERPRET=1`` and ``CUDA_VISIBLE_DEVICES=""`` before Triton is imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(ROOT, "benchmarks")

@pytest.mark.cpu_only("runs Triton's interpreter with the GPU hidden")
@pytest.mark.skipif(any(importlib.util.find_spec(name) is None for name in ("torch", "triton", "vllm")),
                    reason="needs torch, triton and an installed vLLM (whose sources are copied; vLLM is not imported)")
def test_vllm_v2_kernels_from_copied_sources_match_jaxprep(tmp_path):
    sys.path.insert(0, BENCHMARKS)
    try:
        from vllm_sources import vendor
    finally:
        sys.path.remove(BENCHMARKS)
    assert vendor(str(tmp_path)) == "0.33.0"
    copied = [f for _, _, files in os.walk(tmp_path) for f in files]
    assert all(f.endswith(".py") for f in copied if f != "VLLM_VERSION") and "block_table.py" in copied
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, BENCHMARKS, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "mrv2_triton_baseline.py"), "--src",
                             str(tmp_path)], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    for case in json.loads(result.stdout.strip().splitlines()[-1]):
        assert case["vllm"] == "0.33.0" and not case["vllm_imported"], case
        assert case["mismatches"] == [], case  # V2's kernels and jaxprep agree, field by field
        assert case["shifted"] == ["slot_mapping"], case  # negative control: one slot off is seen
