"""What a GPU runs of the models' attention: the StableHLO lowered for CUDA on this CPU machine (no
device needed), as tests/core/test_pallas_lowering.py reads the prepare kernels.

- the ragged kernel lowers the tiny model's step for CUDA to one Triton call in the layer loop, which
  reads the stacked cache itself: no layer is sliced out of it and nothing of it is transposed.
  Control: JAX's decode kernel (``pallas_gpu``) is fed a layer sliced out of the cache and converted
  to its layout per layer.
- ``auto`` on a GPU backend is that kernel when lowered for CUDA; on a CPU backend it traces no
  kernel at all (the XLA path; tracing the kernel would cost every CPU compile).
- the kernel lowers for CUDA at the shapes of the real models (Qwen3-0.6B, Llama-3.2-1B), float32
  and bf16, decode and prefill buckets;
- its two products are traced at HIGHEST precision (IEEE float32 in Triton, not TF32).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from jaxprep import BatchState, PrepConfig, prepare_padded
from jaxprep.attention import stacked_attention
from jaxprep.attention.ragged import ragged_paged_attention
from jaxprep.serving import KVCache, ModelConfig, init_params, paged_forward
from support.kernels import TRITON_CALL, lowering_target

MODEL = ModelConfig(vocab_size=64, num_layers=2, d_model=32, num_heads=2, d_ff=64)
CONFIG = PrepConfig(max_num_reqs=4, max_model_len=256, max_num_batched_tokens=64, block_size=16, num_blocks=64)
LAYER_SHAPE = f"{CONFIG.num_blocks * CONFIG.block_size}x{MODEL.num_kv_heads}x{MODEL.head_dim}xf32"
"""One layer of the cache, [slots, K, D]: what a per-layer consumer slices out of the stacked cache."""


def lowered_step(attention: str, platform: str) -> str:
    def step(params, kv_cache, state):
        inputs = prepare_padded(state, CONFIG, 64)
        return paged_forward(params, kv_cache, inputs, model=MODEL, block_size=CONFIG.block_size,
                             max_model_len=CONFIG.max_model_len, attention=attention)

    args = (init_params(MODEL, 0), KVCache.zeros(MODEL, CONFIG.num_blocks, CONFIG.block_size), BatchState.empty(CONFIG))
    with lowering_target(platform):
        return jax.jit(step).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def triton_kernels(text: str) -> list[str]:
    """The Triton calls of a lowered text, sorted by name (the text's order of outlined functions varies)."""
    return sorted(re.search(r'name = "([^"]*)"', line).group(1) for line in text.splitlines() if TRITON_CALL in line)


PREPARE_KERNELS = ["jaxprep_prepare_rows", "jaxprep_prepare_tokens"]
"""The fused prepared step's two launches: `PrepConfig.kernel="auto"` traced for CUDA picks them too."""


def layer_copies(text: str) -> list[str]:
    """Ops that produce one layer of the cache (a slice of the stack) or move its axes."""
    return [line.strip() for line in text.splitlines()
            if ("stablehlo.dynamic_slice" in line and f"-> tensor<1x{LAYER_SHAPE}>" in line)
            or ("stablehlo.transpose" in line and LAYER_SHAPE.rsplit("x", 1)[0] in line.split("->")[0])]


def test_the_ragged_kernel_on_cuda_reads_the_stacked_cache_in_place():
    text = lowered_step("ragged", "cuda")
    # the attention kernel once, in the scanned layer body, beside the prepared step's two kernels
    assert triton_kernels(text) == sorted(PREPARE_KERNELS + ["jaxprep_ragged_attention"])
    assert f"tensor<2x{LAYER_SHAPE}>" in text  # the stacked cache is there: the pattern below can see it
    assert not layer_copies(text), layer_copies(text)


def test_control_jax_kernel_slices_a_layer_out_of_the_cache():
    """JAX's decode kernel reads one layer in its own layout: the layer is sliced out of the stack (K and
    V) every layer."""
    jax_kernel = lowered_step("pallas_gpu", "cuda")
    jax_decode_kernel = "paged_attention_block_h_16_pages_per_compute_block_8"
    assert triton_kernels(jax_kernel) == sorted(PREPARE_KERNELS + [jax_decode_kernel])
    assert len(layer_copies(jax_kernel)) == 2


@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_auto_is_the_kernel_on_a_gpu_backend_only(backend):
    """`stacked_attention("auto")` as a GPU backend and a CPU one build it, lowered for CUDA: the ragged
    kernel, or the XLA path with no Triton call and no pallas_call traced."""
    attention = stacked_attention("auto", block_size=CONFIG.block_size, max_model_len=CONFIG.max_model_len,
                                  num_heads=4, num_kv_heads=2, head_dim=16, backend=backend)

    def attend(q, k_cache, v_cache, state):
        inputs = prepare_padded(state, CONFIG, 8)
        return attention.attend(q, k_cache, v_cache, jnp.int32(1), attention.plan(inputs))

    q = jax.ShapeDtypeStruct((8, 4, 16), jnp.float32)
    cache = jax.ShapeDtypeStruct((3, CONFIG.num_blocks * CONFIG.block_size, 2, 16), jnp.float32)
    traced = jax.jit(attend).trace(q, cache, cache, BatchState.empty(CONFIG))
    with lowering_target("cuda"):
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    on_gpu = backend == "gpu"
    assert triton_kernels(text) == (["jaxprep_ragged_attention"] if on_gpu else [])
    assert ("pallas_call" in str(traced.jaxpr)) == on_gpu


SHAPES = {"qwen3-0.6b float32 decode": (16, 8, 128, "float32", 8, 8),
          "qwen3-0.6b bf16 prefill": (16, 8, 128, "bfloat16", 256, 1),
          "llama-3.2-1b bf16 decode, long split": (32, 8, 64, "bfloat16", 8, 1),
          "llama-3.2-1b float32 mixed": (32, 8, 64, "float32", 256, 16)}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_lowers_for_cuda_at_real_model_shapes(shape):
    num_heads, num_kv_heads, head_dim, dtype, tokens, max_num_reqs = SHAPES[shape]
    config = PrepConfig(max_num_reqs=max_num_reqs, max_model_len=4096, max_num_batched_tokens=256, block_size=16,
                        num_blocks=512)

    def attend(q, k_cache, v_cache, state):
        return ragged_paged_attention(q, k_cache, v_cache, prepare_padded(state, config, tokens),
                                      block_size=config.block_size)

    q = jax.ShapeDtypeStruct((tokens, num_heads, head_dim), jnp.dtype(dtype))
    cache = jax.ShapeDtypeStruct((config.num_blocks * config.block_size, num_kv_heads, head_dim), jnp.dtype(dtype))
    with lowering_target("cuda"):
        text = jax.jit(attend).trace(q, cache, cache, BatchState.empty(config)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert triton_kernels(text) == sorted(PREPARE_KERNELS + ["jaxprep_ragged_attention"])


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs in its equations' parameters (loops, calls, kernels)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _equations(inner)


def test_the_kernels_products_are_traced_at_highest_precision():
    """Triton's default for a float32 dot is TF32; both of the kernel's products say HIGHEST (IEEE)."""
    inputs = prepare_padded(BatchState.empty(CONFIG), CONFIG, 8)  # prepared outside: the kernel's dots alone
    q = jax.ShapeDtypeStruct((8, 4, 16), jnp.float32)
    cache = jax.ShapeDtypeStruct((CONFIG.num_blocks * CONFIG.block_size, 2, 16), jnp.float32)
    closed = jax.make_jaxpr(functools.partial(ragged_paged_attention, block_size=CONFIG.block_size))(
        q, cache, cache, inputs)
    [kernel] = [eqn.params["jaxpr"] for eqn in _equations(closed.jaxpr) if eqn.primitive.name == "pallas_call"]
    dots = [eqn.params["precision"] for eqn in _equations(kernel) if eqn.primitive.name == "dot_general"]
    assert dots == [(jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)] * 2, dots
