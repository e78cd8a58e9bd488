"""No integer output of jaxprep depends on floating-point precision, on any backend.

XLA:CPU multiplies float32 in float32 whatever the precision says, so no CPU run can see a
precision bug. What an accelerator would run is read from the StableHLO instead: every jitted
function jaxprep and torch_bridge define is lowered for CUDA and TPU (`jax.export`, no device
needed) and for this CPU, and

- the CUDA and TPU lowerings hold no floating-point ``dot_general`` or ``convolution`` at all
  outside the tiny model's own layers (named scope ``model``): index math is integer there;
- the CPU lowering holds float products only at HIGHEST precision (the float scans, exact by
  construction) besides the model's.

The float scan kept for CPU is then shown to be wrong under the input rounding a GPU (TF32) or a
TPU (bfloat16) applies at DEFAULT precision: it must stay unreachable off CPU.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprep
from jaxprep import (
    BatchState,
    DCPConfig,
    FeatureConfig,
    KVCacheGroupSpec,
    LoRAConfig,
    PrepConfig,
    prepare_padded,
    step_buffer,
)
from jaxprep import _ragged as ragged
from jaxprep.features import DrafterConfig, HybridConfig, drafter, grammar
from jaxprep.models import load
from jaxprep.models.tiny import MODEL_SCOPE
from jaxprep.prepare import prepare_packed
from jaxprep.serving import (
    KVCache,
    ModelConfig,
    ServingConfig,
    ServingState,
    init_params,
    step,
    transitions,
)
from jaxprep.serving.host import sharded, workload
from jaxprep.serving.spec_decode.ngram import NgramConfig, propose_ngram_jit
from jaxprep.serving.update_packing import packed_size, widen_packed
from jaxprep.sharding import DATA_AXIS, prepare_sharded

ACCELERATORS = ("cuda", "tpu")
FLOAT_TYPES = ("f16", "bf16", "f32", "f64", "f8")
MODEL = ModelConfig(vocab_size=64, num_layers=2, d_model=32, num_heads=2, d_ff=64)

ALL_FEATURES = FeatureConfig(num_speculative_tokens=2, speculative_method="mtp", discard_request_mask=True,
                             kv_groups=(KVCacheGroupSpec(4, kernel_block_size=2), KVCacheGroupSpec(8)),
                             dcp=DCPConfig(2, 1, 2), mrope=True, prompt_embeds=True, async_tokens=True,
                             attn_state=True, attn_mask="rows_bool", mask_kv_len=32, request_distribution=True,
                             lora=LoRAConfig(max_loras=4, vocab_size=1000), logits_indirection=True,
                             drafter=DrafterConfig(), structured_outputs=True, num_ubatches=2,
                             hybrid=HybridConfig(mode="align", block_size=8, num_speculative_blocks=2, chunk_size=8,
                                                 checkpoints=True))
SMALL = PrepConfig(max_num_reqs=5, max_model_len=40, max_num_batched_tokens=32, block_size=4)
LARGE = PrepConfig(max_num_reqs=1024, max_model_len=4096, max_num_batched_tokens=16384, block_size=16)
LARGE_FEATURES = PrepConfig(max_num_reqs=256, max_model_len=1024, max_num_batched_tokens=8192, block_size=4,
                            features=dataclasses.replace(ALL_FEATURES, runner="v2"))


def _serving_config(prep: PrepConfig) -> ServingConfig:
    return ServingConfig(prep=dataclasses.replace(prep, num_blocks=64), decode_steps=2)


def _one_device_mesh():
    return jax.sharding.Mesh(np.asarray(jax.devices()[:1]), (DATA_AXIS,))


def _serving_args(config: ServingConfig):
    kv_cache = KVCache.zeros(MODEL, config.prep.num_blocks, config.block_size)
    return ServingState.empty(config), kv_cache, init_params(MODEL, 0), np.zeros(packed_size(config), np.int32)


def _record_prev_tokens_case():
    """What async scheduling keeps for the next step (FeatureConfig.async_tokens, 2 drafts), alone and with the
    step's record in the same call."""
    features = FeatureConfig(num_speculative_tokens=2, async_tokens=True)
    config = _serving_config(dataclasses.replace(SMALL, features=features))
    rows = SMALL.max_num_reqs
    return [(f"serving.{function.__name__}", function,
             (ServingState.empty(config), np.zeros(rows, np.int32), np.zeros((rows, 3), np.int32),
              np.zeros(rows, np.int32), np.zeros((rows, 2), np.int32)), {})
            for function in (transitions.record_prev_tokens, transitions.record_with_prev_tokens)]


