"""One int32 buffer per step: a jitted pack on the JAX side, views on the torch side.

Instead of one DLPack capsule per field, a small jitted function concatenates the step's int32
arrays into one flat buffer; torch takes it with a single ``torch.from_dlpack`` and cuts views.
A field torch wants as int64 (``positions``, ``slot_mapping``) is written as (low, high) int32
word pairs, so its int64 view needs no cast on the torch side (JAX runs with x64 off):

    # positions [5, 7], slot_mapping [9, -1] -> words [5, 0, 7, 0, 9, 0, -1, -1]
    # words[0:4].view(int64) -> [5, 7];  words[4:8].view(int64) -> [9, -1]

The layout is a pure function of (name, shape, wide) triples, so it is static per bucket and the
same on both sides. A wide field starts at an even word, so its int64 view is 8-byte aligned.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys

import jax
import jax.numpy as jnp

from jaxprep._typing import Array, Int32
from torch_bridge._torch import torch

FieldSpec = tuple[tuple[str, bool], ...]
"""(name, wide) pairs in buffer order: the static part of a layout."""


@dataclasses.dataclass(frozen=True)
class Span:
    """Where one field lies in the packed buffer: ``offset`` in int32 words."""

    name: str
    offset: int
    shape: tuple[int, ...]
    wide: bool  # stored as int64 (two words per element)
    num_words: int


@functools.lru_cache(maxsize=512)
def layout(fields: tuple[tuple[str, tuple[int, ...], bool], ...]) -> tuple[Span, ...]:
    """Offsets of (name, shape, wide) fields laid end to end; a wide field starts at an even word.

    # (a, (3,), False), (b, (2,), True) -> a at 0 (3 words), one pad word, b at 4 (4 words)
    """
    spans, offset = [], 0
    for name, shape, wide in fields:
        offset += offset % 2 if wide else 0
        spans.append(Span(name, offset, tuple(shape), wide, math.prod(shape) * (2 if wide else 1)))
        offset += spans[-1].num_words
    return tuple(spans)


def num_packed_words(spans: tuple[Span, ...]) -> int:
    """Length of the packed buffer: the end of the last span, rounded up to even (for the int64 view)."""
    end = spans[-1].offset + spans[-1].num_words
    return end + end % 2


def layout_of(arrays: dict, spec: FieldSpec) -> tuple[Span, ...]:
    """The layout of ``arrays`` (name -> array or shape-carrying object) under ``spec``."""
    return layout(tuple((name, tuple(arrays[name].shape), wide) for name, wide in spec))


def widen(values: Int32[Array, "n"]) -> Int32[Array, "2*n"]:
    """int32 values as the little-endian words of their int64 sign extension.

    # [5, -1] -> [5, 0, -1, -1]: the high word is x >> 31 (0 or -1)
    """
    high = values >> 31
    pair = (values, high) if sys.byteorder == "little" else (high, values)
    return jnp.stack(pair, axis=-1).reshape(-1)


@functools.partial(jax.jit, static_argnames=("spec",))
def pack(arrays: dict[str, Array], spec: FieldSpec) -> Int32[Array, "num_words"]:
    """The int32 arrays named in ``spec`` concatenated in `layout` order (wide ones widened)."""
    spans = layout_of(arrays, spec)
    parts, end = [], 0
    for span in spans:
        parts.append(jnp.zeros((span.offset - end,), jnp.int32))  # alignment padding, usually empty
        flat = arrays[span.name].astype(jnp.int32).reshape(-1)
        parts.append(widen(flat) if span.wide else flat)
        end = span.offset + span.num_words
    parts.append(jnp.zeros((num_packed_words(spans) - end,), jnp.int32))
    return jnp.concatenate(parts)


def unpack(words: torch.Tensor, spans: tuple[Span, ...], base: int = 0) -> dict[str, torch.Tensor]:
    """One view of the packed buffer per span, without copying.

    ``words`` is the packed buffer or a copy of its tail, starting at layout word ``base``.
    One ``split_with_sizes`` call cuts every chunk (cheaper than a slice per field); wide
    chunks are then viewed as int64 (their word offset is even) and 2-D ones reshaped.
    """
    sizes, chunk_index = _split_plan(spans, base, words.shape[0])
    chunks = words.split_with_sizes(sizes)
    views = {}
    for span, index in zip(spans, chunk_index):
        chunk = chunks[index].view(torch.int64) if span.wide else chunks[index]
        views[span.name] = chunk if len(span.shape) == 1 else chunk.view(span.shape)
    return views


@functools.lru_cache(maxsize=512)
def _split_plan(spans: tuple[Span, ...], base: int, num_words: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Chunk sizes covering ``num_words`` words from ``base`` (gaps included), and each span's chunk.

    # spans at 0 (3 words) and 4 (4 words), 8 words -> sizes [0, 3, 1, 4, 0], chunks [1, 3]
    """
    sizes, chunk_index, end = [], [], base
    for span in spans:
        sizes.append(span.offset - end)
        chunk_index.append(len(sizes))
        sizes.append(span.num_words)
        end = span.offset + span.num_words
    sizes.append(base + num_words - end)
    return tuple(sizes), tuple(chunk_index)
