"""Many named arrays in one int32 buffer: a static layout, a pack that runs inside jit, slices back.

One transfer (or one DLPack capsule) instead of one per array: a step fetched to the host
(`jaxprep.prepare.prepare_to_host`), a step's state updates sent to the device
(`jaxprep.serving.update_packing`) and a step handed to torch (`torch_bridge`) all use this layout.
The layout is a pure function of (name, shape, kind) triples, so it is static per bucket and the
same on both sides of a transfer. Field kinds say how a field is stored and viewed:

- ``INT32``: one word per element;
- ``INT64``: an int32 value as the (low, high) words of its int64 sign extension, so an int64
  view needs no cast (JAX runs with x64 off); it starts at an even word, 8-byte aligned:

  ```
  # positions [5, 7], slot_mapping [9, -1] -> words [5, 0, 7, 0, 9, 0, -1, -1]
  # words[0:4].view(int64) -> [5, 7];  words[4:8].view(int64) -> [9, -1]
  ```

- ``BOOL``: bytes, four to a word, so a bool view is a byte view of its words:

  ```
  # mask [T, F, T, T, F] -> bytes [1, 0, 1, 1 | 0, 0, 0, 0] -> 2 words;  view(uint8)[:5].view(bool)
  ```

- ``FLOAT32``: a float32 value's bit pattern, one word per element (a bitcast both ways, never a
  conversion):

  ```
  # [1.0, -0.5] -> words [0x3F800000, 0xBF000000]
  ```

`unpack` cuts NumPy (any kind) or traced JAX (``INT32``) buffers by slicing; `decode` reads a field of
any kind back inside a jit (a slice, and for the other kinds a bitcast or a strided slice, which XLA
fuses into its consumer); torch cuts its views with its own ops (`torch_bridge.array_views.unpack`), since
a torch view is not a slice of either.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._typing import Array, Bool, Int32

INT32, INT64, BOOL, FLOAT32 = "int32", "int64", "bool", "float32"
"""Field kinds: the dtype a field is viewed as. On the JAX side a field is int32 (INT32, INT64), bool
or float32."""
KINDS = (INT32, INT64, BOOL, FLOAT32)

FieldSpec = tuple[tuple[str, str], ...]
"""(name, kind) pairs in buffer order: the static part of a layout."""


class Span(NamedTuple):
    """Where one field lies in the packed buffer: ``offset`` in int32 words.

    A tuple, not a dataclass: layouts are cache keys, and a tuple hashes in C.
    """

    name: str
    offset: int
    shape: tuple[int, ...]
    kind: str  # INT32 (a word per element), INT64 (two words), BOOL (a byte) or FLOAT32 (a word of bits)
    num_words: int


def num_words(kind: str, num_elements: int) -> int:
    """Words a field of ``kind`` takes: # 5 elements -> INT32 5, INT64 10, BOOL 2, FLOAT32 5"""
    if kind == INT64:
        return 2 * num_elements
    return -(-num_elements // 4) if kind == BOOL else num_elements


@functools.lru_cache(maxsize=512)
def layout(fields: tuple[tuple[str, tuple[int, ...], str], ...]) -> tuple[Span, ...]:
    """Offsets of (name, shape, kind) fields laid end to end; an INT64 field starts at an even word.

    ```
    # (a, (3,), INT32), (b, (2,), INT64) -> a at 0 (3 words), one pad word, b at 4 (4 words)
    ```
    """
    spans, offset = [], 0
    for name, shape, kind in fields:
        if kind not in KINDS:
            raise ValueError(f"field {name}: kind must be one of {KINDS}, got {kind!r}")
        offset += offset % 2 if kind == INT64 else 0
        spans.append(Span(name, offset, tuple(shape), kind, num_words(kind, math.prod(shape))))
        offset += spans[-1].num_words
    return tuple(spans)


def num_packed_words(spans: tuple[Span, ...]) -> int:
    """Length of the packed buffer: the end of the last span, rounded up to even (for an int64 view)."""
    end = spans[-1].offset + spans[-1].num_words
    return end + end % 2


def layout_of(arrays: dict, spec: FieldSpec) -> tuple[Span, ...]:
    """The layout of ``arrays`` (name -> array or shape-carrying object) under ``spec``."""
    return layout(tuple((name, tuple(arrays[name].shape), kind) for name, kind in spec))


def path_name(path) -> str:
    """A pytree leaf's path as a field name.

    ```
    # (DictKey('kv_groups'), SequenceKey(1), GetAttrKey('slot_mapping')) -> "kv_groups.1.slot_mapping"
    ```
    """
    parts = []
    for key in path:
        for attribute in ("key", "idx", "name"):
            if hasattr(key, attribute):
                parts.append(str(getattr(key, attribute)))
                break
    return ".".join(parts)


def widen(values: Int32[Array, " n"]) -> Int32[Array, " 2*n"]:
    """int32 values as the words of their int64 sign extension, in memory order.

    ```
    # [5, -1] -> [5, 0, -1, -1] (little-endian): the high word is x >> 31 (0 or -1)
    ```
    """
    high = values >> 31
    pair = (values, high) if sys.byteorder == "little" else (high, values)
    return jnp.stack(pair, axis=-1).reshape(-1)


def bytes_to_words(flags: Bool[Array, " *shape"]) -> Int32[Array, " num_words"]:
    """Booleans as bytes (0 or 1), four to an int32 word, in memory order.

    ```
    # [T, F, T, T, F] -> bytes [1, 0, 1, 1, 0, 0, 0, 0] -> words [0x01010001, 0] (little-endian)
    ```
    """
    flat = flags.reshape(-1).astype(jnp.uint8)
    padded = jnp.pad(flat, (0, -flat.shape[0] % 4))
    return jax.lax.bitcast_convert_type(padded.reshape(-1, 4), jnp.int32)


def _encode(array: Array, kind: str) -> Int32[Array, " num_words"]:
    if kind == BOOL:
        return bytes_to_words(array)
    if kind == FLOAT32:
        return jax.lax.bitcast_convert_type(array.astype(jnp.float32), jnp.int32).reshape(-1)
    flat = array.astype(jnp.int32).reshape(-1)
    return widen(flat) if kind == INT64 else flat


def pack_body(arrays: dict[str, Array], spec: FieldSpec) -> Int32[Array, " num_words"]:
    """The arrays named in ``spec`` concatenated in `layout` order, each encoded as its kind (traced)."""
    spans = layout_of(arrays, spec)
    parts, end = [], 0
    for span in spans:
        parts.append(jnp.zeros((span.offset - end,), jnp.int32))  # alignment padding, usually empty
        parts.append(_encode(arrays[span.name], span.kind))
        end = span.offset + span.num_words
    parts.append(jnp.zeros((num_packed_words(spans) - end,), jnp.int32))
    return jnp.concatenate(parts)


pack = jax.jit(pack_body, static_argnames=("spec",))
pack.__doc__ = """`pack_body` as one small executable per layout (what torch_bridge calls on a prepared step)."""


def pack_host(arrays: dict[str, np.ndarray], spans: tuple[Span, ...]) -> np.ndarray:
    """`pack_body` on the host, for ``INT32`` spans: [num_packed_words] int32 NumPy words.

    ```
    # {rows: [4], token_ids: [4, 8]} -> 36 words: rows at 0, token_ids at 4 (raveled)
    ```
    """
    parts, end = [], 0
    for span in spans:
        if span.kind != INT32:
            raise ValueError(f"pack_host packs INT32 fields only; {span.name} is {span.kind}")
        if span.offset > end:
            parts.append(np.zeros(span.offset - end, np.int32))
        parts.append(np.ravel(arrays[span.name]))
        end = span.offset + span.num_words
    parts.append(np.zeros(num_packed_words(spans) - end, np.int32))
    return np.concatenate(parts).astype(np.int32, copy=False)


def unpack(words, spans: tuple[Span, ...]) -> dict:
    """One slice of ``words`` per span, shaped as the field (0-d for a scalar); no copy.

    ``words`` is a NumPy array (any kind: ``INT64`` and ``BOOL`` spans are viewed as int64 and
    bool) or a traced JAX array (``INT32`` spans: free slicing inside a jit).
    """
    views = {}
    for name, offset, shape, kind, size in spans:  # unpacked, not span.x: this runs on every host fetch
        if not shape and kind == INT32:
            views[name] = words[offset, ...]  # a 0-d view
            continue
        chunk = words[offset: offset + size]
        if kind == INT64:
            chunk = chunk.view(np.int64)
        elif kind == BOOL:
            chunk = chunk.view(np.uint8)[:math.prod(shape)].view(np.bool_)
        elif kind == FLOAT32:
            chunk = chunk.view(np.float32)
        views[name] = chunk if len(shape) == 1 else chunk.reshape(shape)
    return views


def decode(words: Int32[Array, " num_words"], span: Span) -> Array:
    """The field of ``span`` read back from a traced (or device) buffer, in its JAX dtype and shape: INT32 and
    INT64 as int32 (an INT64 field's low words, a strided slice), BOOL as bool, FLOAT32 as float32 (bitcast).
    Inside a jit every read is a slice that XLA fuses into the field's consumer.

    ```
    # words [5, 0, 7, 0], span (positions, 0, (2,), INT64, 4) -> [5, 7]
    ```
    """
    _, offset, shape, kind, size = span
    chunk = jax.lax.slice(words, (offset,), (offset + size,))
    if kind == INT64:
        chunk = chunk.reshape(-1, 2)[:, 0 if sys.byteorder == "little" else 1]
    elif kind == BOOL:
        chunk = jax.lax.bitcast_convert_type(chunk, jnp.uint8).reshape(-1)[:math.prod(shape)] != 0
    elif kind == FLOAT32:
        chunk = jax.lax.bitcast_convert_type(chunk, jnp.float32)
    return chunk.reshape(shape)


def host_view(words: np.ndarray, span: Span) -> np.ndarray:
    """The field of ``span`` as a NumPy view of fetched ``words`` (no copy), in its JAX dtype: an INT64
    field as its low int32 words (a strided view), BOOL as bool, FLOAT32 as float32; shaped as the field."""
    _, offset, shape, kind, size = span
    chunk = words[offset: offset + size]
    if kind == INT64:
        chunk = chunk[0 if sys.byteorder == "little" else 1::2]
    elif kind == BOOL:
        chunk = chunk.view(np.uint8)[:math.prod(shape)].view(np.bool_)
    elif kind == FLOAT32:
        chunk = chunk.view(np.float32)
    return chunk.reshape(shape)
