"""One host-to-device transfer per step: every int32 leaf of a `StepUpdates` in one flat buffer.

The layout (`jaxprep.packing`, one ``INT32`` span per leaf, named by its path) is fixed by the
`ServingConfig`, so it is static inside the jit and the split back into leaves is free slicing
(docs/semantics.md#peer-lessons, item 1 of "What jaxprep takes from them").
# leaves rows [4], token_ids [4, 8] -> blob [36]: blob[0:4] -> rows, blob[4:36].reshape(4, 8) -> token_ids
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxprep.packing import INT32, Span, layout, num_packed_words, pack_host, path_name, unpack
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.state import StepUpdates


@functools.lru_cache(maxsize=64)
def _spans(treedef, shapes: tuple[tuple[int, ...], ...]) -> tuple[Span, ...]:
    """The layout of a `StepUpdates` of this structure and these leaf shapes."""
    placeholders = jax.tree_util.tree_unflatten(treedef, range(len(shapes)))
    names = [path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(placeholders)[0]]
    return layout(tuple((name, shape, INT32) for name, shape in zip(names, shapes, strict=True)))


def _layout(config: ServingConfig):
    leaves, treedef = jax.tree_util.tree_flatten(StepUpdates.build(config))
    return treedef, _spans(treedef, tuple(leaf.shape for leaf in leaves))


def packed_size(config: ServingConfig) -> int:
    return num_packed_words(_layout(config)[1])


def pack_updates(updates: StepUpdates) -> np.ndarray:
    """The leaves of ``updates`` (host arrays), raveled and concatenated: [packed_size] int32."""
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    spans = _spans(treedef, tuple(leaf.shape for leaf in leaves))
    return pack_host({span.name: leaf for span, leaf in zip(spans, leaves, strict=True)}, spans)


def unpack_updates(blob: jax.Array, config: ServingConfig) -> StepUpdates:
    """Inverse of `pack_updates`, for use inside a jitted function (static slices and reshapes)."""
    treedef, spans = _layout(config)
    views = unpack(blob, spans)
    return jax.tree_util.tree_unflatten(treedef, [views[span.name] for span in spans])
