"""Attention over jaxprep's paged KV cache, read through a prepared step's metadata.

- `paged_attention` (`paged.py`): plain XLA, a loop over each token's own KV blocks with an online
  softmax; cost follows the pages the batch holds, not ``max_model_len``. Runs everywhere; the layer
  loop plans its query tiles once per step (`paged_plan`) and reads each layer of the stacked cache in
  place (`paged_attend`).
- the ragged kernel (`ragged.py`): jaxprep's own Pallas (Triton) kernel for NVIDIA GPUs, the XLA
  path's twin: query tiles per request, one launch per layer, the stacked cache read where it lies.
  Imported only where a step asks for it (it needs Pallas' Triton backend, which jax 0.11 deprecates).
- `gpu_paged_attention`, `tpu_ragged_paged_attention` (`pallas.py`): JAX's own Pallas kernels fed by
  the same metadata, with the layout conversions `to_gpu_pages`, `to_tpu_kv_pages`.
- `gather_all_attention` (`gather_all.py`): the former path (every token gathers all ``max_model_len``
  positions), kept as a cross-check and a memory control.

`stacked_attention` is how the models' layer loop runs one of them (`jaxprep.models.tiny.scan_paged_layers`);
`layer_attention` is the same over one layer's cache. ``"auto"`` is the ragged kernel on an NVIDIA GPU,
JAX's TPU kernel on a TPU, the XLA path elsewhere (docs/guides/attention.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxprep.attention.gather_all import gather_all_attention, paged_context
from jaxprep.attention.pallas import (
    gpu_paged_attention,
    to_gpu_pages,
    to_tpu_kv_pages,
    tpu_ragged_paged_attention,
)
from jaxprep.attention.paged import paged_attend, paged_attention, paged_plan, token_kv_lens
from jaxprep.config import triton_backend_available

ATTENTION_KINDS = ("auto", "xla", "ragged", "pallas_gpu", "pallas_tpu", "gather_all")
"""Names `stacked_attention` and `layer_attention` accept: ``ragged`` is jaxprep's kernel (Triton on CUDA,
Pallas' interpreter elsewhere); ``auto`` the kernel of the backend where it supports the shapes."""


def gpu_kernel_fits(block_size: int, head_dim: int) -> bool:
    """The Triton lowering of JAX's GPU kernel needs dot operands of at least 16 on every side, and
    power-of-2 block shapes (a page of keys, a head)."""
    return all(size >= 16 and size & (size - 1) == 0 for size in (block_size, head_dim))


