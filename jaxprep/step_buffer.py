"""A prepared step as ONE int32 buffer: `StepBuffer`, its words and the static `StepLayout` that names them.

On an NVIDIA GPU every array in or out of a jitted call costs the calling thread ~5 µs, more than the
step's own work: a step that leaves as the dozen-plus arrays of `StepInputs` pays for its count, not its
size. `prepare_buffer` (and the serving door, `jaxprep.serving.step.update_and_prepare_buffer`) pack the
step inside the jit that prepares it, so it leaves as one array; the pytree comes back as views:

- a JAX consumer takes them inside its own jit (`StepBuffer.views`: slices and bitcasts XLA fuses into
  their consumers, no dispatch of their own);
- a NumPy consumer views the fetched words (`StepBuffer.to_numpy`: one transfer, no copy per field);
- torch takes the words with one DLPack handoff and cuts its views from the layout
  (`torch_bridge.to_torch(buffer)`);
- `StepBuffer.inputs` unpacks the `StepInputs` of JAX arrays (one jitted call), equal field for field to
  `prepare_padded`'s.

The layout (`step_layout`) is a pure function of the step's pytree structure, leaf shapes and dtypes, so
it is static per configuration and bucket: it travels as the pytree's static part (no per-call cost, the
same on both sides of a jit). Every leaf is named by its path: a core field by its `STEP_FIELDS` name, a
feature field by its path in the step (``kv_groups.1.slot_mapping``, ``spec_decode.draft_token_ids``,
``dcp_local_seq_lens``). Fields lie in three regions, so that one copy of the buffer's tail brings every
value a host reads:

    device fields: input_ids, positions, logits_indices, idx_mapping, slot_mapping, block_table, then the
                   features' leaves in pytree order
    host scalars:  num_actual_tokens, num_reqs, max_query_len, max_seq_len, errors (and attn_state)
    host mirrors:  query_start_loc, seq_lens (vLLM's ``query_start_loc_cpu``, ``seq_lens_cpu``)

Kinds (`jaxprep.array_packing`) follow vLLM's dtypes, so torch's views need no cast: ``positions``, every slot
mapping, ``mrope_positions`` and the fields of `VLLM_INT64_FIELDS` INT64 (an int32 value's int64 words);
booleans BOOL; float32 leaves FLOAT32 (their bit patterns); every other int32 leaf INT32. A leaf of any
other dtype (an Ascend attention mask in float16 or bfloat16) is not packed: it travels beside the words
as one of `StepBuffer.extras`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from jaxprep.array_packing import (
    BOOL,
    FLOAT32,
    INT32,
    INT64,
    Span,
    decode,
    host_view,
    layout,
    num_packed_words,
    pack_body,
)
from jaxprep.array_packing import path_name as _path_name
from jaxprep.metadata import SCALAR_FIELDS, STEP_FIELDS, StepInputs

HOST_SCALARS = (*SCALAR_FIELDS, "errors", "attn_state")
"""0-d fields read as Python ints, in buffer order (``attn_state`` only where the feature is on)."""
HOST_MIRRORED = ("query_start_loc", "seq_lens")
"""Fields that vLLM also keeps on the host (``query_start_loc_cpu``, ``seq_lens_cpu``): last in the buffer."""
VLLM_INT64_FIELDS = ("positions", "slot_mapping", "mrope_positions", "lora.token_lora_indices",
                     "lora.sampler_indices", "lora.sampler_indices_padded", "lora.embeddings_indices",
                     "logits_indirection.logits_indices", "logits_indirection.expanded_idx_mapping",
                     "logits_indirection.logits_pos", "sampling.idx_mapping", "sampling.pos")
"""int64 in vLLM's CUDA/CPU runners: positions and slot mappings (``CommonAttentionMetadata``),
``MRotaryEmbedding`` positions, the LoRA index tensors ``convert_mapping`` builds (torch.long), V2's
``logits_indices``, ``expanded_idx_mapping`` and the positions the sampler reads."""
VLLM_INT64_SUFFIXES = (".positions", ".slot_mapping")
"""So are a micro-batch's ``positions`` and each KV-cache group's (and micro-batch's) ``slot_mapping``."""


def field_kind(name: str, dtype) -> str | None:
    """The packing kind of a step leaf named ``name`` of ``dtype``; None: not packable (an extra).

    ```
    # ("positions", int32) -> INT64; ("kv_groups.1.slot_mapping", int32) -> INT64;
    # ("discard_request_mask", bool) -> BOOL; ("sampling.temperature", float32) -> FLOAT32
    ```
    """
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return BOOL
    if dtype == np.float32:
        return FLOAT32
    if dtype != np.int32:
        return None
    return INT64 if name in VLLM_INT64_FIELDS or name.endswith(VLLM_INT64_SUFFIXES) else INT32


def leaf_name(path) -> str:
    """A step leaf's field name from its pytree path: `STEP_FIELDS` names as they are, an attention
    metadata feature without its ``attn_metadata.`` prefix, anything else its dotted path.

    ```
    # (GetAttrKey('attn_metadata'), GetAttrKey('seq_lens')) -> "seq_lens"
    # (GetAttrKey('kv_groups'), SequenceKey(1), GetAttrKey('slot_mapping')) -> "kv_groups.1.slot_mapping"
    ```
    """
    name = _path_name(path)
    return name.removeprefix("attn_metadata.")


@dataclasses.dataclass(frozen=True, eq=False)
class StepLayout:
    """Where every leaf of a step's pytree lies in its buffer (static; hashed once, compared by identity
    first: layouts come from `step_layout`'s cache)."""

    spans: tuple[Span, ...]  # buffer order: device fields, host scalars, host mirrors
    treedef: Any  # the step's pytree (StepInputs, its features, num_tokens_padded)
    leaves: tuple[tuple[str, int], ...]  # per leaf in treedef order: (field name, span index; -1 - k: extras[k])
    num_device: int  # spans[:num_device] are device fields
    num_scalars: int  # then this many host scalars, then the host mirrors

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.spans, self.treedef, self.leaves, self.num_device, self.num_scalars))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, StepLayout) and hash(self) == hash(other) and
                                 (self.spans, self.treedef, self.leaves, self.num_device, self.num_scalars)
                                 == (other.spans, other.treedef, other.leaves, other.num_device, other.num_scalars))

    @property
    def num_words(self) -> int:
        return num_packed_words(self.spans)

    @functools.cached_property
    def by_name(self) -> dict[str, Span]:
        return {span.name: span for span in self.spans}

    @property
    def num_tokens_padded(self) -> int:
        return self.placeholder_step.num_tokens_padded

    @functools.cached_property
    def placeholder_step(self):
        """The step's pytree with each leaf's index in place of the leaf (static structure, for readers)."""
        return jax.tree.unflatten(self.treedef, list(range(self.treedef.num_leaves)))

    @property
    def host_start(self) -> int:
        """First word of the host region (the scalars, then the mirrors)."""
        return self.spans[self.num_device].offset


