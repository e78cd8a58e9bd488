"""`checks.schedule_fits` (every bound of a schedule as one boolean vector, one reduction) against
`checks._schedule_named` (the bounds one by one, raising on the first): the same verdict on random mirrors and
schedules, drafts, placeholders, grammar rows and huge counts included."""

from __future__ import annotations

import numpy as np
import pytest

import jaxprep
from jaxprep.serving import InvalidUpdateError, ServingConfig
from jaxprep.serving.host import checks
from jaxprep.serving.state import Schedule

ROWS, VOCAB = 6, 30


def config(k: int) -> ServingConfig:
    features = jaxprep.FeatureConfig(num_speculative_tokens=k, structured_outputs=True)
    prep = jaxprep.PrepConfig(max_num_reqs=ROWS, max_model_len=24, max_num_batched_tokens=16, block_size=4,
                              num_blocks=32, features=features)
    return ServingConfig(prep=prep, vocab_size=VOCAB)


def random_mirror(rng) -> checks.HostRows:
    """Mostly rows a schedule can run (busy, settled, their blocks allocated), some that it cannot."""
    rows = checks.HostRows.empty(ROWS)
    busy = rng.random(ROWS) < 0.9
    rows.num_tokens[:] = np.where(busy, rng.integers(1, 25, ROWS), 0)
    rows.num_computed_tokens[:] = np.where(busy, rng.integers(0, np.maximum(rows.num_tokens, 1)), 0)
    rows.table_blocks[:, 0] = np.where(busy, -(-rows.num_tokens // 4) + rng.integers(-1, 2, ROWS), 0).clip(0, 6)
    rows.pending_drafts[:] = np.where(busy & (rng.random(ROWS) < 0.05), rng.integers(0, 3, ROWS), -1)
    return rows


def random_schedule(rng, rows: checks.HostRows, k: int) -> Schedule:
    left = np.maximum(rows.num_tokens - rows.num_computed_tokens, 1)
    scheduled = np.minimum(rng.integers(1, 5, ROWS), left + rng.integers(0, 2, ROWS)) * (rng.random(ROWS) < 0.5)
    if rng.random() < 0.1:
        scheduled[rng.integers(ROWS)] = rng.choice([-1, 17, 2**62])
    drafts = np.minimum(rng.integers(0, k + 2, ROWS), scheduled) if k else np.zeros(ROWS, np.int64)
    if k == 0 and rng.random() < 0.1:
        drafts[rng.integers(ROWS)] = 1
    draft_ids = rng.integers(-2, VOCAB + 2, (ROWS, k))
    grammar = np.where(rng.random(ROWS) < 0.05, rng.integers(-2, 3, ROWS), -1)
    return Schedule(num_scheduled_tokens=scheduled.astype(np.int64), num_draft_tokens=drafts.astype(np.int64),
                    draft_token_ids=draft_ids.astype(np.int64), grammar_index=grammar.astype(np.int64))


@pytest.mark.parametrize("k", [0, 2])
def test_schedule_fits_gives_the_named_checks_verdict(k):
    cfg, rng = config(k), np.random.default_rng(k)
    verdicts = []
    for _ in range(3000):
        rows = random_mirror(rng)
        schedule = random_schedule(rng, rows, k)
        try:
            checks._schedule_named(rows, schedule, cfg)
            named = True
        except InvalidUpdateError:
            named = False
        assert checks.schedule_fits(rows, schedule, cfg) == named
        verdicts.append(named)
    assert 150 < sum(verdicts) < len(verdicts) - 150  # both verdicts are common (the control of the comparison)


def two_group_config() -> ServingConfig:
    """Two KV-cache groups of different block sizes (4 and 8): a row's longest sequence is the smaller of its
    groups' block spans."""
    groups = (jaxprep.KVCacheGroupSpec(block_size=4), jaxprep.KVCacheGroupSpec(block_size=8, num_blocks=16))
    prep = jaxprep.PrepConfig(max_num_reqs=ROWS, max_model_len=24, max_num_batched_tokens=16, block_size=4,
                              num_blocks=32, features=jaxprep.FeatureConfig(kv_groups=groups))
    return ServingConfig(prep=prep, vocab_size=VOCAB)


@pytest.mark.parametrize("make_config", [lambda: config(0), two_group_config], ids=["one group", "two groups"])
def test_a_plain_schedule_gets_schedule_fits_verdict_from_the_column_check(make_config):
    """`column_checks._plain_schedule_fits` (a common step's schedule against each row's longest sequence, the
    bound `checks.sequence_faults` states per sequence) gives `checks.schedule_fits`' verdict on busy, settled
    rows: the max_model_len end, every group's blocks, the budget, zero counts."""
    from jaxprep.serving.host import column_checks

    cfg, rng = make_config(), np.random.default_rng(7)
    tables = len(cfg.prep.features.kv_groups) or 1
    verdicts = []
    for _ in range(3000):
        rows = checks.HostRows.empty(ROWS, tables)
        rows.num_tokens[:] = rng.integers(1, 25, ROWS)
        rows.num_computed_tokens[:] = rng.integers(0, rows.num_tokens)
        for g, size in enumerate(checks.group_block_sizes(cfg)):
            rows.table_blocks[:, g] = (-(-rows.num_tokens // size) + rng.integers(-1, 2, ROWS)).clip(0, 24 // size)
        scheduled = np.minimum(rng.integers(0, 6, ROWS), rows.num_tokens - rows.num_computed_tokens
                               + rng.integers(0, 2, ROWS)) * (rng.random(ROWS) < 0.6)
        if rng.random() < 0.05:
            scheduled[rng.integers(ROWS)] = 17  # over the budget alone
        scheduled = scheduled.astype(np.int64)
        general = checks.schedule_fits(rows, column_checks.plain_schedule(cfg, scheduled), cfg)
        assert column_checks._plain_schedule_fits(rows, scheduled, column_checks._bounds(cfg)) == general
        verdicts.append(general)
    assert 150 < sum(verdicts) < len(verdicts) - 150  # both verdicts are common (the control of the comparison)
