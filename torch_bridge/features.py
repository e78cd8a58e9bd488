"""A step's optional feature outputs (`jaxprep.FeatureConfig`) on the torch side.

Every feature array a step carries becomes one more named field of the bridge, named by its
path in the step, so it travels with the core fields (in the packed buffer, or as a capsule of
its own) and is rebuilt into its pytree with torch leaves:

    # step.kv_groups[1].slot_mapping  -> field "kv_groups.1.slot_mapping"
    # step.spec_decode.draft_token_ids -> field "spec_decode.draft_token_ids"
    # step.attn_metadata.dcp_local_seq_lens -> field "dcp_local_seq_lens"

torch dtypes follow vLLM: ``mrope_positions``, the fields of `INT64_FIELDS` and each micro-batch's
``positions`` int64; each group's (and micro-batch's) ``slot_mapping`` takes the kind of the step's
own ``slot_mapping`` (int64 on CPU/CUDA, int32 on the NPU); boolean masks stay bool; everything else
(block tables, spec-decode indices, ``request_distribution``, ``dcp_local_seq_lens``, the LoRA
mappings and kernel metadata, ``cu_num_logits``, ``expanded_local_pos``, the drafter, hybrid and
grammar metadata, the sampling rows' ``top_k`` and seed words) int32. A leaf that is neither int32
nor bool (the sampling rows' float32 parameters) is converted on its own.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxprep.array_packing import BOOL, INT32, INT64, FieldSpec, path_name
from torch_bridge._torch import torch
from torch_bridge.transfer import convert_leaf

STEP_FEATURES = ("spec_decode", "discard_request_mask", "kv_groups", "mrope_positions", "prompt_embeds",
                 "request_distribution", "lora", "logits_indirection", "sampling", "drafter", "hybrid", "grammar",
                 "ubatches")
"""`StepInputs` feature fields that `TorchStepInputs` carries under the same names."""
METADATA_FEATURES = ("dcp_local_seq_lens",)
"""`AttentionMetadata` feature fields that `TorchAttentionMetadata` carries under the same names."""
INT64_FIELDS = ("mrope_positions", "lora.token_lora_indices", "lora.sampler_indices", "lora.sampler_indices_padded",
                "lora.embeddings_indices", "logits_indirection.logits_indices",
                "logits_indirection.expanded_idx_mapping", "logits_indirection.logits_pos", "sampling.idx_mapping",
                "sampling.pos")
"""int64 in vLLM: ``MRotaryEmbedding`` positions; the LoRA index tensors ``convert_mapping`` builds
(torch.long); V2's ``logits_indices``, ``expanded_idx_mapping`` (``idx_mapping`` is int64) and the
positions the sampler reads (also as ``sampling.idx_mapping`` / ``sampling.pos``)."""
INT64_SUFFIXES = (".positions",)
"""A micro-batch's ``positions`` are int64, like the step's (``ubatches.batches.0.positions``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchGroupMetadata:
    """One KV-cache group (docs/semantics.md#kv-groups): its layers read these in place of the step's own."""

    block_table_tensor: torch.Tensor  # [num_reqs_padded, kernel_width] int32, in kernel blocks; pad rows 0
    slot_mapping: torch.Tensor  # [num_tokens_padded] int64 (int32 on the NPU), manager slots; pad -1
    block_size: int  # manager block size B_g of the slots
    kernel_block_size: int  # b: the block size of block_table_tensor (B_g when not expanded)


@dataclasses.dataclass(frozen=True)
class FeatureFields:
    """A step's feature arrays flattened for the bridge, and what rebuilds them."""

    arrays: dict[str, jax.Array]  # int32 and bool leaves by field name, moved by the bridge
    spec: FieldSpec  # (field name, kind) of those, in leaf order
    names: tuple[str | None, ...]  # field name of every leaf; None: converted on its own
    leaves: tuple[Any, ...]
    treedef: Any  # of {feature name: the step's value, None when off}

    @property
    def group_block_tables(self) -> tuple[str, ...]:
        return tuple(name for name in self.arrays if name.startswith("kv_groups.") and name.endswith(".block_table"))


NO_FEATURES = FeatureFields({}, (), (), (), None)
"""A step without features: the plain step's handoff skips flattening and rebuilding."""


def feature_fields(step_inputs, slot_kind: str) -> FeatureFields:
    """The feature arrays of ``step_inputs`` (any absent or None feature adds nothing)."""
    tree = {name: getattr(step_inputs, name, None) for name in STEP_FEATURES}
    tree.update({name: getattr(step_inputs.attn_metadata, name, None) for name in METADATA_FEATURES})
    if all(value is None for value in tree.values()):
        return NO_FEATURES
    leaves, treedef = jax.tree.flatten(tree)
    dtypes = tuple(leaf.dtype if isinstance(leaf, jax.Array) else None for leaf in leaves)
    names, spec = _plan(treedef, dtypes, slot_kind)
    arrays = {name: leaf for name, leaf in zip(names, leaves) if name is not None}
    return FeatureFields(arrays, spec, names, tuple(leaves), treedef)


@functools.lru_cache(maxsize=256)
def _plan(treedef, dtypes: tuple, slot_kind: str) -> tuple[tuple[str | None, ...], FieldSpec]:
    """Field name (None: not carried) of every leaf, and the spec of the carried ones; static per step shape.

    The leaves' paths come from the tree rebuilt with placeholder leaves, once per tree structure.
    """
    placeholders = jax.tree.unflatten(treedef, range(treedef.num_leaves))
    names, spec = [], []
    for (path, _), dtype in zip(jax.tree_util.tree_flatten_with_path(placeholders)[0], dtypes, strict=True):
        name = path_name(path)
        kind = _kind(name, dtype, slot_kind)
        names.append(None if kind is None else name)
        if kind is not None:
            spec.append((name, kind))
    return tuple(names), tuple(spec)


def torch_features(fields: FeatureFields, tensors: dict[str, torch.Tensor], device) -> dict[str, Any]:
    """{feature name: value with torch leaves}, for `STEP_FEATURES` and `METADATA_FEATURES` ({}: none)."""
    if fields is NO_FEATURES:
        return {}
    leaves = [convert_leaf(leaf, device) if name is None else tensors[name]
              for name, leaf in zip(fields.names, fields.leaves)]
    tree = jax.tree.unflatten(fields.treedef, leaves)
    if tree["kv_groups"] is not None:
        tree["kv_groups"] = tuple(
            TorchGroupMetadata(block_table_tensor=group.block_table, slot_mapping=group.slot_mapping,
                               block_size=group.block_size, kernel_block_size=group.kernel_block_size)
            for group in tree["kv_groups"])
    return tree


def _kind(name: str, dtype, slot_kind: str) -> str | None:
    """The packing kind of a leaf of ``dtype`` (None: not a JAX array), or None when it is not int32 or bool."""
    if dtype == jnp.bool_:
        return BOOL
    if dtype != jnp.int32:
        return None
    if name in INT64_FIELDS or (name.startswith("ubatches.") and name.endswith(INT64_SUFFIXES)):
        return INT64
    return slot_kind if name.endswith(".slot_mapping") else INT32
