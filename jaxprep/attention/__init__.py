"""Attention over jaxprep's paged KV cache, read through a prepared step's metadata.

- `paged_attention` (`paged.py`): plain XLA, a loop over each token's own KV blocks with an online
  softmax; cost follows the pages the batch holds, not ``max_model_len``. Runs everywhere.
- `gpu_paged_attention`, `tpu_ragged_paged_attention` (`pallas.py`): JAX's own Pallas kernels fed by
  the same metadata, with the layout conversions `to_gpu_pages`, `to_tpu_kv_pages`.
- `gather_all_attention` (`gather_all.py`): the former path (every token gathers all ``max_model_len``
  positions), kept as a cross-check and a memory control.

`layer_attention` picks one by name; ``"auto"`` picks by the backend JAX traces for (docs/guides/attention.md).
"""

from __future__ import annotations

import functools

import jax

from jaxprep.attention.gather_all import gather_all_attention, paged_context
from jaxprep.attention.pallas import (
    gpu_kernel_available,
    gpu_paged_attention,
    to_gpu_pages,
    to_tpu_kv_pages,
    tpu_ragged_paged_attention,
)
from jaxprep.attention.paged import paged_attention, token_kv_lens

ATTENTION_KINDS = ("auto", "xla", "pallas_gpu", "pallas_tpu", "gather_all")
"""Names `layer_attention` accepts; ``auto`` is the Pallas kernel of the backend where it supports the shapes."""


def gpu_kernel_fits(block_size: int, head_dim: int) -> bool:
    """The Triton lowering of the GPU kernel needs dot operands of at least 16 on every side, and
    power-of-2 block shapes (a page of keys, a head)."""
    return all(size >= 16 and size & (size - 1) == 0 for size in (block_size, head_dim))


def tpu_kernel_fits(num_kv_heads: int, head_dim: int) -> bool:
    """The TPU kernel broadcasts its [.., 128] softmax statistics over head_dim, and tiles 2K combined
    heads as XLA does (`ragged_paged_attention.kernel.get_min_heads_per_blk`, float32)."""
    combined = 2 * num_kv_heads
    return head_dim % 128 == 0 and (combined in (2, 4, 8) or combined % 8 == 0)


def auto_kind(block_size: int, num_kv_heads: int, head_dim: int, backend: str | None = None) -> str:
    """The attention ``auto`` runs on ``backend`` (default: JAX's default backend) for these shapes."""
    backend = backend or jax.default_backend()
    if backend == "gpu" and gpu_kernel_fits(block_size, head_dim) and gpu_kernel_available():
        return "pallas_gpu"
    if backend == "tpu" and tpu_kernel_fits(num_kv_heads, head_dim):
        return "pallas_tpu"
    return "xla"


def layer_attention(kind: str, *, block_size: int, max_model_len: int, num_kv_heads: int, head_dim: int):
    """``attend(q [T, H, D], k_cache, v_cache [num_slots, K, D], inputs) -> [T, H, D]`` of ``kind``."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention={kind!r}: must be one of {ATTENTION_KINDS}")
    if kind == "auto":
        kind = auto_kind(block_size, num_kv_heads, head_dim)
    if kind == "gather_all":
        return functools.partial(gather_all_attention, block_size=block_size, max_model_len=max_model_len)
    return functools.partial({"xla": paged_attention, "pallas_gpu": gpu_paged_attention,
                              "pallas_tpu": tpu_ragged_paged_attention}[kind], block_size=block_size)


__all__ = ["ATTENTION_KINDS", "auto_kind", "gather_all_attention", "gpu_paged_attention", "layer_attention",
           "paged_attention", "paged_context", "to_gpu_pages", "to_tpu_kv_pages", "token_kv_lens",
           "tpu_ragged_paged_attention"]
