"""One int32 buffer per step: a jitted pack on the JAX side, views on the torch side.

Instead of one DLPack capsule per field, a small jitted function concatenates the step's int32
arrays into one flat buffer; torch takes it with a single ``torch.from_dlpack`` and cuts views.
A field torch wants as int64 (``positions``, ``slot_mapping``) is written as (low, high) int32
word pairs, so its int64 view needs no cast on the torch side (JAX runs with x64 off):

    # positions [5, 7], slot_mapping [9, -1] -> words [5, 0, 7, 0, 9, 0, -1, -1]
    # words[0:4].view(int64) -> [5, 7];  words[4:8].view(int64) -> [9, -1]

A boolean field (``discard_request_mask``) is written as bytes, four to a word, so its torch view
is a byte view of its words, again without a copy:

    # mask [T, F, T, T, F] -> bytes [1, 0, 1, 1 | 0, 0, 0, 0] -> 2 words;  view(uint8)[:5].view(bool)

The layout is a pure function of (name, shape, kind) triples, so it is static per bucket and the
same on both sides. An int64 field starts at an even word, so its int64 view is 8-byte aligned.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxprep._typing import Array, Int32
from torch_bridge._torch import torch

INT32, INT64, BOOL = "int32", "int64", "bool"
"""Field kinds: the torch dtype a field is viewed as. Every field is int32 (or bool) on the JAX side."""

FieldSpec = tuple[tuple[str, str], ...]
"""(name, kind) pairs in buffer order: the static part of a layout."""


class Span(NamedTuple):
    """Where one field lies in the packed buffer: ``offset`` in int32 words.

    A tuple, not a dataclass: layouts are cache keys, and a tuple hashes in C.
    """

    name: str
    offset: int
    shape: tuple[int, ...]
    kind: str  # INT32 (a word per element), INT64 (two words) or BOOL (a byte)
    num_words: int


def num_words(kind: str, num_elements: int) -> int:
    """Words a field of ``kind`` takes: # 5 elements -> INT32 5, INT64 10, BOOL 2"""
    if kind == INT64:
        return 2 * num_elements
    return -(-num_elements // 4) if kind == BOOL else num_elements


@functools.lru_cache(maxsize=512)
def layout(fields: tuple[tuple[str, tuple[int, ...], str], ...]) -> tuple[Span, ...]:
    """Offsets of (name, shape, kind) fields laid end to end; an INT64 field starts at an even word.

    # (a, (3,), INT32), (b, (2,), INT64) -> a at 0 (3 words), one pad word, b at 4 (4 words)
    """
    spans, offset = [], 0
    for name, shape, kind in fields:
        if kind not in (INT32, INT64, BOOL):
            raise ValueError(f"field {name}: kind must be {INT32!r}, {INT64!r} or {BOOL!r}, got {kind!r}")
        offset += offset % 2 if kind == INT64 else 0
        spans.append(Span(name, offset, tuple(shape), kind, num_words(kind, math.prod(shape))))
        offset += spans[-1].num_words
    return tuple(spans)


def num_packed_words(spans: tuple[Span, ...]) -> int:
    """Length of the packed buffer: the end of the last span, rounded up to even (for the int64 view)."""
    end = spans[-1].offset + spans[-1].num_words
    return end + end % 2


def layout_of(arrays: dict, spec: FieldSpec) -> tuple[Span, ...]:
    """The layout of ``arrays`` (name -> array or shape-carrying object) under ``spec``."""
    return layout(tuple((name, tuple(arrays[name].shape), kind) for name, kind in spec))


def widen(values: Int32[Array, "n"]) -> Int32[Array, "2*n"]:
    """int32 values as the little-endian words of their int64 sign extension.

    # [5, -1] -> [5, 0, -1, -1]: the high word is x >> 31 (0 or -1)
    """
    high = values >> 31
    pair = (values, high) if sys.byteorder == "little" else (high, values)
    return jnp.stack(pair, axis=-1).reshape(-1)


def bytes_to_words(flags: Array) -> Int32[Array, "ceil(n/4)"]:
    """Booleans as bytes (0 or 1), four to an int32 word, in memory order.

    # [T, F, T, T, F] -> bytes [1, 0, 1, 1, 0, 0, 0, 0] -> words [0x01010001, 0] (little-endian)
    """
    flat = flags.reshape(-1).astype(jnp.uint8)
    padded = jnp.pad(flat, (0, -flat.shape[0] % 4))
    return jax.lax.bitcast_convert_type(padded.reshape(-1, 4), jnp.int32)


def _encode(array: Array, kind: str) -> Int32[Array, "num_words"]:
    if kind == BOOL:
        return bytes_to_words(array)
    flat = array.astype(jnp.int32).reshape(-1)
    return widen(flat) if kind == INT64 else flat


@functools.partial(jax.jit, static_argnames=("spec",))
def pack(arrays: dict[str, Array], spec: FieldSpec) -> Int32[Array, "num_words"]:
    """The arrays named in ``spec`` concatenated in `layout` order, each encoded as its kind."""
    spans = layout_of(arrays, spec)
    parts, end = [], 0
    for span in spans:
        parts.append(jnp.zeros((span.offset - end,), jnp.int32))  # alignment padding, usually empty
        parts.append(_encode(arrays[span.name], span.kind))
        end = span.offset + span.num_words
    parts.append(jnp.zeros((num_packed_words(spans) - end,), jnp.int32))
    return jnp.concatenate(parts)


def unpack(words: torch.Tensor, spans: tuple[Span, ...], base: int = 0) -> dict[str, torch.Tensor]:
    """One view of the packed buffer per span, without copying.

    ``words`` is the packed buffer or a copy of its tail, starting at layout word ``base``.
    One ``split_with_sizes`` call cuts every chunk (cheaper than a slice per field); INT64
    chunks are then viewed as int64 (their word offset is even), BOOL chunks as their leading
    bytes, and other than 1-D ones reshaped.
    """
    sizes, chunk_index = _split_plan(spans, base, words.shape[0])
    chunks = words.split_with_sizes(sizes)
    views = {}
    for span, index in zip(spans, chunk_index):
        chunk = chunks[index]
        if span.kind == INT64:
            chunk = chunk.view(torch.int64)
        elif span.kind == BOOL:
            chunk = chunk.view(torch.uint8)[:math.prod(span.shape)].view(torch.bool)
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
