"""Loading a local Hugging Face checkpoint directory: config.json plus ``*.safetensors`` files, one
file or shards listed by ``model.safetensors.index.json``; float32, float16 or bfloat16. No network.

The tensors are read with the ``safetensors`` package (``safetensors.deserialize``: names, dtype tags,
shapes and raw bytes). NumPy has no bfloat16, so every tensor is viewed through its dtype tag,
BF16 as ``ml_dtypes.bfloat16`` (the type JAX itself uses); values keep the checkpoint's dtype.
"""

from __future__ import annotations

import glob
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxprep.models.config import DecoderConfig, read_config
from jaxprep.models.errors import CheckpointError

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
"""safetensors dtype tag -> NumPy dtype of the floating-point checkpoints supported."""

INDEX_FILE = "model.safetensors.index.json"
LAYER_PREFIX = "model.layers"


def load_model(directory: str) -> tuple[DecoderConfig, dict]:
    """``(config, params)`` of the checkpoint in ``directory``; params live on the default device."""
    config = read_config(directory)
    return config, build_params(config, read_safetensors(directory))


def read_safetensors(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint's safetensors files, by name."""
    try:
        import safetensors
    except ImportError as error:  # pragma: no cover - exercised only without the package
        raise ImportError("reading a checkpoint needs the safetensors package: pip install 'jaxprep[models]'") \
            from error
    files, weight_map = _safetensors_files(directory)
    tensors = {}
    for file in files:
        with open(os.path.join(directory, file), "rb") as f:
            for name, view in safetensors.deserialize(f.read()):
                tensors[name] = _as_numpy(name, view)
    for name, file in weight_map.items():
        if name not in tensors:
            raise CheckpointError(f"{INDEX_FILE} maps tensor {name!r} to {file}, which does not hold it")
    return tensors


def _safetensors_files(directory: str) -> tuple[list[str], dict[str, str]]:
    """The files to read, and the index's tensor -> file map ({} without an index)."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return sorted(set(weight_map.values())), weight_map
    files = sorted(os.path.basename(path) for path in glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{directory} holds no *.safetensors file (pytorch_model.bin checkpoints are not "
                              "read: save with safe_serialization=True)")
    return files, {}


def _as_numpy(name: str, view: dict) -> np.ndarray:
    dtype = DTYPES.get(view["dtype"])
    if dtype is None:
        raise CheckpointError(f"tensor {name!r} has dtype {view['dtype']}; supported: {', '.join(DTYPES)}")
    return np.frombuffer(view["data"], dtype=dtype).reshape(view["shape"])


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
    """The forward's params: ``embed_tokens``, ``norm``, ``lm_head`` (untied only) and ``layers``,
    each per-layer tensor stacked on a leading layer axis [num_layers, ...]. Raises `CheckpointError`
    naming a missing, unexpected or misshapen tensor."""
    _check_tensors(config, tensors)
    params = {"embed_tokens": tensors["model.embed_tokens.weight"], "norm": tensors["model.norm.weight"],
              "layers": {name: np.stack([tensors[f"{LAYER_PREFIX}.{i}.{name}"] for i in range(config.num_layers)])
                         for name in layer_shapes(config)}}
    if not config.tie_word_embeddings:
        params["lm_head"] = tensors["lm_head.weight"]
    return jax.tree_util.tree_map(jnp.asarray, params)


def _check_tensors(config: DecoderConfig, tensors: dict[str, np.ndarray]) -> None:
    expected = checkpoint_shapes(config)
    for name, shape in expected.items():
        if name not in tensors:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(tensors[name].shape)}, the config needs {shape}")
    unexpected = sorted(name for name in tensors if name not in expected and not _ignored(name, config))
    if unexpected:
        raise CheckpointError(f"tensor {unexpected[0]!r} is not part of a {config.model_type} model as its config.json "
                              f"describes it ({len(unexpected)} unexpected tensors)")


def _ignored(name: str, config: DecoderConfig) -> bool:
    """Tensors that carry nothing the forward reads: saved RoPE buffers, a tied head saved anyway."""
    return name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight")
