"""The pytrees one prepared step returns: `StepInputs` and its `AttentionMetadata`.

Sizes: ``num_tokens_padded`` is the step's token bucket and ``num_reqs_padded =
min(num_tokens_padded, max_num_reqs)``. Real counts are 0-d int32 arrays, so every batch of one
bucket shares one compiled executable.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import TYPE_CHECKING

import jax

from jaxprep._typing import Bool, Int32, StepArray

if TYPE_CHECKING:  # feature pytrees, defined next to the code that builds them
    from jaxprep.features.drafter import DrafterTargetInputs
    from jaxprep.features.grammar import GrammarMetadata
    from jaxprep.features.hybrid import HybridMetadata
    from jaxprep.features.kv_groups import KVGroupMetadata
    from jaxprep.features.logits_indirection import LogitsIndirection
    from jaxprep.features.lora import LoRAMetadata
    from jaxprep.features.prompt_embeds import PromptEmbedsMetadata
    from jaxprep.features.sampling import SamplingMetadata
    from jaxprep.features.spec_decode import SpecDecodeMetadata


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """vLLM's ``CommonAttentionMetadata`` fields, padded to static shapes."""

    query_start_loc: Int32[StepArray, " num_reqs_padded_plus_1"]  # pad: repeats num_actual_tokens
    seq_lens: Int32[StepArray, " num_reqs_padded"]  # num_computed + num_scheduled; pad: 0
    slot_mapping: Int32[StepArray, " num_tokens_padded"]  # block * block_size + offset; pad: -1
    block_table: Int32[StepArray, "num_reqs_padded max_blocks_per_req"]  # rows in batch order; pad: 0
    num_actual_tokens: Int32[StepArray, ""]  # scheduled tokens, unpadded
    num_reqs: Int32[StepArray, ""]  # requests in the batch, unpadded
    max_query_len: Int32[StepArray, ""]  # max num_scheduled over the batch
    max_seq_len: Int32[StepArray, ""]  # max seq_lens over the batch
    # DCP (docs/semantics.md#dcp) only: this rank's share of seq_lens; pad: 0
    dcp_local_seq_lens: Int32[StepArray, " num_reqs_padded"] | None = None


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Model inputs of one step."""

    input_ids: Int32[StepArray, " num_tokens_padded"]  # pad: 0
    positions: Int32[StepArray, " num_tokens_padded"]  # pad: 0
    logits_indices: Int32[StepArray, " num_reqs_padded"]  # last scheduled token of each request; pad: 0
    idx_mapping: Int32[StepArray, " num_reqs_padded"]  # state row of each batch row; pad: -1
    attn_metadata: AttentionMetadata
    errors: Int32[StepArray, ""]  # bit flags of the bounds the input broke, 0 if none (jaxprep.validate)
    num_tokens_padded: int = dataclasses.field(metadata=dict(static=True))
    # Optional features (jaxprep.FeatureConfig): None (an empty pytree node) when off.
    spec_decode: SpecDecodeMetadata | None = None  # docs/semantics.md#spec-decode
    # docs/semantics.md#logits-indices, True: not sampled; pad: True
    discard_request_mask: Bool[StepArray, " num_reqs_padded"] | None = None
    kv_groups: tuple[KVGroupMetadata, ...] | None = None  # docs/semantics.md#kv-groups, one per KV-cache group
    mrope_positions: Int32[StepArray, "3 num_tokens_padded"] | None = None  # docs/semantics.md#m-rope; pad: 0
    prompt_embeds: PromptEmbedsMetadata | None = None  # docs/semantics.md#prompt-embeddings
    attn_state: Int32[StepArray, ""] | None = None  # jaxprep.AttnState value (docs/semantics.md#ascend-state)
    attn_mask: StepArray | None = None  # docs/semantics.md#ascend-masks, see jaxprep.features.masks
    request_distribution: Int32[StepArray, " 3"] | None = None  # [decode_end, prefill_end, mixed_end]
    drafter: DrafterTargetInputs | None = None  # the target side of an EAGLE / MTP drafter
    hybrid: HybridMetadata | None = None  # Mamba / linear-attention layers
    grammar: GrammarMetadata | None = None  # structured outputs: bitmask row of each logits row
    ubatches: MicroBatches | None = None  # dual-batch overlap: the step split into micro-batches
    lora: LoRAMetadata | None = None  # vLLM's LoRA mappings, slot indices, kernel metadata (jaxprep.features.lora)
    logits_indirection: LogitsIndirection | None = None  # V2's cu_num_logits, expanded_idx_mapping, ...
    sampling: SamplingMetadata | None = None  # every logits row's sampling parameters (jaxprep.features.sampling)

    @property
    def num_reqs_padded(self) -> int:
        return self.idx_mapping.shape[0]


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class MicroBatches:
    """`StepInputs.ubatches`: the step's micro-batches, in token order."""

    batches: tuple[StepInputs, ...]
    first_rows: StepArray  # [n] int32: the step's batch row of each micro-batch's row 0 (0 when empty)
    # vLLM's should_ubatch: the last micro-batch holds real tokens (else vLLM runs the step whole)
    should_ubatch: Bool[StepArray, ""]

    @property
    def token_starts(self) -> tuple[int, ...]:
        """The step's token index of each micro-batch's token 0 (static)."""
        starts, start = [], 0
        for batch in self.batches:
            starts.append(start)
            start += batch.num_tokens_padded
        return tuple(starts)


