"""The door's step is compiled at no more than two payload rungs per token bucket (`batch.door_rungs`): the
smallest rung that holds a step of min(bucket, max_num_reqs) scheduled rows and the top step rung; a step's buffer
is padded on the host to the first of them that holds it (`batch.door_buffer`).

Checked: the rungs of a 256-row configuration, worked out by hand; a buffer padded to a larger rung leaves the
state and prepares the step bit for bit as at its own rung (general and steady programs, updates that add,
finish and append, and steady ones), with a negative control; the door's steps of a run use only the executables
a warm-up lists (so none compiles after it), and the warm-up lists one door program per bucket and door rung;
the `Engine`'s fused serving step likewise (one program per bucket and door rung, nothing compiled after the
warm-up, the tokens checked against the dense model and the data-parallel engine's).
"""

from __future__ import annotations

import copy

import jax
import numpy as np
import pytest

from jaxprep import FeatureConfig, PrepConfig
from jaxprep.serving import Engine, ServingBatch, ServingConfig, StepUpdates, check_against_dense, random_workload
from jaxprep.serving.host import batch as batch_module
from jaxprep.serving.host import sharded as sharded_module
from jaxprep.serving.host.batch import (
    door_buffer,
    door_rungs,
    door_step_words,
    steady_buckets,
    takes_admissions_whole,
)
from jaxprep.serving.host.dp_engine import DataParallelEngine
from jaxprep.serving.step import update_and_prepare_buffer
from jaxprep.serving.update_packing import bulk_rungs, is_steady, pad_to, step_payload_buckets
from jaxprep.sharding import data_mesh
from support.loop_workloads import MODEL, make_config
from support.run_keys import recording_run, run_after_warmup

VOCAB = 64


def _config(rows: int, max_model_len: int, budget: int, drafts: int = 0) -> ServingConfig:
    prep = PrepConfig(max_num_reqs=rows, max_model_len=max_model_len, max_num_batched_tokens=budget, block_size=4,
                      num_blocks=8 * rows + 8, features=FeatureConfig(num_speculative_tokens=drafts))
    return ServingConfig(prep=prep, num_speculative_tokens=drafts, vocab_size=VOCAB)


def test_the_rungs_of_each_bucket_worked_out():
    """256 rows, one table: a step of n rows takes 10 header words, n sparse schedule entries (row, count: 2
    words; with 2 drafts 5) and n one-block segments (kind, row, column, length, the id: 5 words)."""
    config = _config(256, 256, 1024)
    assert step_payload_buckets(config) == (64, 96, 144, 224, 336, 512, 768)
    expected = {8: (96, 768),  # 10 + 16 + 40 = 66
                16: (144, 768),  # 122
                32: (336, 768),  # 234
                64: (512, 768),  # 458
                96: (768,), 256: (768,), 768: (768,), 1024: (768,)}  # 682 and more: the top alone
    assert {bucket: door_rungs(config, bucket, steady=True) for bucket in expected} == expected
    # the general programs: at 1024 tokens (more than the top rung's 768 words) the bulk rung holds a whole
    # admission, 10 + 256 add records of 6 fields + 1024 tokens + 1024 / 4 + 256 blocks = 3082 words: the ladder
    # past 768 by halves, 1152, 1728, 2592, 3888
    assert {bucket: door_rungs(config, bucket) for bucket in expected} == {**expected, 1024: (3888,)}
    assert door_rungs(_config(256, 256, 1024, drafts=2), 16)[0] == 224  # 5 schedule fields: 10 + 80 + 80 = 170
    buffer = np.arange(70, dtype=np.int32)
    assert len(door_buffer(config, 8, buffer)) == 96 and len(door_buffer(config, 8, buffer[:20])) == 96
    assert len(door_buffer(config, 8, np.zeros(200, np.int32))) == 768
    assert len(door_buffer(config, 1024, buffer, steady=True)) == 768 and len(door_buffer(config, 1024, buffer)) == 3888
    assert len(door_buffer(config, 8, np.zeros(1000, np.int32))) == 1000  # past the top: as it is, no error


def _batch(config: ServingConfig, rng) -> ServingBatch:
    batch = ServingBatch(config)
    rows = config.max_num_reqs - 2
    adds = [dict(row=r, token_ids=rng.integers(0, VOCAB, int(rng.integers(10, 17))),
                 block_ids=[int(b) for b in rng.choice(np.arange(1, 8 * config.max_num_reqs), 3, replace=False)])
            for r in range(rows)]
    batch.apply_updates(StepUpdates.build(config, add=adds))
    return batch


