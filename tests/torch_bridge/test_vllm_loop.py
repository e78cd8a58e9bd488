"""examples/vllm_torch_loop.py: vLLM 0.33.0's real scheduler -> VllmAdapter -> jaxprep -> torch_bridge ->
TorchDecoder -> greedy tokens -> ``scheduler.update_from_output``. Greedy outputs equal transformers'
``generate(do_sample=False)`` per request, in both runner modes of the scheduler, with chunked prefill
and a preemption on the way (vLLM's own decisions)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
if importlib.util.find_spec("vllm") is None:  # not importorskip: importing vLLM here costs ~10 s
    pytest.skip("needs vLLM (the vllm extra)", allow_module_level=True)

from support.hf_checkpoints import SPECS, compare_greedy, reference_model, save_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_TOKENS = 6
DRIVER = """
import json, os, sys
sys.path.insert(0, os.path.join({root!r}, "examples"))
import vllm_torch_loop
results = {{}}
for mode in ("0", "1"):  # V1: a preempted request comes back in resumed_req_ids; V2: re-sent as new
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = mode  # read when the scheduler's VllmConfig is built
    results[mode] = vllm_torch_loop.serve({directory!r}, {prompts!r}, {max_tokens}, budget=8, num_blocks=9)
print(json.dumps(results))
"""


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 320, size=n).tolist() for n in (5, 13, 9, 20)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama"))
    save_checkpoint(SPECS["llama-llama3-rope"], directory)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get(
        "PYTHONPATH")])))
    code = DRIVER.format(root=ROOT, directory=directory, prompts=_prompts(), max_tokens=MAX_TOKENS)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return directory, json.loads(result.stdout.strip().splitlines()[-1])


def _requests(outputs: list[list[int]]):
    return [types.SimpleNamespace(request_id=i, prompt_token_ids=p, max_tokens=MAX_TOKENS, output_token_ids=o)
            for i, (p, o) in enumerate(zip(_prompts(), outputs, strict=True))]


@pytest.mark.parametrize("mode", ["0", "1"], ids=["V1 resume", "V2 re-send"])
def test_vllm_driven_greedy_tokens_equal_transformers(run, mode):
    directory, results = run
    outputs, counts = results[mode]
    assert counts["preempted"] >= 1 and counts["partial_prefills"] > 0, counts
    assert [len(o) for o in outputs] == [MAX_TOKENS] * 4
    check = compare_greedy(reference_model(directory), _requests(outputs))
    assert check.num_tokens == 4 * MAX_TOKENS and check.mismatches == 0 and check.near_ties == 0


def test_the_comparison_sees_outputs_of_the_wrong_request(run):
    """Negative control: the same outputs handed to the wrong requests (0 and 1 swapped) do not pass."""
    directory, results = run
    outputs = list(results["0"][0])
    outputs[0], outputs[1] = outputs[1], outputs[0]
    assert compare_greedy(reference_model(directory), _requests(outputs)).mismatches >= 2
