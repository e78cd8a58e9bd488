"""Which request and which local position every logits row belongs to (vLLM V2's logits indirection).

A step computes ``n_b = D_b + 1`` logits rows for batch row ``b`` (its drafts and the bonus token),
or one per request without spec decode. vLLM V2 calls the inclusive offsets ``cu_num_logits``, the
request of each row ``expanded_idx_mapping`` (as a state slot) and the position inside the request
``expanded_local_pos`` (`vllm/v1/worker/gpu/model_runner.py::prepare_inputs`,
``input_batch.py::expand_idx_mapping``). The drafter and the grammar bitmask read them; here they
come from the step's own spec-decode metadata, so nothing is recomputed from the state.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from jaxprep._ragged import token_request_index
from jaxprep._typing import Array, Bool, Int32


class LogitsRows(NamedTuple):
    """The logits rows of a step, padded to ``num_logits_padded`` (R_pad without spec decode)."""

    cu_num_logits: Int32[Array, " num_reqs_padded_plus_1"]  # [0, cumsum(n)]; pad repeats the total
    num_logits: Int32[Array, " num_reqs_padded"]  # n_b = D_b + 1; pad: 0
    batch_row: Int32[Array, " num_logits_padded"]  # b of each row; pad: clipped to the last batch row
    local_pos: Int32[Array, " num_logits_padded"]  # j - cu_num_logits[b]; pad: 0
    is_real: Bool[Array, " num_logits_padded"]


def logits_rows(spec_decode, is_real_req: Bool[Array, " num_reqs_padded"]) -> LogitsRows:
    """`LogitsRows` from ``step.spec_decode`` (None without spec decode: one row per request).

    # D [2, 1, 0, 0] (the running example's batch) -> n [3, 2, 1, 1], cu [0, 3, 5, 6, 7]
    #   batch_row [0,0,0, 1,1, 2, 3], local_pos [0,1,2, 0,1, 0, 0]
    """
    num_reqs_padded = is_real_req.shape[0]
    if spec_decode is None:
        rows = jnp.arange(num_reqs_padded, dtype=jnp.int32)
        num_reqs = jnp.sum(is_real_req, dtype=jnp.int32)
        cu = jnp.minimum(jnp.arange(num_reqs_padded + 1, dtype=jnp.int32), num_reqs)
        return LogitsRows(cu_num_logits=cu, num_logits=is_real_req.astype(jnp.int32), batch_row=rows,
                          local_pos=jnp.zeros_like(rows), is_real=is_real_req)
    ends = spec_decode.cu_num_sampled_tokens  # inclusive; padded rows repeat the total
    cu = jnp.pad(ends, (1, 0))
    num_logits_padded = spec_decode.logits_indices.shape[0]
    batch_row = token_request_index(ends, num_logits_padded)
    row = jnp.arange(num_logits_padded, dtype=jnp.int32)
    is_real = row < ends[-1]
    return LogitsRows(cu_num_logits=cu, num_logits=jnp.where(is_real_req, spec_decode.num_draft_tokens + 1, 0),
                      batch_row=batch_row, local_pos=jnp.where(is_real, row - cu[batch_row], 0), is_real=is_real)
