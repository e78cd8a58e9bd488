"""The steady program: an update that finishes, adds and resumes no row (the common decode step) is applied by
a program that reads those sections at size 0 (`unpack_updates(..., steady=True)`), a third fewer kernels.

Checked: on random steady updates of three configurations (plain; spec decode with sampling; every feature:
two KV groups, M-RoPE, prompt embeddings, LoRA slots, grammar rows, a Mamba table), the steady door step leaves
the state and prepares the step bit for bit as the general program does; a buffer that finishes, adds or
resumes a row is refused whole by the steady program (the ``packed_counts`` bit, nothing else written), which
the general program applies (the control); the warmed door routes each buffer to its program and compiles
nothing (the separate-updates engine's routing: tests/serving/test_separate_updates.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprep import FeatureConfig, KVCacheGroupSpec, LoRAConfig, PrepConfig, SamplingConfig
from jaxprep.features.config import HybridConfig
from jaxprep.serving import ServingBatch, ServingConfig, StepUpdates
from jaxprep.serving.host import batch as batch_module
from jaxprep.serving.host.batch import steady_buckets
from jaxprep.serving.state import ERROR_BITS
from jaxprep.serving.step import update_and_prepare_buffer
from jaxprep.serving.transitions import apply_packed
from jaxprep.serving.update_packing import HEADER, HEADER_WORDS, SEGMENT_FIELDS, is_steady, payload_buckets
from support.run_keys import recording_run

VOCAB = 64


def _config(rows: int, budget: int, **features) -> ServingConfig:
    k = features.get("num_speculative_tokens", 0)
    return ServingConfig(prep=PrepConfig(max_num_reqs=rows, max_model_len=32, max_num_batched_tokens=budget,
                                         block_size=4, num_blocks=64, features=FeatureConfig(**features)),
                         num_speculative_tokens=k, vocab_size=VOCAB)


GROUPS = (KVCacheGroupSpec(block_size=4), KVCacheGroupSpec(block_size=8, sliding_window=8, num_blocks=16))
CONFIGS = {
    "plain": _config(6, 32),
    "spec": _config(6, 32, num_speculative_tokens=2, sampling=SamplingConfig(vocab_size=VOCAB)),
    "every feature": _config(4, 16, num_speculative_tokens=2, discard_request_mask=True, kv_groups=GROUPS, mrope=True,
                             prompt_embeds=True, lora=LoRAConfig(max_loras=2), structured_outputs=True,
                             hybrid=HybridConfig(), sampling=SamplingConfig(vocab_size=VOCAB)),
}


def _groups(config: ServingConfig) -> int:
    return len(config.prep.features.kv_groups) or 1


def _request(config: ServingConfig, row: int, rng) -> dict:
    """A request of 5..20 tokens with a random prefix computed, its blocks and, where on, its feature values."""
    n = int(rng.integers(5, 21))
    request = dict(row=row, token_ids=rng.integers(0, VOCAB, n), num_computed_tokens=int(rng.integers(0, n)))
    blocks = [int(b) for b in rng.choice(np.arange(1, 64), -(-n // 4), replace=False)]
    if _groups(config) == 1:
        return dict(request, block_ids=blocks)
    features = config.prep.features
    return dict(request, block_ids=[blocks, [0] + [int(b) for b in rng.integers(1, 16, -(-n // 8) - 1)]],
                mrope_positions=rng.integers(0, 100, (3, n)), mrope_position_delta=int(rng.integers(-5, 5)),
                is_token_ids=rng.random(n) < 0.5, prompt_embeds_start=int(rng.integers(0, 5)),
                lora_id=int(rng.integers(0, 3)), mamba_block_ids=[int(rng.integers(1, 64))], prompt_len=n - 1) \
        if features.mrope else dict(request, block_ids=[blocks, [0]])


def _busy_batch(config: ServingConfig, rng) -> ServingBatch:
    """Rows 0..R-2 hold random requests (the last row free), applied by the general program."""
    batch = ServingBatch(config)
    rows = config.max_num_reqs - 1
    batch.apply_updates(StepUpdates.build(config, add=[_request(config, r, rng) for r in range(rows)],
                                          lora_slots=[1, -1] if config.prep.features.lora else None))
    return batch


def _steady_update(config: ServingConfig, batch: ServingBatch, rng) -> StepUpdates:
    """A random update of running rows only: each busy row scheduled (its remaining prefill in part, or one
    token with drafts), blocks appended to some rows, grammar rows and LoRA slots where on."""
    rows, k, features = config.max_num_reqs - 1, config.num_speculative_tokens, config.prep.features
    mirror = batch.rows
    scheduled, drafts = np.zeros(config.max_num_reqs, np.int64), np.zeros(config.max_num_reqs, np.int64)
    budget = config.prep.max_num_batched_tokens
    for row in rng.permutation(rows):
        left = int(mirror.num_tokens[row] - mirror.num_computed_tokens[row])
        if left > 1:
            want = int(rng.integers(1, left + 1))
        else:
            drafts[row] = int(rng.integers(0, k + 1)) if k else 0
            want = 1 + drafts[row]
        if want > budget:
            drafts[row] = 0
            continue
        scheduled[row], budget = want, budget - want
    appends = {}
    for row in range(rows):
        if rng.random() < 0.5:
            ids = [int(b) for b in rng.integers(1, 64, int(rng.integers(1, 3)))]
            appends[row] = ids if _groups(config) == 1 else [ids, []]
    extra = {}
    if features.structured_outputs:
        extra["grammar_index"] = {int(r): i for i, r in enumerate(np.flatnonzero(scheduled)[:2])}
    if features.lora is not None and rng.random() < 0.5:
        extra["lora_slots"] = [int(rng.integers(1, 4)), -1]
    return StepUpdates.build(config, append=appends, num_scheduled_tokens=scheduled, num_draft_tokens=drafts,
                             draft_token_ids=rng.integers(0, VOCAB, (config.max_num_reqs, k)), **extra)


def _bucket(config: ServingConfig, updates: StepUpdates) -> int:
    return config.prep.bucket_for(max(int(updates.schedule.num_scheduled_tokens.sum()), 1))


def _copy(state):
    return jax.tree.map(jnp.copy, state)


def _assert_same(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_steady_update_applies_as_the_general_program_applies_it(name):
    config, rng, compared = CONFIGS[name], np.random.default_rng(7), 0
    for _ in range(4):
        batch = _busy_batch(config, rng)
        for _ in range(3):
            updates = _steady_update(config, batch, rng)
            packed = batch.pack(updates)
            assert packed.steady and not packed.before
            bucket, before = _bucket(config, updates), _copy(batch.state)
            general = update_and_prepare_buffer(_copy(before), packed.step, config=config, num_tokens_padded=bucket)
            steady = update_and_prepare_buffer(_copy(before), packed.step, config=config, num_tokens_padded=bucket,
                                               steady=True)
            _assert_same(steady, general)
            assert int(np.asarray(steady[0].errors)[0]) == 0
            batch.update_and_prepare(updates, bucket)  # the door's own step: the mirror moves on
            _assert_same(batch.state, general[0])
            compared += 1
    assert compared == 12
    # negative control: the last buffer with its schedule's first word changed gives another step, and it is seen
    changed = packed.step.copy()
    first = HEADER_WORDS + len(SEGMENT_FIELDS) * changed[HEADER.index("n_segments")]  # a steady buffer's schedule
    changed[first] = 0 if changed[first] else 1
    with pytest.raises(AssertionError):
        _assert_same(steady, update_and_prepare_buffer(_copy(before), changed, config=config, num_tokens_padded=bucket,
                                                       steady=True))


def _moving_updates(config: ServingConfig, rng) -> dict[str, StepUpdates]:
    free = config.max_num_reqs - 1
    return {"finish": StepUpdates.build(config, finish=[0]),
            "add": StepUpdates.build(config, add=[_request(config, free, rng)]),
            "resume": StepUpdates.build(config, resume=[dict(row=0, num_computed_tokens=0, token_ids=[1, 2, 3])])}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_steady_program_refuses_a_buffer_that_moves_a_row(name):
    config, rng = CONFIGS[name], np.random.default_rng(3)
    batch = _busy_batch(config, rng)
    counts = ERROR_BITS["packed_counts"]
    words = payload_buckets(config)[-1]
    for what, updates in _moving_updates(config, rng).items():
        # the buffer holding the section (a large add goes before the step's buffer, `pack_columns`)
        buffer = next(b for b in batch.pack(updates).buffers if b[HEADER.index(f"n_{what}")] > 0)
        assert not is_steady(buffer), what
        buffer = np.pad(buffer, (0, words - len(buffer)))
        before = batch.state
        refused = apply_packed(_copy(before), buffer, config=config, steady=True)
        assert int(np.asarray(refused.errors)[0]) == counts, what
        after, was = refused.to_numpy(), before.to_numpy()
        assert after.keys() == was.keys() and "errors" in after
        for field in after.keys() - {"errors"}:  # all but the error word as before
            _assert_same(after[field], was[field])
        # control: the general program takes the same buffer, and it changes the state
        applied = apply_packed(_copy(before), buffer, config=config)
        assert int(np.asarray(applied.errors)[0]) == 0, what
        with pytest.raises(AssertionError):
            _assert_same(applied, before)


def test_is_steady_reads_the_three_counts():
    config = CONFIGS["plain"]
    batch = _busy_batch(config, np.random.default_rng(0))
    assert is_steady(batch.pack(StepUpdates.build(config, num_scheduled_tokens=[1] * 5 + [0])).step)
    assert is_steady(batch.pack(StepUpdates.build(config, append={2: [9]})).step)
    for what, updates in _moving_updates(config, np.random.default_rng(0)).items():
        assert not batch.pack(updates).steady, what


def test_the_warmed_door_routes_each_buffer_to_its_program_and_compiles_nothing(monkeypatch):
    """After the warm-up (the door's step for any update at every bucket and step rung, the steady one at a
    decode's buckets: 5 rows, no drafts -> bucket 8 only), steady steps of up to 8 tokens take the steady program;
    a steady chunk of 12 tokens (bucket 16), an admission and a finish take the general one; nothing compiles.
    Without a warm-up (the control) every buffer takes the general program: no second program on first use."""
    from jaxprep import count_compiles

    config, rng = CONFIGS["plain"], np.random.default_rng(9)
    assert steady_buckets(config) == (8,) and config.prep.reachable_buckets[:2] == (8, 16)
    keys = []
    monkeypatch.setattr(batch_module, "run", recording_run(keys))
    add = StepUpdates.build(config, add=[dict(row=r, token_ids=rng.integers(0, VOCAB, 20),
                                              block_ids=[4 * r + b + 1 for b in range(5)]) for r in range(5)],
                            num_scheduled_tokens=[4, 4, 4, 4, 4, 0])
    steps = [(add, 32)] + [(StepUpdates.build(config, finish=finish, num_scheduled_tokens=scheduled),
                            config.prep.bucket_for(sum(scheduled)))
                           for scheduled, finish in (([1, 1, 1, 1, 1, 0], ()), ([4, 4, 4, 0, 0, 0], ()),
                                                     ([1, 2, 1, 1, 1, 0], ()), ([1, 1, 1, 1, 0, 0], (4,)))]
    routes = {}
    for warmed in (True, False):
        batch = ServingBatch(config)
        if warmed:
            batch.warmup()
            steady = [key for key in batch.executables if key[0] == "door" and key[-1]]
            assert steady and {key[1] for key in steady} == set(steady_buckets(config))
        keys.clear()
        with count_compiles() as compiles:
            for updates, bucket in steps:
                batch.update_and_prepare(updates, bucket)
        routes[warmed] = [key[1:] for key in keys if key[0] == "door"]
        if warmed:
            assert compiles.compiles == 0
        assert {key for key in keys if key[0] == "apply"} == {("apply", False)}  # the admission's leading buffers
    assert routes[True] == [(32, 64, False), (8, 64, True), (16, 64, False), (8, 64, True), (8, 64, False)]
    assert routes[False] == [(32, 64, False), (8, 64, False), (16, 64, False), (8, 64, False), (8, 64, False)]
