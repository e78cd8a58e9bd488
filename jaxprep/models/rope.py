"""Rotary-embedding parameters of a checkpoint: the RoPE type and its inverse frequencies.

transformers 5.x writes them as ``rope_parameters = {"rope_type": ..., "rope_theta": ..., ...}`` in
config.json; 4.x checkpoints have ``rope_scaling = {"rope_type" or "type": ..., ...}`` (or null) and a
top-level ``rope_theta``. Both are read. The frequencies follow transformers' ``modeling_rope_utils``
(``_compute_default_rope_parameters``, ``_compute_linear_scaling_rope_parameters``,
``_compute_llama3_parameters``) step by step in float32, so greedy tokens match a float32 transformers run.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxprep.models.errors import UnsupportedConfigError

ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_THETA = 10000.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """RoPE type and parameters (hashable). ``factor`` etc. are unused by the types that do not read them."""

    rope_type: str = "default"
    theta: float = DEFAULT_THETA
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequency of each rotated pair [head_dim // 2] float32.

        ```
        # default, theta 10000, head_dim 4 -> [1, 0.01]; linear factor 2 -> [0.5, 0.005]
        ```
        """
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        inv_freq = np.float32(1.0) / (np.float32(self.theta) ** exponents)
        if self.rope_type == "linear":
            inv_freq = inv_freq / np.float32(self.factor)
        elif self.rope_type == "llama3":
            inv_freq = self._llama3(inv_freq)
        return inv_freq.astype(np.float32)

    def _llama3(self, inv_freq: np.ndarray) -> np.ndarray:
        """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, the band between blended."""
        factor, low, high = self.factor, self.low_freq_factor, self.high_freq_factor
        old_context_len = self.original_max_position_embeddings
        low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq)
        smooth = (np.float32(old_context_len) / wavelen - np.float32(low)) / np.float32(high - low)
        smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled)


def parse_rope(raw: dict) -> RopeConfig:
    """The `RopeConfig` of a config.json dict; unknown types raise naming the field."""
    field = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
    params = raw.get(field) or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedConfigError(f"config.json: {field} must be one flat dict (per-layer-type RoPE parameters "
                                     f"are not supported), got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedConfigError(f"config.json: {field}.rope_type={rope_type!r} is not supported "
                                     f"(supported: {', '.join(ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError(f"config.json: {field}.partial_rotary_factor="
                                     f"{params['partial_rotary_factor']!r} is not supported (only 1.0)")
    theta = _positive(params.get("rope_theta", raw.get("rope_theta", DEFAULT_THETA)), f"{field}.rope_theta")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = _positive(params.get("factor"), f"{field}.factor")
    if rope_type == "linear":
        return RopeConfig(rope_type="linear", theta=theta, factor=factor)
    # a top-level original_max_position_embeddings wins, as in transformers' standardize_rope_params
    original = (raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                or raw.get("max_position_embeddings"))
    low = _positive(params.get("low_freq_factor"), f"{field}.low_freq_factor")
    high = _positive(params.get("high_freq_factor"), f"{field}.high_freq_factor")
    if high <= low:
        raise UnsupportedConfigError(f"config.json: {field}.high_freq_factor={high} must exceed "
                                     f"low_freq_factor={low}")
    return RopeConfig(rope_type="llama3", theta=theta, factor=factor, low_freq_factor=low, high_freq_factor=high,
                      original_max_position_embeddings=int(_positive(
                          original, f"{field}.original_max_position_embeddings")))


def _positive(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise UnsupportedConfigError(f"config.json: {name}={value!r} must be a positive number")
    return float(value)
