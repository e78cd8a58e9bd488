"""JAX's own Pallas paged-attention kernels, driven by a jaxprep step: the JAX-side twin of feeding
vLLM's Triton backend.

- `gpu_paged_attention`: ``jax.experimental.pallas.ops.gpu.paged_attention`` is a decode kernel (one
  query per sequence, attending to the first ``lengths[b]`` keys of its ``block_tables[b]``). Every
  query token of a mixed batch is fed as its own sequence: its row's block table and ``lengths`` =
  `token_kv_lens` (``min(position + 1, seq_lens[row])``), which is exactly the causal mask of a
  prefill chunk; a padded token gets length 0 (the kernel outputs 0 for it).
- `tpu_ragged_paged_attention`: ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` takes the
  step as vLLM's TPU backend does: ``cu_q_lens`` = ``query_start_loc``, ``kv_lens`` = ``seq_lens``,
  ``page_indices`` = ``block_table``, ``num_seqs`` = ``[num_reqs]`` (a request's queries are the
  last ``num_scheduled`` of its ``seq_lens`` positions, as jaxprep's ``positions`` are).

Both want their own cache layout; `to_gpu_pages` and `to_tpu_kv_pages` convert one layer of
jaxprep's `KVCache` (slot-major ``[num_blocks * block_size, K, D]``), after a cache held as bf16 bit
patterns (uint16, XLA:CPU only: `jaxprep._typing`) is bit-cast to q's dtype, which the kernels read.
Neither kernel scales the scores by 1/sqrt(D) unless told: the GPU one never does (q is pre-scaled
here), the TPU one takes ``sm_scale``.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from jaxprep._typing import as_compute
from jaxprep.attention.paged import token_kv_lens
from jaxprep.bounds import module_available
from jaxprep.metadata import StepInputs

GPU_PAGES_PER_COMPUTE_BLOCK = 8
GPU_K_SPLITS = 16


def to_gpu_pages(cache: jax.Array, block_size: int) -> jax.Array:
    """One layer's cache [num_blocks * B, K, D] -> the GPU kernel's pages [K, num_blocks, B, D].

    ```
    # B 2, slots [s0 s1 | s2 s3] of head k -> pages[k] = [[s0, s1], [s2, s3]]
    ```
    """
    num_slots, num_kv_heads, head_dim = cache.shape
    return cache.reshape(num_slots // block_size, block_size, num_kv_heads, head_dim).transpose(2, 0, 1, 3)


def to_tpu_kv_pages(k_cache: jax.Array, v_cache: jax.Array, block_size: int) -> jax.Array:
    """One layer's K and V caches [num_blocks * B, K, D] -> the TPU kernel's kv_pages
    [num_blocks, B, 2K, D], K and V interleaved by head: combined head 2k is K head k, 2k + 1 is V head k.

    ```
    # K heads [k0, k1], V heads [v0, v1] -> [k0, v0, k1, v1]
    ```
    """
    num_slots, num_kv_heads, head_dim = k_cache.shape
    pages = jnp.stack([k_cache, v_cache], axis=2)  # [num_slots, K, 2, D]
    return pages.reshape(num_slots // block_size, block_size, 2 * num_kv_heads, head_dim)


def gpu_kernel_table(block_table: jax.Array) -> tuple[jax.Array, int, int]:
    """``(block_tables, k_splits, pages_per_compute_block)``: the GPU kernel wants pages_per_sequence
    divisible by k_splits, and each split divisible by pages_per_compute_block, a power of 2 (Triton's
    block shapes); columns are padded with the null block 0 (never read: they lie past every length).

    ```
    # width 5 -> pages_per_compute_block 4, k_splits 2, width 8; width 40 -> 8, 5, 40
    ```
    """
    width = block_table.shape[1]
    per_block = min(GPU_PAGES_PER_COMPUTE_BLOCK, 1 << (width.bit_length() - 1))
    k_splits = min(GPU_K_SPLITS, -(-width // per_block))
    padded = -(-width // (k_splits * per_block)) * k_splits * per_block
    return jnp.pad(block_table, ((0, 0), (0, padded - width))), k_splits, per_block


GPU_KERNEL_MODULE = "jax.experimental.pallas.ops.gpu.paged_attention"


def gpu_kernel_available() -> bool:
    """Whether this jax still ships the GPU kernel (jax 0.11 deprecates it; ``auto`` then falls back)."""
    return module_available(GPU_KERNEL_MODULE)


def _gpu_kernel():
    """JAX's GPU decode kernel. jax 0.11 deprecates its module (a `DeprecationWarning` at import, no
    replacement named); jaxprep uses it knowingly (docs/guides/attention.md), so that one warning is
    silenced here and nothing else is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=f"{GPU_KERNEL_MODULE} is deprecated", category=DeprecationWarning)
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    return paged_attention


