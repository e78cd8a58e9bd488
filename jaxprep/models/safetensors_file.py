"""One ``.safetensors`` file read as a stream: the header parsed and checked, tensor rows read on demand.

The format (https://huggingface.co/docs/safetensors): 8 bytes little-endian header length N, N bytes
of JSON ``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": ...}``,
then the data; offsets count from the end of the header. Nothing is read before it is asked for, and
rows are read into a buffer of their own (no memory map), so loading holds one chunk at a time.

Every defect is a `CheckpointError` naming the file and the tensor: an unsupported dtype tag, a shape
that is not a list of sizes >= 0, ``data_offsets`` that do not hold exactly the shape's bytes, or data
past the end of the file (a truncated download).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct

import ml_dtypes
import numpy as np

from jaxprep.models.errors import CheckpointError

DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}
"""safetensors dtype tag -> NumPy dtype of the floating-point checkpoints supported (BF16 as
``ml_dtypes.bfloat16``, the type JAX itself uses)."""

HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors package's own bound


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie in its file."""

    name: str
    dtype_tag: str  # "F32", "F16" or "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of the data in the file

    @property
    def dtype(self) -> np.dtype:
        return DTYPES[self.dtype_tag]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class SafetensorsFile:
    """The checked header of ``path``; `read_rows` reads rows of one tensor."""

    def __init__(self, path: str):
        self.path, self.name = path, os.path.basename(path)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = self._read_header(f, size)
        data_start = HEADER_LENGTH_BYTES + self._header_length
        self.entries = {name: self._entry(name, raw, data_start, size)
                        for name, raw in header.items() if name != "__metadata__"}

    def _read_header(self, f, size: int) -> dict:
        prefix = f.read(HEADER_LENGTH_BYTES)
        if len(prefix) < HEADER_LENGTH_BYTES:
            raise CheckpointError(f"{self.name}: truncated: {size} bytes, too short for a safetensors header")
        (self._header_length,) = struct.unpack("<Q", prefix)
        if self._header_length > min(MAX_HEADER_BYTES, size - HEADER_LENGTH_BYTES):
            raise CheckpointError(f"{self.name}: header length {self._header_length} exceeds the file's "
                                  f"{size} bytes: truncated or not a safetensors file")
        try:
            header = json.loads(f.read(self._header_length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointError(f"{self.name}: the header is not valid JSON ({error})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.name}: the header is not a JSON object")
        return header

    def _entry(self, name: str, raw, data_start: int, size: int) -> TensorEntry:
        where = f"{self.name}: tensor {name!r}"
        if not isinstance(raw, dict):
            raise CheckpointError(f"{where}: its header entry is not an object")
        if raw.get("dtype") not in DTYPES:
            raise CheckpointError(f"{where} has dtype {raw.get('dtype')}; supported: {', '.join(DTYPES)}")
        shape, offsets = raw.get("shape"), raw.get("data_offsets")
        if not isinstance(shape, list) or not all(_is_size(n) for n in shape):
            raise CheckpointError(f"{where} has shape {shape!r}; a shape is a list of sizes >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_size(n) for n in offsets)):
            raise CheckpointError(f"{where} has data_offsets {offsets!r}; they are [begin, end] byte offsets")
        entry = TensorEntry(name, raw["dtype"], tuple(shape), data_start + offsets[0])
        if offsets[1] - offsets[0] != entry.num_bytes:
            raise CheckpointError(f"{where}: shape {list(shape)} of {raw['dtype']} needs {entry.num_bytes} bytes, "
                                  f"its data_offsets {offsets} hold {offsets[1] - offsets[0]}")
        if data_start + offsets[1] > size:
            raise CheckpointError(f"{where}: truncated file: the tensor's data ends at byte "
                                  f"{data_start + offsets[1]}, the file has {size} bytes")
        return entry

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of tensor ``name``'s first axis (a 0-d or 1-d tensor: all of it), as
        a new array of the checkpoint's dtype."""
        entry = self.entries[name]
        if len(entry.shape) < 2:
            start, stop, shape = 0, 1, entry.shape
        else:
            shape = (stop - start, *entry.shape[1:])
        row_bytes = entry.num_bytes // num_rows(entry.shape) if entry.num_bytes else 0
        data = np.empty((stop - start) * row_bytes, np.uint8)
        with open(self.path, "rb") as f:
            f.seek(entry.begin + start * row_bytes)
            num_read = f.readinto(memoryview(data))
        if num_read != data.size:  # the file shrank since its header was read
            raise CheckpointError(f"{self.name}: tensor {name!r}: truncated file while reading")
        return data.view(entry.dtype).reshape(shape)


def num_rows(shape: tuple[int, ...]) -> int:
    """Rows `SafetensorsFile.read_rows` splits a tensor into: its first axis, or 1 for a 0-d or 1-d tensor."""
    return shape[0] if len(shape) > 1 else 1


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
