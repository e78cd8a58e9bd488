"""NumPy reference of the structured-output bitmask rows (vLLM V2 ``structured_outputs.py``), for reading.

Written the way vLLM's worker does it: a Python list for the mapping, one program per bitmask row
for the apply kernel, a Python loop for the invalid-draft limits; unpadded, in batch order. The logits
rows (``cu_num_logits``) are V2's, `jaxprep.reference.logits.logits_indirection_reference`.
"""

from __future__ import annotations

import numpy as np

from jaxprep._constants import INT32_MAX


def grammar_mapping_reference(grammar_batch_rows, stride: int) -> list[int]:
    """``mapping[g * stride + i] = batch_row(g) * stride + i`` for the grammar requests in bitmask order."""
    return [row * stride + position for row in grammar_batch_rows for position in range(stride)]


def apply_grammar_bitmask_reference(logits, bitmask, mapping, cu_num_logits, stride: int) -> np.ndarray:
    """``_apply_grammar_bitmask_kernel``: bitmask row k masks logits row ``cu[req] + pos`` when the
    request has that many logits rows (``pos < n``); a 0 bit writes ``-inf``."""
    out = np.array(logits, dtype=np.float32)
    vocab = out.shape[1]
    for k, entry in enumerate(mapping):
        req, position = divmod(entry, stride)
        first, count = cu_num_logits[req], cu_num_logits[req + 1] - cu_num_logits[req]
        if position >= count:
            continue
        for token in range(vocab):
            if (int(bitmask[k][token // 32]) >> (token % 32)) & 1 == 0:
                out[first + position, token] = -np.inf
    return out


def grammar_invalid_drafts_reference(grammar_batch_rows, num_acceptable_drafts, num_draft_tokens):
    """vLLM's ``grammar_invalid_drafts``: None, or one bool per logits row (local position > limit)."""
    num_draft_tokens = np.asarray(num_draft_tokens, np.int64)
    if not len(grammar_batch_rows) or num_draft_tokens.sum() == 0:
        return None
    limit = np.full(len(num_draft_tokens), INT32_MAX, np.int64)
    for g, row in enumerate(grammar_batch_rows):
        limit[row] = num_acceptable_drafts[g] if num_acceptable_drafts is not None else 0
    if (limit >= num_draft_tokens).all():
        return None
    return np.array([position > limit[row] for row, d in enumerate(num_draft_tokens) for position in range(d + 1)])
