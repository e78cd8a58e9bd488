"""Verification of draft tokens against the target model (docs/semantics.md#verification), vLLM's
rejection sampler (`vllm/v1/sample/rejection_sampler.py::rejection_sample`) on static shapes.

Both verifiers read the row layout from jaxprep's `SpecDecodeMetadata`: batch row ``b`` with ``D``
drafts owns logit rows ``bonus_logits_indices[b] - D .. bonus_logits_indices[b]`` (slot ``i < D``
is the target at draft ``i``, slot ``D`` the bonus position) and drafts
``draft_token_ids[cu_num_draft_tokens[b] - D + i]``. Both return vLLM's output layout:
``output [num_reqs_padded, K + 1]`` holds the accepted drafts, then one token from the target (the
replacement at the first rejection, or the bonus token when every draft is accepted), then
`PLACEHOLDER` (-1); ``num_sampled`` = accepted + 1 (0 on padded rows).

```
# D 3, drafts [7, 8, 9], target argmax [7, 5, 9, 4] -> accepted 1, output [7, 5, -1, -1], num_sampled 2
```
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprep._typing import Array, Bool, Float32, Int32
from jaxprep.features.spec_decode import SpecDecodeMetadata

PLACEHOLDER = -1
"""Output entry past a row's sampled tokens (vLLM ``PLACEHOLDER_TOKEN_ID``)."""


def _row_slots(meta: SpecDecodeMetadata, k: int, num_logits: int):
    """``(logit_rows [R, K + 1], drafts [R, K], num_drafts [R], is_real [R])`` per batch row.

    ```
    # cu_num_draft [2, 2, 3], bonus [2, 3, 5], K 2 -> logit rows [[0, 1, 2], [3, -, -], [4, 5, -]]
    #   (``-`` past the row's D: clamped to a real row, never read as a result)
    ```
    """
    num_drafts = meta.num_draft_tokens
    is_real = jnp.diff(meta.cu_num_sampled_tokens, prepend=jnp.zeros((1,), jnp.int32)) > 0
    slot = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    logit_rows = jnp.clip(meta.bonus_logits_indices[:, None] - num_drafts[:, None] + slot, 0, num_logits - 1)
    flat = meta.cu_num_draft_tokens[:, None] - num_drafts[:, None] + slot[:, :k]
    flat = jnp.clip(flat, 0, max(meta.draft_token_ids.shape[0] - 1, 0))
    if meta.draft_token_ids.shape[0]:
        drafts = meta.draft_token_ids.at[flat].get(mode="promise_in_bounds")
    else:
        drafts = jnp.zeros(flat.shape, jnp.int32)
    drafts = jnp.where(slot[:, :k] < num_drafts[:, None], drafts, PLACEHOLDER)
    return logit_rows, drafts, num_drafts, is_real


def _assemble(accept: Bool[Array, "R K"], drafts: Int32[Array, "R K"], replacement: Int32[Array, "R K1"],
              num_drafts: Int32[Array, " R"], is_real: Bool[Array, " R"]):
    """Keeps the leading accepted drafts, then the replacement at the first rejected slot (the bonus
    slot D when none is rejected), then placeholders.

    ```
    # accept [1, 0, 1], D 3, drafts [7, 8, 9], replacement [_, 5, _, _] -> [7, 5, -1, -1], 2
    ```
    """
    k = drafts.shape[1]
    slot = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    kept = accept & (slot[:, :k] < num_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(kept.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)  # leading run
    drafts = jnp.concatenate([drafts, jnp.full((drafts.shape[0], 1), PLACEHOLDER, jnp.int32)], axis=1)
    output = jnp.where(slot < accepted[:, None], drafts,
                       jnp.where(slot == accepted[:, None], replacement, PLACEHOLDER))
    return jnp.where(is_real[:, None], output, PLACEHOLDER), jnp.where(is_real, accepted + 1, 0)


def greedy_verify(target_argmax: Int32[Array, " num_logits_padded"], meta: SpecDecodeMetadata,
                  k: int) -> tuple[Int32[Array, "R K1"], Int32[Array, " R"]]:
    """Drafts kept while they equal the target's argmax at their position; the first mismatch emits
    the argmax there, all accepted emit the argmax at the bonus position
    (`vllm/v1/sample/rejection_sampler.py::rejection_greedy_sample_kernel`)."""
    logit_rows, drafts, num_drafts, is_real = _row_slots(meta, k, target_argmax.shape[0])
    targets = target_argmax.at[logit_rows].get(mode="promise_in_bounds")  # [R, K + 1]
    return _assemble(drafts == targets[:, :k], drafts, targets, num_drafts, is_real)


def rejection_verify(target_probs: Float32[Array, "num_logits_padded V"], meta: SpecDecodeMetadata, k: int,
                     key: jax.Array) -> tuple[Int32[Array, "R K1"], Int32[Array, " R"]]:
    """Standard rejection sampling of deterministic drafts (n-gram drafts: q is one-hot at the draft):
    draft ``x`` at slot i is accepted with probability ``min(1, p_i(x) / q_i(x)) = p_i(x)``; the first
    rejection emits a sample of the residual ``max(0, p_i - q_i)`` normalized (p_i without x); all
    accepted emit a sample of p at the bonus position
    (`vllm/v1/sample/rejection_sampler.py::rejection_random_sample_kernel`, ``NO_DRAFT_PROBS``).

    ``target_probs`` rows are the target's (already temperature/top-k/top-p processed)
    probabilities at ``meta.logits_indices``; ``key`` a PRNG key (one step's randomness, split
    into one key per batch row).
    The output token distribution at every position equals the target's (tests/serving/test_verify.py).
    """
    keys = jax.random.split(key, meta.num_draft_tokens.shape[0])
    return rejection_verify_rows(target_probs, meta, k, keys)


def rejection_verify_rows(target_probs: Float32[Array, "num_logits_padded V"], meta: SpecDecodeMetadata, k: int,
                          keys: jax.Array) -> tuple[Int32[Array, "R K1"], Int32[Array, " R"]]:
    """`rejection_verify` with one PRNG key per batch row (``keys [R]``): a seeded request's draws
    depend on its own key only, never on its neighbours in the batch."""
    logit_rows, drafts, num_drafts, is_real = _row_slots(meta, k, target_probs.shape[0])
    probs = target_probs[logit_rows]  # [R, K + 1, V]
    draft_ids = jnp.clip(drafts, 0, probs.shape[-1] - 1)
    p_draft = jnp.take_along_axis(probs[:, :k], draft_ids[:, :, None], axis=2)[:, :, 0]
    slot = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    is_draft_slot = slot < num_drafts[:, None]  # [R, K + 1]
    draft_onehot = jax.nn.one_hot(jnp.concatenate([draft_ids, jnp.zeros_like(draft_ids[:, :1])], axis=1),
                                  probs.shape[-1], dtype=jnp.bool_)
    residual = jnp.where(is_draft_slot[:, :, None] & draft_onehot, 0.0, probs)

    def draws(key, residual_row):
        key_accept, key_sample = jax.random.split(key)
        uniform = jax.random.uniform(key_accept, (k,), jnp.float32)  # [K] in [0, 1)
        return uniform, jax.random.categorical(key_sample, jnp.log(residual_row), axis=-1).astype(jnp.int32)

    uniform, replacement = jax.vmap(draws)(keys, residual)
    accept = uniform < p_draft  # P = p(x); p(x) = 0 is never accepted, p(x) = 1 always
    return _assemble(accept, drafts, replacement, num_drafts, is_real)