@functools.lru_cache(maxsize=256)
def step_layout(treedef, leaf_types: tuple[tuple[tuple[int, ...], str], ...]) -> StepLayout:
    """The layout of a step with pytree ``treedef`` and leaves of (shape, dtype name) ``leaf_types``."""
    placeholder = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(placeholder)[0]]
    names = [leaf_name(path) for path in paths]
    kinds = [field_kind(name, dtype) for name, (_, dtype) in zip(names, leaf_types, strict=True)]
    index = {name: i for i, name in enumerate(names)}
    scalars = [name for name in HOST_SCALARS if name in index and kinds[index[name]] == INT32
               and leaf_types[index[name]][0] == ()]
    mirrored = [name for name in HOST_MIRRORED if name in index]
    host = set(scalars) | set(mirrored)
    core = [name for name in STEP_FIELDS if name in index and name not in host]
    device = core + [name for name, kind in zip(names, kinds) if kind is not None and name not in host
                     and name not in core]
    order = device + scalars + mirrored
    spans = layout(tuple((name, tuple(leaf_types[index[name]][0]), kinds[index[name]]) for name in order))
    position = {name: i for i, name in enumerate(order)}
    extras = [name for name, kind in zip(names, kinds) if kind is None]
    leaves = tuple((name, position[name] if name in position else -1 - extras.index(name)) for name in names)
    return StepLayout(spans=spans, treedef=treedef, leaves=leaves, num_device=len(device), num_scalars=len(scalars))


