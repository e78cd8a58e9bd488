"""What both launches of the fused step share: the static sizes they are specialised to, and small
helpers (power-of-two blocks, a lane-vector "any", the binary search of a batch row, the error-bit OR).

Triton blocks have power-of-two sizes, so a vector of ``n`` items is held in ``next_pow2(n)`` lanes and
every load and store past ``n`` is masked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxprep.bounds import BLOCK_ID_OUT_OF_RANGE, NULL_BLOCK

TOKEN_BLOCK = 128
"""Tokens (and logits rows, draft rows) per program of the token kernel; below 512 tokens a bucket
is split into 4 programs."""
MIN_TOKEN_PROGRAMS = 4
COLUMN_BLOCK = 256
"""Block-table columns one program copies per iteration."""
ROW_BLOCK = 32
"""State rows one program of the sorting row kernel ranks (a batch order on: `rows.py`)."""
MIN_ROW_PROGRAMS = 4
TOKEN_FLAGS = (BLOCK_ID_OUT_OF_RANGE, NULL_BLOCK)
"""The error bits the token kernel sets; the row kernel sets the others."""
COMPILER_PARAMS = plgpu.CompilerParams(num_warps=4, num_stages=1)


def pow2(n: int) -> int:
    """Smallest power of two >= n (Triton blocks have power-of-two sizes). # 5 -> 8, 8 -> 8, 1 -> 1"""
    return 1 << max(0, (n - 1).bit_length())


def any_lane(mask) -> jax.Array:
    """1 if any lane of ``mask`` is set, else 0 (int32: Triton reduces with max, not or)."""
    return jnp.max(mask.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The static sizes and switches both kernels are specialised to (part of the compile key).

    The switches are the features the kernels cover (`jaxprep.config.KERNEL_FEATURES`):
    ``num_speculative_tokens`` (K > 0: `SpecDecodeMetadata`), ``order`` (`FeatureConfig.batch_order`),
    ``descending_ties`` (``runner="v2"``: ties of the V2 order by descending slot) and ``indirection``
    (`LogitsIndirection`).
    """

    num_rows: int  # R = max_num_reqs, rows of the state tables
    max_model_len: int  # M, the token table's width
    width: int  # W, the block table's width
    num_tokens_padded: int  # T
    num_reqs_padded: int  # Rp = min(T, R)
    block_size: int  # B
    max_block_id: int
    num_speculative_tokens: int = 0  # K; 0: no spec decode
    order: str | None = None  # None (state-row order), "v2" or "decode_first"
    descending_ties: bool = False
    indirection: bool = False

    @classmethod
    def of(cls, state, config, num_tokens_padded: int) -> Sizes:
        features = config.features
        return cls(num_rows=config.max_num_reqs, max_model_len=config.max_model_len,
                   width=state.block_table.shape[1], num_tokens_padded=num_tokens_padded,
                   num_reqs_padded=config.num_reqs_padded(num_tokens_padded), block_size=config.block_size,
                   max_block_id=config.max_block_id, num_speculative_tokens=features.num_speculative_tokens,
                   order=features.batch_order, descending_ties=features.runner == "v2",
                   indirection=features.logits_indirection_on)

    @property
    def spec_decode(self) -> bool:
        return self.num_speculative_tokens > 0

    @property
    def logits_rows(self) -> bool:
        """Whether the step has logits rows of its own (spec decode or V2's indirection)."""
        return self.spec_decode or self.indirection

    @property
    def num_logits_padded(self) -> int:
        """``L_pad = min(T, Rp * (K + 1))`` (`jaxprep.features.spec_decode.padded_sizes`)."""
        return min(self.num_tokens_padded, self.num_reqs_padded * (self.num_speculative_tokens + 1))

    @property
    def num_drafts_padded(self) -> int:
        """``D_pad = min(T, Rp * K)``."""
        return min(self.num_tokens_padded, self.num_reqs_padded * self.num_speculative_tokens)

    @property
    def token_block(self) -> int:
        """Tokens per program: T / MIN_TOKEN_PROGRAMS rounded up to a power of 2, at most TOKEN_BLOCK.

        ```
        # T 16 -> 4, T 256 -> 64, T 8192 -> 128
        ```
        """
        return min(TOKEN_BLOCK, pow2(-(-self.num_tokens_padded // MIN_TOKEN_PROGRAMS)))

    @property
    def num_token_blocks(self) -> int:
        return -(-self.num_tokens_padded // self.token_block)

    @property
    def row_block(self) -> int:
        """State rows per program of the sorting row kernel (at least 2 lanes). # R 6 -> 2, R 256 -> 32, R 1024 -> 32"""
        return min(ROW_BLOCK, max(2, pow2(self.num_rows) // MIN_ROW_PROGRAMS))

    @property
    def num_row_programs(self) -> int:
        """Programs of the row kernel: 1 in state-row order (one scan), else one per `row_block` rows."""
        return 1 if self.order is None else -(-self.num_rows // self.row_block)


def batch_row_of(values, ends_ref, first: int, count: int):
    """The batch row owning each of ``values`` (tokens, logits rows, draft rows): the number of ends
    ``ends_ref[first + b] <= v`` (b < count), by binary search over those non-decreasing ends, clipped
    to the last row (as `jaxprep._ragged.token_request_index`). Every read lies in ``[first, first + count)``.

    ```
    # ends [2, 7, 10, 10] (query_start_loc[1:]), values [0, 1, 2, 6, 7, 9, 10, 11] -> [0, 0, 1, 1, 2, 2, 3, 3]
    ```
    """
    low = jnp.zeros(values.shape, jnp.int32)
    high = jnp.full(values.shape, count, jnp.int32)
    for _ in range(count.bit_length()):  # count + 1 answers: ceil(log2(count + 1)) halvings
        middle = jnp.minimum((low + high) // 2, count - 1)
        active = low < high
        right = active & (ends_ref[first + middle] <= values)
        low = jnp.where(right, middle + 1, low)
        high = jnp.where(active & ~right, middle, high)
    return jnp.minimum(low, count - 1)


def add_error_bits(errors_ref, seen_ref, flagged):
    """ORs bit k of `TOKEN_FLAGS` into the error word once, for each ``flagged[k] > 0``: the first
    program to raise ``seen[k]`` from 0 adds it. Triton's atomic or has no interpreter rule; max and
    add do, and this needs only them."""
    for k, flag in enumerate(flagged):
        pl.when(flag > 0)(functools.partial(add_error_bit, errors_ref, seen_ref, k))


def add_error_bit(errors_ref, seen_ref, k: int):
    before = plgpu.atomic_max(seen_ref, (jnp.int32(k),), jnp.int32(1))
    plgpu.atomic_add(errors_ref, (jnp.int32(0),), jnp.where(before == 0, jnp.int32(TOKEN_FLAGS[k]), jnp.int32(0)))


def named(body, names, **static):
    """A Pallas kernel taking its refs positionally that hands ``body`` one dict of them by ``names``."""
    def kernel(*refs):
        body(dict(zip(names, refs, strict=True)), **static)

    return kernel
