"""The Llama-family decoder (Llama, Qwen2, Qwen3), paged like the serving loop's tiny model.

`paged_forward` consumes one step's `StepInputs` as `jaxprep.models.tiny.paged_forward` does:
each layer's K/V is written at ``slot_mapping``, a token's context is read back through its row's
``block_table`` up to ``positions`` and ``seq_lens``, RoPE rotates at ``positions`` and logits are
taken at ``logits_indices``. `dense_forward` recomputes one whole sequence with a causal mask and no
cache: the oracle of ``jaxprep simulate --check``.

Weights keep transformers' layout (``[out, in]`` linear weights, per-layer tensors stacked on a
leading layer axis, named by their transformers suffix, e.g. ``self_attn.q_proj.weight``) in the
model's ``dtype`` (`DecoderConfig.dtype`, chosen at load time), and are used in that dtype: no step
converts a weight.

- ``float32`` (the exact mode): every product at float32 precision (``Precision.HIGHEST``: no TF32 or
  bf16 passes on GPU/TPU), so greedy tokens match transformers in float32.
- ``bfloat16``: activations, weights and the KV cache in bf16, with float32 where transformers computes
  in float32: RMSNorm (``LlamaRMSNorm`` upcasts), the attention softmax (``softmax(..., dtype=float32)``)
  and the accumulation of every product (``preferred_element_type=float32``, then rounded to bf16 as a
  bf16 matmul's output is). Logits stay float32 (the sampler reads float32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprep._typing import BITS16, as_compute, as_stored, storage_dtype
from jaxprep.metadata import StepInputs
from jaxprep.models.tiny import MASKED, MODEL_SCOPE, KVCache, scan_dense_layers, scan_paged_layers

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
LOGITS_CHUNK = 16384
"""Most vocabulary rows of the LM head in one product when the head is stored as bit patterns."""


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis (transformers' LlamaRMSNorm): normalised in
    float32, rounded back to x's dtype, then scaled by the weight in that dtype."""
    weight = as_compute(weight, x.dtype).reshape((1,) * (x.ndim - 1) + weight.shape)  # broadcast over leading axes
    x32 = x.astype(F32)
    return weight * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


@jax.named_scope(MODEL_SCOPE)
def _linear(layer: dict, name: str, x: jax.Array) -> jax.Array:
    """x [T, in] through the linear ``name``: weight [out, in] (transformers' layout), bias [out] if stored.
    Accumulated in float32, the result in x's dtype."""
    weight = as_compute(layer[name + ".weight"], x.dtype)
    y = jnp.einsum("ti,oi->to", x, weight, precision=HIGHEST, preferred_element_type=F32)
    bias = layer.get(name + ".bias")
    return (y if bias is None else y + as_compute(bias, x.dtype).astype(F32)[None, :]).astype(x.dtype)


def _rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates x [T, H, Dh] at integer positions [T]: pair (i, i + Dh/2) by positions * inv_freq[i]; cos and
    sin are computed in float32 and rounded to x's dtype (transformers' ``apply_rotary_pos_emb``)."""
    angles = positions.astype(F32)[:, None] * inv_freq[None, :]  # [T, Dh/2]
    cos = jnp.cos(angles)[:, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _qkv(layer: dict, x: jax.Array, positions: jax.Array, model):
    """q [T, H, Dh], k and v [T, H_kv, Dh] of hidden states x [T, D]; q and k rotated; k and v in the
    KV cache's storage dtype (`jaxprep._typing`: bf16 as uint16 bit patterns on XLA:CPU)."""
    tokens, eps = x.shape[0], model.rms_norm_eps
    h = _rms_norm(x, layer["input_layernorm.weight"], eps)
    q = _linear(layer, "self_attn.q_proj", h).reshape(tokens, model.num_heads, model.head_dim)
    k = _linear(layer, "self_attn.k_proj", h).reshape(tokens, model.num_kv_heads, model.head_dim)
    v = _linear(layer, "self_attn.v_proj", h).reshape(tokens, model.num_kv_heads, model.head_dim)
    if model.qk_norm:  # Qwen3: RMSNorm over each head before RoPE
        q = _rms_norm(q, layer["self_attn.q_norm.weight"], eps)
        k = _rms_norm(k, layer["self_attn.k_norm.weight"], eps)
    inv_freq = jnp.asarray(model.inv_freq())
    storage = storage_dtype(model.dtype)
    return _rope(q, positions, inv_freq), as_stored(_rope(k, positions, inv_freq), storage), as_stored(v, storage)