def ragged_kernel_fits(head_dim: int) -> bool:
    """jaxprep's ragged kernel gathers a chunk's keys slot by slot (any block size); its blocks of a head
    are powers of 2 and Triton's dots at least 16 wide: head_dim must be both."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def tpu_kernel_fits(num_kv_heads: int, head_dim: int) -> bool:
    """The TPU kernel broadcasts its [.., 128] softmax statistics over head_dim, and tiles 2K combined
    heads as XLA does (`ragged_paged_attention.kernel.get_min_heads_per_blk`, float32)."""
    combined = 2 * num_kv_heads
    return head_dim % 128 == 0 and (combined in (2, 4, 8) or combined % 8 == 0)


def auto_kind(block_size: int, num_kv_heads: int, head_dim: int, backend: str | None = None) -> str:
    """The attention ``auto`` runs on ``backend`` (default: JAX's default backend) for these shapes. On a
    ``gpu`` backend the ragged kernel is resolved when the step is lowered: CUDA runs it, ROCm the XLA path."""
    backend = backend or jax.default_backend()
    if backend == "gpu" and ragged_kernel_fits(head_dim) and triton_backend_available():
        return "ragged"
    if backend == "tpu" and tpu_kernel_fits(num_kv_heads, head_dim):
        return "pallas_tpu"
    return "xla"


@dataclasses.dataclass(frozen=True)
class StackedAttention:
    """One kind of attention as the models' layer loop runs it: ``plan(inputs)`` once per step, before
    the loop (what every layer reads of the step); ``attend(q [T, H, D], k_cache, v_cache [L, slots, K, D],
    layer, plan) -> [T, H, D]`` for layer ``layer`` (0-d int32) of the stacked caches."""

    plan: Callable
    attend: Callable


def _per_layer(fn) -> StackedAttention:
    """A kind that reads one layer's cache: the layer sliced out of the stack (a copy per layer and step
    where the consumer is a kernel)."""
    return StackedAttention(plan=lambda inputs: inputs,
                            attend=lambda q, k_cache, v_cache, layer, inputs: fn(q, k_cache[layer], v_cache[layer],
                                                                                 inputs))


def _ragged(block_size: int, num_heads: int, num_kv_heads: int, *, cuda_only: bool,
            fallback: StackedAttention | None = None) -> StackedAttention:
    """The ragged kernel on CUDA (resolved when the step is lowered, `jax.lax.platform_dependent`); off
    CUDA ``fallback`` (``auto``) or the same kernel in Pallas' interpreter (``ragged``)."""
    from jaxprep.attention import ragged

    def kernel(interpret):
        def attend(q, k_cache, v_cache, layer, plans):
            return ragged.ragged_attend(q, k_cache, v_cache, layer, plans[0], block_size=block_size,
                                        interpret=interpret)
        return attend

    def other(q, k_cache, v_cache, layer, plans):
        return fallback.attend(q, k_cache, v_cache, layer, plans[1])

    def attend(q, k_cache, v_cache, layer, plans):
        return jax.lax.platform_dependent(q, k_cache, v_cache, layer, plans, cuda=kernel(interpret=False),
                                          default=other if cuda_only else kernel(interpret=True))

    def plan(inputs):
        return (ragged.plan_ragged(inputs, num_heads=num_heads, num_kv_heads=num_kv_heads),
                fallback.plan(inputs) if cuda_only else None)

    return StackedAttention(plan=plan, attend=attend)


def stacked_attention(kind: str, *, block_size: int, max_model_len: int, num_heads: int, num_kv_heads: int,
                      head_dim: int, backend: str | None = None) -> StackedAttention:
    """The `StackedAttention` of ``kind`` (one of `ATTENTION_KINDS`) for these shapes; ``auto`` as
    `auto_kind` names it for ``backend`` (default: JAX's default backend), the ragged kernel there
    only where the step is lowered for CUDA (a ROCm GPU keeps the XLA path)."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention={kind!r}: must be one of {ATTENTION_KINDS}")
    xla = StackedAttention(plan=functools.partial(paged_plan, block_size=block_size),
                           attend=functools.partial(paged_attend, block_size=block_size))
    if kind == "auto":
        kind = auto_kind(block_size, num_kv_heads, head_dim, backend)
        if kind == "ragged":
            return _ragged(block_size, num_heads, num_kv_heads, cuda_only=True, fallback=xla)
    if kind == "ragged":
        return _ragged(block_size, num_heads, num_kv_heads, cuda_only=False)
    if kind == "xla":
        return xla
    if kind == "gather_all":
        return _per_layer(functools.partial(gather_all_attention, block_size=block_size, max_model_len=max_model_len))
    kernel = {"pallas_gpu": gpu_paged_attention, "pallas_tpu": tpu_ragged_paged_attention}[kind]
    return _per_layer(functools.partial(kernel, block_size=block_size))


def layer_attention(kind: str, *, block_size: int, max_model_len: int, num_heads: int, num_kv_heads: int,
                    head_dim: int):
    """``attend(q [T, H, D], k_cache, v_cache [num_slots, K, D], inputs) -> [T, H, D]`` of ``kind``: the
    `stacked_attention` of one layer."""
    stacked = stacked_attention(kind, block_size=block_size, max_model_len=max_model_len, num_heads=num_heads,
                                num_kv_heads=num_kv_heads, head_dim=head_dim)

    def attend(q, k_cache, v_cache, inputs):
        return stacked.attend(q, k_cache[None], v_cache[None], jnp.int32(0), stacked.plan(inputs))

    return attend


__all__ = ["ATTENTION_KINDS", "StackedAttention", "auto_kind", "gather_all_attention", "gpu_paged_attention",
           "layer_attention", "paged_attention", "paged_context", "stacked_attention", "to_gpu_pages",
           "to_tpu_kv_pages", "token_kv_lens", "tpu_ragged_paged_attention"]
