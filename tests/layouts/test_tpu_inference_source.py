"""tpu-inference 0.32.0's own runner and kernel code against the layout and the transcription (opt-in).

Runs only when ``JAXPREP_TPU_INFERENCE`` names a folder holding the ``tpu_inference`` package, installed
apart from the environment (``pip install --no-deps --target DIR tpu-inference==0.32.0``: its wheel
also installs top-level ``tests`` and ``tools`` packages, which would shadow this repository's, so CI
never installs it). `tests/support/tpu_inference_source.py` runs their ``_init_inputs``,
``_reorder_batch`` and ``_prepare_inputs`` on 80 random steps and their RPA v3 kernel module in a fresh
process (about a minute).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cli.test_simulate import ROOT

SOURCE = os.environ.get("JAXPREP_TPU_INFERENCE")


@pytest.mark.skipif(not SOURCE, reason="set JAXPREP_TPU_INFERENCE to a folder holding tpu-inference 0.32.0 "
                                       "(pip install --no-deps --target DIR tpu-inference==0.32.0)")
def test_tpu_inference_own_code_agrees():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "support", "tpu_inference_source.py"),
                             SOURCE], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 80 and summary["swapped_steps"] > 10, summary
    assert summary["layout_mismatches"] == summary["transcription_mismatches"] == [], summary
    assert summary["control_mismatches"], "the comparison missed a step with one computed count changed"
    assert summary["cache_shape_equal"] and summary["merge_kv_equal"] and summary["reference_cache_equal"]
    assert summary["reference_vs_transcription"] < 1e-5 and summary["reference_vs_jaxprep_oracle"] < 1e-5
    if "kernel_error" in summary:  # jax 0.10.2's TPU interpreter cannot read the kernel's reshaped cache ref
        assert "ReshapeTransform" in summary["kernel_error"], summary["kernel_error"]
    else:
        assert summary["kernel_vs_oracle"] < 1e-4 and summary["kernel_cache_equal"], summary