def layout_of_step(step) -> StepLayout:
    """The `StepLayout` of a step (traced, concrete, or of ShapeDtypeStructs)."""
    leaves, treedef = jax.tree.flatten(step)
    return step_layout(treedef, tuple((tuple(leaf.shape), np.dtype(leaf.dtype).name) for leaf in leaves))


@dataclasses.dataclass(frozen=True)
class StepBuffer:
    """A prepared step as one int32 buffer (``words``) and its static `StepLayout`; ``extras`` holds the
    leaves no word can carry (usually none). A pytree: pass it into a jit and read `views` there."""

    words: jax.Array  # [layout.num_words] int32
    extras: tuple  # leaves of other dtypes (an attention mask in float16 / bfloat16), in leaf order
    layout: StepLayout = dataclasses.field(metadata=dict(static=True))

    @property
    def num_tokens_padded(self) -> int:
        return self.layout.num_tokens_padded

    def views(self) -> StepInputs:
        """The step's pytree read from the words (inside a jit: slices and bitcasts fused into their
        consumers; outside one, a dispatch per field: use `inputs` there)."""
        return _rebuild(self.layout, [decode(self.words, span) for span in self.layout.spans], self.extras)

    def field(self, name: str) -> jax.Array:
        """One field by name, read from the words (traced, like `views`)."""
        return decode(self.words, self.layout.by_name[name])

    def inputs(self) -> StepInputs:
        """The `StepInputs` of JAX arrays, unpacked by one jitted call; equal to `prepare_padded`'s step."""
        return _unpack(self)

    def to_numpy(self) -> StepInputs:
        """The step as NumPy views of the fetched words (one transfer), each in its JAX dtype (an INT64
        field viewed as its int32 low words); scalars 0-d."""
        words = np.asarray(self.words)
        return _rebuild(self.layout, [host_view(words, span) for span in self.layout.spans],
                        [np.asarray(extra) for extra in self.extras])


jax.tree_util.register_dataclass(StepBuffer, data_fields=["words", "extras"], meta_fields=["layout"])


def _rebuild(layout: StepLayout, fields: list, extras) -> StepInputs:
    leaves = [fields[i] if i >= 0 else extras[-1 - i] for _, i in layout.leaves]
    return jax.tree.unflatten(layout.treedef, leaves)


@jax.jit
def _unpack(buffer: StepBuffer) -> StepInputs:
    return buffer.views()


def pack_step_body(step) -> StepBuffer:
    """``step`` (traced, inside the jit that prepares it) as its `StepBuffer`: one concatenation of its
    leaves, each encoded as its kind, in `step_layout` order."""
    lay = layout_of_step(step)
    leaves = jax.tree.leaves(step)
    arrays = {name: leaves[k] for k, (name, i) in enumerate(lay.leaves) if i >= 0}
    extras = tuple(leaves[k] for k, (_, i) in enumerate(lay.leaves) if i < 0)
    spec = tuple((span.name, span.kind) for span in lay.spans)
    return StepBuffer(words=pack_body(arrays, spec), extras=extras, layout=lay)


@functools.partial(jax.jit, static_argnames=("config", "num_tokens_padded"))
def prepare_buffer(state, config, num_tokens_padded: int) -> StepBuffer:
    """`prepare_padded`'s step as one `StepBuffer` (one array out of the call instead of a dozen)."""
    from jaxprep.prepare import prepare_body

    return pack_step_body(prepare_body(state, config, num_tokens_padded))


def mismatched_fields(buffer: StepBuffer, step: StepInputs) -> list[str]:
    """The field names where ``buffer``'s views differ from ``step`` (host compare; [] when equal)."""
    ours = jax.tree_util.tree_leaves_with_path(buffer.to_numpy())
    theirs = jax.tree.leaves(step)
    return [leaf_name(path) for (path, a), b in zip(ours, theirs, strict=True)
            if np.asarray(a).dtype != np.asarray(b).dtype or not np.array_equal(np.asarray(a), np.asarray(b))]


__all__ = ["HOST_MIRRORED", "HOST_SCALARS", "StepBuffer", "StepLayout", "VLLM_INT64_FIELDS", "field_kind",
           "layout_of_step", "pack_step_body", "prepare_buffer", "step_layout"]