def _core_fields(cls) -> tuple[dataclasses.Field, ...]:
    """Fields every step has: required and not static (a feature field defaults to None)."""
    return tuple(f for f in dataclasses.fields(cls)
                 if f.default is dataclasses.MISSING and not f.metadata.get("static"))


def _dims(field: dataclasses.Field) -> tuple[str, ...]:
    """The dimension names of a field's jaxtyping annotation: ``Int32[StepArray, "a b"]`` -> ("a", "b")."""
    return tuple(re.search(r"""["']([^"']*)["']""", field.type).group(1).split())


_FIELD_DIMS: dict[str, tuple[str, ...]] = {
    **{f.name: _dims(f) for f in _core_fields(StepInputs) if f.name != "attn_metadata"},
    **{f.name: _dims(f) for f in _core_fields(AttentionMetadata)},
}
STEP_FIELDS: tuple[str, ...] = tuple(_FIELD_DIMS)
"""Names of the arrays every step has (`StepInputs` fields, then `AttentionMetadata` fields),
read from the dataclasses: the one list of a step's core fields."""
_METADATA_FIELDS = tuple(f.name for f in _core_fields(AttentionMetadata))
SCALAR_FIELDS: tuple[str, ...] = tuple(name for name in _METADATA_FIELDS if not _FIELD_DIMS[name])
"""The 0-d fields of the attention metadata: ``num_actual_tokens``, ``num_reqs``, ``max_query_len``,
``max_seq_len`` (the step's other 0-d field is its error word, ``errors``)."""
_STEP_ONLY_FIELDS = tuple(name for name in STEP_FIELDS if name not in _METADATA_FIELDS)


def step_fields(step) -> dict[str, StepArray]:
    """The `STEP_FIELDS` arrays of ``step`` (a `StepInputs`, or anything with its fields) by name;
    its optional feature outputs are left out. A step-like object without ``errors`` gives None there."""
    fields = {name: getattr(step, name, None) if name == "errors" else getattr(step, name)
              for name in _STEP_ONLY_FIELDS}
    meta = step.attn_metadata
    fields.update({name: getattr(meta, name) for name in _METADATA_FIELDS})
    return fields


def step_from_fields(fields: dict[str, StepArray], num_tokens_padded: int) -> StepInputs:
    """The inverse of `step_fields`: a `StepInputs` (no features) from its `STEP_FIELDS` arrays.

    Equal to ``StepInputs(**..., attn_metadata=AttentionMetadata(**...))``, built by `_filled`: a host
    fetch (`jaxprep.prepare.unpack_to_host`) rebuilds a step on every call, and the frozen dataclasses'
    ``__init__`` costs an ``object.__setattr__`` per field (31 of them: ~3 µs, more than the fetch).
    """
    meta = _filled(AttentionMetadata, {name: fields[name] for name in _METADATA_FIELDS})
    step = {name: fields[name] for name in _STEP_ONLY_FIELDS}
    step["attn_metadata"], step["num_tokens_padded"] = meta, num_tokens_padded
    return _filled(StepInputs, step)


_DEFAULTS = {cls: {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
             for cls in (StepInputs, AttentionMetadata)}


def _filled(cls, values: dict):
    """``cls(**values)`` for `StepInputs` or `AttentionMetadata` (frozen dataclasses with no ``__post_init__``
    and no default factory), every required field in ``values``: their defaults and ``values`` written into
    the new object's ``__dict__`` at once, which is what ``__init__`` does one field at a time."""
    obj = object.__new__(cls)
    obj.__dict__.update(_DEFAULTS[cls])
    obj.__dict__.update(values)
    return obj


def step_field_shapes(**sizes: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the `STEP_FIELDS` whose dimensions ``sizes`` all name, read from their annotations.

    ```
    # num_tokens_padded=8, num_reqs_padded=3 -> input_ids (8,), query_start_loc (4,), seq_lens (3,),
    #   num_reqs (), ... (block_table needs max_blocks_per_req too)
    ```
    """
    if "num_reqs_padded" in sizes:
        sizes["num_reqs_padded_plus_1"] = sizes["num_reqs_padded"] + 1
    return {name: tuple(sizes[d] for d in dims) for name, dims in _FIELD_DIMS.items()
            if all(d in sizes for d in dims)}

