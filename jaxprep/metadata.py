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
    """vLLM's ``CommonAttentionMetadata`` fields, padded to static shapes.

    Attributes:
      query_start_loc: ``[num_reqs_padded + 1]``, where each request's tokens start in the batch; padded
        entries repeat ``num_actual_tokens``.
      seq_lens: ``[num_reqs_padded]``, ``num_computed + num_scheduled`` of each request; pad 0.
      slot_mapping: ``[num_tokens_padded]``, each token's KV-cache slot, ``block * block_size + offset``;
        pad -1 (``PAD_SLOT_ID``).
      block_table: ``[num_reqs_padded, max_blocks_per_req]``, each request's block ids, rows in batch
        order; pad 0 (the null block).
      num_actual_tokens: 0-d, the scheduled tokens, unpadded.
      num_reqs: 0-d, the requests in the batch, unpadded.
      max_query_len: 0-d, the most tokens one request schedules.
      max_seq_len: 0-d, the largest of ``seq_lens``.
      dcp_local_seq_lens: ``[num_reqs_padded]``, this rank's share of ``seq_lens`` under decode context
        parallelism (docs/semantics.md#dcp); pad 0. ``None`` without DCP.
    """

    query_start_loc: Int32[StepArray, " num_reqs_padded_plus_1"]
    seq_lens: Int32[StepArray, " num_reqs_padded"]
    slot_mapping: Int32[StepArray, " num_tokens_padded"]
    block_table: Int32[StepArray, "num_reqs_padded max_blocks_per_req"]
    num_actual_tokens: Int32[StepArray, ""]
    num_reqs: Int32[StepArray, ""]
    max_query_len: Int32[StepArray, ""]
    max_seq_len: Int32[StepArray, ""]
    dcp_local_seq_lens: Int32[StepArray, " num_reqs_padded"] | None = None


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Model inputs of one step, padded to the step's token bucket (``num_tokens_padded``) and
    ``num_reqs_padded = min(num_tokens_padded, max_num_reqs)`` batch rows.

    The first six fields are every step's; each optional feature's field (`jaxprep.FeatureConfig`) is
    ``None`` (an empty pytree node) when the feature is off.

    Attributes:
      input_ids: ``[num_tokens_padded]``, each scheduled token's id; pad 0.
      positions: ``[num_tokens_padded]``, each token's position in its request; pad 0.
      logits_indices: ``[num_reqs_padded]``, the last scheduled token of each request (the row the
        sampler reads); pad 0.
      idx_mapping: ``[num_reqs_padded]``, the `BatchState` row of each batch row (vLLM V2's name); pad -1.
      attn_metadata: `AttentionMetadata`, what the attention backend reads.
      errors: 0-d, bit flags of the bounds the input broke, 0 if none (`jaxprep.validate` names them).
      num_tokens_padded: the step's token bucket (static: part of the compile key).
      spec_decode: `SpecDecodeMetadata`: draft counts, draft ids, target and bonus logits rows
        (docs/semantics.md#spec-decode).
      discard_request_mask: ``[num_reqs_padded]`` bool, True for a request whose sample is discarded (a
        prefill chunk that stops short of its tokens; docs/semantics.md#logits-indices); pad True.
      kv_groups: one `KVGroupMetadata` per KV-cache group: its block table and slot mapping
        (docs/semantics.md#kv-groups).
      mrope_positions: ``[3, num_tokens_padded]``, M-RoPE's temporal, height and width positions
        (docs/semantics.md#m-rope); pad 0.
      prompt_embeds: `PromptEmbedsMetadata`: which tokens read a prompt embedding instead of an id
        (docs/semantics.md#prompt-embeddings).
      attn_state: 0-d, a `jaxprep.AttnState` value, vllm-ascend's state ladder
        (docs/semantics.md#ascend-state).
      attn_mask: vllm-ascend's attention mask, compressed or one row per token
        (docs/semantics.md#ascend-masks; `jaxprep.features.masks`).
      request_distribution: ``[3]``, ``[decode_end, prefill_end, mixed_end]`` of a decode-first batch.
      drafter: the target side of an EAGLE / MTP drafter (`jaxprep.features.drafter`).
      hybrid: Mamba / linear-attention metadata (`jaxprep.features.hybrid`).
      grammar: structured outputs: the bitmask row of each logits row (`jaxprep.features.grammar`).
      ubatches: `MicroBatches`, the step split for dual-batch overlap.
      lora: vLLM's LoRA mappings, slot indices and kernel metadata (`jaxprep.features.lora`).
      logits_indirection: model runner V2's logits rows (``cu_num_logits``, ``expanded_idx_mapping``, ...).
      sampling: every logits row's sampling parameters (`jaxprep.features.sampling`).
    """

    input_ids: Int32[StepArray, " num_tokens_padded"]
    positions: Int32[StepArray, " num_tokens_padded"]
    logits_indices: Int32[StepArray, " num_reqs_padded"]
    idx_mapping: Int32[StepArray, " num_reqs_padded"]
    attn_metadata: AttentionMetadata
    errors: Int32[StepArray, ""]
    num_tokens_padded: int = dataclasses.field(metadata=dict(static=True))
    # optional features (jaxprep.FeatureConfig): None (an empty pytree node) when off
    spec_decode: SpecDecodeMetadata | None = None
    discard_request_mask: Bool[StepArray, " num_reqs_padded"] | None = None
    kv_groups: tuple[KVGroupMetadata, ...] | None = None
    mrope_positions: Int32[StepArray, "3 num_tokens_padded"] | None = None
    prompt_embeds: PromptEmbedsMetadata | None = None
    attn_state: Int32[StepArray, ""] | None = None
    attn_mask: StepArray | None = None
    request_distribution: Int32[StepArray, " 3"] | None = None
    drafter: DrafterTargetInputs | None = None
    hybrid: HybridMetadata | None = None
    grammar: GrammarMetadata | None = None
    ubatches: MicroBatches | None = None
    lora: LoRAMetadata | None = None
    logits_indirection: LogitsIndirection | None = None
    sampling: SamplingMetadata | None = None

    @property
    def num_reqs_padded(self) -> int:
        """Batch rows of the step: ``min(num_tokens_padded, max_num_reqs)``."""
        return self.idx_mapping.shape[0]


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class MicroBatches:
    """`StepInputs.ubatches`: the step's micro-batches, in token order.

    Attributes:
      batches: each micro-batch as a `StepInputs` of its own.
      first_rows: ``[n]`` int32, the step's batch row of each micro-batch's row 0 (0 when empty).
      should_ubatch: 0-d bool, vLLM's ``should_ubatch``: the last micro-batch holds real tokens (else
        vLLM runs the step whole).
    """

    batches: tuple[StepInputs, ...]
    first_rows: StepArray
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

