"""`BatchState`: the persistent per-request tables one step is prepared from.

Rows are request slots (vLLM's persistent batch rows). A row with ``num_scheduled_tokens == 0``
takes no part in the step; the step's batch is the rows with work, in row order.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jaxprep._typing import Array, Int32

from jaxprep._constants import NULL_BLOCK_ID
from jaxprep.config import PrepConfig

INT32 = np.dtype(np.int32)


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class BatchState:
    """Immutable pytree of the batch tables; every field is a device array."""

    token_ids: Int32[Array, "max_num_reqs max_model_len"]  # prompt, then outputs, then drafts
    block_table: Int32[Array, "max_num_reqs max_blocks_per_req"]  # 0 = null block past num_blocks
    num_computed_tokens: Int32[Array, "max_num_reqs"]  # tokens whose KV is already cached
    num_scheduled_tokens: Int32[Array, "max_num_reqs"]  # tokens to run this step; 0 = not in the batch

    @classmethod
    def empty(cls, config: PrepConfig) -> BatchState:
        """All-zero tables: no tokens, null blocks, nothing computed or scheduled."""
        rows = config.max_num_reqs
        return cls(
            token_ids=jnp.zeros((rows, config.max_model_len), jnp.int32),
            block_table=jnp.full((rows, config.max_blocks_per_req), NULL_BLOCK_ID, jnp.int32),
            num_computed_tokens=jnp.zeros((rows,), jnp.int32),
            num_scheduled_tokens=jnp.zeros((rows,), jnp.int32),
        )

    @classmethod
    def from_numpy(cls, *, token_ids, block_table, num_computed_tokens, num_scheduled_tokens) -> BatchState:
        """Builds a state from host arrays (any integer dtype whose values fit int32).

        Shapes are checked for consistency with each other; `jaxprep.validate` checks them
        against a `PrepConfig`.
        """
        host = {
            "token_ids": _as_int32(token_ids, "token_ids", ndim=2),
            "block_table": _as_int32(block_table, "block_table", ndim=2),
            "num_computed_tokens": _as_int32(num_computed_tokens, "num_computed_tokens", ndim=1),
            "num_scheduled_tokens": _as_int32(num_scheduled_tokens, "num_scheduled_tokens", ndim=1),
        }
        rows = host["token_ids"].shape[0]
        for name, array in host.items():
            if array.shape[0] != rows:
                raise ValueError(f"BatchState.{name} has {array.shape[0]} rows, but token_ids has {rows}")
        return cls(**jax.device_put(host))

    def to_numpy(self) -> dict[str, np.ndarray]:
        """Host copies of every field, by name."""
        return {f.name: np.asarray(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _as_int32(value, name: str, *, ndim: int) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != ndim:
        raise ValueError(f"BatchState.{name} must be {ndim}-D, got shape {array.shape}")
    if array.dtype == INT32:
        return array
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"BatchState.{name} must hold integers, got dtype {array.dtype}")
    info = np.iinfo(INT32)
    if array.size and (array.min() < info.min or array.max() > info.max):
        raise ValueError(f"BatchState.{name} has values outside int32 [{info.min}, {info.max}]")
    return array.astype(INT32)
