"""A tiny decoder-only transformer with random weights, run two ways: paged and dense.

`paged_forward` is the serving path: it writes each layer's K/V into a paged cache through
``slot_mapping`` and reads a request's context back through its block table, only the blocks up to
its ``seq_lens``, with the causal mask given by ``positions`` (docs/semantics.md#causal-mask,
docs/guides/attention.md). `dense_forward` recomputes a whole
sequence with a plain causal mask and no cache: the oracle the serving loop is checked against.
Both share the embedding, RoPE, norms and MLP; only attention and the cache differ.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep.attention import ATTENTION_KINDS, paged_context, stacked_attention  # noqa: F401 (paged_context: re-exported)
from jaxprep.metadata import StepInputs

MODEL_SCOPE = "model"
"""Named scope of the models' own float products (exempt from the index-math precision test)."""

MASKED = -1e30
"""Score of a masked key: exp(MASKED - max) is exactly 0, and a fully masked (padded) query stays finite."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes of the tiny model (static, hashable)."""

    vocab_size: int = 512
    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 4
    d_ff: int = 128
    rope_theta: float = 10000.0
    attention: str = "auto"  # one of `jaxprep.attention.ATTENTION_KINDS`

    def __post_init__(self):
        if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
            raise ValueError(f"ModelConfig: d_model={self.d_model} must split into num_heads={self.num_heads} "
                             "heads of an even size (RoPE rotates pairs)")
        check_attention_kind("ModelConfig", self.attention)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def num_kv_heads(self) -> int:
        """Heads of the KV cache: one per attention head (no grouped-query attention here)."""
        return self.num_heads

    # A model config of the serving loop: `forward` is what the step runs, `dense_forward` the
    # loop's oracle (`jaxprep.models.DecoderConfig` is another one).
    def forward(self, params, kv_cache: KVCache, inputs: StepInputs, *, block_size: int, max_model_len: int):
        return paged_forward(params, kv_cache, inputs, model=self, block_size=block_size, max_model_len=max_model_len,
                             attention=self.attention)

    def dense_forward(self, params, token_ids: jax.Array) -> jax.Array:
        return dense_forward(params, token_ids, model=self)


def check_attention_kind(owner: str, kind: str) -> None:
    """A model config's ``attention`` must name one of `ATTENTION_KINDS`."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"{owner}: attention={kind!r} must be one of {', '.join(ATTENTION_KINDS)}")


@typing.runtime_checkable
class ServingModel(typing.Protocol):
    """What the serving loop needs of a model config (static, hashable): the tiny `ModelConfig`, or a
    checkpoint's `jaxprep.models.DecoderConfig`."""

    vocab_size: int
    num_layers: int
    num_kv_heads: int  # KVCache.zeros: [num_layers, slots, num_kv_heads, head_dim]
    head_dim: int

    def forward(self, params, kv_cache, inputs, *, block_size: int, max_model_len: int):
        """``(kv_cache, logits [R_pad, vocab_size])`` of one paged step."""

    def dense_forward(self, params, token_ids):
        """Logits [L, vocab_size] of one sequence without a cache."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Paged K/V of every layer, indexed by slot = block_id * block_size + offset."""

    k: jax.Array  # [num_layers, num_blocks * block_size, num_kv_heads, head_dim] float32 (or the model's dtype)
    v: jax.Array  # [num_layers, num_blocks * block_size, num_kv_heads, head_dim] float32 (or the model's dtype)

    @classmethod
    def zeros(cls, model: ServingModel, num_blocks: int, block_size: int) -> KVCache:
        """An empty cache in the model's ``kv_cache_dtype`` (float32 for a model config without one)."""
        shape = (model.num_layers, num_blocks * block_size, model.num_kv_heads, model.head_dim)
        dtype = getattr(model, "kv_cache_dtype", jnp.float32)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def init_params(model: ModelConfig, seed: int) -> dict[str, jax.Array]:
    """Gaussian weights scaled by 1/sqrt(fan_in); per-layer weights stacked on a leading axis."""
    rng = np.random.default_rng(seed)
    layers, d, f, v = model.num_layers, model.d_model, model.d_ff, model.vocab_size

    def normal(*shape, fan_in=None):
        scale = 1.0 if fan_in is None else fan_in ** -0.5
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    return {
        "embed": normal(v, d),
        "wqkv": normal(layers, d, 3 * d, fan_in=d),
        "wo": normal(layers, d, d, fan_in=d),
        "w_up": normal(layers, d, f, fan_in=d),
        "w_down": normal(layers, f, d, fan_in=f),
        "lm_head": normal(d, v, fan_in=d) * 4.0,  # logits of std ~4: greedy picks are well separated
    }


def _rms_norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding of x [T, H, Dh] at integer positions [T] (half-split pairs)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, half]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


@jax.named_scope(MODEL_SCOPE)
def _qkv(layer_params, x: jax.Array, positions: jax.Array, model: ModelConfig):
    tokens = x.shape[0]
    qkv = _rms_norm(x) @ layer_params["wqkv"]
    q, k, v = (part.reshape(tokens, model.num_heads, model.head_dim) for part in jnp.split(qkv, 3, axis=-1))
    return _rope(q, positions, model.rope_theta), _rope(k, positions, model.rope_theta), v


@jax.named_scope(MODEL_SCOPE)
def _mlp_and_residual(layer_params, x: jax.Array, attn: jax.Array) -> jax.Array:
    x = x + attn.reshape(x.shape) @ layer_params["wo"]
    return x + jax.nn.gelu(_rms_norm(x) @ layer_params["w_up"]) @ layer_params["w_down"]


