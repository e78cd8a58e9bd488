"""The sampler against the NumPy reference: exact for greedy and top-k 1, a chi-square test of many
draws for the rest; seeded rows reproducible whatever their neighbours and the bucket."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxprep import SamplingParams
from jaxprep.reference.sampling import distribution_reference, penalties_reference
from jaxprep.serving.sample.sampler import row_probabilities, sample
from support.sampling_examples import Bins, sampler_rows

V = 16
DRAWS = 3000
CASES = {
    "temperature": SamplingParams(temperature=0.8, seed=1),
    "top_k": SamplingParams(temperature=1.3, top_k=5, seed=2),
    "top_p": SamplingParams(temperature=1.0, top_p=0.7, seed=3),
    "min_p": SamplingParams(temperature=0.9, min_p=0.15, seed=4),
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.4,
                                presence_penalty=0.3, seed=5),
    "everything": SamplingParams(temperature=0.7, top_k=9, top_p=0.85, min_p=0.05, repetition_penalty=0.8,
                                 seed=6),
}


def bins(num_rows: int, rng) -> Bins:
    """Prompt tokens {1, 3, 5, 20 % 32...}: bits 1, 3, 5; output counts of tokens 3 and 7."""
    mask = np.zeros((num_rows, 1), np.int32)
    mask[:, 0] = (1 << 1) | (1 << 3) | (1 << 5)
    counts = np.zeros((num_rows, V), np.int32)
    counts[:, 3], counts[:, 7] = 2, 1
    return Bins(mask, counts)


def reference_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    x = penalties_reference(logits, 0, 0, [0], [1, 3, 5], bins(1, None).output_bin_counts[0],
                            params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
    top_k = V if params.top_k <= 0 else params.top_k
    return distribution_reference(x, params.temperature, top_k, params.top_p, params.min_p)


@functools.partial(jax.jit, static_argnames="fn")
def run(fn, logits, rows, table):
    return fn(logits, rows, table)


def test_greedy_and_top_k_1_are_exact():
    """Greedy (after penalties) and top-k 1 rows take the reference's argmax, whatever the seed."""
    rng = np.random.default_rng(0)
    params = [SamplingParams.greedy(), SamplingParams.greedy(repetition_penalty=2.0, frequency_penalty=1.0),
              SamplingParams(temperature=1.5, top_k=1)] * 20
    logits = rng.normal(0, 1, (len(params), V)).astype(np.float32)
    rows = sampler_rows(params, V, pos=rng.integers(0, 1000, len(params)))
    got = np.asarray(run(sample, logits, rows, bins(len(params), rng)))
    want = [int(np.argmax(reference_distribution(row, p))) for row, p in zip(logits, params, strict=True)]
    assert got.tolist() == want


def test_row_probabilities_match_reference():
    rng = np.random.default_rng(1)
    params = list(CASES.values()) + [SamplingParams.greedy(presence_penalty=0.5)]
    logits = rng.normal(0, 1.5, (len(params), V)).astype(np.float32)
    got = np.asarray(run(row_probabilities, logits, sampler_rows(params, V), bins(len(params), rng)))
    for row, p in enumerate(params):
        np.testing.assert_allclose(got[row], reference_distribution(logits[row], p), atol=2e-6, err_msg=str(p))


@pytest.mark.parametrize("case", sorted(CASES))
def test_draws_follow_the_reference_distribution(case):
    """DRAWS rows of one request at positions 0..DRAWS-1 (each its own noise), in one jitted call."""
    params = CASES[case]
    logits_row = np.random.default_rng(2).normal(0, 1.0, V).astype(np.float32)
    rows = sampler_rows([params] * DRAWS, V, pos=np.arange(DRAWS))
    tokens = np.asarray(run(sample, np.tile(logits_row, (DRAWS, 1)), rows, bins(DRAWS, None)))
    observed = np.bincount(tokens, minlength=V)
    expected = reference_distribution(logits_row, params) * DRAWS
    assert observed[expected == 0].sum() == 0  # masked tokens are never drawn
    support = expected > 0
    result = stats.chisquare(observed[support], expected[support])
    assert result.pvalue > 1e-3, (case, observed, expected.round(1))


def test_seeded_rows_do_not_depend_on_neighbours_or_bucket():
    """The same (seed, position) rows, among other rows and at other batch sizes, draw the same tokens."""
    rng = np.random.default_rng(3)
    mine = [SamplingParams(temperature=1.0, top_p=0.9, seed=s) for s in (7, -3, 2**40 + 1)]
    pos = [5, 17, 400]
    logits = rng.normal(0, 1, (3, V)).astype(np.float32)
    alone = np.asarray(run(sample, logits, sampler_rows(mine, V, pos=pos), bins(3, rng)))
    for size in (8, 32):
        others = [SamplingParams(temperature=0.6, top_k=4, seed=int(s)) for s in rng.integers(0, 1000, size - 3)]
        order = rng.permutation(size)  # my rows land at random places
        params, where = [None] * size, {}
        for j, p in enumerate(mine + others):
            params[order[j]] = p
        where = order[:3]
        batch_pos = np.empty(size, np.int64)
        batch_pos[where] = pos
        batch_pos[order[3:]] = rng.integers(0, 1000, size - 3)
        batch_logits = rng.normal(0, 1, (size, V)).astype(np.float32)
        batch_logits[where] = logits
        got = np.asarray(run(sample, batch_logits, sampler_rows(params, V, pos=batch_pos), bins(size, rng)))
        assert got[where].tolist() == alone.tolist(), size


def test_seed_and_position_change_the_draw():
    params = [SamplingParams(temperature=5.0, seed=1)] * 64
    logits = jnp.zeros((64, V), jnp.float32)
    same_pos = np.asarray(run(sample, logits, sampler_rows(params, V, seeds=range(64)), bins(64, None)))
    same_seed = np.asarray(run(sample, logits, sampler_rows(params, V, pos=np.arange(64)), bins(64, None)))
    assert len(set(same_pos.tolist())) > 4 and len(set(same_seed.tolist())) > 4
