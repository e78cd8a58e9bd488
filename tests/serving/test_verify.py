"""Verification of drafts: greedy acceptance equals the NumPy reference on random patterns (all,
none, some accepted, no drafts, padded rows), and rejection sampling's output tokens follow the
target distribution (chi-square over many keys drawn in one jitted call)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxprep.features.spec_decode import spec_decode_metadata
from jaxprep.reference.spec_decode import greedy_verify as greedy_verify_reference
from jaxprep.serving.spec_decode.verify import PLACEHOLDER, greedy_verify, rejection_verify

VOCAB = 16


def make_batch(rng, num_drafts, k, num_reqs_padded, extra_tokens=2):
    """Batch rows with ``num_drafts`` (then padded rows): each runs a few tokens, then its drafts."""
    scheduled = [int(rng.integers(1, extra_tokens + 1)) + d for d in num_drafts]
    pad = num_reqs_padded - len(num_drafts)
    qsl = np.concatenate([[0], np.cumsum(scheduled), np.full(pad, sum(scheduled))]).astype(np.int32)
    num_tokens_padded = sum(scheduled) + 3
    input_ids = rng.integers(0, VOCAB, num_tokens_padded).astype(np.int32)
    is_real = np.arange(num_reqs_padded) < len(num_drafts)
    drafts = np.concatenate([num_drafts, np.zeros(pad, int)]).astype(np.int32)
    meta = spec_decode_metadata(jnp.asarray(drafts), jnp.asarray(qsl), jnp.asarray(is_real),
                                jnp.asarray(input_ids), k)
    return meta, input_ids, qsl


PATTERNS = ("all", "none", "partial", "random")


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("seed", range(3))
def test_greedy_verify_matches_reference(pattern, seed):
    rng = np.random.default_rng(seed)
    k = 3
    num_drafts = [int(d) for d in rng.integers(0, k + 1, 5)] + [0, k]  # zero drafts and full rows included
    meta, input_ids, qsl = make_batch(rng, num_drafts, k, num_reqs_padded=9)
    argmax = rng.integers(0, VOCAB, meta.logits_indices.shape[0]).astype(np.int32)
    row_drafts, row_targets, bonus = [], [], []
    for b, count in enumerate(num_drafts):
        drafts = input_ids[qsl[b + 1] - count: qsl[b + 1]].tolist()
        first = int(meta.bonus_logits_indices[b]) - count  # logit row of the row's first draft
        cut = {"all": count, "none": 0, "partial": int(rng.integers(0, count + 1))}.get(pattern)
        for i, draft in enumerate(drafts):
            keep = rng.random() < 0.5 if cut is None else i < cut
            argmax[first + i] = draft if keep else (draft + 1 + int(rng.integers(0, VOCAB - 1))) % VOCAB
        row_drafts.append(drafts)
        row_targets.append(argmax[first: first + count].tolist())
        bonus.append(int(argmax[first + count]))
    expected, expected_n = greedy_verify_reference(row_drafts + [[]] * 2, row_targets + [[]] * 2,
                                                   bonus + [None] * 2, k)
    for fn in (greedy_verify, jax.jit(greedy_verify, static_argnames="k")):
        output, num_sampled = fn(jnp.asarray(argmax), meta, k=k)
        np.testing.assert_array_equal(np.asarray(output), expected)
        np.testing.assert_array_equal(np.asarray(num_sampled), expected_n)
    accepted = expected_n[: len(num_drafts)] - 1
    if pattern == "all":
        assert (accepted == num_drafts).all()
    if pattern == "none":
        assert (accepted == 0).all()


def test_verify_worked_example():
    """The module's example: drafts [7, 8, 9], argmax [7, 5, 9, 4] -> [7, 5, -1, -1]."""
    meta, _, _ = make_one_row([7, 8, 9])
    output, num_sampled = greedy_verify(jnp.asarray([7, 5, 9, 4], jnp.int32), meta, k=3)
    assert np.asarray(output).tolist() == [[7, 5, PLACEHOLDER, PLACEHOLDER]] and int(num_sampled[0]) == 2


def make_one_row(drafts):
    """One batch row: its last known token (3), then ``drafts``."""
    input_ids = jnp.asarray([3, *drafts], jnp.int32)
    qsl = jnp.asarray([0, len(drafts) + 1], jnp.int32)
    return spec_decode_metadata(jnp.asarray([len(drafts)], jnp.int32), qsl, jnp.asarray([True]), input_ids,
                                len(drafts)), input_ids, qsl


# --- rejection sampling: the output distribution is the target's ----------------------------------

DRAWS = 40_000


@functools.partial(jax.jit, static_argnames=("k",))
def _many_draws(probs, meta, keys, k):
    return jax.vmap(lambda key: rejection_verify(probs, meta, k, key))(keys)


def _target_table(seed):
    """p at 3 positions (2 drafts + bonus) over a vocabulary of 6, with zeros and a draft of high
    and one of low probability."""
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(6), size=3).astype(np.float32)
    probs[0, 5] = 0.0  # a token the target never picks
    probs[0] /= probs[0].sum()
    return probs


def _draws(probs, drafts, seed=0):
    meta, _, _ = make_one_row(drafts)
    keys = jax.random.split(jax.random.key(seed), DRAWS)
    output, num_sampled = _many_draws(jnp.asarray(probs), meta, keys, k=len(drafts))
    return np.asarray(output)[:, 0], np.asarray(num_sampled)[:, 0]


def _chi_square_p(samples, probs):
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    probs = np.asarray(probs, np.float64)
    support = probs > 0
    assert counts[~support].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[support] / probs[support].sum() * counts.sum()
    return stats.chisquare(counts[support], expected).pvalue


@pytest.mark.parametrize("draft_rank", [0, 3])  # the target's likeliest token, and a less likely one
def test_rejection_sampling_first_token_follows_the_target(draft_rank):
    probs = _target_table(0)
    first_draft = int(np.argsort(-probs[0])[draft_rank])
    output, num_sampled = _draws(probs, [first_draft, 2])
    assert _chi_square_p(output[:, 0], probs[0]) > 1e-3
    # acceptance of the first draft happens with probability p(draft)
    accepted = (num_sampled > 1).mean()
    assert abs(accepted - probs[0, first_draft]) < 4 * np.sqrt(probs[0, first_draft] / DRAWS) + 1e-3


def test_rejection_sampling_second_and_bonus_tokens_follow_the_target():
    probs = _target_table(1)
    drafts = [int(np.argmax(probs[0])), int(np.argmax(probs[1]))]
    output, num_sampled = _draws(probs, drafts, seed=1)
    reached_second = num_sampled >= 2  # the first draft was accepted: slot 1 is drawn from p_1
    assert _chi_square_p(output[reached_second, 1], probs[1]) > 1e-3
    all_accepted = num_sampled == 3  # the bonus slot is drawn from p_2
    assert all_accepted.sum() > 1000
    assert _chi_square_p(output[all_accepted, 2], probs[2]) > 1e-3


def test_the_chi_square_check_can_fail():
    """The same check rejects a slightly wrong sampler: a quarter of the draws forced to the draft."""
    probs = _target_table(0)
    draft = int(np.argmax(probs[0]))
    output, _ = _draws(probs, [draft, 2])
    biased = np.where(np.arange(DRAWS) % 4 == 0, draft, output[:, 0])
    assert _chi_square_p(biased, probs[0]) < 1e-6
