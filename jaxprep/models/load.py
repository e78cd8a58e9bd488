"""Loading a local Hugging Face checkpoint directory: config.json plus ``*.safetensors`` files, one
file or shards listed by ``model.safetensors.index.json``; float32, float16 or bfloat16. No network.

The tensors are streamed: every file's header is read and checked first (`SafetensorsFile`), then
each parameter is allocated once on the device in the chosen dtype and filled tensor by tensor, in
chunks of at most `CHUNK_BYTES`, by a donated in-place update. The per-layer tensors land directly in
their slot of the stacked ``[num_layers, ...]`` array, so the peak memory is the weights plus one
chunk (not the files, then the stack, then the device copy). Every defect raises `CheckpointError`
naming the file and the tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._typing import as_stored, storage_dtype
from jaxprep.models.config import DTYPES, DecoderConfig, read_config
from jaxprep.models.errors import CheckpointError
from jaxprep.models.safetensors_file import DTYPES as SAFETENSORS_DTYPES
from jaxprep.models.safetensors_file import SafetensorsFile, num_rows

INDEX_FILE = "model.safetensors.index.json"
LAYER_PREFIX = "model.layers"
CHUNK_BYTES = 4 * 2**20
"""Largest piece of a tensor read and sent to the device at once."""


def load_model(directory: str, dtype: str = "float32", on_progress=None) -> tuple[DecoderConfig, dict]:
    """``(config, params)`` of the checkpoint in ``directory``; params live on the default device.

    ``dtype`` (``float32``, the exact mode, or ``bfloat16``) is the dtype of the params and of the
    compute (`DecoderConfig.dtype`); the checkpoint's own dtype is converted once, here.
    ``on_progress(bytes_read, total_bytes)`` is called after each chunk (a progress display).
    """
    config = _with_dtype(read_config(directory), dtype)
    return config, place_params(config, open_checkpoint(directory), on_progress)


def check_checkpoint(directory: str) -> DecoderConfig:
    """The config of the checkpoint in ``directory``, once everything `load_model` checks before it reads a
    weight has passed: config.json (and generation_config.json), every safetensors header, every tensor's
    name and shape. No tensor data is read and nothing is allocated, so a command can refuse a broken
    folder before it shows any progress."""
    config = read_config(directory)
    _check_tensors(config, open_checkpoint(directory))
    return config


def _with_dtype(config: DecoderConfig, dtype: str) -> DecoderConfig:
    if dtype not in DTYPES:
        raise ValueError(f"load_model: dtype={dtype!r} must be one of {', '.join(DTYPES)}")
    return dataclasses.replace(config, dtype=dtype)


class Checkpoint:
    """The tensors of a checkpoint's files, by name: their shapes, and their rows on demand."""

    def __init__(self, files: list[SafetensorsFile]):
        self.file_of: dict[str, SafetensorsFile] = {}
        for file in files:
            for name in file.entries:
                if name in self.file_of:
                    raise CheckpointError(f"{file.name}: tensor {name!r} is also in {self.file_of[name].name}")
                self.file_of[name] = file

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file_of[name].entries[name].shape

    def dtype(self, name: str) -> np.dtype:
        return self.file_of[name].entries[name].dtype

    def where(self, name: str) -> str:
        """The file holding ``name``, as the start of an error message."""
        return f"{self.file_of[name].name}: " if name in self.file_of else ""

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return self.file_of[name].read_rows(name, start, stop)


class InMemoryTensors:
    """NumPy arrays by name, read like a `Checkpoint` (what `build_params` places)."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.file_of = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.file_of[name].shape)

    def dtype(self, name: str) -> np.dtype:
        dtype = np.asarray(self.file_of[name]).dtype
        if dtype not in SAFETENSORS_DTYPES.values():
            raise CheckpointError(f"tensor {name!r} has dtype {dtype}; supported: float32, float16, bfloat16")
        return dtype

    def where(self, name: str) -> str:
        return ""

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        array = np.asarray(self.file_of[name])
        return array if array.ndim < 2 else array[start:stop]


def open_checkpoint(directory: str) -> Checkpoint:
    """The checked headers of every safetensors file of ``directory`` (no tensor data is read)."""
    files, weight_map = _safetensors_files(directory)
    checkpoint = Checkpoint([_open_file(directory, file) for file in files])
    for name, file in weight_map.items():
        if checkpoint.file_of.get(name) is None or checkpoint.file_of[name].name != file:
            raise CheckpointError(f"{INDEX_FILE} maps tensor {name!r} to {file}, which does not hold it")
    return checkpoint


def _open_file(directory: str, file: str) -> SafetensorsFile:
    path = os.path.join(directory, file)
    if not os.path.isfile(path):
        raise CheckpointError(f"{INDEX_FILE} lists {file}, which is not a file in {directory}")
    return SafetensorsFile(path)


def read_safetensors(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint's safetensors files, by name, in the checkpoint's dtype (read whole:
    for inspection; `load_model` streams)."""
    checkpoint = open_checkpoint(directory)
    return {name: checkpoint.read_rows(name, 0, num_rows(checkpoint.shape(name))) for name in checkpoint.file_of}


