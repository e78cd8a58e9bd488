"""Per-step cost of each optional feature: a plain step against the same step with one feature on.

    PYTHONPATH=. python benchmarks/bench_features.py [--reqs 64] [--tokens 2048] [--iters 100] [--rounds 5]
        [--only NAME ...] [--default-runtime]
    PYTHONPATH=. python benchmarks/bench_features.py --checks-cost   # the fast-path checks, on and off

Runs on one CPU thread (``PJRT_NPROC=1``) with synchronous dispatch, the way the CLI does, unless
``--default-runtime``. Every configuration is compiled first (compile time reported apart), then
timed call by call with ``block_until_ready`` inside the clock, in rounds that sweep every
configuration (each keeps its best median, so load from other processes hits all alike); the plain
step and vLLM V1's host-side preparation of the plain batch (`vllm_v1_baseline.VllmV1HostPrep`, the
benchmarks' baseline, checked equal to jaxprep's plain step) are measured in the same process. The
table gives each feature's time, its extra microseconds over plain, the ratio to plain and the
ratio to the vLLM V1 baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import configure_benchmark_runtime

RUNTIME = configure_benchmark_runtime()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_prepare import v1_baseline  # noqa: E402
from common import (  # noqa: E402
    add_runtime_argument,
    assert_same_step,
    interleaved_us,
    load_line,
    machine_line,
    unchecked_step,
)

from jaxprep import (  # noqa: E402
    BatchState,
    DCPConfig,
    FeatureConfig,
    KVCacheGroupSpec,
    LoRAConfig,
    PrepConfig,
    SamplingConfig,
    prepare_inputs,
    prepare_padded,
    validate,
)
from jaxprep.config import block_table_width, cdiv  # noqa: E402
from jaxprep.features import DrafterConfig, HybridConfig  # noqa: E402
from jaxprep.features.drafter import draft_decode_start, draft_prefill  # noqa: E402
from jaxprep.features.grammar import apply_grammar_bitmask, grammar_invalid_drafts  # noqa: E402
from jaxprep.features.sampling import empty_sampling_rows  # noqa: E402

K = 3  # draft tokens per decode when spec decode is on
LORA = LoRAConfig(max_loras=8, vocab_size=32000)  # requests cycle through 6 loaded adapters and none
SAMPLING = SamplingConfig(vocab_size=32000)  # requests cycle through greedy, T 0.7 / top-k 50, T 1 / top-p 0.9
BASELINE = "vLLM V1 host path (plain)"
BLOCK_SIZE = 16
FEATURES = {
    "plain": FeatureConfig(),
    "spec_decode (K=3)": FeatureConfig(num_speculative_tokens=K),
    "discard_request_mask": FeatureConfig(discard_request_mask=True),
    "kv_groups (3 groups)": FeatureConfig(kv_groups=(
        KVCacheGroupSpec(BLOCK_SIZE), KVCacheGroupSpec(32, kernel_block_size=16),
        KVCacheGroupSpec(BLOCK_SIZE, sliding_window=512))),
    "dcp (W=4, I=1)": FeatureConfig(dcp=DCPConfig(4, 1, 1)),
    "mrope": FeatureConfig(mrope=True),
    "prompt_embeds": FeatureConfig(prompt_embeds=True),
    "async_tokens": FeatureConfig(async_tokens=True),
    "async_tokens + spec": FeatureConfig(async_tokens=True, num_speculative_tokens=K),
    "attn_state": FeatureConfig(attn_state=True),
    "attn_mask compressed": FeatureConfig(attn_mask="compressed"),
    "attn_mask rows_bool": FeatureConfig(attn_mask="rows_bool"),
    "attn_mask rows_additive fp16": FeatureConfig(attn_mask="rows_additive"),
    "reorder decode_first": FeatureConfig(reorder="decode_first"),
    "reorder v2": FeatureConfig(reorder="v2"),
    "request_distribution": FeatureConfig(request_distribution=True),
    "drafter (K=3, target side)": FeatureConfig(num_speculative_tokens=K, drafter=DrafterConfig()),
    "hybrid (none, chunk 256)": FeatureConfig(hybrid=HybridConfig(chunk_size=256)),
    "hybrid (align, K=3, ckpt)": FeatureConfig(num_speculative_tokens=K, hybrid=HybridConfig(
        mode="align", block_size=BLOCK_SIZE, num_speculative_blocks=K, chunk_size=256, checkpoints=True)),
    "structured_outputs (K=3)": FeatureConfig(num_speculative_tokens=K, structured_outputs=True),
    "ubatches (2)": FeatureConfig(num_ubatches=2),
    "runner v2 (order + logits rows)": FeatureConfig(runner="v2"),
    "logits_indirection (V1)": FeatureConfig(logits_indirection=True),
    "lora (8 slots)": FeatureConfig(lora=LORA),
    "lora + spec (K=3), V1": FeatureConfig(lora=LORA, num_speculative_tokens=K),
    "sampling (V 32000)": FeatureConfig(sampling=SAMPLING),
}
EVERY = FeatureConfig(num_speculative_tokens=K, discard_request_mask=True,
                      kv_groups=FEATURES["kv_groups (3 groups)"].kv_groups[:2], dcp=DCPConfig(4, 1, 1), mrope=True,
                      prompt_embeds=True, async_tokens=True, attn_state=True, attn_mask="compressed", reorder="v2",
                      request_distribution=True)
"""Every feature on (the row masks left out: 300+ us of mask writing would hide everything else; no
sliding-window group, which DCP does not support)."""
FEATURES.update({
    "every feature, V1": EVERY,
    "every feature + logits_indirection": dataclasses.replace(EVERY, logits_indirection=True),
    "every feature + lora": dataclasses.replace(EVERY, lora=LORA),
    "every feature + runner v2": dataclasses.replace(EVERY, runner="v2"),
    "every feature + runner v2 + lora": dataclasses.replace(EVERY, runner="v2", lora=LORA),
    "every feature + sampling": dataclasses.replace(EVERY, sampling=SAMPLING),
    "every feature + v2 + lora + sampling": dataclasses.replace(EVERY, runner="v2", lora=LORA, sampling=SAMPLING),
})
SPEC_BASE = "spec_decode (K=3)"
"""The runner features with K drafts add to this one (their rows above say so); the post-step functions
below run on its step with the feature on."""
VOCAB = 32_000


def batch(config: PrepConfig, num_reqs: int, num_tokens: int, rng) -> dict:
    """3/4 of the requests decode (with K drafts when spec decode is on), the rest share the other tokens."""
    features, rows, width = config.features, config.max_num_reqs, config.max_model_len
    num_decodes = num_reqs * 3 // 4
    decode_len = 1 + (K if features.spec_decode else 0)
    prefill_tokens = num_tokens - num_decodes * decode_len
    scheduled = np.array([decode_len] * num_decodes + [prefill_tokens // (num_reqs - num_decodes)] *
                         (num_reqs - num_decodes), np.int32)
    scheduled[-1] += num_tokens - scheduled.sum()
    computed = np.where(np.arange(num_reqs) < num_decodes, rng.integers(100, 2000, num_reqs), 0).astype(np.int32)
    arrays = dict(token_ids=rng.integers(1, 32000, (rows, width), np.int32),
                  block_table=_blocks(rows, config.max_blocks_per_req, computed + scheduled, BLOCK_SIZE),
                  num_computed_tokens=computed, num_scheduled_tokens=scheduled)
    return _feature_inputs(arrays, config, rng)


def _blocks(rows, width, seq_lens, block_size):
    table = np.zeros((rows, width), np.int32)
    start = 1
    for row, n in enumerate(seq_lens):
        count = cdiv(int(n), block_size)
        table[row, :count] = np.arange(start, start + count)
        start += count
    return table


def _feature_inputs(arrays: dict, config: PrepConfig, rng) -> dict:
    features, rows, width = config.features, config.max_num_reqs, config.max_model_len
    seq_lens = arrays["num_computed_tokens"] + arrays["num_scheduled_tokens"]
    decodes = (arrays["num_computed_tokens"] > 0).astype(np.int32)
    arrays["prefill_len"] = np.where(decodes, 1, seq_lens + 100).astype(np.int32)
    if features.spec_decode:
        arrays["num_draft_tokens"] = (decodes * K).astype(np.int32)
    if len(features.kv_groups) > 1:
        arrays["extra_block_tables"] = [_blocks(rows, block_table_width(width, g.block_size), seq_lens, g.block_size)
                                        for g in features.kv_groups[1:]]
    if features.mrope:
        arrays["mrope_positions"] = np.tile(np.arange(width, dtype=np.int32), (rows, 3, 1))
        arrays["mrope_position_delta"] = np.zeros(rows, np.int32)
    if features.prompt_embeds:
        arrays["is_token_ids"] = rng.random((rows, width)) < 0.5
        arrays["prompt_embeds_start"] = (np.arange(rows) * width).astype(np.int32)
    if features.async_tokens:
        arrays["prev_sampled_token_ids"] = rng.integers(1, 32000, rows).astype(np.int32)
        arrays["prev_batch_rows"] = np.where(decodes, rng.permutation(rows), -1).astype(np.int32)
        if features.spec_decode:
            arrays["prev_draft_token_ids"] = rng.integers(1, 32000, (rows, K)).astype(np.int32)
    if features.lora is not None:
        arrays["lora_slots"] = np.array([11, 12, 13, -1, 14, 15, 16, -1], np.int32)
        arrays["lora_ids"] = np.array([0, 11, 12, 13, 14, 15, 16] * rows, np.int32)[:rows]
    if features.sampling is not None:
        arrays.update(empty_sampling_rows(rows, features.sampling))
        kind = np.arange(rows) % 3  # 0 greedy, 1 T 0.7 top-k 50, 2 T 1 top-p 0.9
        arrays["temperature"] = np.choose(kind, [0.0, 0.7, 1.0]).astype(np.float32)
        arrays["top_k"] = np.where(kind == 1, 50, features.sampling.vocab_size).astype(np.int32)
        arrays["top_p"] = np.where(kind == 2, 0.9, 1.0).astype(np.float32)
    return _runner_inputs(arrays, config, rng)


def _runner_inputs(arrays: dict, config: PrepConfig, rng) -> dict:
    """Mamba state blocks, accepted counts and checkpoints; a grammar on every other request."""
    features, rows = config.features, config.max_num_reqs
    if features.hybrid is not None:
        width = features.hybrid.table_width(config.max_model_len)
        arrays["mamba_block_table"] = (1 + np.arange(rows * width, dtype=np.int32)).reshape(rows, width)
        arrays["num_accepted_tokens"] = np.ones(rows, np.int32)
        scheduled = arrays["num_scheduled_tokens"]
        arrays["mamba_checkpoint_offsets"] = np.where(scheduled > 64, scheduled // 2, 0).astype(np.int32)
    if features.structured_outputs:
        with_grammar = np.arange(rows) % 2 == 0
        arrays["grammar_index"] = np.where(with_grammar, np.cumsum(with_grammar) - 1, -1).astype(np.int32)
    return arrays


def setup_step(state, config, num_tokens: int):
    """(compile seconds, the call to time: one step with its outputs ready)."""
    def call():
        return jax.block_until_ready(prepare_inputs(state, config, num_tokens))

    start = time.perf_counter()
    call()
    return time.perf_counter() - start, call


def checked_step(state, config, num_tokens: int):
    """`prepare_padded` called directly (no `prepare_inputs` wrapper), compiled; returns the timed call."""
    def call():
        return jax.block_until_ready(prepare_padded(state, config, num_tokens))

    call()
    return call


def baseline_step(config: PrepConfig, num_tokens: int, plain_call):
    """vLLM V1's host path over the plain batch, checked equal to jaxprep's plain step."""
    arrays = batch(config, config.max_num_reqs, num_tokens, np.random.default_rng(0))
    baseline = v1_baseline(config, arrays)
    scheduled, num_reqs_padded = arrays["num_scheduled_tokens"], config.num_reqs_padded(num_tokens)
    assert_same_step(plain_call(), baseline.prepare(scheduled, num_tokens, num_reqs_padded))
    return lambda: baseline.prepare(scheduled, num_tokens, num_reqs_padded)


def post_step_calls(base: PrepConfig, num_reqs: int, num_tokens: int) -> dict:
    """The drafter and grammar functions that run after verification / on the logits, timed alone."""
    features = FeatureConfig(num_speculative_tokens=K, drafter=DrafterConfig(), structured_outputs=True)
    config = dataclasses.replace(base, features=features)
    state = BatchState.from_numpy(**batch(config, num_reqs, num_tokens, np.random.default_rng(0)))
    step = jax.block_until_ready(prepare_inputs(state, config, num_tokens))
    rows = step.num_reqs_padded
    sampled = jax.device_put(np.where(np.asarray(step.idx_mapping) >= 0, 2, 0).astype(np.int32))
    last = jax.device_put(np.ones(config.max_num_reqs, np.int32))
    draft = jax.block_until_ready(draft_prefill(step, sampled, last))
    tokens = jax.device_put(np.ones(rows, np.int32))
    num_logits = step.grammar.bitmask_rows.shape[0]
    logits = jax.device_put(np.zeros((num_logits, VOCAB), np.float32))
    bitmask = jax.device_put(np.full((num_logits, cdiv(VOCAB, 32)), -1, np.int32))
    acceptable = jax.device_put(np.ones(rows, np.int32))
    return {
        "draft_prefill (step 0 inputs)": lambda: jax.block_until_ready(draft_prefill(step, sampled, last)),
        "draft_decode_start (step 1)": lambda: jax.block_until_ready(draft_decode_start(draft, tokens, step,
                                                                                        config=config)),
        f"apply_grammar_bitmask (V={VOCAB})": lambda: jax.block_until_ready(apply_grammar_bitmask(logits, bitmask,
                                                                                              step.grammar)),
        "grammar_invalid_drafts": lambda: jax.block_until_ready(grammar_invalid_drafts(step.grammar, acceptable)),
    }


EVERY_INPUT = dataclasses.replace(EVERY, runner="v2", lora=LORA, sampling=SAMPLING, structured_outputs=True,
                                  hybrid=HybridConfig(chunk_size=256, num_speculative_blocks=K, checkpoints=True))
"""Every feature that reads a `BatchState` input: all of them carry bits of the error word."""
def checks_cost(base: PrepConfig, args) -> None:
    """The fast-path checks' cost: each step with and without them, timed in the same rounds."""
    calls = {}
    for name, features in (("plain", FeatureConfig()), ("every input feature (v2)", EVERY_INPUT)):
        config = dataclasses.replace(base, features=features)
        state = BatchState.from_numpy(**batch(config, args.reqs, args.tokens, np.random.default_rng(0)))
        validate(state, config)
        checked = checked_step(state, config, args.tokens)  # the jitted step itself, as the unchecked one
        unchecked = unchecked_step(state, config, args.tokens)
        assert int(checked().errors) == 0
        calls[f"{name}, checked"], calls[f"{name}, unchecked"] = checked, unchecked
    medians = interleaved_us(calls, args.iters, args.rounds)
    print(f"# fast-path checks: {args.reqs} requests, {args.tokens} tokens, max_model_len {args.max_model_len}, "
          f"best of {args.rounds} medians of {args.iters} calls")
    print(f"# {machine_line()}; {load_line()}")
    print(f"# {RUNTIME}")
    print(f"{'step':40s} {'median us':>10s} {'extra us':>9s} {'ratio':>6s}")
    for name in ("plain", "every input feature (v2)"):
        on, off = medians[f"{name}, checked"], medians[f"{name}, unchecked"]
        print(f"{name + ', unchecked':40s} {off:10.1f}")
        print(f"{name + ', checked':40s} {on:10.1f} {on - off:+9.1f} {on / off:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reqs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=100, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over all features; each keeps its best median")
    parser.add_argument("--only", nargs="+", metavar="NAME", default=None,
                        help="measure only these configurations (and plain), by their names in the table")
    parser.add_argument("--checks-cost", action="store_true",
                        help="only the cost of the fast-path checks (error word, dropped rows, clamped tables)")
    add_runtime_argument(parser)
    args = parser.parse_args()
    base = PrepConfig(max_num_reqs=args.reqs, max_model_len=args.max_model_len,
                      max_num_batched_tokens=args.tokens, block_size=BLOCK_SIZE)
    if args.checks_cost:
        checks_cost(base, args)
        return
    compile_s, calls = {}, {}
    chosen = {name: f for name, f in FEATURES.items() if args.only is None or name in ("plain", *args.only)}
    for name, features in chosen.items():
        config = dataclasses.replace(base, features=features)
        state = BatchState.from_numpy(**batch(config, args.reqs, args.tokens, np.random.default_rng(0)))
        validate(state, config)
        compile_s[name], calls[name] = setup_step(state, config, args.tokens)
    calls[BASELINE] = baseline_step(base, args.tokens, calls["plain"])
    post_steps = post_step_calls(base, args.reqs, args.tokens)
    calls.update(post_steps)
    medians = interleaved_us(calls, args.iters, args.rounds)
    print(f"# jaxprep feature costs: {args.reqs} requests, {args.tokens} tokens (bucket {args.tokens}), "
          f"max_model_len {args.max_model_len}, best of {args.rounds} medians of {args.iters} calls, rounds "
          f"sweeping every feature")
    print(f"# {machine_line()}; {load_line()}")
    print(f"# {RUNTIME}")
    print(f"{'feature':30s} {'compile s':>9s} {'median us':>10s} {'extra us':>9s} {'ratio':>6s} {'vs V1':>6s}")
    plain, v1 = medians["plain"], medians.pop(BASELINE)
    print(f"{BASELINE:30s} {'-':>9s} {v1:10.1f} {v1 - plain:+9.1f} {v1 / plain:6.2f} {1:6.2f}")
    for name, median in medians.items():
        if name in post_steps:
            continue
        print(f"{name:30s} {compile_s[name]:9.2f} {median:10.1f} {median - plain:+9.1f} {median / plain:6.2f} "
              f"{median / v1:6.2f}")
    print(f"# after the step (own jitted calls, on the {SPEC_BASE} batch; ratio to plain prepare):")
    for name in post_steps:
        print(f"{name:30s} {'-':>9s} {medians[name]:10.1f} {'-':>9s} {medians[name] / plain:6.2f} {'-':>6s}")


if __name__ == "__main__":
    main()
