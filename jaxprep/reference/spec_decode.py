"""NumPy oracles of speculative decoding in the serving loop: the n-gram drafter and the greedy
verification of drafts, written as plain loops.

- `ngram_propose`: `vllm/v1/spec_decode/ngram_proposer.py::_find_longest_matched_ngram_and_propose_tokens`
- `greedy_verify`: `vllm/v1/sample/rejection_sampler.py::rejection_greedy_sample_kernel`
"""

from __future__ import annotations

import numpy as np

PLACEHOLDER = -1
"""Output entry past a row's sampled tokens (vLLM ``PLACEHOLDER_TOKEN_ID``)."""


def ngram_propose(tokens, *, min_n: int, max_n: int, max_model_len: int, k: int) -> list[int]:
    """The drafts of one request whose known tokens are ``tokens`` (prompt + outputs).

    For every earlier start ``s``, the longest ``n <= max_n`` with ``tokens[s : s + n]`` equal to
    the last ``n`` tokens and at least one token after the match; the longest such ``n`` over all
    starts wins, the earliest start among equals; then up to ``k`` tokens from ``s + n``.
    """
    tokens = [int(t) for t in tokens]
    total = len(tokens)
    k = min(k, max_model_len - total)
    if total < min_n or k <= 0:
        return []
    best_n, draft_start = 0, 0
    for start in range(total - 1):
        n = 0
        for length in range(max_n, 0, -1):
            if start + length <= total - 1 and tokens[start:start + length] == tokens[total - length:]:
                n = length
                break
        if n > best_n:  # strictly longer: an equal match later in the sequence does not replace it
            best_n, draft_start = n, start + n
    if best_n < min_n:
        return []
    return tokens[draft_start:draft_start + min(k, total - draft_start)]


def greedy_verify(draft_token_ids, target_argmax, bonus_token_ids, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(output [rows, k + 1], num_sampled [rows])`` of greedy verification.

    ``draft_token_ids[r]``: the row's drafts (a list); ``target_argmax[r]``: the target's argmax at
    each draft's position; ``bonus_token_ids[r]``: the argmax after the last draft, or ``None`` for
    a padded row (no output). A row keeps drafts while they equal the argmax; the first mismatch
    emits the argmax, all accepted emit the bonus token.
    """
    rows = len(draft_token_ids)
    output = np.full((rows, k + 1), PLACEHOLDER, np.int64)
    num_sampled = np.zeros(rows, np.int64)
    for row in range(rows):
        if bonus_token_ids[row] is None:
            continue
        emitted = []
        for draft, target in zip(draft_token_ids[row], target_argmax[row], strict=True):
            emitted.append(int(target))
            if draft != target:
                break
        else:
            emitted.append(int(bonus_token_ids[row]))
        output[row, :len(emitted)] = emitted
        num_sampled[row] = len(emitted)
    return output, num_sampled
