"""What the bridge checks before it moves anything: a device it can target, named in its own words,
and a step whose fields agree with each other (one bucket, one configuration).

A step is usually `prepare_inputs`' output, whose fields agree by construction. One assembled by
hand (``dataclasses.replace`` of fields from two steps, a relabelled ``num_tokens_padded``) would
otherwise be bridged as it is, and the model would read one bucket's tokens with another's slots.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np

from jaxprep.metadata import AttentionMetadata, StepInputs, step_field_shapes
from torch_bridge._torch import torch

DEVICE_TYPES = ("cpu", "cuda", "npu")
_DEVICE_STRING = re.compile(r"^(cpu|cuda|npu)(:(\d+))?$")


def check_device(function: str, device) -> None:
    """``device`` is None, ``"cpu"``, ``"cuda[:N]"`` or ``"npu[:N]"`` (or a torch.device of those
    types), and a CUDA device is one torch sees; raises ValueError naming the device otherwise.

    ```
    # "bogus", "CPU", "meta", 3 -> ValueError naming it; "cuda:1" on a one-GPU host -> ValueError
    ```
    """
    if device is None:
        return
    if isinstance(device, str) and _DEVICE_STRING.match(device):
        match = _DEVICE_STRING.match(device)
        kind, index = match[1], None if match[3] is None else int(match[3])
    elif isinstance(device, (str, torch.device)):
        try:
            parsed = torch.device(device)
        except RuntimeError:
            lower = f" (lower case: {device.lower()!r})" if _DEVICE_STRING.match(device.lower()) else ""
            raise ValueError(f"{function}: device {device!r} is not a device torch_bridge can target{lower}: "
                             "give 'cpu', 'cuda', 'cuda:N', 'npu', 'npu:N' or a torch.device of those types") from None
        kind, index = parsed.type, parsed.index
    else:
        hint = f" (a CUDA ordinal? give 'cuda:{device}')" if isinstance(device, int) else ""
        raise ValueError(f"{function}: device {device!r} is not a device torch_bridge can target{hint}: give "
                         "'cpu', 'cuda', 'cuda:N', 'npu', 'npu:N' or a torch.device of those types")
    if kind not in DEVICE_TYPES:
        raise ValueError(f"{function}: device {device!r} is not one torch_bridge can target: a {kind} tensor "
                         f"{'holds no data' if kind == 'meta' else 'is not supported'}; give cpu, cuda or npu")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{function}: device {device!r}: torch sees no CUDA device "
                             "(torch.cuda.is_available() is False)")
        if index is not None and index >= count:
            raise ValueError(f"{function}: device {device!r}: torch sees {count} CUDA device(s), "
                             f"cuda:0..cuda:{count - 1}")


def check_consistent(function: str, step_inputs, arrays: dict) -> dict[str, int]:
    """The step's core fields have the shapes of one bucket and one configuration: every per-token
    field ``num_tokens_padded`` entries, every per-request field the same ``num_reqs_padded`` (read
    from ``logits_indices``), the block table ``max_blocks_per_req`` columns (read from itself).
    Raises ValueError naming the first field that disagrees; returns the sizes it read.

    ```
    # num_tokens_padded 16 but input_ids (8,) -> "input_ids has shape (8,), ... needs (16,)"
    ```
    """
    tokens_padded = step_inputs.num_tokens_padded
    if isinstance(tokens_padded, bool) or not isinstance(tokens_padded, (int, np.integer)):
        raise TypeError(f"{function}: num_tokens_padded must be an int, got {type(tokens_padded).__name__}")
    shapes = {name: tuple(np.shape(value)) for name, value in arrays.items()}
    block_table = shapes.get("block_table_tensor", ())
    sizes = dict(num_tokens_padded=int(tokens_padded), num_reqs_padded=(shapes["logits_indices"] or (0,))[0],
                 max_blocks_per_req=block_table[1] if len(block_table) == 2 else -1)
    expected = step_field_shapes(**sizes)
    expected["block_table_tensor"] = expected.pop("block_table")
    for name, shape in expected.items():
        if shapes.get(name) != shape:
            raise ValueError(
                f"{function}: the step's fields disagree: {name} has shape {shapes.get(name)}, but "
                f"num_tokens_padded={sizes['num_tokens_padded']} and num_reqs_padded={sizes['num_reqs_padded']} "
                f"(from logits_indices) need {shape}: fields from two buckets or two configs, or a relabelled "
                "num_tokens_padded? Bridge the step prepare_inputs returned, as it is")
    return sizes


def check_features(function: str, step_inputs, sizes: dict[str, int], treedef, leaves) -> None:
    """The step's feature arrays (``leaves`` of ``{feature name: value}``, `torch_bridge.features`) belong to
    its bucket, as its core fields do: each dimension its field's annotation names after the step's sizes
    (``num_tokens_padded``, ``num_reqs_padded``, ``num_reqs_padded_plus_1``) or a number has that size; the
    logits and draft rows (``num_logits_padded``, ``num_drafts_padded``) are ``min(T, R * (K + 1))`` and
    ``min(T, R * K)`` for one K in every feature (`jaxprep.features.spec_decode.padded_sizes`); each
    micro-batch's core fields are consistent and their tokens add up to the step's. Raises ValueError naming
    the first field that disagrees.

    ```
    # a bucket-8 step carrying a bucket-16 step's spec_decode -> "spec_decode.logits_indices has shape (12,) ..."
    ```
    """
    shapes = tuple(tuple(leaf.shape) if hasattr(leaf, "shape") else None for leaf in leaves)
    _check_feature_shapes(function, treedef, shapes, sizes["num_tokens_padded"], sizes["num_reqs_padded"])
    ubatches = getattr(step_inputs, "ubatches", None)
    if ubatches is not None:
        total = sum(batch.num_tokens_padded for batch in ubatches.batches)
        if total != sizes["num_tokens_padded"]:
            raise ValueError(f"{function}: the step's fields disagree: its micro-batches hold {total} tokens, the step "
                             f"num_tokens_padded={sizes['num_tokens_padded']}: a micro-batch split of another bucket")
        for batch in ubatches.batches:
            check_consistent(function, batch, _core(batch))


@functools.lru_cache(maxsize=512)
def _check_feature_shapes(function: str, treedef, shapes: tuple, tokens: int, reqs: int) -> None:
    """`check_features` on the leaves' shapes (static per bucket and configuration: cached, so a step of a
    shape seen before costs one tuple of shapes and a lookup; a refusal raises and is not cached)."""
    sizes = dict(num_tokens_padded=tokens, num_reqs_padded=reqs)
    step = {"num_tokens_padded": tokens, "num_reqs_padded": reqs, "num_reqs_padded_plus_1": reqs + 1}
    logit_rows = []  # (field, shape, dimension, size) of every logits / drafts dimension
    for (name, dims), shape in zip(feature_dims(treedef), shapes, strict=True):
        if dims is None or shape is None:
            continue
        if len(dims) != len(shape):
            _disagree(function, name, shape, f"dimensions are ({', '.join(dims)})", sizes)
        for dim, size in zip(dims, shape):
            if dim in LOGIT_DIMS:
                logit_rows.append((name, shape, dim, size))
            elif dim.isdigit() or dim in step:  # else a size of the configuration (a KV group's kernel width, ...)
                expected = int(dim) if dim.isdigit() else step[dim]
                if size != expected:
                    _disagree(function, name, shape, f"{dim} is {expected}", sizes)
    _check_logit_rows(function, logit_rows, sizes)


LOGIT_DIMS = ("num_logits_padded", "num_drafts_padded")
"""Feature dimensions that follow the bucket through the drafts per request, K (one K for the whole step)."""


def _check_logit_rows(function: str, logit_rows: list, sizes: dict[str, int]) -> None:
    """Each logits / drafts dimension is ``min(T, R (K + 1))`` / ``min(T, R K)`` for some K >= 0, the same K
    for all: the first field that fits no K, or none that the fields before it fit, is named.

    ```
    # T 8, R 4: logits 8 and drafts 8 fit K >= 2; logits 12 fits no K (more rows than tokens)
    ```
    """
    tokens, reqs = sizes["num_tokens_padded"], max(sizes["num_reqs_padded"], 1)
    candidates = range(tokens // reqs + 2)  # past it every K gives min(T, ...) = T
    common = set(candidates)
    for name, shape, dim, size in logit_rows:
        fits = {k for k in candidates if size == min(tokens, reqs * (k + 1 if dim == "num_logits_padded" else k))}
        if not fits & common:
            why = "fits no number of drafts per request K" if not fits else "disagrees with the fields before it"
            _disagree(function, name, shape, f"{dim} (min(T, R * (K + 1)) logits rows, min(T, R * K) draft rows) "
                      f"{why}", sizes)
        common &= fits


def _disagree(function: str, name: str, shape: tuple, why: str, sizes: dict[str, int]):
    raise ValueError(f"{function}: the step's fields disagree: {name} has shape {shape}, but its {why} at "
                     f"num_tokens_padded={sizes['num_tokens_padded']} and num_reqs_padded={sizes['num_reqs_padded']}: "
                     "a feature from another bucket or config? Bridge the step prepare_inputs returned, as it is")


def _core(step) -> dict:
    from jaxprep.metadata import step_fields

    arrays = step_fields(step)
    arrays["block_table_tensor"] = arrays.pop("block_table")
    return arrays


class _Leaf:
    """A placeholder leaf: its place in the flattened tree (never mistaken for a static int field)."""

    def __init__(self, index: int):
        self.index = index


@functools.lru_cache(maxsize=256)
def feature_dims(treedef) -> tuple[tuple[str, tuple[str, ...] | None], ...]:
    """Per leaf of a features tree: its path name and the dimension names its dataclass field declares
    (``Int32[StepArray, " num_logits_padded"]`` -> ("num_logits_padded",)); None where none is declared
    (a micro-batch's fields, which follow its own sizes, `check_features` checks apart)."""
    out: list = [None] * treedef.num_leaves

    def walk(node, path: str, dims):
        if isinstance(node, _Leaf):
            out[node.index] = (path, dims)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                inside = None if path.startswith("ubatches") else _declared_dims(field.type)
                walk(getattr(node, field.name), f"{path}.{field.name}", inside)
        elif isinstance(node, (tuple, list)):
            for i, item in enumerate(node):
                walk(item, f"{path}.{i}", None)
        elif isinstance(node, dict):  # the features tree: {StepInputs (or AttentionMetadata) field: value}
            for key, item in node.items():
                walk(item, str(key), _declared_dims(_STEP_ANNOTATIONS.get(key)))

    walk(jax.tree.unflatten(treedef, [_Leaf(i) for i in range(treedef.num_leaves)]), "", None)
    return tuple((path, dims) for path, dims in out)


_STEP_ANNOTATIONS = {f.name: f.type for cls in (AttentionMetadata, StepInputs) for f in dataclasses.fields(cls)}
_DIMS = re.compile(r"""StepArray,\s*["']([^"']*)["']""")


def _declared_dims(annotation) -> tuple[str, ...] | None:
    match = _DIMS.search(annotation) if isinstance(annotation, str) else None
    return tuple(match.group(1).split()) if match else None


def as_jax(name: str, value) -> jax.Array:
    """A step field as a `jax.Array`: itself, or a NumPy array (a `jaxprep.prepare_to_host` step)
    placed on JAX's CPU device, from where DLPack hands it to torch; anything else raises naming the field."""
    if isinstance(value, jax.Array):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        if value.dtype.kind not in "iub":
            raise TypeError(f"step field {name} holds {value.dtype} values; a step's fields are int32 (or bool)")
        return jax.device_put(value, jax.devices("cpu")[0])
    raise TypeError(f"step field {name} is a {type(value).__name__}; expected a jax.Array (prepare_inputs) or a "
                    "NumPy array (prepare_to_host)")
