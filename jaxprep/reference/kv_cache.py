"""NumPy reference of the KV-cache features (docs/semantics.md#kv-groups, #dcp, #sliding-window), for reading: kernel
block tables,
sliding windows and the DCP slot mapping.

Loops over tokens and blocks, written from the descriptions in docs/semantics.md rather than from the jitted
formulas where a more direct description exists (DCP by dealing chunks out to ranks). The oracle
of the feature tests.
"""

from __future__ import annotations

import numpy as np

from jaxprep._constants import NULL_BLOCK_ID, PAD_SLOT_ID


def kernel_block_table_reference(block_table, k: int) -> np.ndarray:
    """docs/semantics.md#kv-groups ``kernel_bt[r, c*k + j] = BT[r, c] * k + j``; the null block stays null
    (DIVERGENCES.md)."""
    block_table = np.asarray(block_table, np.int64)
    rows, width = block_table.shape
    out = np.zeros((rows, width * k), np.int64)
    for r in range(rows):
        for c in range(width):
            for j in range(k):
                block = block_table[r, c]
                out[r, c * k + j] = NULL_BLOCK_ID if block == NULL_BLOCK_ID else block * k + j
    return out


def sliding_window_reference(block_table, num_computed, sliding_window: int, block_size: int) -> np.ndarray:
    """docs/semantics.md#sliding-window (vLLM V2): columns ``< max(C - (window - 1), 0) // B`` read the null block."""
    out = np.array(block_table, np.int64)
    for r, computed in enumerate(num_computed):
        out[r, : max(int(computed) - (sliding_window - 1), 0) // block_size] = NULL_BLOCK_ID
    return out


def _dcp_owner_and_local_offset(position: int, block_size: int, world: int, interleave: int) -> tuple[int, int, int]:
    """Deals the tokens of a virtual block (``B * W`` tokens) to the ranks, ``interleave`` at a time.

    Returns (virtual block index, owning rank, index of the token among that rank's tokens of the block).
    """
    span = block_size * world
    virtual_block, offset = divmod(position, span)
    owners = [(o // interleave) % world for o in range(span)]
    owner = owners[offset]
    local = sum(1 for o in range(offset) if owners[o] == owner)
    return virtual_block, owner, local


def dcp_slot_mapping_reference(positions, token_rows, block_table, block_size: int, world: int, rank: int,
                               interleave: int) -> np.ndarray:
    """docs/semantics.md#dcp: slot of each token on ``rank``, -1 for tokens another rank stores."""
    slots = []
    for position, row in zip(positions, token_rows):
        virtual_block, owner, local = _dcp_owner_and_local_offset(int(position), block_size, world, interleave)
        slots.append(block_table[row][virtual_block] * block_size + local if owner == rank else PAD_SLOT_ID)
    return np.array(slots, np.int64)


def dcp_local_seq_lens_reference(seq_lens, block_size: int, world: int, rank: int, interleave: int) -> np.ndarray:
    """Tokens of each sequence that ``rank`` stores."""
    return np.array([sum(1 for p in range(int(n)) if _dcp_owner_and_local_offset(p, block_size, world, interleave)[1]
                         == rank) for n in seq_lens], np.int64)
