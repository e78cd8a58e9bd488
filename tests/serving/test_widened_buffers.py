"""One `apply_packed` executable for every payload rung: a buffer widened on the device to the top rung
(`widen_packed`) is applied exactly as at its own rung, the state after equal bit for bit, the error word
included: real updates of every kind, and buffers whose headers or values the device refuses (a count past
its rung's sizes, more words than the buffer holds, a bad flag, a bad value).

Negative control: the same buffers zero-padded to the top rung on the host, without `widen_packed`'s
refusal of what the original length cannot hold, are accepted where their own rung refuses them."""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprep import FeatureConfig, PrepConfig, SamplingConfig
from jaxprep.serving import ServingBatch, ServingConfig, StepUpdates
from jaxprep.serving.host.batch import apply_buffer
from jaxprep.serving.state import ERROR_BITS
from jaxprep.serving.transitions import apply_packed
from jaxprep.serving.update_packing import (
    HEADER,
    HEADER_WORDS,
    pad_to,
    payload_buckets,
    section_sizes,
    widen_packed,
)

VOCAB, ROWS = 64, 12
CONFIG = ServingConfig(prep=PrepConfig(max_num_reqs=ROWS, max_model_len=40, max_num_batched_tokens=32, block_size=4,
                                       num_blocks=128, features=FeatureConfig(num_speculative_tokens=2,
                                                                             sampling=SamplingConfig(vocab_size=VOCAB))),
                       num_speculative_tokens=2, vocab_size=VOCAB)
TOP = payload_buckets(CONFIG)[-1]


@functools.lru_cache(maxsize=1)
def _busy() -> ServingBatch:
    batch = ServingBatch(CONFIG)
    batch.apply_updates(StepUpdates.build(CONFIG, add=[dict(row=r, token_ids=[r + 1, r + 2], block_ids=[r + 1])
                                                       for r in range(ROWS // 2)]))
    return batch


def busy_batch() -> ServingBatch:
    """A batch with rows 0..5 busy, the same each time (an unseeded request draws its seed on the host)."""
    batch = copy.copy(_busy())
    batch.state, batch.rows = jax.tree.map(jnp.copy, _busy().state), _busy().rows.copy()
    return batch


def real_buffers() -> list[np.ndarray]:
    """Buffers `pack_step` writes for updates of every kind, at every rung below the top."""
    rng = np.random.default_rng(0)
    buffers = []
    for n in (1, 3, 9, 20):
        adds = [dict(row=r, token_ids=rng.integers(0, VOCAB, n), block_ids=[20 + 6 * r + b for b in range(-(-n // 4))])
                for r in range(ROWS // 2, ROWS // 2 + 2)]
        updates = StepUpdates.build(CONFIG, finish=[0], add=adds, append={1: [100]},
                                    num_scheduled_tokens=[0, 1, 2, 0, 1, 0] + [0] * (ROWS - 6),
                                    num_draft_tokens=[0, 0, 1] + [0] * (ROWS - 3),
                                    draft_token_ids=rng.integers(0, VOCAB, (ROWS, 2)))
        buffers += [b for b in busy_batch().pack(updates).buffers if len(b) < TOP]
    return buffers


def refused_buffers() -> dict[str, tuple[np.ndarray, int]]:
    """Buffers of the smallest rung the device refuses, each with the bit its rung sets."""
    words = payload_buckets(CONFIG)[0]
    sizes = section_sizes(CONFIG, words)
    counts, values = ERROR_BITS["packed_counts"], ERROR_BITS["packed_values"]
    cases = {}

    def case(name, bit, **header):
        buffer = np.zeros(words, np.int32)
        for field, value in header.items():
            buffer[HEADER.index(field)] = value
        cases[name] = buffer, bit

    case("n_add past the rung's size (within the top's)", counts, n_add=sizes.add + 1)
    case("n_finish past the buffer's words", counts, n_finish=words - HEADER_WORDS + 1)
    case("n_data past the buffer's words", counts, n_data=words)
    case("n_finish negative", counts, n_finish=-1)
    case("has_schedule 3", counts, has_schedule=3)
    finish_row = np.zeros(words, np.int32)
    finish_row[HEADER.index("n_finish")] = 1
    finish_row[HEADER_WORDS] = ROWS + 5  # a row outside the rows: a bad value
    cases["finish row outside the rows"] = finish_row, values
    return cases


def state_of(state) -> dict:
    return {name: np.asarray(value) for name, value in jax.tree_util.tree_leaves_with_path(state)}


def assert_same_state(got, expected) -> None:
    got, expected = state_of(got), state_of(expected)
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=str(name))


def test_real_buffers_apply_as_at_their_own_rung():
    buffers = real_buffers()
    assert {len(b) for b in buffers} >= set(payload_buckets(CONFIG)[:2])  # several rungs below the top
    for buffer in buffers:
        at_rung = apply_packed(busy_batch().state, buffer, config=CONFIG)
        widened = widen_packed(buffer, config=CONFIG)
        assert widened.shape == (TOP,)
        np.testing.assert_array_equal(np.asarray(widened), pad_to(buffer, TOP))  # the words as sent, then zeros
        assert_same_state(apply_packed(busy_batch().state, widened, config=CONFIG), at_rung)
        assert int(at_rung.errors[0]) == 0


@pytest.mark.parametrize("name", list(refused_buffers()))
def test_refused_buffers_are_refused_alike(name):
    buffer, bit = refused_buffers()[name]
    before = busy_batch().state
    at_rung = apply_packed(busy_batch().state, buffer, config=CONFIG)
    assert int(at_rung.errors[0]) & bit
    assert_same_state(apply_buffer({}, busy_batch().state, buffer, CONFIG), at_rung)
    after, before = at_rung.to_numpy(), before.to_numpy()
    for field, value in before.items():  # refused whole: nothing but the error word changed
        if field != "errors" and not field.startswith("_"):
            np.testing.assert_array_equal(after[field], value, err_msg=field)


def test_padding_on_the_host_alone_would_let_a_count_through():
    """Negative control: the count past the small rung's size, zero-padded to the top rung without
    `widen_packed`, no longer sets ``packed_counts``."""
    buffer, bit = refused_buffers()["n_add past the rung's size (within the top's)"]
    padded = apply_packed(busy_batch().state, pad_to(buffer, TOP), config=CONFIG)
    assert not int(padded.errors[0]) & bit
    assert int(apply_buffer({}, busy_batch().state, buffer, CONFIG).errors[0]) & bit


def test_one_update_executable_for_every_rung():
    """`apply_buffer` traces `apply_packed` at the top rung only; each smaller rung traces a widening."""
    traced = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traced.append(kwargs.get("fun_name"))

    batch, buffers = busy_batch(), real_buffers()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for buffer in buffers:
            batch.state = apply_buffer({}, batch.state, buffer, CONFIG)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert "apply_packed" not in traced  # busy_batch traced it at the top rung
    assert traced.count("widen_packed") <= len({len(b) for b in buffers})