def _layers(params) -> dict[str, jax.Array]:
    """The stacked per-layer weights, scanned over by the forward passes."""
    return {name: params[name] for name in ("wqkv", "wo", "w_up", "w_down")}


@jax.named_scope(MODEL_SCOPE)
def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention of q [T, H, Dh] over per-query keys k, v [T, S, H, Dh] where mask [T, S]."""
    scores = jnp.einsum("thd,tshd->ths", q, k) * (q.shape[-1] ** -0.5)
    scores = jnp.where(mask[:, None, :], scores, MASKED)
    return jnp.einsum("ths,tshd->thd", jax.nn.softmax(scores, axis=-1), v)


def paged_forward(params, kv_cache: KVCache, inputs: StepInputs, *, model: ModelConfig,
                  block_size: int, max_model_len: int, attention: str = "auto") -> tuple[KVCache, jax.Array]:
    """One step over the padded batch: writes K/V at ``slot_mapping``, returns logits [R_pad, V]
    of the rows' ``logits_indices``. Scans over the layers, carrying the whole cache.
    ``attention``: one of `jaxprep.attention.ATTENTION_KINDS`."""
    x, kv_cache = scan_paged_layers(
        params["embed"][inputs.input_ids], kv_cache, inputs, _layers(params), block_size=block_size,
        max_model_len=max_model_len, num_heads=model.num_heads,
        qkv=lambda layer, x, positions: _qkv(layer, x, positions, model), finish=_mlp_and_residual, attention=attention)
    with jax.named_scope(MODEL_SCOPE):
        return kv_cache, _rms_norm(x[inputs.logits_indices]) @ params["lm_head"]


def scan_paged_layers(x: jax.Array, kv_cache: KVCache, inputs: StepInputs, layers, *, block_size: int,
                      max_model_len: int, num_heads: int, qkv, finish,
                      attention: str = "auto") -> tuple[jax.Array, KVCache]:
    """The layers of a paged forward, scanned: hidden states x [T, D] -> (x, kv_cache).

    Layer i computes ``q, k, v = qkv(layer, x, positions)`` (q with ``num_heads`` heads), writes k and v
    at ``slot_mapping`` in the cache's layer i, attends over each token's context read back through its
    row's block table (`jaxprep.attention.stacked_attention` of ``attention``: what it reads of the step
    is planned once, before the loop, and it reads layer i of the stacked cache; [T, H, Dh] flattened
    to [T, H * Dh]) and returns ``finish(layer, x, attn)``. ``layers``: per-layer params stacked on a
    leading axis of kv_cache.k.shape[0] layers.
    """
    meta = inputs.attn_metadata
    _, num_slots, num_kv_heads, head_dim = kv_cache.k.shape
    # PAD_SLOT_ID -1 would wrap to the last slot even with mode='drop': send it past the end instead
    write_slots = jnp.where(meta.slot_mapping >= 0, meta.slot_mapping, num_slots)
    attention = stacked_attention(attention, block_size=block_size, max_model_len=max_model_len, num_heads=num_heads,
                                  num_kv_heads=num_kv_heads, head_dim=head_dim)
    plan = attention.plan(inputs)

    def layer_step(carry, layer_in):
        x, k_cache, v_cache = carry
        index, layer = layer_in
        q, k, v = qkv(layer, x, inputs.positions)
        k_cache = k_cache.at[index, write_slots].set(k.astype(k_cache.dtype), mode="drop")
        v_cache = v_cache.at[index, write_slots].set(v.astype(v_cache.dtype), mode="drop")
        with jax.named_scope(MODEL_SCOPE):
            attn = attention.attend(q, k_cache, v_cache, index, plan)
        return (finish(layer, x, attn.reshape(attn.shape[0], -1)), k_cache, v_cache), None

    layer_ids = jnp.arange(kv_cache.k.shape[0], dtype=jnp.int32)
    (x, k_cache, v_cache), _ = jax.lax.scan(layer_step, (x, kv_cache.k, kv_cache.v), (layer_ids, layers))
    return x, KVCache(k=k_cache, v=v_cache)


def dense_forward(params, token_ids: jax.Array, *, model: ModelConfig) -> jax.Array:
    """Logits [L, V] of every position of one sequence, recomputed with a causal mask, no cache.

    Padding past the real length changes nothing before it (the mask is causal)."""
    x = scan_dense_layers(params["embed"][token_ids], _layers(params), attend=_attend, finish=_mlp_and_residual,
                          qkv=lambda layer, x, positions: _qkv(layer, x, positions, model))
    with jax.named_scope(MODEL_SCOPE):
        return _rms_norm(x) @ params["lm_head"]


def scan_dense_layers(x: jax.Array, layers, *, qkv, attend, finish) -> jax.Array:
    """The layers of a cache-free forward over one sequence x [L, D] at positions 0..L-1, causal
    mask; ``qkv``, ``attend`` and ``finish`` as in `scan_paged_layers`."""
    length = x.shape[0]
    positions = jnp.arange(length, dtype=jnp.int32)
    causal = positions[None, :] <= positions[:, None]

    def layer_step(x, layer):
        q, k, v = qkv(layer, x, positions)
        keys = jnp.broadcast_to(k[None], (length,) + k.shape)
        values = jnp.broadcast_to(v[None], (length,) + v.shape)
        return finish(layer, x, attend(q, keys, values, causal)), None

    x, _ = jax.lax.scan(layer_step, x, layers)
    return x
