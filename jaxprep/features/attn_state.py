"""The attention state of a step, vllm-ascend's ``_build_attn_state`` ladder (docs/semantics.md#ascend-state), on the
device.

The first rung that matches decides, over the requests of the batch:

1. no request has cached tokens (``C == 0``)            -> PrefillNoCache
2. every request schedules one token                   -> DecodeOnly (SpecDecoding for "mtp")
3. every request schedules one token plus its drafts   -> SpecDecoding with spec decode, else ChunkedPrefill
4. chunked prefill is enabled                          -> ChunkedPrefill
5. otherwise                                           -> PrefillCacheHit

vllm-ascend then hands ChunkedPrefill to the attention backend when rung 3 gives SpecDecoding
for a method other than "mtp" (its returned value stays SpecDecoding); the value here is the
one the attention backend uses.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxprep._typing import Array, Bool, Int32
from jaxprep.features.config import AttnState, FeatureConfig
from jaxprep.features.record import Feature


def attn_state(computed: Int32[Array, " num_reqs_padded"], scheduled: Int32[Array, " num_reqs_padded"],
               drafts: Int32[Array, " num_reqs_padded"], is_real_req: Bool[Array, " num_reqs_padded"],
               features: FeatureConfig) -> Int32[Array, ""]:
    """The `AttnState` value of the batch as a 0-d int32 array.

    ```
    # C [0, 0], S [3, 5] -> PrefillNoCache; C [4, 9], S [1, 1] -> DecodeOnly;
    # C [4, 9], S [1, 3], D [0, 2], K=2, "mtp" -> SpecDecoding; C [4, 0], S [1, 7] -> ChunkedPrefill
    ```
    """
    def every(condition):
        return jnp.all(condition | ~is_real_req)

    is_mtp = features.speculative_method == "mtp"
    decode = AttnState.SpecDecoding if is_mtp else AttnState.DecodeOnly
    spec_rung = AttnState.SpecDecoding if features.spec_decode and is_mtp else AttnState.ChunkedPrefill
    fallback = AttnState.ChunkedPrefill if features.enable_chunked_prefill else AttnState.PrefillCacheHit
    state = jnp.where(every(scheduled - drafts == 1), spec_rung, fallback)
    state = jnp.where(every(scheduled == 1), decode, state)
    return jnp.where(every(computed == 0), AttnState.PrefillNoCache, state).astype(jnp.int32)


def _metadata(build) -> None:
    layout = build.layout
    build.outputs["attn_state"] = attn_state(layout.computed, layout.scheduled, build.drafts, layout.is_real_req,
                                             build.config.features)


FEATURE = Feature(name="attn_state", is_on=lambda features: features.attn_state, metadata=_metadata)
"""This feature's record (`jaxprep.features.registry`): no input of its own and no check; `_metadata` adds
its outputs to the step."""