def _cases():
    """(name, jitted function, args, kwargs) for every executable jaxprep builds."""
    serving = _serving_config(SMALL)
    state, kv_cache, params, packed = _serving_args(serving)
    mesh = _one_device_mesh()
    cases = [(f"prepare_padded[{label}, {bucket}]", prepare_padded, (BatchState.empty(config), config, bucket), {})
             for label, config, bucket in [("plain", SMALL, 8), ("plain", LARGE, 16384),
                                           # PrepConfig.kernel: the Pallas kernels (Triton on CUDA,
                                           # interpreted on CPU and TPU), and "auto" (Triton on CUDA only)
                                           ("pallas", dataclasses.replace(SMALL, kernel="pallas"), 8),
                                           ("auto", dataclasses.replace(LARGE, kernel="auto"), 16384),
                                           ("all features", dataclasses.replace(SMALL, features=ALL_FEATURES), 32),
                                           ("all features + v2", LARGE_FEATURES, 8192)]]
    cases += [
        ("prepare.prepare_packed", prepare_packed, (BatchState.empty(LARGE), LARGE, 4096), {}),
        ("serving.serve_step", step.serve_step, (state, kv_cache, params, packed),
         dict(config=serving, model=MODEL, num_tokens_padded=32)),
        ("serving.run_step", step.run_step, (state, kv_cache, params, np.int32(1)),
         dict(config=serving, model=MODEL, num_tokens_padded=32)),
        _spec_serve_step_case(),
        ("serving.ngram.propose_ngram_jit", propose_ngram_jit,
         (np.zeros((5, 40), np.int32), np.full(5, 9, np.int32), np.ones(5, bool)),
         dict(k=3, config=NgramConfig(prompt_lookup_min=2, prompt_lookup_max=4), max_model_len=40)),
        ("serving.update_and_prepare", step.update_and_prepare, (state, packed),
         dict(config=serving, num_tokens_padded=32)),
        ("serving.update_and_prepare_donated", step.update_and_prepare_donated, (state, packed),
         dict(config=serving, num_tokens_padded=32)),
        ("serving.update_and_prepare_buffer", step.update_and_prepare_buffer, (state, packed),
         dict(config=serving, num_tokens_padded=32)),
        ("step_buffer.prepare_buffer", step_buffer.prepare_buffer, (BatchState.empty(SMALL), SMALL, 8), {}),
        ("step_buffer._unpack", step_buffer._unpack,
         (step_buffer.prepare_buffer(BatchState.empty(SMALL), SMALL, 8),), {}),
        ("serving.apply_packed", transitions.apply_packed, (state, packed), dict(config=serving)),
        ("serving.widen_packed", widen_packed, (packed[:64],), dict(config=serving)),
        ("serving.record_sampled", transitions.record_sampled,
         (state, np.zeros(5, np.int32), np.zeros((5, 1), np.int32), np.zeros(5, np.int32)), {}),
        *_record_prev_tokens_case(),
        ("serving.dense_logits", workload.dense_logits, (params, np.zeros(16, np.int32)), dict(model=MODEL)),
        # the streamed loader writes each chunk of a stacked parameter in place (a dynamic_update_slice)
        ("models.load._write_rows", load._write_rows,
         (np.zeros((2, 4, 8), np.uint16), np.zeros((1, 2, 8), np.float32), np.array([1, 2, 0], np.int32)),
         dict(dtype="bfloat16")),
        ("sharding.prepare_sharded", prepare_sharded, (BatchState.empty(SMALL), SMALL, 16, mesh), {}),
        ("sharded.serve_step_sharded", sharded.serve_step_sharded, (state, kv_cache, params, packed[None]),
         dict(config=serving, model=MODEL, num_tokens_padded=32, mesh=mesh)),
        ("sharded.apply_updates_sharded", sharded.apply_updates_sharded, (state, packed[None]),
         dict(config=serving, mesh=mesh)),
        ("sharded.update_and_prepare_sharded", sharded.update_and_prepare_sharded, (state, packed[None]),
         dict(config=serving, num_tokens_padded=32, mesh=mesh)),
        ("sharded.update_and_prepare_sharded_donated", sharded.update_and_prepare_sharded_donated,
         (state, packed[None]), dict(config=serving, num_tokens_padded=32, mesh=mesh)),
    ]
    return cases + _runner_feature_cases() + _bridge_cases() + _layout_cases()


