"""``runner="v2"`` against vLLM 0.33.0's own V2 input kernels (Triton's CPU interpreter, in a subprocess).

For the running example and random valid V2 batches (prefill chunks, decodes, decodes with drafts,
idle slots), tests/support/vllm_v2_worker.py runs ``sort_batch_req_ids`` and V2's ``prepare_inputs`` kernels;
jaxprep's step must give the same batch order, query_start_loc, seq_lens, positions, input ids and
logits rows. The scheduler order handed to vLLM is descending slot (V2's arrival order for requests
admitted one after another, the order jaxprep assumes for ties). Skipped without vllm and triton.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jaxprep import FeatureConfig, PrepConfig
from support import mrv2_examples as ex
from support.feature_batches import block_table, run_step

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "vllm_v2_worker.py"
MISSING = [m for m in ("vllm", "triton", "torch") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"needs {MISSING} (vLLM's V2 kernels)")

K = 2
CONFIG = PrepConfig(max_num_reqs=8, max_model_len=48, max_num_batched_tokens=40, block_size=4,
                    features=FeatureConfig(num_speculative_tokens=K, runner="v2"))


def random_v2_batch(seed: int) -> dict:
    """Valid V2 state: a prefill chunk stays inside its prompt; a decode (C >= prefill_len) has S = 1 + D."""
    rng = np.random.default_rng(seed)
    rows, width = CONFIG.max_num_reqs, CONFIG.max_model_len
    computed, scheduled, drafts, prefill = (np.zeros(rows, np.int32) for _ in range(4))
    budget = CONFIG.max_num_batched_tokens
    for row in rng.permutation(rows):
        kind = rng.integers(0, 4)  # 0: idle, 1: prefill chunk, 2: decode, 3: decode with drafts
        if kind == 0 or budget < 1 + K:
            continue
        if kind == 1:
            prefill[row] = rng.integers(2, width - 2)
            computed[row] = rng.integers(0, prefill[row])
            scheduled[row] = rng.integers(1, min(prefill[row] - computed[row], budget) + 1)
        else:
            drafts[row] = rng.integers(1, K + 1) if kind == 3 else 0
            prefill[row] = rng.integers(1, width - 2 - K)
            computed[row] = rng.integers(prefill[row], width - 1 - drafts[row])
            scheduled[row] = 1 + drafts[row]
        budget -= int(scheduled[row])
    if scheduled.sum() == 0:
        prefill[0], scheduled[0] = 5, 5
    return dict(token_ids=rng.integers(1, 30000, (rows, width)).astype(np.int32),
                block_table=block_table(rows, CONFIG.max_blocks_per_req, computed + scheduled, CONFIG.block_size, seed),
                num_computed_tokens=computed, num_scheduled_tokens=scheduled, num_draft_tokens=drafts,
                prefill_len=prefill)


def worker_batch(arrays: dict, num_tokens_padded: int) -> dict:
    slots = [int(s) for s in np.flatnonzero(arrays["num_scheduled_tokens"] > 0)][::-1]  # arrival order
    drafts = []
    for s in slots:
        c, n, d = (int(arrays[f][s]) for f in ("num_computed_tokens", "num_scheduled_tokens", "num_draft_tokens"))
        drafts.append((s, arrays["token_ids"][s, c + n - d: c + n].tolist()))
    return {"num_speculative_tokens": K, "num_tokens_padded": num_tokens_padded,
            "token_ids": arrays["token_ids"].tolist(), "num_computed_tokens": arrays["num_computed_tokens"].tolist(),
            "prefill_len": arrays["prefill_len"].tolist(),
            "scheduled": [(s, int(arrays["num_scheduled_tokens"][s])) for s in slots], "drafts": drafts}


def run_worker(batches: list[dict]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "VLLM_NO_USAGE_STATS": "1"}
    result = subprocess.run([sys.executable, str(WORKER)], input=json.dumps(batches), check=False, cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_jaxprep_v2_steps_equal_vllm_v2_kernels():
    cases = [(ex.arrays(ex.V2_SLOTS), ex.config("v2"))] + [(random_v2_batch(seed), CONFIG) for seed in range(24)]
    steps = [run_step(arrays, config, "jit") for arrays, config in cases]
    want = run_worker([worker_batch(arrays, step.num_tokens_padded)
                       for (arrays, _), step in zip(cases, steps, strict=True)])
    for i, (step, vllm) in enumerate(zip(steps, want, strict=True)):
        num_reqs, num_tokens = len(vllm["idx_mapping"]), vllm["query_start_loc"][-1]
        meta, logits = step.attn_metadata, step.logits_indirection
        num_logits = vllm["cu_num_logits"][-1]
        got = {"idx_mapping": np.asarray(step.idx_mapping)[:num_reqs],
               "query_start_loc": np.asarray(meta.query_start_loc)[:num_reqs + 1],
               "seq_lens": np.asarray(meta.seq_lens)[:num_reqs], "positions": np.asarray(step.positions)[:num_tokens],
               "input_ids": np.asarray(step.input_ids)[:num_tokens],
               "cu_num_logits": np.asarray(logits.cu_num_logits)[:num_reqs + 1],
               "logits_indices": np.asarray(logits.logits_indices)[:num_logits],
               "expanded_idx_mapping": np.asarray(logits.expanded_idx_mapping)[:num_logits],
               "expanded_local_pos": np.asarray(logits.expanded_local_pos)[:num_logits]}
        for name, value in got.items():
            np.testing.assert_array_equal(value, vllm[name], err_msg=f"batch {i}: {name}")
