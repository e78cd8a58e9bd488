"""A step's admissions handled at once (one conversion, one check, one record table per field) against
the one-request-at-a-time paths they replace: the same entries, the same host rows, the same records,
and a bad value still refused by name (the per-request path names it)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxprep import FeatureConfig, LoRAConfig, PrepConfig, SamplingConfig, SamplingParams
from jaxprep.serving import InvalidUpdateError, ServingConfig, StepUpdates, state, update_packing
from jaxprep.serving.host import checks

VOCAB = 64
CONFIG = ServingConfig(prep=PrepConfig(max_num_reqs=8, max_model_len=32, max_num_batched_tokens=64, block_size=4,
                                       num_blocks=40, features=FeatureConfig(lora=LoRAConfig(max_loras=2),
                                                                             sampling=SamplingConfig(vocab_size=VOCAB))),
                       vocab_size=VOCAB)


def requests(seed: int = 0) -> list[dict]:
    """Six admissions of random lengths, blocks, hits, adapters and sampling parameters (seeded)."""
    rng, out = np.random.default_rng(seed), []
    for row in (5, 0, 3, 7, 1, 2):
        n = int(rng.integers(1, 30))
        computed = int(rng.integers(0, n)) // 4 * 4
        blocks = rng.integers(1, 40, -(-n // 4)).tolist()
        params = SamplingParams(temperature=float(rng.uniform(0, 2)), top_p=float(rng.uniform(0.1, 1)),
                                top_k=int(rng.integers(0, 80)), seed=int(rng.integers(0, 1000)),
                                repetition_penalty=float(rng.uniform(0.5, 2)))
        out.append(dict(row=row, token_ids=rng.integers(0, VOCAB, n).tolist(), block_ids=blocks,
                        num_computed_tokens=computed, prefill_len=n, lora_id=int(rng.integers(0, 3)),
                        sampling=params if row != 3 else None, prompt_len=int(rng.integers(0, n + 1))))
    return out


def one_by_one(reqs: list[dict]) -> tuple:
    np.random.seed(0)  # the seed drawn for a request without one (NumPy's global generator)
    return tuple(state._add_entry(CONFIG, i, r) for i, r in enumerate(reqs))


def assert_same_entries(got: tuple, expected: tuple) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        for field in dataclasses.fields(a):
            x, y = getattr(a, field.name), getattr(b, field.name)
            if field.name == "block_ids":
                assert len(x) == len(y) and all(np.array_equal(p, q) and p.dtype == q.dtype for p, q in zip(x, y))
            elif isinstance(y, np.ndarray):
                assert np.array_equal(x, y) and x.dtype == y.dtype, field.name
            else:
                assert x == y, field.name


def test_build_at_once_equals_one_by_one():
    reqs = requests()
    assert state._add_entries_at_once(CONFIG, reqs) is not None  # the vectorized path is the one taken
    expected = one_by_one(reqs)
    np.random.seed(0)
    assert_same_entries(state.AddRequests.build(CONFIG, reqs).entries, expected)
    # negative control: a perturbed token differs from the one-by-one entries of the original
    perturbed = requests()
    perturbed[2]["token_ids"][0] = (perturbed[2]["token_ids"][0] + 1) % VOCAB
    np.random.seed(0)
    with pytest.raises(AssertionError):
        assert_same_entries(state.AddRequests.build(CONFIG, perturbed).entries, expected)


@pytest.mark.parametrize("field, value, message", [
    ("token_ids", [3, 2.5], r"AddRequests entry 1 \(row 0\): token_ids\[1\] = 2.5 is not an integer"),
    ("token_ids", [3, VOCAB], r"AddRequests entry 1 \(row 0\): token_ids\[1\] = 64 is outside \[0, vocab_size=64\)"),
    ("num_computed_tokens", 1.5, r"AddRequests entry 1 \(row 0\): num_computed_tokens = 1.5 is not an integer"),
    ("block_ids", [1, 2**40], r"AddRequests entry 1 \(row 0\): block_ids has values outside int32"),
])
def test_build_at_once_leaves_a_bad_value_to_be_named(field, value, message):
    reqs = requests()
    reqs[1][field] = value
    assert state._add_entries_at_once(CONFIG, reqs) is None
    with pytest.raises(ValueError, match=message):
        state.AddRequests.build(CONFIG, reqs)


def checked_rows(updates: StepUpdates, at_once: bool, monkeypatch) -> checks.HostRows:
    with monkeypatch.context() as patch:
        if not at_once:
            patch.setattr(checks, "_adds_fit", lambda *args: False)
        return checks.check_updates(checks.HostRows.for_config(CONFIG), updates, CONFIG)


def test_checks_at_once_equal_one_by_one(monkeypatch):
    updates = StepUpdates.build(CONFIG, add=requests())
    got, expected = checked_rows(updates, True, monkeypatch), checked_rows(updates, False, monkeypatch)
    for field in dataclasses.fields(got):
        assert np.array_equal(getattr(got, field.name), getattr(expected, field.name)), field.name
    # negative control: the rows of another admission differ
    other = checked_rows(StepUpdates.build(CONFIG, add=requests(1)), True, monkeypatch)
    assert not np.array_equal(other.num_tokens, expected.num_tokens)


@pytest.mark.parametrize("change, message", [
    (dict(token_ids=np.array([3, VOCAB])), r"AddRequests entry 1 \(row 0\): token_ids\[1\] = 64 is outside"),
    (dict(block_ids=(np.array([1, 40]),)), r"AddRequests entry 1 \(row 0\): block_table block id \[1\] = 40"),
    (dict(num_computed_tokens=2), r"AddRequests entry 1 \(row 0\): num_computed_tokens=2 must lie in \[0, "),
    (dict(lora_id=-1), r"AddRequests entry 1 \(row 0\): lora_id=-1 must be >= 0"),
])
def test_checks_at_once_leave_a_bad_entry_to_be_named(change, message, monkeypatch):
    entries = list(StepUpdates.build(CONFIG, add=requests()).add.entries)
    entries[1] = dataclasses.replace(entries[1], token_ids=np.array([3, 4]), block_ids=(np.array([1]),),
                                     num_computed_tokens=0, prefill_len=2, sampling=None)
    entries[1] = dataclasses.replace(entries[1], **change)
    updates = dataclasses.replace(StepUpdates.build(CONFIG), add=state.AddRequests(entries=tuple(entries)))
    rows = checks.HostRows.for_config(CONFIG)
    assert not checks._adds_fit(rows.copy(), updates.add.entries, np.array([e.row for e in entries]), CONFIG)
    with pytest.raises(InvalidUpdateError, match=message):
        checks.check_updates(rows, updates, CONFIG)


def test_records_at_once_equal_one_by_one():
    lay = update_packing.payload_layout(CONFIG)
    entries = StepUpdates.build(CONFIG, add=requests()).add.entries
    expected = np.array([update_packing._add_record(e, lay) for e in entries], np.int64)
    np.testing.assert_array_equal(update_packing._add_records(entries, lay), expected)
    # negative control: another temperature gives another record
    warmer = [dataclasses.replace(entries[0], sampling=dict(entries[0].sampling, temperature=3.0)), *entries[1:]]
    assert not np.array_equal(update_packing._add_records(warmer, lay), expected)
