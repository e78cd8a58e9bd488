"""The n-gram (prompt-lookup) drafter on the device: vLLM's ``ngram`` proposer
(`vllm/v1/spec_decode/ngram_proposer.py::_find_longest_matched_ngram_and_propose_tokens`) on the
token table, with static shapes and integer index math only (docs/semantics.md#n-gram-drafter).

For a row of ``T`` known tokens, a match of length ``n`` ending before position ``j`` is
``tokens[j - n : j] == tokens[T - n : T]`` with ``1 <= j <= T - 1`` (at least one token follows
it). vLLM's rule: the longest ``n <= prompt_lookup_max`` that matches anywhere wins; among matches
of that length the earliest one in the sequence wins; it needs ``n >= prompt_lookup_min``. The
drafts are the up to ``k`` tokens that follow the match, cut at the end of the known tokens and
at ``max_model_len - T``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprep._typing import Array, Bool, Int32
from jaxprep.serving.config import NgramConfig

NO_DRAFT = -1
"""Entry of the drafter's output past a row's draft count."""


def backward_match_lengths(token_ids: Int32[Array, "rows max_model_len"], num_tokens: Int32[Array, " rows"],
                           max_n: int) -> Int32[Array, "rows max_model_len"]:
    """``B[r, j]``: how many tokens before position ``j`` equal the last tokens of row ``r``, up to
    ``max_n`` (``tokens[j - d] == tokens[T - d]`` for d = 1, 2, ...), for ``1 <= j <= T - 1``; 0 elsewhere.

    ```
    # T 6, tokens [3, 4, 5, 3, 4, 9]: suffix ..4, 9 -> B [0, 0, 0, 0, 0, 0]
    # T 6, tokens [3, 4, 5, 9, 3, 4], max_n 3: B[2] = 2 (tokens[0:2] = [3, 4] = the suffix), else 0
    ```
    """
    rows, width = token_ids.shape
    column = jnp.arange(width, dtype=jnp.int32)[None, :]
    alive = (column >= 1) & (column <= num_tokens[:, None] - 1)
    lengths = jnp.zeros((rows, width), jnp.int32)
    for d in range(1, max_n + 1):
        if d > width:
            break
        # shifted[r, j] = tokens[r, j - d] (a sentinel for j < d); suffix[r] = tokens[r, T - d]
        shifted = jnp.concatenate([jnp.full((rows, d), NO_DRAFT, jnp.int32), token_ids[:, : width - d]], axis=1)
        suffix_column = jnp.clip(num_tokens - d, 0, width - 1)[:, None]
        suffix = jnp.take_along_axis(token_ids, suffix_column, axis=1, mode="promise_in_bounds")
        alive = alive & (column >= d) & (num_tokens[:, None] >= d) & (shifted == suffix)
        lengths = lengths + alive.astype(jnp.int32)
    return lengths


def propose_ngram(token_ids: Int32[Array, "rows max_model_len"], num_tokens: Int32[Array, " rows"],
                  active: Bool[Array, " rows"], *, k: int, config: NgramConfig,
                  max_model_len: int) -> tuple[Int32[Array, "rows k"], Int32[Array, " rows"]]:
    """``(draft_token_ids [rows, k] (NO_DRAFT past the count), num_draft_tokens [rows])`` of every
    ``active`` row, from its first ``num_tokens`` tokens.

    ```
    # k 2, T 7, tokens [5, 6, 7, 8, 5, 6, 7], lookup 2..3: suffix [5, 6, 7] matches at 0..2 (B[3] = 3)
    #   -> drafts [8, 5] (the 2 tokens from position 3), num_draft_tokens 2
    ```
    """
    width = token_ids.shape[1]
    lengths = backward_match_lengths(token_ids, num_tokens, config.prompt_lookup_max)
    longest = jnp.max(lengths, axis=1)  # [rows]
    start = jnp.argmax(lengths == longest[:, None], axis=1).astype(jnp.int32)  # earliest j of the longest
    room = jnp.minimum(jnp.minimum(k, max_model_len - num_tokens), num_tokens - start)
    found = active & (longest >= config.prompt_lookup_min)
    count = jnp.where(found, jnp.clip(room, 0, k), 0)
    offsets = jnp.arange(k, dtype=jnp.int32)[None, :]
    columns = jnp.clip(start[:, None] + offsets, 0, width - 1)
    drafts = jnp.take_along_axis(token_ids, columns, axis=1, mode="promise_in_bounds")
    return jnp.where(offsets < count[:, None], drafts, NO_DRAFT), count


propose_ngram_jit = jax.jit(propose_ngram, static_argnames=("k", "config", "max_model_len"))