def gpu_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, inputs: StepInputs, *,
                        block_size: int, interpret: bool = False) -> jax.Array:
    """Attention [T, H, D] of every token of a mixed step through the Pallas GPU decode kernel, one
    kernel sequence per query token. ``k_cache``, ``v_cache``: one layer in jaxprep's layout."""
    paged_attention = _gpu_kernel()
    token_row, kv_lens = token_kv_lens(inputs)
    num_blocks = k_cache.shape[0] // block_size
    k_cache, v_cache = as_compute(k_cache, q.dtype), as_compute(v_cache, q.dtype)  # bit patterns: a bit-cast
    rows = jnp.clip(inputs.attn_metadata.block_table[token_row], 0, num_blocks - 1)  # [T, max_blocks_per_req]
    block_tables, k_splits, per_block = gpu_kernel_table(rows)
    scaled = (q.astype(jnp.float32) * (q.shape[-1] ** -0.5)).astype(q.dtype)
    # the kernel's dots take no precision: traced under "highest", float32 runs as IEEE float32 in
    # Triton (its default would be TF32), as the models' other products (Precision.HIGHEST)
    with jax.default_matmul_precision("highest"):
        out = paged_attention(scaled, to_gpu_pages(k_cache, block_size), to_gpu_pages(v_cache, block_size),
                              block_tables, kv_lens, k_splits=k_splits, pages_per_compute_block=per_block,
                              interpret=interpret)
    return jnp.where((kv_lens > 0)[:, None, None], out, 0).astype(q.dtype)


def tpu_ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, inputs: StepInputs, *,
                               block_size: int, num_kv_pages_per_block: int | None = None,
                               num_queries_per_block: int | None = None) -> jax.Array:
    """Attention [T, H, D] of a mixed step through the Pallas TPU ragged kernel (on CPU: inside
    ``pltpu.force_tpu_interpret_mode()``). Padded tokens (past ``num_actual_tokens``) give zeros.

    The two block sizes default to the kernel's tuned table, which needs a TPU v4 or later to read
    the chip's version: off a TPU (interpret mode) give both."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    meta = inputs.attn_metadata
    num_blocks = k_cache.shape[0] // block_size
    k_cache, v_cache = as_compute(k_cache, q.dtype), as_compute(v_cache, q.dtype)  # bit patterns: a bit-cast
    out = ragged_paged_attention(q, to_tpu_kv_pages(k_cache, v_cache, block_size), meta.seq_lens,
                                 jnp.clip(meta.block_table, 0, num_blocks - 1), meta.query_start_loc,
                                 meta.num_reqs.reshape(1), sm_scale=q.shape[-1] ** -0.5,
                                 num_kv_pages_per_block=num_kv_pages_per_block,
                                 num_queries_per_block=num_queries_per_block)
    is_real = jnp.arange(q.shape[0], dtype=jnp.int32) < meta.num_actual_tokens
    return jnp.where(is_real[:, None, None], out, 0).astype(q.dtype)