def _layout_cases():
    """The tpu-inference layout of a plain step, and the RPA v3 cache built from slot-major K and V."""
    from jaxprep.layouts import tpu_inference

    num_tokens_padded, num_reqs_padded = tpu_inference.tpu_inference_sizes(SMALL, 1, 1)
    step = prepare_padded(BatchState.empty(SMALL), SMALL, 8)
    cache = np.zeros((4 * SMALL.block_size, 2, 8), np.float32)  # [slots, kv heads, head dim]
    return [("layouts.tpu_inference_layout", tpu_inference.tpu_inference_layout,
             (step, SMALL, num_tokens_padded, num_reqs_padded), {}),
            ("layouts.to_rpa_v3_cache", tpu_inference.to_rpa_v3_cache, (cache, cache),
             dict(block_size=SMALL.block_size))]


def _runner_feature_cases():
    """The drafter and grammar functions that run after the step, on an every-feature step."""
    config = dataclasses.replace(SMALL, features=ALL_FEATURES)
    step = prepare_padded(BatchState.empty(config), config, 32)
    rows = np.zeros(step.num_reqs_padded, np.int32)
    draft = drafter.draft_prefill(step, rows, np.zeros(config.max_num_reqs, np.int32))
    logits = np.zeros((step.grammar.bitmask_rows.shape[0], 64), np.float32)
    return [("drafter.draft_prefill", drafter.draft_prefill, (step, rows, np.zeros(5, np.int32)), {}),
            ("drafter.draft_decode_start", drafter.draft_decode_start, (draft, rows, step), dict(config=config)),
            ("drafter.draft_decode_advance", drafter.draft_decode_advance,
             (drafter.draft_decode_start(draft, rows, step, config=config), rows, step), dict(config=config)),
            ("grammar.apply_grammar_bitmask", grammar.apply_grammar_bitmask,
             (logits, np.zeros((15, 2), np.int32), step.grammar), {}),
            ("grammar.grammar_invalid_drafts", grammar.grammar_invalid_drafts, (step.grammar, rows), {})]


def _spec_serve_step_case():
    """`serve_step` on its speculative path: n-gram drafts, greedy verification."""
    spec = dataclasses.replace(_serving_config(SMALL), num_speculative_tokens=3, ngram=NgramConfig())
    state, kv_cache, params, packed = _serving_args(spec)
    return ("serving.serve_step[spec decode]", step.serve_step, (state, kv_cache, params, packed),
            dict(config=spec, model=MODEL, num_tokens_padded=32))


def _bridge_cases():
    """torch_bridge's packer and FIA layout, over an every-feature step's arrays."""
    pytest.importorskip("torch")
    from jaxprep.array_packing import pack
    from torch_bridge.inputs import bridge_inputs
    from torch_bridge.npu import NPU_SPEC, fia_layout

    config = dataclasses.replace(SMALL, features=ALL_FEATURES)
    arrays, pack_spec, features = bridge_inputs(prepare_padded(BatchState.empty(config), config, 32), NPU_SPEC)
    return [("torch_bridge.pack", pack, (arrays, pack_spec.spec), {}),
            ("torch_bridge.fia_layout", fia_layout, (arrays, features.group_block_tables), {})]


def _jitted_functions() -> set[str]:
    """``module.name`` of every module-level jitted function in jaxprep and torch_bridge."""
    pytest.importorskip("torch")
    import torch_bridge

    jitted_type = type(jax.jit(lambda: 0))
    found = set()
    for package in (jaxprep, torch_bridge):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith("__main__"):  # importing it runs the CLI
                continue
            try:
                module = importlib.import_module(info.name)
            except ImportError as error:  # an optional extra (vllm) that is not installed: it defines no jit
                assert info.name in OPTIONAL_MODULES, f"{info.name}: {error}"
                continue
            for name, value in vars(module).items():
                defined_here = getattr(getattr(value, "__wrapped__", None), "__module__", None) == info.name
                if isinstance(value, jitted_type) and defined_here:  # not where it is imported
                    found.add(f"{info.name}.{name}")
    return found


OPTIONAL_MODULES = {"torch_bridge.vllm"}
"""Modules that import an optional extra; they hold no jitted function."""

