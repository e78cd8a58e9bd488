"""NumPy reference of the EAGLE / MTP drafter inputs (vLLM V2 ``TargetDependentARSpeculator``), for reading.

One loop per request, the way vLLM's three Triton kernels run one program per request, over host
arrays in batch order (unpadded: ``R`` requests, ``N`` tokens). Entries vLLM leaves stale are
`STALE` here; the jitted code writes its documented pad values there.
"""

from __future__ import annotations

import numpy as np

STALE = -999
"""Marks an entry vLLM does not write (its buffer keeps an older step's value)."""


def num_sampled_and_rejected_reference(num_sampled, num_draft, seq_lens, prefill_len):
    """vLLM V2 ``get_num_sampled_and_rejected``: a prefill chunk samples nothing and rejects nothing."""
    sampled, rejected = [], []
    for n, d, seq_len, prefill in zip(num_sampled, num_draft, seq_lens, prefill_len, strict=True):
        chunk = seq_len < prefill
        sampled.append(0 if chunk else int(n))
        rejected.append(0 if chunk else int(d) + 1 - int(n))
    return np.array(sampled, np.int64), np.array(rejected, np.int64)


def next_prefill_tokens_reference(token_ids_rows, computed, scheduled, prefill_len):
    """The target's ``next_prefill_tokens``: the prompt token after this step, 0 once the prompt ends."""
    return np.array([row[c + s] if c + s < p else 0
                     for row, c, s, p in zip(token_ids_rows, computed, scheduled, prefill_len, strict=True)], np.int64)


def draft_prefill_reference(query_start_loc, seq_lens, positions, input_ids, idx_mapping, num_sampled,
                            num_rejected, last_sampled, next_prefill_tokens, max_num_reqs: int) -> dict:
    """``_prepare_prefill_inputs_kernel`` then ``_prefill``'s position bookkeeping, request by request.

    ``last_sampled`` is indexed by state row, every other per-request array by batch row.
    """
    num_reqs = len(idx_mapping)
    num_tokens = int(query_start_loc[num_reqs])
    ids_d = np.full(num_tokens, STALE, np.int64)
    pos_d = np.full(num_tokens, STALE, np.int64)
    last = np.zeros(max_num_reqs, np.int64)
    for b in range(num_reqs):
        start = int(query_start_loc[b])
        kept = int(query_start_loc[b + 1]) - start - int(num_rejected[b])
        next_token = last_sampled[idx_mapping[b]] if num_sampled[b] > 0 else next_prefill_tokens[b]
        for i in range(1, kept):
            ids_d[start + i - 1] = input_ids[start + i]
        last[b] = start + kept - 1
        ids_d[last[b]] = next_token
        for i in range(kept):
            pos_d[start + i] = positions[start + i]
    qsl_d = np.full(max_num_reqs + 1, num_tokens, np.int64)
    qsl_d[:num_reqs + 1] = query_start_loc[:num_reqs + 1]
    seq_lens_d = np.zeros(max_num_reqs, np.int64)
    seq_lens_d[:num_reqs] = seq_lens[:num_reqs]
    idx_d = np.full(max_num_reqs, -1, np.int64)
    idx_d[:num_reqs] = idx_mapping
    decode_positions = pos_d[last[:num_reqs]]
    return dict(idx_mapping=idx_d, input_ids=ids_d, positions=pos_d, query_start_loc=qsl_d, seq_lens=seq_lens_d,
                last_token_indices=last, decode_positions=decode_positions,
                sample_src_positions=decode_positions + 1)


def draft_decode_reference(draft_tokens, positions, seq_lens, sample_src, max_model_len: int, max_num_reqs: int,
                           advance: bool, num_rejected=None) -> dict:
    """One draft decode step over the ``R`` real rows.

    With ``num_rejected`` it is step 1 (``_prepare_decode_inputs_kernel``: ``seq_lens`` are the
    target's minus the rejected tokens), without it step k -> k + 1 (``_update_draft_inputs_kernel``).
    """
    num_reqs = len(draft_tokens)
    out = dict(input_ids=[], positions=[], seq_lens=[], sample_src_positions=[])
    for b in range(num_reqs):
        seq_len = int(seq_lens[b]) - (int(num_rejected[b]) if num_rejected is not None else 0)
        position = int(positions[b])
        if advance:
            position = min(position + 1, max_model_len - 1)
            seq_len = min(seq_len + 1, max_model_len)
        out["input_ids"].append(int(draft_tokens[b]))
        out["positions"].append(position)
        out["seq_lens"].append(seq_len)
        out["sample_src_positions"].append(int(sample_src[b]) + 1)
    out = {name: np.array(values, np.int64) for name, values in out.items()}
    out["query_start_loc"] = np.array([min(i, num_reqs) for i in range(max_num_reqs + 1)], np.int64)
    return out
