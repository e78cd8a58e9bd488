"""A JAX LoRA linear layer driven by ``step.lora`` equals applying each request's adapter densely.

``y = x W + (x A_s) B_s`` for a token whose request uses the adapter in GPU slot ``s``. The caller
loads adapters into slots (`BatchState.lora_slots`); the step tells each kernel which rows go where:

- `punica_layer` walks the active slots like vLLM's shrink/expand kernels
  (`vllm/lora/ops/triton_ops/lora_shrink_op.py`): program ``k`` takes the tokens
  ``token_indices_sorted_by_lora_ids[start[k] : start[k] + num_tokens_per_lora[k]]`` of slot
  ``active_lora_ids[k]`` and skips slot -1;
- `gathered_layer` gathers each token's adapter by ``token_lora_indices`` (the BGMV way).

The dense oracle loops over requests on the host, from the state tables, not from the step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import mrv2_examples as ex
from support.feature_batches import build_feature_batch, run_step
from support.mrv2_examples import with_random_adapters

D_IN, D_OUT, RANK = 8, 6, 2


def weights(max_loras: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=shape).astype(np.float32)
                 for shape in ((D_IN, D_OUT), (max_loras, D_IN, RANK), (max_loras, RANK, D_OUT)))


@jax.jit
def punica_layer(x, w, lora_a, lora_b, meta):
    """One pass per active slot over its contiguous run of sorted tokens (vLLM's kernel grid axis 2)."""
    y = x @ w
    rows = jnp.arange(x.shape[0])
    for k in range(meta.active_lora_ids.shape[0]):  # static: max_loras + 1 programs
        slot = meta.active_lora_ids[k]
        take = rows < meta.num_tokens_per_lora[k]
        start = meta.lora_token_start_loc[k]
        tokens = meta.token_indices_sorted_by_lora_ids[jnp.clip(start + rows, 0, x.shape[0] - 1)]
        delta = (x[tokens] @ lora_a[jnp.maximum(slot, 0)]) @ lora_b[jnp.maximum(slot, 0)]
        keep = (take & (slot >= 0))[:, None]
        y = y.at[jnp.where(take, tokens, x.shape[0])].add(jnp.where(keep, delta, 0.0), mode="drop")
    return y


@jax.jit
def gathered_layer(x, w, lora_a, lora_b, token_lora_indices):
    slot = jnp.maximum(token_lora_indices, 0)
    delta = jnp.einsum("tr,tro->to", jnp.einsum("ti,tir->tr", x, lora_a[slot]), lora_b[slot])
    return x @ w + jnp.where((token_lora_indices >= 0)[:, None], delta, 0.0)


def dense_oracle(x, w, lora_a, lora_b, arrays, rows) -> np.ndarray:
    """Per request in batch order: its tokens times W, plus its adapter's product if it has one."""
    y = np.asarray(x, np.float64) @ w
    slot_of = {int(a): s for s, a in enumerate(arrays["lora_slots"]) if a > 0}
    start = 0
    for row in rows:
        count = int(arrays["num_scheduled_tokens"][row])
        adapter = int(arrays["lora_ids"][row])
        if adapter > 0:
            s = slot_of[adapter]
            y[start:start + count] += (x[start:start + count] @ lora_a[s]) @ lora_b[s]
        start += count
    return y


def check(step, arrays, max_loras: int, seed: int):
    x = np.random.default_rng(seed).normal(size=(step.num_tokens_padded, D_IN)).astype(np.float32)
    w, lora_a, lora_b = weights(max_loras, seed)
    rows = np.asarray(step.idx_mapping)[: int(step.attn_metadata.num_reqs)]
    want = dense_oracle(x, w, lora_a, lora_b, arrays, rows)
    meta = step.lora.token_mapping_meta
    with jax.default_matmul_precision("highest"):
        got_punica = punica_layer(x, w, lora_a, lora_b, meta)
        got_gathered = gathered_layer(x, w, lora_a, lora_b, step.lora.token_lora_indices)
    np.testing.assert_allclose(got_punica, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_gathered, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("runner, rows", [("v1", ex.V1_ROWS), ("v2", ex.V2_SLOTS)])
def test_running_example(runner, rows):
    arrays = ex.arrays(rows)
    check(run_step(arrays, ex.config(runner), "jit"), arrays, 4, seed=1)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches(seed):
    rng = np.random.default_rng(seed)
    config = dataclasses.replace(ex.config("v2" if seed % 2 else "v1"), max_model_len=40, max_num_batched_tokens=32,
                                 token_buckets=None)
    arrays = build_feature_batch(config, lambda lo, hi: int(rng.integers(lo, hi + 1)), max_drafts=ex.K)
    arrays = with_random_adapters(arrays, 4, rng)
    check(run_step(arrays, config, "jit"), arrays, 4, seed)
