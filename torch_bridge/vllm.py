"""vLLM's own ``CommonAttentionMetadata`` (vLLM 0.33.0) from a bridged step, for vLLM's attention backends.

```python
inputs = torch_bridge.to_torch(jaxprep.prepare_inputs(state, config))
cam = torch_bridge.vllm.common_attention_metadata(inputs, prefill_len=prompt_lens_by_row)
attn_metadata = TritonAttentionMetadataBuilder(spec, layer_names, vllm_config, device).build(0, cam)
cams = torch_bridge.vllm.group_common_attention_metadata(inputs)   # one per KV-cache group
```

Needs vllm itself (``pip install --no-deps vllm==0.33.0``) and its import-time dependencies
(``pip install jaxprep[vllm]``); this module is imported on its own, never by ``import torch_bridge``.

The fields follow how vLLM's runners fill them (``vllm/v1/worker/gpu/attn_utils.py::build_attn_metadata``
and ``vllm/v1/worker/gpu/model_states/default.py::prepare_attn`` in model runner V2,
``vllm/v1/worker/gpu_model_runner.py::_build_attention_metadata`` in V1):

| field | filled from |
|---|---|
| query_start_loc (+ ``_cpu``) | the step's, and the bridge's host mirror |
| seq_lens | the step's |
| seq_lens_cpu_upper_bound | the bridge's host mirror of ``seq_lens``: exact, so a valid upper bound |
| num_reqs, num_actual_tokens | the step's real counts; with ``padded=True`` the padded sizes (V2's FULL mode, V1) |
| max_query_len, max_seq_len | the step's |
| block_table_tensor | the step's (or the KV-cache group's, in kernel blocks); pad rows null |
| slot_mapping | the step's (or the group's), ``num_tokens_padded`` long; pad ``-1`` |
| positions | the step's, int64, ``num_tokens_padded`` long |
| causal | the ``causal`` argument (default True) |
| is_prefilling | host bool ``num_computed < prefill_len``, given ``prefill_len`` |
| req_idx | host copy of ``idx_mapping`` (state row of each real batch row), as V2 |
| dcp_local_seq_lens (+ bound) | the step's (DCP on), and a host copy as the upper bound (V1 does the same) |
| logits_indices_padded, num_logits_indices, max_logits_per_req | with ``kv_sharing_fast_prefill=True``: the \
sampled token rows (pads repeat the last one), their count, the most per request (1 + the longest draft) |

Left at vLLM's default (None), and what each would need:

- ``encoder_seq_lens``, ``encoder_seq_lens_cpu``: encoder lengths of encoder-decoder models (cross
  attention); jaxprep prepares decoder steps only.
- ``mm_req_doc_ranges``: PrefixLM bidirectional ranges of multimodal placeholders; needs each request's
  multimodal feature positions, which a `BatchState` does not hold.
- ``rswa_prefix_lens``: R-SWA needs the original prompt length of each request; `BatchState.prefill_len`
  is V2's ``prefill_len`` (prompt plus resumed outputs), not that.
- ``replayssm_decode_base_cpu``: Mamba2 ReplaySSM ring origin; needs per-request SSM state history.
- ``_num_computed_tokens_cache``, ``_token_to_req_indices_cache``: private caches vLLM fills lazily.

vLLM 0.33.0 has no ``seq_lens_cpu`` or ``num_computed_tokens_cpu`` field any more: ``seq_lens_cpu_upper_bound``
replaced the first, and ``CommonAttentionMetadata.compute_num_computed_tokens`` derives the second on device.

Host copies: the host-side fields come from one `HostMirror` per step. ``query_start_loc`` and
``seq_lens`` are the bridge's own mirrors (free); ``idx_mapping``, ``dcp_local_seq_lens`` and the
spec-decode counts are read back in one device-to-host copy (none when the step lives on the CPU).
`group_common_attention_metadata` makes that mirror once and shares it by every group.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxprep._constants import PAD_STATE_ROW
from torch_bridge._torch import torch

VLLM_HINT = 'pip install "jaxprep[vllm]" && pip install --no-deps vllm==0.33.0'

try:
    from vllm.v1.attention.backend import CommonAttentionMetadata
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(f"torch_bridge.vllm needs vLLM 0.33.0 and its import-time dependencies: {VLLM_HINT} "
                      f"(importing vllm failed: {error})") from error


@dataclasses.dataclass(frozen=True)
class HostMirror:
    """A step's host-side values, read once per step and shared by every KV-cache group."""

    query_start_loc: torch.Tensor  # [num_reqs_padded + 1] int32, CPU; pad repeats num_actual_tokens
    seq_lens: torch.Tensor  # [num_reqs_padded] int32, CPU; pad 0
    idx_mapping: np.ndarray  # [num_reqs_padded] int32; pad -1
    dcp_local_seq_lens: torch.Tensor | None  # [num_reqs_padded] int32, CPU; None: DCP off
    num_logits: int  # sampled logits of the step (num_reqs without spec decode)
    max_logits_per_req: int  # 1, or 1 + the longest draft with spec decode


