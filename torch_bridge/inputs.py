"""The torch side of a bridged step: `TorchStepInputs`, `TorchAttentionMetadata`, and how a
strategy's tensors are assembled into them (shared by `to_torch` and `to_npu`).

Lifetime: every tensor shares memory with a JAX array through DLPack and holds a reference to it
(so does `TorchStepInputs.jax_buffers`). A step's arrays are outputs of `prepare_inputs`: they
never alias the `BatchState` they came from, so updating and donating that state leaves the
tensors as they were. While torch holds a tensor, PJRT sees an external reference on its buffer
and will not hand the buffer to a donated argument: on the CPU it copies instead, on CUDA the call
fails ("Donation requested for buffer with external reference"). With the default packed strategy
the shared buffer is internal to the bridge, so no caller can donate it at all. Do not donate a
step's arrays while torch still reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxprep.array_packing import INT32, INT64
from jaxprep.bounds import type_name
from jaxprep.metadata import SCALAR_FIELDS, STEP_FIELDS, StepInputs, step_fields
from torch_bridge._checks import as_jax, check_consistent, check_features
from torch_bridge._torch import torch
from torch_bridge.features import METADATA_FEATURES, FeatureFields, TorchGroupMetadata, feature_fields, torch_features
from torch_bridge.transfer import Bridged, PackSpec, check_live, convert_leaf, with_fields

SCALARS = SCALAR_FIELDS + ("errors",)
"""Read back as Python ints (the metadata's, then the step's error word)."""
HOST_MIRRORED = ("query_start_loc", "seq_lens")
"""On the target device and on the host (vLLM's ``query_start_loc_cpu``, ``seq_lens_cpu``)."""
TORCH_NAMES = {"block_table": "block_table_tensor"}
"""vLLM's ``CommonAttentionMetadata`` names where they differ from jaxprep's."""


def core_pack_spec(int64_fields: tuple[str, ...]) -> PackSpec:
    """How the bridge carries a step's `STEP_FIELDS`: every array on the target device (``int64_fields``
    as int64, the rest int32), then the scalars and the host-mirrored arrays."""
    device_only = tuple((TORCH_NAMES.get(name, name), INT64 if name in int64_fields else INT32)
                        for name in STEP_FIELDS if name not in SCALARS + HOST_MIRRORED)
    return PackSpec(device_only=device_only, scalars=SCALARS, host_mirrored=HOST_MIRRORED)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchAttentionMetadata:
    """vLLM's ``CommonAttentionMetadata`` fields, as torch tensors and Python ints."""

    query_start_loc: torch.Tensor  # [num_reqs_padded + 1] int32; pad repeats num_actual_tokens
    query_start_loc_cpu: torch.Tensor  # host mirror of query_start_loc
    seq_lens: torch.Tensor  # [num_reqs_padded] int32; pad 0
    seq_lens_cpu: torch.Tensor  # host mirror of seq_lens
    num_reqs: int  # requests in the batch, unpadded
    num_actual_tokens: int  # scheduled tokens, unpadded
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor  # [num_reqs_padded, max_blocks_per_req] int32; pad rows 0
    slot_mapping: torch.Tensor  # [num_tokens_padded] int64 (int32 on the NPU); pad -1
    causal: bool = True
    attn_state: Any = None  # from jaxprep's attention-state function, passed through
    attn_mask: torch.Tensor | None = None  # likewise
    dcp_local_seq_lens: torch.Tensor | None = None  # [num_reqs_padded] int32, DCP only; pad 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchStepInputs:
    """Model inputs of one step on the torch side; the optional features are None when off."""

    input_ids: torch.Tensor  # [num_tokens_padded] int32; pad 0
    positions: torch.Tensor  # [num_tokens_padded] int64; pad 0
    logits_indices: torch.Tensor  # [num_reqs_padded] int32; pad 0
    idx_mapping: torch.Tensor  # [num_reqs_padded] int32; pad -1
    attn_metadata: TorchAttentionMetadata
    num_tokens_padded: int
    errors: int = 0  # the step's error word (`jaxprep.validate`), read with the other host scalars
    spec_decode: Any = None  # the step's SpecDecodeMetadata with int32 torch leaves
    discard_request_mask: torch.Tensor | None = None  # [num_reqs_padded] bool; pad True
    kv_groups: tuple[TorchGroupMetadata, ...] | None = None  # one per KV-cache group
    mrope_positions: torch.Tensor | None = None  # [3, num_tokens_padded] int64; pad 0
    prompt_embeds: Any = None  # the step's PromptEmbedsMetadata with torch leaves (bool, int32)
    request_distribution: torch.Tensor | None = None  # [3] int32: decode_end, prefill_end, mixed_end
    lora: Any = None  # the step's LoRAMetadata with torch leaves (slot indices int64, the rest int32)
    logits_indirection: Any = None  # the step's LogitsIndirection with torch leaves (see torch_bridge.features)
    sampling: Any = None  # the step's SamplingMetadata with torch leaves: float32 parameters, bool flags
    drafter: Any = None  # the step's DrafterTargetInputs with torch leaves (int32, bool)
    hybrid: Any = None  # the step's HybridMetadata with torch leaves (int32, bool)
    grammar: Any = None  # the step's GrammarMetadata with int32 torch leaves
    ubatches: Any = None  # the step's MicroBatches: each micro-batch a StepInputs with torch leaves
    jax_buffers: tuple[jax.Array, ...] = ()  # the JAX arrays the tensors share memory with

    def group_attn_metadata(self, group: int) -> TorchAttentionMetadata:
        """The attention metadata that layers of KV-cache group ``group`` read (vLLM builds one
        ``CommonAttentionMetadata`` per group): the step's, with that group's block table and slots."""
        if self.kv_groups is None:
            raise ValueError("the step has no KV-cache groups (FeatureConfig.kv_groups is off)")
        chosen = self.kv_groups[group]
        return dataclasses.replace(self.attn_metadata, block_table_tensor=chosen.block_table_tensor,
                                   slot_mapping=chosen.slot_mapping)


STEP_ATTRIBUTES = ("input_ids", "positions", "logits_indices", "idx_mapping", "attn_metadata", "num_tokens_padded")
"""What the bridge reads from a step: a `jaxprep.StepInputs`, or any object with these attributes."""


def expect_step(function: str, step_inputs) -> None:
    """A prepared step (what `prepare_inputs` returns, or an object with its fields), not its
    `BatchState` or a dict of arrays; raises TypeError naming what is missing."""
    if isinstance(step_inputs, StepInputs) or all(hasattr(step_inputs, name) for name in STEP_ATTRIBUTES):
        return
    missing = [name for name in STEP_ATTRIBUTES if not hasattr(step_inputs, name)]
    raise TypeError(f"{function}: step_inputs must be a jaxprep.StepInputs, got {type_name(step_inputs)} "
                    f"(without {', '.join(missing)}; prepare one with jaxprep.prepare_inputs(state, config))")


def step_arrays(step_inputs) -> dict[str, jax.Array]:
    """The step's arrays under vLLM's names (``block_table`` becomes ``block_table_tensor``)."""
    expect_step("step_arrays", step_inputs)
    arrays = {TORCH_NAMES.get(name, name): value for name, value in step_fields(step_inputs).items()}
    if arrays["errors"] is None:  # a step-like object built without jaxprep's error word
        arrays["errors"] = jnp.zeros((), jnp.int32)
    check_consistent("torch_bridge", step_inputs, arrays)
    arrays = {name: as_jax(name, value) for name, value in arrays.items()}  # a prepare_to_host step: NumPy
    check_live(arrays)
    return arrays


def bridge_inputs(step_inputs, pack_spec: PackSpec) -> tuple[dict[str, jax.Array], PackSpec, FeatureFields]:
    """Every array the bridge moves (`step_arrays` and the features'), the spec that carries them,
    and the features' structure. Group slot mappings take the kind of ``slot_mapping``."""
    arrays = step_arrays(step_inputs)
    features = feature_fields(step_inputs, slot_kind=pack_spec.slot_kind)
    if features.treedef is not None:  # every feature array belongs to the step's bucket, as its core fields do
        sizes = dict(num_tokens_padded=int(step_inputs.num_tokens_padded),
                     num_reqs_padded=int(arrays["logits_indices"].shape[0]))
        check_features("torch_bridge", step_inputs, sizes, features.treedef, features.leaves)
    if not features.spec:
        return arrays, pack_spec, features
    features = dataclasses.replace(features, arrays={name: as_jax(name, v) for name, v in features.arrays.items()})
    check_live(features.arrays)
    return {**arrays, **features.arrays}, with_fields(pack_spec, features.spec), features


def assemble(step_inputs, bridged: Bridged, features: FeatureFields, device, *, attn_state, attn_mask,
             metadata_cls=TorchAttentionMetadata, **metadata_extras) -> TorchStepInputs:
    """Builds `TorchStepInputs` from bridged tensors, with the step's optional features rebuilt."""
    tensors, host = bridged.device, bridged.host
    attn_state = _feature(step_inputs, "attn_state", attn_state)
    attn_mask = _feature(step_inputs, "attn_mask", attn_mask)
    step_features = torch_features(features, tensors, device)
    metadata_features = {name: step_features.pop(name, None) for name in METADATA_FEATURES}
    scalars = dict(bridged.scalars)
    errors = scalars.pop("errors", 0)
    metadata = metadata_cls(
        query_start_loc=tensors["query_start_loc"], query_start_loc_cpu=host["query_start_loc"],
        seq_lens=tensors["seq_lens"], seq_lens_cpu=host["seq_lens"],
        block_table_tensor=tensors["block_table_tensor"], slot_mapping=tensors["slot_mapping"],
        attn_state=int(attn_state) if isinstance(attn_state, jax.Array) else attn_state,
        attn_mask=None if attn_mask is None else convert_leaf(attn_mask, device),
        **metadata_features, **scalars, **metadata_extras)
    return TorchStepInputs(
        input_ids=tensors["input_ids"], positions=tensors["positions"],
        logits_indices=tensors["logits_indices"], idx_mapping=tensors["idx_mapping"],
        attn_metadata=metadata, num_tokens_padded=step_inputs.num_tokens_padded, errors=errors,
        jax_buffers=bridged.jax_buffers, **step_features)


def _feature(step_inputs, name: str, given):
    """An explicit argument wins over the step's own attribute (or its attn_metadata's)."""
    if given is not None:
        return given
    found = getattr(step_inputs, name, None)
    return getattr(step_inputs.attn_metadata, name, None) if found is None else found
