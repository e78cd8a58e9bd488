"""bf16 serving (``dtype="bfloat16"``): greedy tokens against transformers running the same bf16
checkpoint in bf16, and no float32 copy of any weight or of the KV cache in the compiled step."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("transformers", reason="these tests build their checkpoints with transformers (test extra)")
pytest.importorskip("safetensors", reason="loading checkpoints needs safetensors (test extra)")

from jaxprep import PrepConfig, prepare_padded
from jaxprep._typing import as_compute
from jaxprep.models import build_params, load_model, parse_config
from jaxprep.models.load import checkpoint_shapes
from jaxprep.serving import Engine, KVCache, ServingBatch, ServingConfig
from jaxprep.serving.host.workload import random_workload
from support.hf_checkpoints import BF16_SPECS, bf16_reference_models, compare_greedy_bf16, save_checkpoint

PREP = PrepConfig(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=16, block_size=4, num_blocks=20,
                  token_buckets=(16,))


def _serve(directory: str):
    model, params = load_model(directory, dtype="bfloat16")
    config = ServingConfig(prep=PREP, eos_token_id=model.eos_token_ids[0], decode_steps=4)
    workload = random_workload(3, num_requests=6, vocab_size=model.vocab_size, prompt_len=(2, 36),
                               max_tokens=(4, 20), arrival_spread=6)
    engine = Engine(config, model, params=params)
    engine.submit(workload.requests, workload.arrival_steps)
    finished = sorted(engine.run(), key=lambda r: r.request_id)
    assert engine.stats.preemptions > 0 and len(finished) == len(workload.requests)
    return engine, finished


def test_bf16_greedy_tokens_match_transformers_in_bf16(tmp_path):
    """Chunked prefill, preemption, mixed batches in bf16 (llama, llama3 RoPE): every token equals transformers'
    bf16 greedy token wherever transformers' top-2 margin exceeds bf16 noise; a token changed at such a position
    is a mismatch. (Qwen3 in bf16: `test_generate_bf16_matches_transformers_and_reports_rates`.)"""
    name = "llama-llama3-rope-bf16"
    save_checkpoint(BF16_SPECS[name], str(tmp_path))
    engine, finished = _serve(str(tmp_path))
    assert engine.kv_cache.k.dtype in (jnp.bfloat16, jnp.uint16)  # bf16, or its bit patterns on XLA:CPU
    hf_models = bf16_reference_models(str(tmp_path))
    check = compare_greedy_bf16(hf_models, finished)
    print(f"{name}: {check}")
    assert check.num_tokens > 45
    assert check.mismatches == 0, check
    assert check.near_ties <= 2, check  # divergences at near-ties (each ends that request's comparison)

    # negative control: the longest request with its first token replaced by another one
    longest = max(finished, key=lambda r: len(r.output_token_ids))
    shifted = dataclasses.replace(longest, output_token_ids=[(longest.output_token_ids[0] + 1) % 320]
                                  + longest.output_token_ids[1:])
    assert compare_greedy_bf16(hf_models, [shifted]).mismatches == 1


RAW = {"model_type": "qwen3", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
       "max_position_embeddings": 512, "tie_word_embeddings": False}


@functools.partial(jax.jit, static_argnames=("model",))
def _step(params, kv_cache, state, *, model):
    inputs = prepare_padded(state.batch, PREP, 16)
    return model.forward(params, kv_cache, inputs, block_size=PREP.block_size, max_model_len=PREP.max_model_len)


def _float32_copies(compiled_text: str, shapes: set[tuple[int, ...]]) -> set[tuple[int, ...]]:
    """Shapes in ``shapes`` (or those shapes with a leading size-1 axis) of float32 arrays in compiled HLO."""
    found = set()
    for match in re.finditer(r"f32\[([\d,]+)\]", compiled_text):
        shape = tuple(int(n) for n in match.group(1).split(","))
        if shape in shapes or (shape[0] == 1 and shape[1:] in shapes):
            found.add(shape)
    return found


def test_bf16_step_holds_no_float32_copy_of_weights_or_cache():
    """The compiled bf16 step reads bf16 weights and a bf16 cache as they are: no float32 array of a
    weight's or the cache's shape (per layer or stacked), temporaries far below one float32 copy, float32
    logits. Negative control on XLA:CPU: the same step over params held as plain bf16 arrays (which XLA:CPU's
    float normalization upcasts) does hold float32 copies."""
    config = dataclasses.replace(parse_config(RAW), dtype="bfloat16")
    rng = np.random.default_rng(0)
    params = build_params(config, {name: rng.standard_normal(shape).astype(np.float32)
                                   for name, shape in checkpoint_shapes(config).items()})
    kv_cache = KVCache.zeros(config, PREP.num_blocks, PREP.block_size)
    state = ServingBatch(ServingConfig(prep=PREP)).state
    leaves = jax.tree.leaves(params)
    shapes = {tuple(x.shape) for x in leaves if x.size > 10_000} | {tuple(x.shape[1:]) for x in leaves if x.ndim == 3}
    shapes |= {tuple(kv_cache.k.shape), tuple(kv_cache.k.shape[1:])}
    bf16_bytes = sum(x.nbytes for x in leaves)

    compiled = _step.lower(params, kv_cache, state, model=config).compile()
    assert all(x.dtype.itemsize == 2 for x in leaves)
    assert _float32_copies(compiled.as_text(), shapes) == set()
    assert compiled.memory_analysis().temp_size_in_bytes < bf16_bytes * 0.75  # a float32 copy: 2x bf16_bytes
    _, logits = _step(params, kv_cache, state, model=config)
    assert logits.dtype == jnp.float32

    if jax.default_backend() == "cpu":
        plain = jax.tree.map(lambda x: as_compute(x, jnp.bfloat16), params)
        control = _step.lower(plain, kv_cache, state, model=config).compile()
        assert _float32_copies(control.as_text(), shapes)
        assert control.memory_analysis().temp_size_in_bytes > bf16_bytes


def test_generate_bf16_matches_transformers_and_reports_rates(tmp_path, capsys):
    """`jaxprep generate --dtype bfloat16` on the bf16 Qwen3 checkpoint (qk-norm; prompts prefilled in chunks
    of 8): tokens equal transformers' bf16 greedy tokens beyond near-ties; stderr shows the loading, compiling,
    prefill and decode bars; the JSON line reports every prompt token as prefill and the rates."""
    from jaxprep.cli import main

    save_checkpoint(BF16_SPECS["qwen3-bf16"], str(tmp_path))
    prompts = [[5, 17, 300, 42, 9, 11, 23, 4, 4, 8, 19], [7, 7, 100], [31, 8, 250, 3, 3]]
    argv = ["generate", "--model", str(tmp_path), "--dtype", "bfloat16", "--max-tokens", "10", "--ignore-eos",
            "--budget", "8", "--block-size", "4", "--progress", "always", "--json"]
    for prompt in prompts:
        argv += ["--prompt-ids", " ".join(map(str, prompt))]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    for bar in ("loading (bfloat16)", "compiling", "prefill", "decode"):
        assert bar in err
    result = json.loads(out)  # stdout holds the JSON object alone
    rates = result["rates"]
    assert rates["prefill_tokens"] == sum(map(len, prompts)) and rates["prefill_tokens_per_s"] > 0
    assert 0 < rates["decode_tokens"] <= 9 * len(prompts) and rates["decode_tokens_per_s"] > 0
    assert "qwen3 (2 layers, vocab 320, bfloat16)" in err and "== prefill 19 tokens in" in err  # --json: stdout JSON

    class Finished:
        def __init__(self, i):
            self.request_id, self.prompt_token_ids, self.output_token_ids = i, prompts[i], result["outputs"][i]
            self.max_tokens = 10

    check = compare_greedy_bf16(bf16_reference_models(str(tmp_path)), [Finished(i) for i in range(3)])
    print(check)
    assert check.num_tokens >= 20 and check.mismatches == 0 and check.near_ties <= 1, check


def test_threads_per_job(monkeypatch, tmp_path):
    """One XLA thread only for the tiny built-in model; a checkpoint gets XLA's default, ``--threads N`` N."""
    from jaxprep.cli import configure_runtime, parse_args
    from jaxprep.cli._checkpoint import single_thread_cpu

    async_dispatch = jax.config.read("jax_cpu_enable_async_dispatch")
    try:
        monkeypatch.delenv("PJRT_NPROC", raising=False)
        _, args = parse_args(["simulate", "--requests", "2"])
        assert single_thread_cpu(args) and os.environ["PJRT_NPROC"] == "1"
        monkeypatch.delenv("PJRT_NPROC")
        save_checkpoint(BF16_SPECS["qwen3-bf16"], str(tmp_path))  # the folder is checked before anything runs
        _, args = parse_args(["simulate", "--model", str(tmp_path), "--requests", "2"])
        assert not single_thread_cpu(args) and "PJRT_NPROC" not in os.environ
        _, args = parse_args(["simulate", "--model", str(tmp_path), "--threads", "3"])
        assert os.environ["PJRT_NPROC"] == "3"
        monkeypatch.delenv("PJRT_NPROC")
        configure_runtime(single_thread_cpu=False)
        assert "PJRT_NPROC" not in os.environ
    finally:
        jax.config.update("jax_cpu_enable_async_dispatch", async_dispatch)


def test_chunked_lm_head_equals_one_product(monkeypatch):
    """A head stored as bit patterns (bf16 on XLA:CPU) is multiplied in vocabulary chunks (no copy of the whole
    head): the logits equal one product over the bf16 head; a chunk put in the wrong place fails."""
    from jaxprep.models import llama

    config = dataclasses.replace(parse_config(RAW), dtype="bfloat16")
    rng = np.random.default_rng(1)
    bits = jnp.asarray(rng.standard_normal((2048, 256)).astype(ml_dtypes.bfloat16).view(np.uint16))
    params = {"embed_tokens": bits, "lm_head": bits, "norm": jnp.ones(256, jnp.bfloat16)}
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    monkeypatch.setattr(llama, "LOGITS_CHUNK", 512)
    assert llama._vocab_chunk(2048) == 512
    chunked = jax.jit(lambda p, x: llama._logits(p, x, config))(params, x)
    plain = jax.jit(lambda p, x: llama._logits(p, x, config))({**params, "lm_head": as_compute(bits, jnp.bfloat16)}, x)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(plain), rtol=1e-6, atol=1e-6)
    rolled = np.roll(np.asarray(chunked), 512, axis=1)
    assert not np.allclose(rolled, np.asarray(plain), atol=1e-3)