def _safetensors_files(directory: str) -> tuple[list[str], dict[str, str]]:
    """The files to read, and the index's tensor -> file map ({} without an index)."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{INDEX_FILE}: not a safetensors index with a weight_map ({error!r})") from None
        return files, weight_map
    files = sorted(os.path.basename(path) for path in glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{directory} holds no *.safetensors file (pytorch_model.bin checkpoints are not "
                              "read: save with safe_serialization=True)")
    return files, {}


def layer_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Shape of each tensor of one decoder layer, by its name after ``model.layers.{i}.``."""
    d, f, dh = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * dh, config.num_kv_heads * dh
    shapes = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
              "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
              "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
              "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)}
    if config.qkv_bias:
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if config.o_bias:
        shapes["self_attn.o_proj.bias"] = (d,)
    if config.mlp_bias:
        shapes.update({"mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (d,)})
    if config.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (dh,), "self_attn.k_norm.weight": (dh,)})
    return shapes


def checkpoint_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor the checkpoint must hold, by its full name."""
    shapes = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
              "model.norm.weight": (config.hidden_size,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    for i in range(config.num_layers):
        shapes.update({f"{LAYER_PREFIX}.{i}.{name}": shape for name, shape in layer_shapes(config).items()})
    return shapes


def build_params(config: DecoderConfig, tensors: dict[str, np.ndarray]) -> dict:
    """The forward's params from NumPy arrays by checkpoint name, in ``config.dtype`` (see `place_params`)."""
    return place_params(config, InMemoryTensors(tensors))


def place_params(config: DecoderConfig, source, on_progress=None) -> dict:
    """The forward's params: ``embed_tokens``, ``norm``, ``lm_head`` (untied only) and ``layers``,
    each per-layer tensor stacked on a leading layer axis [num_layers, ...], all in ``config.dtype``
    (stored as `jaxprep._typing` says: bf16 as uint16 bit patterns on XLA:CPU) on the default
    device. ``source``: a `Checkpoint` or `InMemoryTensors`. Raises `CheckpointError`
    naming a missing, unexpected or misshapen tensor (and its file) before anything is allocated."""
    _check_tensors(config, source)
    targets = _param_sources(config)
    total = sum(_num_bytes(source, name) for _, names in targets for name in names)
    done, params = 0, {"layers": {}}
    for path, names in targets:
        array = jnp.zeros((len(names), *source.shape(names[0])) if path[0] == "layers" else source.shape(names[0]),
                          storage_dtype(config.dtype))
        for layer, name in enumerate(names):
            for start, stop in _chunks(source.shape(name)):
                rows = source.read_rows(name, start, stop)
                starts = (layer, start) if path[0] == "layers" else (start,)
                array = _write_rows(array, rows[None] if path[0] == "layers" else rows,
                                    np.array(starts + (0,) * (array.ndim - len(starts)), np.int32), dtype=config.dtype)
                array.block_until_ready()  # else queued writes would each hold their chunk: one chunk at a time
                done += rows.nbytes
                if on_progress is not None:
                    on_progress(done, total)
        _set(params, path, array)
    return params


def _param_sources(config: DecoderConfig) -> list[tuple[tuple[str, ...], list[str]]]:
    """(path in the params tree, the checkpoint tensors it is made of: one, or one per layer)."""
    targets = [(("embed_tokens",), ["model.embed_tokens.weight"]), (("norm",), ["model.norm.weight"])]
    if not config.tie_word_embeddings:
        targets.append((("lm_head",), ["lm_head.weight"]))
    targets += [(("layers", name), [f"{LAYER_PREFIX}.{i}.{name}" for i in range(config.num_layers)])
                for name in layer_shapes(config)]
    return targets


def _chunks(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Row ranges of at most `CHUNK_BYTES` (at float32) covering a tensor's rows.

    ```
    # shape [10, 2**20] float32 (4 MiB a row), CHUNK_BYTES 32 MiB -> [(0, 8), (8, 10)]
    ```
    """
    rows = num_rows(shape)
    row_bytes = 4 * int(np.prod(shape[1:] if len(shape) > 1 else shape))
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


@functools.partial(jax.jit, donate_argnums=0, static_argnames="dtype")
def _write_rows(array: jax.Array, rows: jax.Array, starts: jax.Array, *, dtype: str) -> jax.Array:
    """``array`` with ``rows`` written at index ``starts`` [array.ndim], in place (donated), converted to
    ``dtype`` and held in the array's storage dtype (`jaxprep._typing`)."""
    rows = as_stored(rows.astype(dtype), array.dtype)
    return jax.lax.dynamic_update_slice(array, rows, tuple(starts[i] for i in range(array.ndim)))


def _num_bytes(source, name: str) -> int:
    return int(np.prod(source.shape(name))) * source.dtype(name).itemsize


def _set(params: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        params = params[key]
    params[path[-1]] = value


def _check_tensors(config: DecoderConfig, source) -> None:
    expected = checkpoint_shapes(config)
    for name, shape in expected.items():
        if name not in source.file_of:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
        if tuple(source.shape(name)) != shape:
            raise CheckpointError(f"{source.where(name)}tensor {name!r} has shape {tuple(source.shape(name))}, "
                                  f"the config needs {shape}")
    unexpected = sorted(name for name in source.file_of if name not in expected and not _ignored(name, config))
    if unexpected:
        raise CheckpointError(f"{source.where(unexpected[0])}tensor {unexpected[0]!r} is not part of a "
                              f"{config.model_type} model as its config.json describes it ({len(unexpected)} "
                              "unexpected tensors)")


def _ignored(name: str, config: DecoderConfig) -> bool:
    """Tensors that carry nothing the forward reads: saved RoPE buffers, a tied head saved anyway."""
    return name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight")