def host_mirror(inputs) -> HostMirror:
    """The host values of ``inputs`` (a `torch_bridge.TorchStepInputs`): one device-to-host copy at most.

    ```
    # idx_mapping [2, 0, -1, -1], dcp [5, 3, 0, 0] -> one [8] int32 copy -> split back into [4] + [4]
    ```
    """
    meta = inputs.attn_metadata
    parts = {"idx_mapping": inputs.idx_mapping}
    if meta.dcp_local_seq_lens is not None:
        parts["dcp_local_seq_lens"] = meta.dcp_local_seq_lens
    if inputs.spec_decode is not None:
        parts["num_draft_tokens"] = inputs.spec_decode.num_draft_tokens
    host = _to_host(parts)
    drafts = host.get("num_draft_tokens")
    num_reqs = meta.num_reqs
    return HostMirror(
        query_start_loc=meta.query_start_loc_cpu, seq_lens=meta.seq_lens_cpu,
        idx_mapping=host["idx_mapping"].numpy(), dcp_local_seq_lens=host.get("dcp_local_seq_lens"),
        num_logits=num_reqs + (int(drafts[:num_reqs].sum()) if drafts is not None else 0),
        max_logits_per_req=1 + (int(drafts[:num_reqs].max()) if drafts is not None and num_reqs else 0))


