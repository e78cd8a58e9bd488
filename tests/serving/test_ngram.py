"""The n-gram drafter: the NumPy reference equals vLLM's own matcher, and the device drafter equals
the reference on random token tables (small vocabularies, so most rows repeat; no-match rows too)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep.reference.spec_decode import ngram_propose
from jaxprep.serving.spec_decode.ngram import NO_DRAFT, NgramConfig, propose_ngram, propose_ngram_jit
from tests.support.vllm_ngram import load_vllm_ngram

VLLM_NGRAM = load_vllm_ngram()


@pytest.mark.skipif(VLLM_NGRAM is None, reason="vLLM is not installed")
@pytest.mark.parametrize("seed", range(4))
def test_reference_matches_vllm(seed):
    rng = np.random.default_rng(seed)
    found = 0
    for _ in range(400):
        total = int(rng.integers(0, 30))
        tokens = rng.integers(0, 1 + seed, total).astype(np.int32)  # seed 0: one token repeated
        low = int(rng.integers(1, 4))
        high, k = int(rng.integers(low, 6)), int(rng.integers(1, 5))
        max_model_len = total + int(rng.integers(0, 4))
        expected = [int(t) for t in VLLM_NGRAM(tokens, low, high, max_model_len, k)]
        assert ngram_propose(tokens, min_n=low, max_n=high, max_model_len=max_model_len, k=k) == expected
        found += bool(expected)
    assert found > 50


def test_worked_examples():
    config = NgramConfig(prompt_lookup_min=2, prompt_lookup_max=3)
    table = np.zeros((4, 12), np.int32)
    rows = [[5, 6, 7, 8, 5, 6, 7],  # suffix [5, 6, 7] seen at 0: drafts [8, 5]
            [1, 2, 9, 1, 2, 8, 1, 2],  # [1, 2] seen at 0 and 3; vLLM takes the earliest: [9, 1]
            [1, 2, 3, 4, 5],  # no repeat: nothing
            [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]]  # one column left before max_model_len: 1 draft
    for row, tokens in enumerate(rows):
        table[row, : len(tokens)] = tokens
    num_tokens = jnp.asarray([len(t) for t in rows], jnp.int32)
    drafts, count = propose_ngram_jit(jnp.asarray(table), num_tokens, jnp.ones(4, bool), k=2, config=config,
                                      max_model_len=12)
    assert np.asarray(count).tolist() == [2, 2, 0, 1]
    assert np.asarray(drafts).tolist() == [[8, 5], [9, 1], [NO_DRAFT] * 2, [4, NO_DRAFT]]


@st.composite
def token_tables(draw):
    # shapes from a few values: the drafter runs op by op, and each new shape compiles every op again
    rows, width = 5, draw(st.sampled_from([1, 4, 11, 24]))
    vocab = draw(st.integers(1, 4))
    table = np.asarray(draw(st.lists(st.integers(0, vocab - 1), min_size=rows * width, max_size=rows * width)),
                       np.int32).reshape(rows, width)
    num_tokens = np.asarray(draw(st.lists(st.integers(0, width), min_size=rows, max_size=rows)), np.int32)
    active = np.asarray(draw(st.lists(st.booleans(), min_size=rows, max_size=rows)))
    low = draw(st.integers(1, 4))
    config = NgramConfig(prompt_lookup_min=low, prompt_lookup_max=draw(st.integers(low, 5)))
    return table, num_tokens, active, config, draw(st.integers(1, 5))


@settings(max_examples=80, deadline=None)
@given(token_tables())
def test_device_drafter_matches_reference(case):
    table, num_tokens, active, config, k = case
    width = table.shape[1]
    drafts, count = propose_ngram(jnp.asarray(table), jnp.asarray(num_tokens), jnp.asarray(active), k=k,
                                  config=config, max_model_len=width)
    for row in range(table.shape[0]):
        expected = ngram_propose(table[row, : num_tokens[row]], min_n=config.prompt_lookup_min,
                                 max_n=config.prompt_lookup_max, max_model_len=width, k=k) if active[row] else []
        assert int(count[row]) == len(expected)
        assert np.asarray(drafts[row]).tolist() == expected + [NO_DRAFT] * (k - len(expected))


@pytest.mark.parametrize("low, high", [(0, 3), (3, 2), (2, 2.0)])
def test_bad_lookup_sizes_are_rejected(low, high):
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramConfig(prompt_lookup_min=low, prompt_lookup_max=high)
