"""Each token id is checked once on the host, where it enters: a payload built by `AddRequests.build` /
`ResumeRequests.build` carries the bound its ids were checked against, and `checks.check_updates` does not
check them again under the same (or a narrower) vocabulary; a payload built by hand, copied with
`dataclasses.replace`, or built for a looser vocabulary is checked there. The verdicts are compared with
the ids' own bound, so a skipped check can never let an id outside the vocabulary through."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from jaxprep import PrepConfig
from jaxprep.serving import AddRequests, InvalidUpdateError, ServingConfig, StepUpdates, state
from jaxprep.serving.host import checks

PREP = PrepConfig(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, block_size=4, num_blocks=16)
CONFIG = ServingConfig(prep=PREP, vocab_size=64)
REQUESTS = [dict(row=1, token_ids=[2, 3, 63], block_ids=[1]), dict(row=2, token_ids=[5], block_ids=[2])]


def count_token_checks(monkeypatch) -> list:
    """Every call of the one token-id bound test (`state.token_ids_fit`) made by `checks`, as its ids."""
    calls = []

    def counted(values, bound, low=0):
        calls.append(np.asarray(values).tolist())
        return state.token_ids_fit(values, bound, low)

    monkeypatch.setattr(checks, "token_ids_fit", counted)
    monkeypatch.setattr(checks, "check_token_ids", lambda where, ids, *args, **kwargs: calls.append(list(ids)))
    return calls


@pytest.mark.parametrize("requests", [REQUESTS, REQUESTS[:1]], ids=["at once", "one by one"])
def test_a_built_payload_is_not_checked_again(requests, monkeypatch):
    add = AddRequests.build(CONFIG, requests)
    assert add.token_id_bound == CONFIG.token_id_bound
    calls = count_token_checks(monkeypatch)
    checks.check_updates(checks.HostRows.for_config(CONFIG), dataclasses.replace(StepUpdates.build(CONFIG), add=add),
                         CONFIG)
    assert calls == []
    # negative control: the same payload copied by dataclasses.replace starts unchecked, so its ids are checked
    copied = dataclasses.replace(add, entries=add.entries)
    assert copied.token_id_bound is None
    checks.check_updates(checks.HostRows.for_config(CONFIG), dataclasses.replace(
        StepUpdates.build(CONFIG), add=copied), CONFIG)
    assert calls == [[t for r in requests for t in r["token_ids"]]]


def test_a_payload_built_for_a_looser_vocabulary_is_checked_again():
    loose = AddRequests.build(ServingConfig(prep=PREP), [dict(row=1, token_ids=[2, 64], block_ids=[1])])
    assert loose.token_id_bound > CONFIG.token_id_bound
    with pytest.raises(InvalidUpdateError, match=re.escape("token_ids[1] = 64 is outside [0, vocab_size=64)")):
        checks.check_updates(checks.HostRows.for_config(CONFIG), dataclasses.replace(
            StepUpdates.build(CONFIG), add=loose), CONFIG)
    # negative control: the same ids within the vocabulary pass
    fine = AddRequests.build(ServingConfig(prep=PREP), [dict(row=1, token_ids=[2, 63], block_ids=[1])])
    checks.check_updates(checks.HostRows.for_config(CONFIG), dataclasses.replace(
        StepUpdates.build(CONFIG), add=fine), CONFIG)


def test_token_ids_fit_matches_the_elementwise_bounds():
    rng = np.random.default_rng(0)
    for _ in range(200):
        values = rng.integers(-3, 70, int(rng.integers(0, 6)))
        low = int(rng.choice([-1, 0]))
        assert state.token_ids_fit(values, 64, low) == bool(((values >= low) & (values < 64)).all())
    assert not state.token_ids_fit(np.array([1.0]), 64)  # not integers
    assert state.token_ids_fit(np.array([2**63], np.uint64), 2**64)  # no wrap through a signed compare
