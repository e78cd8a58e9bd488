"""NumPy reference of micro-batch slicing (vLLM ``ubatch_utils.py``, V2 ``gpu/ubatch_utils.py``), for reading.

``maybe_create_ubatch_slices`` (token cuts at ``T_pad // n``, request ranges by binary search over
``query_start_loc``), the V2 clamps of ``create_ubatch_slices``, then ``_slice_input_batch``'s
rebased ``query_start_loc`` and truncated ``seq_lens``, on the step's padded host arrays.
"""

from __future__ import annotations

import numpy as np


def ubatch_slices_reference(num_scheduled, num_tokens_padded: int, num_reqs_padded: int, num_ubatches: int):
    """``[(req_start, req_stop, tok_start, tok_stop)]`` of each micro-batch, as vLLM V2 runs them."""
    num_reqs = len(num_scheduled)
    cu = np.concatenate([[0], np.cumsum(num_scheduled)])
    size = num_tokens_padded // num_ubatches
    points = [size * i for i in range(1, num_ubatches)] + [int(cu[-1])]
    slices, start = [], 0
    for end in points:
        req_start = int(np.searchsorted(cu, start, side="right") - 1)
        req_stop = int(np.searchsorted(cu, end, side="left"))
        slices.append([req_start, req_stop, start, end])
        start = end
    slices[-1][1], slices[-1][3] = num_reqs_padded, num_tokens_padded  # _pad_out_ubatch_slices
    return [(min(a, num_reqs - 1), min(b, num_reqs_padded), c, d) for a, b, c, d in slices]


def slice_step_reference(query_start_loc, seq_lens, num_reqs: int, num_tokens: int, req_start: int, req_stop: int,
                         tok_start: int, tok_stop: int) -> dict:
    """``_slice_input_batch`` over the step's padded ``query_start_loc`` [R_pad + 1] and ``seq_lens`` [R_pad]."""
    padded_tokens = tok_stop - tok_start
    qsl = np.clip(np.asarray(query_start_loc)[req_start:req_stop + 1] - tok_start, 0, padded_tokens)
    lens = np.array(seq_lens[req_start:req_stop], np.int64)
    lens[-1] -= max(int(query_start_loc[req_stop]) - tok_stop, 0)
    return dict(query_start_loc=qsl, seq_lens=lens,
                num_reqs=max(0, min(req_stop, num_reqs) - req_start),
                num_tokens=max(0, min(tok_stop, num_tokens) - tok_start))