def _to_host(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU tensors of equal-length int32 ``parts``: themselves on the CPU, else one concatenated copy."""
    if all(tensor.device.type == "cpu" for tensor in parts.values()):
        return parts
    joined = torch.cat([tensor.to(torch.int32) for tensor in parts.values()]).cpu()
    return dict(zip(parts, joined.split([tensor.shape[0] for tensor in parts.values()])))


def common_attention_metadata(inputs, *, group: int | None = None, prefill_len=None, padded: bool = False,
                              causal: bool = True, kv_sharing_fast_prefill: bool = False,
                              host: HostMirror | None = None) -> CommonAttentionMetadata:
    """vLLM's ``CommonAttentionMetadata`` for one step (see the module docstring for every field).

    Args:
      inputs: a `torch_bridge.TorchStepInputs` from `torch_bridge.to_torch` (CPU or CUDA).
      group: a KV-cache group (``FeatureConfig.kv_groups``): its block table (in kernel blocks) and
        slot mapping replace the step's; ``None``: the step's own (group 0).
      prefill_len: host integers by state row (`BatchState.prefill_len`); fills
        ``is_prefilling``. ``None`` leaves it None.
      padded: False (vLLM V2 eager/piecewise): real request and token counts, the per-request fields
        cut to the real requests. True (V2 FULL CUDA graphs; V1 always passes its padded sizes): the
        bucket's sizes; padded rows hold zero query tokens and ``seq_len`` 0. ``block_table_tensor``,
        ``slot_mapping`` and ``positions`` keep their padded length either way, as in both runners.
      causal: vLLM's ``causal`` (False for bidirectional layers).
      kv_sharing_fast_prefill: fill ``logits_indices_padded`` and its counts (vLLM
        ``cache_config.kv_sharing_fast_prefill``).
      host: the step's `HostMirror`, when the caller already made it.
    """
    meta = inputs.attn_metadata
    host = host_mirror(inputs) if host is None else host
    block_table, slot_mapping = _group_tables(inputs, group)
    num_reqs = inputs.idx_mapping.shape[0] if padded else meta.num_reqs
    num_tokens = inputs.num_tokens_padded if padded else meta.num_actual_tokens
    fields = {
        "query_start_loc": meta.query_start_loc[:num_reqs + 1],
        "query_start_loc_cpu": host.query_start_loc[:num_reqs + 1],
        "seq_lens": meta.seq_lens[:num_reqs], "seq_lens_cpu_upper_bound": host.seq_lens[:num_reqs],
        "num_reqs": num_reqs, "num_actual_tokens": num_tokens, "max_query_len": meta.max_query_len,
        "max_seq_len": meta.max_seq_len, "block_table_tensor": block_table, "slot_mapping": slot_mapping,
        "causal": causal, "positions": inputs.positions,
        "req_idx": host.idx_mapping[:meta.num_reqs].astype(np.intp),  # real rows only, as V2's idx_mapping_np
        "is_prefilling": None if prefill_len is None else is_prefilling(host, prefill_len)[:num_reqs],
    }
    if meta.dcp_local_seq_lens is not None:
        fields.update(dcp_local_seq_lens=meta.dcp_local_seq_lens[:num_reqs],
                      dcp_local_seq_lens_cpu_upper_bound=host.dcp_local_seq_lens[:num_reqs])
    if kv_sharing_fast_prefill:
        fields.update(fast_prefill_fields(inputs, host))
    return CommonAttentionMetadata(**fields)


def group_common_attention_metadata(inputs, **options) -> tuple[CommonAttentionMetadata, ...]:
    """One ``CommonAttentionMetadata`` per KV-cache group, sharing one `HostMirror` (vLLM builds one per
    group, differing only in block table and slot mapping). Without ``FeatureConfig.kv_groups`` the
    step is its only group. ``options``: those of `common_attention_metadata`, but ``group``."""
    host = options.pop("host", None) or host_mirror(inputs)
    groups = range(len(inputs.kv_groups)) if inputs.kv_groups is not None else (None,)
    return tuple(common_attention_metadata(inputs, group=group, host=host, **options) for group in groups)


def _group_tables(inputs, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_table_tensor, slot_mapping) of ``group``, or of the step itself for None."""
    if group is None:
        return inputs.attn_metadata.block_table_tensor, inputs.attn_metadata.slot_mapping
    if inputs.kv_groups is None:
        raise ValueError(f"group={group} was asked for, but the step has no KV-cache groups "
                         "(FeatureConfig.kv_groups is off)")
    if not 0 <= group < len(inputs.kv_groups):
        raise ValueError(f"group={group} is outside the step's KV-cache groups [0, {len(inputs.kv_groups)})")
    chosen = inputs.kv_groups[group]
    return chosen.block_table_tensor, chosen.slot_mapping


def is_prefilling(host: HostMirror, prefill_len) -> torch.Tensor:
    """[num_reqs_padded] bool on the CPU: the request has prompt tokens left before this step; pad False.

    As vLLM V1 (``num_computed_tokens_cpu < num_prompt_tokens_cpu``) and V2 (``num_computed_prefill_tokens
    < prefill_len``). num_computed = seq_lens - query lens:

    ```
    # qsl [0, 16, 17], seq_lens [16, 41], prompt by row {3: 40, 1: 20}, idx_mapping [3, 1]
    #   -> computed [0, 40] -> [0 < 40, 40 < 20] = [True, False]
    ```
    """
    prompt = np.asarray(prefill_len)
    rows = host.idx_mapping
    if prompt.ndim != 1 or prompt.shape[0] <= rows.max(initial=PAD_STATE_ROW):
        raise ValueError(f"prefill_len must be 1-D with an entry per state row (the step uses row "
                         f"{rows.max(initial=PAD_STATE_ROW)}), got shape {prompt.shape}")
    qsl = host.query_start_loc.numpy()
    computed = host.seq_lens.numpy() - (qsl[1:] - qsl[:-1])
    real = rows != PAD_STATE_ROW
    # pad rows read row 0 (an in-bounds index) and are masked to False
    return torch.from_numpy(real & (computed < prompt[np.where(real, rows, 0)]))


def fast_prefill_fields(inputs, host: HostMirror) -> dict:
    """``logits_indices_padded`` (pads repeat the last real index, as vLLM's runners pad it),
    ``num_logits_indices`` and ``max_logits_per_req``.

    ```
    # logits_indices [4, 9, 0, 0], 2 real -> [4, 9, 9, 9], num_logits_indices 2, max_logits_per_req 1
    ```
    """
    indices = inputs.logits_indices if inputs.spec_decode is None else inputs.spec_decode.logits_indices
    count = host.num_logits
    if count == 0:
        return {}
    is_real = torch.arange(indices.shape[0], device=indices.device) < count
    return {"logits_indices_padded": torch.where(is_real, indices, indices[count - 1]),
            "num_logits_indices": count, "max_logits_per_req": host.max_logits_per_req}


__all__ = ["HostMirror", "common_attention_metadata", "group_common_attention_metadata", "host_mirror"]
