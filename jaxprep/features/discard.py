"""Which requests are sampled (docs/semantics.md#logits-indices): the discard mask of partial prefills.

Every request gets a logit, but a request still inside its prompt (a chunk of a chunked prefill)
has its sampled token thrown away: ``discard_request_mask[r] = C[r] + S[r] < prefill_len[r]``.
``prefill_len`` is the prefill length: the prompt plus any outputs a resumed request recomputes
(vLLM V2 ``prefill_len``; V1 compares with ``num_tokens``, which is the same for these rows).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxprep._constants import PAD_DISCARD
from jaxprep._ragged import take_rows
from jaxprep._typing import Array, Bool, Int32
from jaxprep.features.record import Feature


def discard_request_mask(computed: Int32[Array, " num_reqs_padded"], scheduled: Int32[Array, " num_reqs_padded"],
                         prefill_len: Int32[Array, " num_reqs_padded"],
                         is_real_req: Bool[Array, " num_reqs_padded"]) -> Bool[Array, " num_reqs_padded"]:
    """True for the batch rows whose sampled token is discarded; padded rows: `PAD_DISCARD`.

    ```
    # C [0, 0, 0], S [3, 2, 5], prompts [3, 2, 8] -> [F, F, T] (docs/semantics.md#example-a-step-1)
    ```
    """
    return jnp.where(is_real_req, computed + scheduled < prefill_len, PAD_DISCARD)


def _metadata(build) -> None:
    layout = build.layout
    prompt = take_rows(build.state.prefill_len, layout.rows, fill_value=0)
    build.outputs["discard_request_mask"] = discard_request_mask(layout.computed, layout.scheduled, prompt,
                                                                 layout.is_real_req)


FEATURE = Feature(name="discard", is_on=lambda features: features.discard_request_mask, metadata=_metadata)
"""This feature's record (`jaxprep.features.registry`): no input of its own and no check; `_metadata` adds
its outputs to the step."""