@jax.named_scope(MODEL_SCOPE)
def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention of q [T, H, Dh] over per-query keys k, v [T, S, H_kv, Dh] where mask [T, S].

    Query head h reads kv head h // (H / H_kv), as transformers' ``repeat_kv``: q viewed as
    [T, H_kv, G, Dh]. # H 4, H_kv 2 -> heads 0, 1 read kv head 0; heads 2, 3 read kv head 1
    Scores and softmax in float32, the probabilities rounded to v's dtype for the second product
    (transformers' ``softmax(..., dtype=float32).to(query.dtype)``); the output in q's dtype.
    """
    tokens, num_heads, head_dim = q.shape
    groups = q.reshape(tokens, k.shape[2], num_heads // k.shape[2], head_dim)
    k, v = as_compute(k, q.dtype), as_compute(v, q.dtype)  # from the cache's storage dtype
    scores = jnp.einsum("tkgd,tskd->tkgs", groups, k, precision=HIGHEST, preferred_element_type=F32)
    scores = jnp.where(mask[:, None, None, :], scores * (head_dim ** -0.5), MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("tkgs,tskd->tkgd", probs, v, precision=HIGHEST, preferred_element_type=F32)
    return out.reshape(tokens, num_heads * head_dim).astype(q.dtype)


def _output_and_mlp(layer: dict, x: jax.Array, attn: jax.Array, model) -> jax.Array:
    """Residual o_proj, then the residual SwiGLU MLP: down(silu(gate(h)) * up(h)), h = post-attention norm."""
    x = x + _linear(layer, "self_attn.o_proj", attn)
    h = _rms_norm(x, layer["post_attention_layernorm.weight"], model.rms_norm_eps)
    gated = jax.nn.silu(_linear(layer, "mlp.gate_proj", h)) * _linear(layer, "mlp.up_proj", h)
    return x + _linear(layer, "mlp.down_proj", gated)


def _embed(params: dict, token_ids: jax.Array, model) -> jax.Array:
    """Rows of the embedding [V, D] at token_ids [T] (clamped into the vocabulary), in the model's dtype."""
    return as_compute(jnp.take(params["embed_tokens"], token_ids, axis=0, mode="clip"), model.dtype)


@jax.named_scope(MODEL_SCOPE)
def _logits(params: dict, x: jax.Array, model) -> jax.Array:
    """Final norm, then the LM head [V, D] (the embedding when tied): logits [N, V] float32."""
    head = params["embed_tokens"] if model.tie_word_embeddings else params["lm_head"]
    h = _rms_norm(x, params["norm"], model.rms_norm_eps)
    chunk = _vocab_chunk(head.shape[0])
    if head.dtype != BITS16 or chunk == head.shape[0]:
        return jnp.einsum("nd,vd->nv", h, as_compute(head, h.dtype), precision=HIGHEST, preferred_element_type=F32)

    # bit patterns (bf16 on XLA:CPU): bit-casting the whole head for one product would copy it, so the
    # product runs over chunks of the vocabulary, each bit-cast on its own
    # V 6, chunk 2 -> chunks [3, 2, D] -> logits [N, 3, 2] -> [N, 6]
    def chunk_logits(_, rows):
        return None, jnp.einsum("nd,vd->nv", h, as_compute(rows, h.dtype), preferred_element_type=F32)

    chunks = head.reshape(head.shape[0] // chunk, chunk, head.shape[1])
    _, logits = jax.lax.scan(chunk_logits, None, chunks)  # [V / chunk, N, chunk]
    return logits.transpose(1, 0, 2).reshape(h.shape[0], head.shape[0])


def _vocab_chunk(vocab_size: int) -> int:
    """The largest divisor of ``vocab_size`` in [LOGITS_CHUNK / 8, LOGITS_CHUNK], else ``vocab_size``.

    ```
    # 151936 -> 9496; 128256 -> 16032; 320 -> 320
    ```
    """
    for chunk in range(min(LOGITS_CHUNK, vocab_size), LOGITS_CHUNK // 8 - 1, -1):
        if vocab_size % chunk == 0:
            return chunk
    return vocab_size


def paged_forward(params: dict, kv_cache: KVCache, inputs: StepInputs, *, model, block_size: int,
                  max_model_len: int) -> tuple[KVCache, jax.Array]:
    """One serving step over the padded batch: writes K/V at ``slot_mapping`` and returns
    ``(kv_cache, logits [R_pad, V])`` of the rows' ``logits_indices``. Scans over the layers."""
    fns = _layer_fns(model)  # attention: the paged one of jaxprep.attention (docs/guides/attention.md)
    x, kv_cache = scan_paged_layers(_embed(params, inputs.input_ids, model), kv_cache, inputs, params["layers"],
                                    block_size=block_size, max_model_len=max_model_len,
                                    num_heads=model.num_heads, qkv=fns["qkv"], finish=fns["finish"],
                                    attention=model.attention)
    return kv_cache, _logits(params, x[inputs.logits_indices], model)


def dense_forward(params: dict, token_ids: jax.Array, *, model) -> jax.Array:
    """Logits [L, V] of every position of one sequence [L], causal mask, no cache.

    Padding past the real length changes nothing before it (the mask is causal)."""
    x = scan_dense_layers(_embed(params, token_ids, model), params["layers"], **_layer_fns(model))
    return _logits(params, x, model)


def _layer_fns(model) -> dict:
    """The per-layer pieces `scan_dense_layers` calls (`scan_paged_layers`: all but ``attend``)."""
    return {"qkv": lambda layer, x, positions: _qkv(layer, x, positions, model), "attend": _attend,
            "finish": lambda layer, x, attn: _output_and_mlp(layer, x, attn, model)}