def _updates(config: ServingConfig, batch: ServingBatch, decoding: int = 6) -> dict[str, StepUpdates]:
    """A steady update (``decoding`` rows decode, one gets a block) and a general one (a row finishes, one joins)."""
    rows = config.max_num_reqs
    busy = np.flatnonzero(batch.rows.num_tokens > 0)
    decode = np.zeros(rows, np.int64)
    decode[busy[:decoding]] = 1
    free = np.flatnonzero(batch.rows.num_tokens == 0)
    admit = decode.copy()
    admit[free[0]] = 2
    joining = dict(row=int(free[0]), token_ids=[5, 6, 7], block_ids=[int(8 * rows - 2)])
    return {"steady": StepUpdates.build(config, append={int(busy[0]): [int(8 * rows - 1)]},
                                        num_scheduled_tokens=decode),
            "general": StepUpdates.build(config, finish=[int(busy[-1])], num_scheduled_tokens=admit, add=[joining])}


@pytest.mark.parametrize("kind", ["steady", "general"])
def test_a_padded_buffer_does_what_it_does_at_its_own_rung(kind):
    config = _config(64, 32, 128)
    rng = np.random.default_rng(7)
    batch = _batch(config, rng)
    updates = _updates(config, batch)[kind]
    buffer = batch.pack(updates).step
    assert len(buffer) == 64 and is_steady(buffer) == (kind == "steady")
    bucket = config.prep.bucket_for(int(np.asarray(updates.schedule.num_scheduled_tokens).sum()))
    padded = door_buffer(config, bucket, buffer)
    assert len(padded) > len(buffer)
    outputs = []
    for blob in (buffer, padded):
        state = jax.tree.map(lambda a: a.copy(), batch.state)
        state, step = update_and_prepare_buffer(state, blob, config=config, num_tokens_padded=bucket,
                                                steady=kind == "steady")
        outputs.append((state.to_numpy(), _step_words(step)))
    (own_state, own_step), (padded_state, padded_step) = outputs
    assert not own_state["errors"].any()
    for name, value in own_state.items():
        np.testing.assert_array_equal(padded_state[name], value, err_msg=name)
    np.testing.assert_array_equal(padded_step, own_step)
    # negative control: the padding's words are never read as content, but a changed content word is seen
    changed = pad_to(buffer, len(padded)).copy()
    changed[np.flatnonzero(buffer)[-1]] += 1  # the last content word: a block id
    state, step = update_and_prepare_buffer(jax.tree.map(lambda a: a.copy(), batch.state), changed, config=config,
                                            num_tokens_padded=bucket, steady=kind == "steady")
    assert not (np.array_equal(_step_words(step), own_step)
                and all(np.array_equal(v, own_state[k]) for k, v in state.to_numpy().items()))


def test_a_run_uses_only_the_warm_ups_door_programs(monkeypatch):
    """Steps of several buckets, steady and not, through `update_and_prepare`: each door call's key is one the
    warm-up lists (each door rung of its bucket), and the warm-up lists one per bucket and rung, no more."""
    config = _config(64, 32, 128)
    batch = _batch(config, np.random.default_rng(3))
    batch.steady_programs = True  # as after the warm-up
    warmed = [e.key for e in batch._warmup_executables() if e.key[0] == "door"]
    buckets = config.prep.reachable_buckets
    expected = [(b, w, s) for s in (False, True) for b in buckets for w in door_rungs(config, b, s)
                if not s or b in steady_buckets(config)]
    assert sorted(key[1:] for key in warmed) == sorted(expected)
    assert len(warmed) < len(step_payload_buckets(config)) * (len(buckets) + len(steady_buckets(config)))
    keys = []
    monkeypatch.setattr(batch_module, "run", recording_run(keys))
    for decoding in (6, 20, 60):  # buckets 8, 32, 64
        for updates in _updates(config, batch, decoding).values():
            scheduled = int(np.asarray(updates.schedule.num_scheduled_tokens).sum())
            batch.update_and_prepare(updates, config.prep.bucket_for(scheduled))
    doors = [key for key in keys if key[0] == "door"]
    assert {key[3] for key in doors} == {False, True} and {key[1] for key in doors} == {8, 32, 64}
    assert all(key in warmed for key in doors), (doors, warmed)
    assert not any(batch.errors().values())


