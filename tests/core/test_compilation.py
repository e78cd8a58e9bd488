"""Compilation is pinned: one trace per bucket, nothing after warm-up, no hidden transfers."""

import chex
import jax
import numpy as np

from jaxprep import BatchState, PrepConfig, count_compiles, prepare_inputs, prepare_padded, warmup
from jaxprep.prepare import prepare_body
from support.batches import numpy_batches

CONFIG = PrepConfig(max_num_reqs=6, max_model_len=50, max_num_batched_tokens=120, block_size=4)


def test_many_batches_in_one_bucket_trace_once():
    stream = numpy_batches(CONFIG, seed=7)
    bucket = CONFIG.token_buckets[-1]
    with count_compiles() as count:
        for _ in range(40):
            jax.block_until_ready(prepare_padded(BatchState.from_numpy(**next(stream)), CONFIG, bucket))
    assert count.traces == 1, count


def test_a_user_jit_of_prepare_body_traces_once_per_bucket():
    """`chex.assert_max_traces`: wrapping `prepare_body` in one's own jit retraces only for a new bucket."""
    stream = numpy_batches(CONFIG, seed=9)
    batches = [next(stream) for _ in range(30)]
    buckets = [CONFIG.bucket_for(int(arrays["num_scheduled_tokens"].sum())) for arrays in batches]
    assert len(set(buckets)) > 1
    chex.clear_trace_counter()
    step = jax.jit(chex.assert_max_traces(prepare_body, n=len(set(buckets))),
                   static_argnames=("config", "num_tokens_padded"))
    for arrays, bucket in zip(batches, buckets, strict=True):
        jax.block_until_ready(step(BatchState.from_numpy(**arrays), CONFIG, bucket))


def test_nothing_compiles_after_warmup():
    config = PrepConfig(max_num_reqs=7, max_model_len=44, max_num_batched_tokens=100, block_size=4)
    state = BatchState.empty(config)
    warmup(config, state)
    stream = numpy_batches(config, seed=3)
    states = [BatchState.from_numpy(**next(stream)) for _ in range(60)]
    with count_compiles() as count:
        buckets = {prepare_inputs(s, config).num_tokens_padded for s in states}
    assert count.compiles == 0 and count.traces == 0, count
    assert len(buckets) > 3  # the batches really spread over the ladder


def test_warmup_compiles_each_bucket_once():
    config = PrepConfig(max_num_reqs=3, max_model_len=20, max_num_batched_tokens=72, block_size=2)
    with count_compiles() as count:
        warmup(config)
    assert count.traces >= len(config.reachable_buckets)
    with count_compiles() as again:
        warmup(config)
    assert again.traces == 0 and again.compiles == 0


def test_warmup_compiles_only_the_buckets_a_step_can_reach():
    """3 rows of at most 20 tokens schedule at most 60 tokens: the budget's rung 72 can never be used, so the
    warm-up leaves it out (the ladder keeps it), and batches filling every row compile nothing after it.
    Negative control: asked for the rung, `prepare_padded` compiles it."""
    config = PrepConfig(max_num_reqs=3, max_model_len=20, max_num_batched_tokens=72, block_size=2)
    assert config.token_buckets == (8, 16, 32, 64, 72)
    assert config.max_tokens_per_step == 60 and config.reachable_buckets == (8, 16, 32, 64)
    warmup(config)
    stream = numpy_batches(config, seed=11)
    states = [BatchState.from_numpy(**next(stream)) for _ in range(40)]
    full = next(stream)
    full.update(num_computed_tokens=np.zeros(3, np.int32), num_scheduled_tokens=np.full(3, 20, np.int32))
    states.append(BatchState.from_numpy(**full))
    with count_compiles() as count:
        buckets = {prepare_inputs(s, config).num_tokens_padded for s in states}
    assert count.compiles == 0 and 64 in buckets
    with count_compiles() as control:
        jax.block_until_ready(prepare_padded(states[-1], config, 72))
    assert control.compiles == 1
    wide = PrepConfig(max_num_reqs=16, max_model_len=256, max_num_batched_tokens=8192, block_size=16)
    assert wide.reachable_buckets == wide.token_buckets[:-2] and wide.reachable_buckets[-1] == 4096


def test_step_with_known_bucket_makes_no_transfers():
    """With the bucket given, a step reads only device arrays and leaves its outputs on the device."""
    state = BatchState.from_numpy(**next(numpy_batches(CONFIG, seed=1)))
    bucket = CONFIG.token_buckets[-1]
    jax.block_until_ready(prepare_padded(state, CONFIG, bucket))
    with jax.transfer_guard("disallow"):
        step = prepare_padded(state, CONFIG, bucket)
        jax.block_until_ready(step)
    assert isinstance(step.input_ids, jax.Array)
    assert np.asarray(step.attn_metadata.num_actual_tokens) == np.asarray(state.num_scheduled_tokens).sum()


def test_prepare_inputs_inside_a_user_jit():
    """A serving loop can call prepare_inputs inside its own jit when it passes the bucket."""
    state = BatchState.from_numpy(**next(numpy_batches(CONFIG, seed=2)))
    bucket = CONFIG.token_buckets[-1]

    @jax.jit
    def serving_step(state):
        return prepare_inputs(state, CONFIG, bucket).attn_metadata.slot_mapping

    np.testing.assert_array_equal(serving_step(state), prepare_padded(state, CONFIG, bucket).attn_metadata.slot_mapping)


def test_warmup_says_what_it_compiles_and_how_many_remain(caplog):
    """`jaxprep.warmup` on the ``jaxprep.warmup`` logger: why (the ladder), each executable with how many are
    left, the seconds at the end; ``on_compiled(done, total, what)`` sees the same executables."""
    import logging

    config = PrepConfig(max_num_reqs=3, max_model_len=20, max_num_batched_tokens=24, block_size=2)
    seen = []
    with caplog.at_level(logging.INFO, logger="jaxprep.warmup"):
        warmup(config, on_compiled=lambda done, total, what: seen.append((done, total, what)))
    lines = [record.getMessage() for record in caplog.records if record.name == "jaxprep.warmup"]
    assert lines[0].startswith("warm-up: compiling 3 executables, prepare_padded at the 3 token buckets 8, 16, 24,")
    assert sorted(line.split(": ", 2)[1] for line in lines[1:-1]) == ["1/3 compiled, 2 to go", "2/3 compiled, 1 to go",
                                                                     "3/3 compiled, 0 to go"]
    assert {line.rsplit(": ", 1)[1] for line in lines[1:-1]} == {f"prepare_padded at {b} tokens" for b in (8, 16, 24)}
    assert lines[-1].startswith("warm-up: 3 executables in ")
    assert [done for done, _, _ in seen] == [1, 2, 3] and {total for _, total, _ in seen} == {3}


def test_the_library_warmup_is_quiet_unless_logging_is_on(capfd):
    """Nothing on stdout or stderr from the library by default (no handler of its own)."""
    warmup(PrepConfig(max_num_reqs=2, max_model_len=12, max_num_batched_tokens=16, block_size=2))
    captured = capfd.readouterr()
    assert "warm-up" not in captured.out + captured.err
