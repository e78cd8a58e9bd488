"""One host-to-device transfer per step: every int32 leaf of a `StepUpdates` in one flat buffer.

The layout (leaf order and shapes) is fixed by the `ServingConfig`, so it is static inside the jit
and the split back into leaves is free slicing (PEERS §4 "Copy" 1).
# leaves rows [4], token_ids [4, 8] -> blob [36]: blob[0:4] -> rows, blob[4:36].reshape(4, 8) -> token_ids
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxprep.serving.config import ServingConfig
from jaxprep.serving.state import StepUpdates


@functools.lru_cache(maxsize=16)
def _layout(config: ServingConfig):
    leaves, treedef = jax.tree_util.tree_flatten(StepUpdates.build(config))
    return treedef, tuple(leaf.shape for leaf in leaves)


def packed_size(config: ServingConfig) -> int:
    return sum(int(np.prod(shape)) for shape in _layout(config)[1])


def pack_updates(updates: StepUpdates) -> np.ndarray:
    """The leaves of ``updates`` (host arrays), raveled and concatenated: [packed_size] int32."""
    return np.concatenate([np.ravel(leaf) for leaf in jax.tree_util.tree_leaves(updates)]).astype(np.int32, copy=False)


def unpack_updates(blob: jax.Array, config: ServingConfig) -> StepUpdates:
    """Inverse of `pack_updates`, for use inside a jitted function (static slices and reshapes)."""
    treedef, shapes = _layout(config)
    leaves, offset = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        leaves.append(blob[offset: offset + size].reshape(shape))
        offset += size
    return jax.tree_util.tree_unflatten(treedef, leaves)