def test_a_bucket_past_the_top_step_rung_takes_a_steps_admissions_whole(monkeypatch):
    """64 rows, a budget of 512: buckets holding more tokens than the top step rung has words take a step's
    admissions whole (the door's general program at the bulk rung, the top of its `door_rungs`). Four new
    requests of 100 tokens each (400 words of prompt, more than the top step rung) at bucket 512: one door call,
    nothing applied first; the state and the step equal the same update applied alone (a bulk
    `apply_packed`, then the schedule) and then prepared (`prepare_padded`). Negative controls: packed without
    the bucket the same update splits (so the test crosses the rung), and a changed prompt token is seen."""
    config = _config(64, 256, 512)
    top, bulk = step_payload_buckets(config)[-1], bulk_rungs(config)[0]
    buckets = config.prep.reachable_buckets
    assert [b for b in buckets if takes_admissions_whole(config, b)] == [b for b in buckets if b > top] != []
    assert all(door_rungs(config, b) == tuple(r for r in door_rungs(config, b, steady=True) if r < top) + (bulk,)
               for b in buckets if b > top)
    assert all(door_rungs(config, b) == door_rungs(config, b, steady=True) for b in buckets if b <= top)
    assert door_step_words(config, 512) == bulk and door_step_words(config, buckets[0]) == top

    def admission(first_token: int) -> StepUpdates:
        adds = [dict(row=r, token_ids=[first_token if r == 0 else 0] + [(t + r) % VOCAB for t in range(1, 100)],
                     block_ids=list(range(1 + 25 * r, 26 + 25 * r))) for r in range(4)]
        counts = np.zeros(config.max_num_reqs, np.int64)
        counts[:4] = 100
        return StepUpdates.build(config, add=adds, num_scheduled_tokens=counts)

    updates = admission(7)
    assert config.prep.bucket_for(400) == 512 > top
    assert len(ServingBatch(config).pack(updates).before) == 1  # without the bucket: a bulk buffer, then the step
    one_call = ServingBatch(config)
    keys, applied = [], []
    monkeypatch.setattr(batch_module, "run", recording_run(keys))
    real_apply = batch_module.apply_buffer
    monkeypatch.setattr(batch_module, "apply_buffer", lambda *a, **k: applied.append(len(a[2])) or real_apply(*a, **k))
    step = one_call.update_and_prepare(updates, 512).to_numpy()
    assert keys == [("door", 512, bulk, False)] and applied == []
    two_calls = ServingBatch(config)
    two_calls.apply_updates(updates)
    assert applied == [bulk, step_payload_buckets(config)[0]]  # the bulk buffer, then the schedule alone
    expected = jax.tree.map(np.asarray, two_calls.prepare(512))
    for name, value in two_calls.state.to_numpy().items():
        np.testing.assert_array_equal(one_call.state.to_numpy()[name], value, err_msg=name)
    for got, want in zip(jax.tree.leaves(step), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(got, want)
    assert not any(one_call.errors().values())
    changed = ServingBatch(config).update_and_prepare(admission(8), 512).to_numpy()
    assert not np.array_equal(changed.input_ids, step.input_ids)


def _step_words(step) -> np.ndarray:
    """The prepared step's words and extras, flat (what the bit-for-bit comparisons compare)."""
    return np.concatenate([np.asarray(step.words).ravel(),
                           *(np.asarray(leaf).ravel().view(np.int32) for leaf in jax.tree.leaves(step.extras))])


ENGINE_CONFIG = make_config(budget=32, block_size=4, num_blocks=264, max_num_reqs=32, max_model_len=32,
                            decode_steps=1)
"""32 rows: step rungs (64, 96); a step of 8 rows may need 66 words, so every bucket's door rung is 96."""


def test_the_engines_serving_step_runs_at_the_door_rungs(monkeypatch):
    """The fused `serve_step` (`Engine`, and `DataParallelEngine` on a one-device mesh) at the door rungs too: the
    warm-up lists one step program per bucket and door rung (3, not 6), a run pads its 64-word buffers to 96 and
    compiles nothing after the warm-up; the greedy tokens pass the dense recomputation and the sharded engine's
    equal them."""
    assert step_payload_buckets(ENGINE_CONFIG) == (64, 96)
    buckets = ENGINE_CONFIG.prep.reachable_buckets
    assert all(door_rungs(ENGINE_CONFIG, b) == (96,) for b in buckets)
    workload = random_workload(5, num_requests=12, vocab_size=MODEL.vocab_size, prompt_len=(2, 10),
                               max_tokens=(2, 6), arrival_spread=3)
    sizes, real_door_buffer = [], batch_module.door_buffer
    monkeypatch.setattr(batch_module, "door_buffer", lambda c, b, buffer: sizes.append(len(buffer)) or
                        real_door_buffer(c, b, buffer))
    engine = Engine(ENGINE_CONFIG, MODEL, seed=0)
    warmed = [e.key for e in engine._warmup_executables()]
    assert sorted(key[2:] for key in warmed if key[0] == "serve_step") == [(b, 96) for b in buckets]
    assert engine.num_executables == len(warmed) and "3 programs" in engine.warmup_plan()
    finished, compiles, keys = run_after_warmup(engine, workload, monkeypatch)
    assert compiles == 0 and len(finished) == len(workload.requests)
    assert 64 in sizes and {key[3] for key in keys if key[0] == "serve_step"} == {96}
    assert check_against_dense(engine.params, MODEL, finished, ENGINE_CONFIG.max_model_len).passed
    _check_the_data_parallel_engine(ENGINE_CONFIG, workload, finished, warmed, monkeypatch)


def _check_the_data_parallel_engine(config, workload, finished, warmed, monkeypatch) -> list[tuple]:
    """`DataParallelEngine` on a one-device mesh runs ``workload`` to the tokens of ``finished`` (the `Engine`'s),
    its serving steps each a program of the `Engine`'s warm-up (``warmed``); returns the keys it ran."""
    sharded = DataParallelEngine(config, MODEL, data_mesh(1), seed=0)
    shard_keys = []
    monkeypatch.setattr(sharded_module, "run", recording_run(shard_keys))
    sharded.submit(copy.deepcopy(workload.requests), workload.arrival_steps)
    tokens = {r.request_id: r.output_token_ids for r in sharded.run()}
    assert tokens == {r.request_id: r.output_token_ids for r in finished}
    assert {key for key in shard_keys if key[0] == "serve_step"} <= set(warmed)
    return shard_keys


BULK_ENGINE_CONFIG = make_config(budget=128, block_size=4, num_blocks=72, max_num_reqs=4, max_model_len=64,
                                 decode_steps=1)
"""4 rows: one step rung (64 words), a bulk rung of 224; buckets 96 and 128 take a step's admissions whole."""


def test_the_engines_serving_step_takes_a_steps_admissions_whole(monkeypatch):
    """The fused `serve_step` at a bucket past the top step rung runs at the bulk rung (`door_rungs`), so a step
    that admits long prompts there is one call: in a run after the warm-up, an update applied apart
    (`apply_packed`) comes only before a step at a bucket of the step rung, steps at 96 and 128 tokens run at
    the bulk rung, nothing compiles after the warm-up, and the greedy tokens pass the dense recomputation; the
    data-parallel engine (one device) gives the same tokens with the warm-up's programs."""
    config = BULK_ENGINE_CONFIG
    buckets = config.prep.reachable_buckets
    assert step_payload_buckets(config) == (64,) and bulk_rungs(config) == (224,)
    assert {b: door_rungs(config, b) for b in buckets} == {8: (64,), 16: (64,), 32: (64,), 64: (64,), 96: (224,),
                                                            128: (224,)}
    workload = random_workload(11, num_requests=6, vocab_size=MODEL.vocab_size, prompt_len=(30, 56),
                               max_tokens=(2, 5), arrival_spread=2)
    engine = Engine(config, MODEL, seed=0)
    warmed = [e.key for e in engine._warmup_executables()]
    assert sorted(key[2:] for key in warmed if key[0] == "serve_step") == sorted(
        (b, w) for b in buckets for w in door_rungs(config, b))
    finished, compiles, keys = run_after_warmup(engine, workload, monkeypatch)
    assert compiles == 0 and len(finished) == len(workload.requests)
    steps = [(i, key) for i, key in enumerate(keys) if key[0] == "serve_step"]
    assert {key[3] for _, key in steps if key[2] > 64} == {224}  # admissions whole at 96 and 128 tokens
    applied_before = [next(key for j, key in steps if j > i) for i, key in enumerate(keys) if key[0] == "apply"]
    assert all(key[2] <= 64 for key in applied_before), applied_before
    assert check_against_dense(engine.params, MODEL, finished, config.max_model_len).passed
    shard_keys = _check_the_data_parallel_engine(config, workload, finished, warmed, monkeypatch)
    assert any(key[0] == "serve_step" and key[3] == 224 for key in shard_keys)