COVERED = {
    "jaxprep.prepare.prepare_padded", "jaxprep.prepare.prepare_packed", "jaxprep.serving.step.serve_step",
    "jaxprep.serving.step.run_step",
    "jaxprep.serving.step.update_and_prepare", "jaxprep.serving.step.update_and_prepare_donated",
    "jaxprep.serving.transitions.apply_packed", "jaxprep.serving.update_packing.widen_packed",
    "jaxprep.serving.transitions.record_sampled", "jaxprep.serving.transitions.record_prev_tokens",
    "jaxprep.serving.transitions.record_with_prev_tokens",
    "jaxprep.serving.host.workload.dense_logits",
    "jaxprep.sharding.prepare_sharded", "jaxprep.serving.host.sharded.serve_step_sharded",
    "jaxprep.serving.host.sharded.apply_updates_sharded", "jaxprep.serving.host.sharded.update_and_prepare_sharded",
    "jaxprep.serving.host.sharded.update_and_prepare_sharded_donated",
    "jaxprep.array_packing.pack", "torch_bridge.npu.fia_layout", "jaxprep.serving.spec_decode.ngram.propose_ngram_jit",
    "jaxprep.features.drafter.draft_prefill", "jaxprep.features.drafter.draft_decode_start",
    "jaxprep.features.drafter.draft_decode_advance", "jaxprep.features.grammar.apply_grammar_bitmask",
    "jaxprep.features.grammar.grammar_invalid_drafts", "jaxprep.models.load._write_rows",
    "jaxprep.layouts.tpu_inference.tpu_inference_layout", "jaxprep.layouts.tpu_inference.to_rpa_v3_cache",
    "jaxprep.serving.step.update_and_prepare_buffer", "jaxprep.step_buffer.prepare_buffer",
    "jaxprep.step_buffer._unpack",
}


def test_every_jitted_function_is_lowered_below():
    """A new jitted function fails here until it is added to `_cases` (and to COVERED)."""
    assert _jitted_functions() == COVERED


def _float_products(text: str) -> list[tuple[str, str]]:
    """(precision, location) of every floating-point dot_general or convolution in a StableHLO text."""
    locations = dict(re.findall(r'^(#loc\d+) = loc\((.*)\)$', text, flags=re.MULTILINE))
    found = []
    for line in text.splitlines():
        if "stablehlo.dot_general" not in line and "stablehlo.convolution" not in line:
            continue
        operand_types = re.search(r":\s*\((.*?)\)\s*->", line).group(1)
        if not any(f"x{kind}>" in operand_types or f"<{kind}>" in operand_types for kind in FLOAT_TYPES):
            continue
        precision = re.search(r"precision = \[(\w+)", line)
        loc = re.search(r"loc\((#loc\d+)\)\s*$", line)
        found.append((precision.group(1) if precision else "DEFAULT", _expand(loc.group(1), locations) if loc else ""))
    return found


def _expand(loc: str, locations: dict[str, str], depth: int = 0) -> str:
    """A location with its #loc references spelled out (named scopes live in the references)."""
    text = locations.get(loc, loc)
    if depth > 20:
        return text
    return re.sub(r"#loc\d+", lambda m: _expand(m.group(0), locations, depth + 1), text)


def _in_model(location: str) -> bool:
    """Whether an op's location lies in the model's named scope (``model/...`` in its name stack)."""
    return re.search(rf'(?<![\w]){MODEL_SCOPE}/', location) is not None


TRITON_CALL = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
"""The fused Pallas step's kernels (`PrepConfig.kernel`): Triton calls, which jax.export does not
promise to keep stable; only the lowering is read here, nothing is serialized."""


def _lowered_text(fn, args, kwargs, platform: str) -> str:
    exported = jax.export.export(fn, platforms=(platform,), disabled_checks=[TRITON_CALL])(*args, **kwargs)
    return exported.mlir_module()


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_accelerator_lowerings_have_no_float_products_in_index_math(case):
    name, fn, args, kwargs = case
    for platform in ACCELERATORS:
        products = _float_products(_lowered_text(fn, args, kwargs, platform))
        outside_model = [p for p in products if not _in_model(p[1])]
        assert not outside_model, f"{name} on {platform}: float products in index math: {outside_model}"


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_cpu_lowering_keeps_float_products_only_at_highest_precision(case):
    name, fn, args, kwargs = case
    products = _float_products(_lowered_text(fn, args, kwargs, "cpu"))
    loose = [p for p in products if p[0] != "HIGHEST" and not _in_model(p[1])]
    assert not loose, f"{name}: float products below HIGHEST precision outside the model: {loose}"


