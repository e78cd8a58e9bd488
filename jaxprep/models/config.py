"""`DecoderConfig`: the static description of a Llama-family checkpoint, parsed from its config.json.

Supported ``model_type``s and how they differ (everything else is shared: RMSNorm, RoPE, GQA,
SwiGLU, tied or untied embeddings):

    llama  q/k/v/o biases iff ``attention_bias``; MLP biases iff ``mlp_bias``
    qwen2  q/k/v biases always, no o bias
    qwen3  q/k/v/o biases iff ``attention_bias``; RMSNorm of q and k over each head (``q_norm``, ``k_norm``)

A field that would change the math in a way not implemented here (sliding-window layers, an unknown
RoPE type, quantization, ...) raises `UnsupportedConfigError` naming the field, never a silent guess.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from jaxprep._typing import storage_dtype
from jaxprep.models import llama
from jaxprep.models.errors import CheckpointError, UnsupportedConfigError
from jaxprep.models.rope import RopeConfig, parse_rope
from jaxprep.models.tiny import check_attention_kind

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16")
"""Compute dtypes: float32 is the exact mode, bfloat16 the one of bf16 serving (`jaxprep.models.llama`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Sizes and switches of a Llama-family decoder; hashable, a static jit argument.

    It is a model config for the serving loop like `jaxprep.serving.ModelConfig`: the step calls
    `forward`, `KVCache.zeros` reads ``num_layers``, ``num_kv_heads``, ``head_dim`` and ``kv_cache_dtype``.
    ``dtype`` (one of `DTYPES`) is the dtype of the params, the activations and the KV cache: it is
    not read from config.json but chosen at load time (`jaxprep.models.load_model`).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    attention: str = "auto"  # one of `jaxprep.attention.ATTENTION_KINDS` (docs/guides/attention.md)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"DecoderConfig: dtype={self.dtype!r} must be one of {', '.join(DTYPES)}")
        check_attention_kind("DecoderConfig", self.attention)

    @property
    def kv_cache_dtype(self):
        """The KV cache holds K and V in the model's dtype (bf16 serving: a bf16 cache, stored as uint16
        bit patterns on XLA:CPU, see `jaxprep._typing`)."""
        return storage_dtype(self.dtype)

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim // 2] float32 (a trace-time constant)."""
        return self.rope.inv_freq(self.head_dim)

    def forward(self, params, kv_cache, inputs, *, block_size: int, max_model_len: int):
        """The paged forward of one serving step: ``(kv_cache, logits [R_pad, vocab_size])``."""
        return llama.paged_forward(params, kv_cache, inputs, model=self, block_size=block_size,
                                   max_model_len=max_model_len)

    def dense_forward(self, params, token_ids):
        """Logits [L, vocab_size] of every position of one sequence, no cache (the loop's oracle)."""
        return llama.dense_forward(params, token_ids, model=self)


def read_config(directory: str) -> DecoderConfig:
    """Parses ``directory``/config.json (and the EOS ids of generation_config.json, if present)."""
    raw = _read_json(os.path.join(directory, "config.json"))
    generation = os.path.join(directory, "generation_config.json")
    if os.path.exists(generation):
        eos = _read_json(generation).get("eos_token_id")
        if eos is not None:
            _eos_ids({"eos_token_id": eos}, "generation_config.json")  # its errors name its own file
            raw = dict(raw, eos_token_id=eos)
    return parse_config(raw)


def parse_config(raw: dict) -> DecoderConfig:
    """A `DecoderConfig` from the dict of a config.json; raises `UnsupportedConfigError` naming the field."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfigError(f"config.json: model_type={model_type!r} is not supported "
                                     f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    _check_unsupported(raw)
    heads = _int(raw, "num_attention_heads")
    hidden = _int(raw, "hidden_size")
    # the transformers class defaults (heads 0 is reported by _check_shapes, not divided by)
    default_head_dim = 128 if model_type == "qwen3" else hidden // heads if heads > 0 else 0
    config = DecoderConfig(
        model_type=model_type, vocab_size=_int(raw, "vocab_size"), hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size"), num_layers=_int(raw, "num_hidden_layers"),
        num_heads=heads, num_kv_heads=_int(raw, "num_key_value_heads", heads),
        head_dim=_int(raw, "head_dim", default_head_dim), rms_norm_eps=_positive_float(raw, "rms_norm_eps", 1e-6),
        rope=parse_rope(raw), max_position_embeddings=_int(raw, "max_position_embeddings", 2048),
        tie_word_embeddings=_bool(raw, "tie_word_embeddings"), eos_token_ids=_eos_ids(raw),
        **_family_switches(model_type, raw))
    _check_shapes(config)
    return config


def _family_switches(model_type: str, raw: dict) -> dict[str, bool]:
    attention_bias = _bool(raw, "attention_bias")
    if model_type == "qwen2":
        return {"qkv_bias": True, "o_bias": False, "mlp_bias": False, "qk_norm": False}
    return {"qkv_bias": attention_bias, "o_bias": attention_bias, "qk_norm": model_type == "qwen3",
            "mlp_bias": model_type == "llama" and _bool(raw, "mlp_bias")}


def _check_unsupported(raw: dict) -> None:
    """Fields whose values would change the math in ways not implemented here."""
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfigError(f"config.json: hidden_act={raw['hidden_act']!r} is not supported (only 'silu')")
    if raw.get("use_sliding_window"):
        raise UnsupportedConfigError("config.json: use_sliding_window=true is not supported (full attention only)")
    if raw.get("model_type") == "llama" and raw.get("sliding_window") is not None:
        raise UnsupportedConfigError(f"config.json: sliding_window={raw['sliding_window']!r} is not supported "
                                     "(full attention only)")
    for i, layer_type in enumerate(raw.get("layer_types") or ()):
        if layer_type != "full_attention":
            raise UnsupportedConfigError(f"config.json: layer_types[{i}]={layer_type!r} is not supported "
                                         "(only 'full_attention')")
    if raw.get("quantization_config") is not None:
        raise UnsupportedConfigError("config.json: quantization_config is set; quantized checkpoints are not supported")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError(f"config.json: partial_rotary_factor={raw['partial_rotary_factor']!r} is not "
                                     "supported (only 1.0)")


def _check_shapes(config: DecoderConfig) -> None:
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "max_position_embeddings"):
        if getattr(config, name) <= 0:
            raise UnsupportedConfigError(f"config.json: {name}={getattr(config, name)} must be positive")
    if config.num_heads % config.num_kv_heads:
        raise UnsupportedConfigError(f"config.json: num_attention_heads={config.num_heads} must be a multiple of "
                                     f"num_key_value_heads={config.num_kv_heads}")
    if config.head_dim % 2:
        raise UnsupportedConfigError(f"config.json: head_dim={config.head_dim} must be even (RoPE rotates pairs)")


def _int(raw: dict, name: str, default: int | None = None) -> int:
    value = raw.get(name, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool):
        raise UnsupportedConfigError(f"config.json: {name}={value!r} must be an int")
    return value


def _positive_float(raw: dict, name: str, default: float) -> float:
    """A finite number > 0 (an int is fine, a bool or a string is not); None or absent: ``default``."""
    value = raw.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UnsupportedConfigError(f"config.json: {name}={value!r} must be a positive number")
    return float(value)


def _bool(raw: dict, name: str) -> bool:
    """true or false (None or absent: false); the string "false" is an error, not True."""
    value = raw.get(name)
    if value is not None and not isinstance(value, bool):
        raise UnsupportedConfigError(f"config.json: {name}={value!r} must be true or false")
    return bool(value)


def _eos_ids(raw: dict, source: str = "config.json") -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    ids = tuple(eos) if isinstance(eos, list) else (eos,)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise UnsupportedConfigError(f"{source}: eos_token_id={eos!r} must be an int >= 0 or a list of them")
    return ids


def _read_json(path: str) -> dict:
    """The JSON object in ``path``; a file that is missing, a folder, unreadable, not JSON or not an
    object raises naming the file (``CheckpointError``; FileNotFoundError when missing)."""
    name = os.path.basename(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: a model directory holds config.json and *.safetensors")
    if os.path.isdir(path):
        raise CheckpointError(f"{name}: is a folder, not a JSON file")
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{name}: not valid JSON ({error.msg} at line {error.lineno} column {error.colno}; "
                              "truncated?)") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{name}: not UTF-8 text") from None
    except OSError as error:
        raise CheckpointError(f"{name}: cannot be read ({error.strerror})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{name}: must hold a JSON object {{...}}, got a {type(value).__name__}")
    return value
