"""Torch views of a packed step: the torch side of `jaxprep.array_packing`.

`jaxprep.array_packing` lays a step's arrays out in one int32 buffer and packs them inside a jit; torch
takes the buffer with a single ``torch.from_dlpack`` and cuts one view per field here, with torch
ops (a view of a torch tensor is not a slice of a NumPy or JAX array, so `jaxprep.array_packing.unpack`
does not apply). INT64 fields become int64 views, FLOAT32 fields float32 views and BOOL fields bool views,
without a copy.
"""

from __future__ import annotations

import functools
import math

from jaxprep.array_packing import BOOL, FLOAT32, INT64, Span
from torch_bridge._torch import torch


def unpack(words: torch.Tensor, spans: tuple[Span, ...], base: int = 0) -> dict[str, torch.Tensor]:
    """One view of the packed buffer per span, without copying.

    ``words`` is the packed buffer or a copy of its tail, starting at layout word ``base``.
    One ``split_with_sizes`` call cuts every chunk (cheaper than a slice per field); INT64
    chunks are then viewed as int64 (their word offset is even), FLOAT32 chunks as float32, BOOL
    chunks as their leading bytes, and other than 1-D ones reshaped.
    """
    sizes, chunk_index = _split_plan(spans, base, words.shape[0])
    chunks = words.split_with_sizes(sizes)
    views = {}
    for span, index in zip(spans, chunk_index):
        chunk = chunks[index]
        if span.kind == INT64:
            chunk = chunk.view(torch.int64)
        elif span.kind == FLOAT32:  # the words are the values' bit patterns
            chunk = chunk.view(torch.float32)
        elif span.kind == BOOL:
            chunk = chunk.view(torch.uint8)[:math.prod(span.shape)].view(torch.bool)
        views[span.name] = chunk if len(span.shape) == 1 else chunk.view(span.shape)
    return views


@functools.lru_cache(maxsize=512)
def _split_plan(spans: tuple[Span, ...], base: int, num_words: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Chunk sizes covering ``num_words`` words from ``base`` (gaps included), and each span's chunk.

    ```
    # spans at 0 (3 words) and 4 (4 words), 8 words -> sizes [0, 3, 1, 4, 0], chunks [1, 3]
    ```
    """
    sizes, chunk_index, end = [], [], base
    for span in spans:
        sizes.append(span.offset - end)
        chunk_index.append(len(sizes))
        sizes.append(span.num_words)
        end = span.offset + span.num_words
    sizes.append(base + num_words - end)
    return tuple(sizes), tuple(chunk_index)
