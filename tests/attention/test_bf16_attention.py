"""The paged attention and the Pallas GPU consumer over a bf16 KV cache, stored as bf16 or (as the bf16
models store it on XLA:CPU, `jaxprep._typing`) as its uint16 bit patterns: against the NumPy oracle on
the same bf16 values."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._typing import BITS16, as_stored
from jaxprep.attention import gpu_paged_attention, paged_attention
from jaxprep.attention.ragged import ragged_paged_attention
from support.attention_batches import CONFIG, AttentionCase, attention_cases, shifted_block

B = CONFIG.block_size
BF16_ATOL = 2e-2
"""The output is rounded to bf16 (8 bits of mantissa) from a float32 accumulation: |out| < 4 here."""


def bf16_case(seed: int) -> AttentionCase:
    """A random step whose q and cache hold bf16 values (the oracle reads the same values in float32)."""
    case = next(attention_cases(seed=seed, count=1))
    rounded = [x.astype(jnp.bfloat16).astype(jnp.float32) for x in (case.q, case.k_cache, case.v_cache)]
    return AttentionCase(case.inputs, *rounded)


@functools.partial(jax.jit, static_argnames="kind")
def bf16_attention(q, k_cache, v_cache, inputs, kind):
    attend = {"xla": paged_attention, "gpu": functools.partial(gpu_paged_attention, interpret=True),
              "ragged": functools.partial(ragged_paged_attention, kv_chunk=16, interpret=True)}[kind]
    return attend(q.astype(jnp.bfloat16), k_cache, v_cache, inputs, block_size=B)


def check_both_storages(case: AttentionCase, kind: str) -> None:
    """bf16 output, the same bits from bf16 storage and from bit patterns, close to the oracle; negative
    control: row 0's first block shifted moves row 0's tokens by more than the tolerance."""
    outputs = []
    for storage in (jnp.dtype(jnp.bfloat16), BITS16):
        k_cache, v_cache = (as_stored(c.astype(jnp.bfloat16), storage) for c in (case.k_cache, case.v_cache))
        assert k_cache.dtype == storage
        out = bf16_attention(case.q, k_cache, v_cache, case.inputs, kind)
        assert out.dtype == jnp.bfloat16
        outputs.append(np.asarray(out.astype(jnp.float32)))
    np.testing.assert_array_equal(outputs[0], outputs[1])
    np.testing.assert_allclose(outputs[1], case.reference(), atol=BF16_ATOL)

    start, end = (int(x) for x in np.asarray(case.inputs.attn_metadata.query_start_loc)[:2])
    shifted = bf16_attention(case.q, k_cache, v_cache, shifted_block(case.inputs), kind)
    assert np.abs(np.asarray(shifted.astype(jnp.float32))[start:end] - case.reference()[start:end]).max() > 0.1


def test_paged_attention_reads_bf16_bit_patterns():
    check_both_storages(bf16_case(seed=31), "xla")


def test_gpu_kernel_reads_bf16_bit_patterns():
    """The Pallas GPU decode kernel (interpret mode) fed a bf16 q and a bit-pattern cache."""
    check_both_storages(bf16_case(seed=32), "gpu")


def test_ragged_kernel_reads_bf16_bit_patterns():
    """jaxprep's ragged kernel (interpret mode): bf16 dots with float32 accumulation, each chunk of a
    bit-pattern cache bit-cast inside the kernel."""
    check_both_storages(bf16_case(seed=34), "ragged")


def test_paged_attention_converts_one_chunk_not_the_cache():
    """Compiled over a uint16 cache of 4096 slots: no float32 or bf16 array of the cache's shape; the
    conversion is per gathered chunk, inside the loop. Negative controls: over a float32 cache the pattern
    finds it; on jax 0.10's XLA:CPU, over a plain bf16 cache (whose gathers it upcasts, the conversion
    hoisted out of the loop) a float32 copy shows up."""
    case = bf16_case(seed=33)
    k_cache = jnp.zeros((4096,) + case.k_cache.shape[1:], BITS16)
    text = bf16_attention.lower(case.q, k_cache, k_cache, case.inputs, "xla").compile().as_text()
    cache_shape = ",".join(str(n) for n in k_cache.shape)
    assert f"u16[{cache_shape}]" in text  # the pattern finds the cache itself
    assert f"f32[{cache_shape}]" not in text and f"bf16[{cache_shape}]" not in text
    as_float = k_cache.astype(jnp.float32)  # control: a float32 copy of the cache's shape is seen
    control = bf16_attention.lower(case.q, as_float, as_float, case.inputs, "xla").compile().as_text()
    assert f"f32[{cache_shape}]" in control
    if jax.default_backend() == "cpu" and jax.__version_info__ < (0, 11):
        # why the cache is stored as bit patterns: jax 0.10's XLA:CPU upcasts a plain bf16 cache (jax 0.11's does not)
        plain = k_cache.astype(jnp.bfloat16)
        control = bf16_attention.lower(case.q, plain, plain, case.inputs, "xla").compile().as_text()
        assert f"f32[{cache_shape}]" in control