def test_the_model_scope_is_where_the_model_products_are():
    """The exemption is not vacuous: the serving step's model products are found, and all in scope."""
    serving = _serving_config(SMALL)
    args = _serving_args(serving)
    products = _float_products(_lowered_text(step.serve_step, args, dict(config=serving, model=MODEL,
                                                                         num_tokens_padded=32), "cuda"))
    assert len(products) >= 4
    assert all(_in_model(location) for _, location in products)


def test_cpu_lowering_holds_the_float_scan_and_accelerators_the_integer_scan():
    """The platform switch does pick: float products on CPU, an integer scan elsewhere."""
    scan = jax.jit(ragged.prefix_sum, static_argnums=1)
    args = (jax.ShapeDtypeStruct((2, 3001), jnp.int32), 6002)
    cpu = _lowered_text(scan, args, {}, "cpu")
    assert [p[0] for p in _float_products(cpu)] and all(p[0] == "HIGHEST" for p in _float_products(cpu))
    for platform in ACCELERATORS:
        text = _lowered_text(scan, args, {}, platform)
        assert not _float_products(text) and "jit(cumsum)" in text, platform  # the integer scan's call


# --- what DEFAULT precision would do to the float scan -------------------------------------------

def _round_mantissa(x: jax.Array, bits: int) -> jax.Array:
    """float32 ``x`` rounded to ``bits`` explicit mantissa bits (round to nearest even), as a GPU's
    TF32 (10 bits) or a TPU's bfloat16 pass (7 bits) rounds a DEFAULT-precision product's inputs."""
    drop = 23 - bits
    word = jax.lax.bitcast_convert_type(x, jnp.uint32)
    half = jnp.uint32(1 << (drop - 1)) - 1 + ((word >> drop) & 1)
    return jax.lax.bitcast_convert_type(((word + half) >> drop) << drop, jnp.float32)


@pytest.mark.parametrize("bits, name", [(10, "tf32"), (7, "bf16")])
def test_the_float_scan_is_wrong_under_accelerator_input_rounding(monkeypatch, bits, name):
    """One 3001-token chunk and a 1024-request scan: the rounded product gets them wrong (scans longer
    than `SHORT_SCAN`: shorter ones are XLA's cumsum, no product)."""
    def rounded_matmul(a, b):
        return jnp.matmul(_round_mantissa(a, bits), _round_mantissa(jnp.asarray(b), bits))

    chunk = np.zeros((1, ragged.SHORT_SCAN + 1), np.int32)  # one prefill chunk, two decodes, idle rows
    chunk[0, :3] = [3001, 1, 2]
    counts = np.random.default_rng(0).integers(1, 40, (1, 1024)).astype(np.int32)
    exact = [np.cumsum(chunk, axis=1), np.cumsum(counts, axis=1)]
    for values, want in zip([chunk, counts], exact):  # the real (HIGHEST) float scan is exact on CPU
        np.testing.assert_array_equal(ragged._f32_prefix_sum(jnp.asarray(values)), want)
    monkeypatch.setattr(ragged, "_exact_matmul", rounded_matmul)
    for values, want in zip([chunk, counts], exact):
        with jax.disable_jit():
            got = np.asarray(ragged._f32_prefix_sum(jnp.asarray(values)))
        assert not np.array_equal(got, want), f"{name} rounding left the scan exact: the test proves nothing"


def test_tf32_rounds_a_3001_token_chunk_to_3000():
    assert float(_round_mantissa(jnp.float32(3001.0), 10)) == 3000.0
    assert float(_round_mantissa(jnp.float32(257.0), 7)) == 256.0
    assert float(_round_mantissa(jnp.float32(1024.0), 10)) == 1024.0


def test_take_rows_clamps_every_row_before_its_unchecked_gather():
    """The only ``promise_in_bounds`` gather: rows outside the table read the fill value."""
    table = jnp.asarray(np.arange(12, dtype=np.int32).reshape(3, 4))
    rows = jnp.asarray([2, 3, -1, 2**31 - 1, -(2**31), 0], jnp.int32)
    got = jax.jit(ragged.take_rows, static_argnums=2)(table, rows, -7)
    want = np.array([[8, 9, 10, 11]] + [[-7] * 4] * 4 + [[0, 1, 2, 3]])
    np.testing.assert_array_equal(got, want)
    promised = [line for line in _lowered_text(jax.jit(ragged.take_rows, static_argnums=2),
                                               (table, rows, -7), {}, "cuda").splitlines()
                if "stablehlo.gather" in line]
    assert len(promised) == 1
