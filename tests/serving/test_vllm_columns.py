"""`VllmAdapter`'s common path (vLLM's output read straight into the buffer's columns, `vllm_columns`, checked at
once by `column_checks`, packed by `pack_columns`) against its general path (`StepUpdates`, `checks`,
`pack_step`): the same buffers bit for bit, the same mirror and request map, and never a step the general path
refuses. On vLLM's real scheduler (tests/support/vllm_columns_worker.py, in a subprocess) and on random
scheduler outputs with vLLM's field names (below, `SimpleNamespace` stand-ins), each with corrupted copies; the
comparison's negative controls change one word, one mirror value.
"""

from __future__ import annotations

import copy
import cProfile
import dataclasses
import functools
import pstats
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

import jaxprep
from jaxprep.serving import ServingConfig
from jaxprep.serving.host.vllm import GRAMMAR_NOT_GIVEN, VllmAdapter
from support.column_paths import both_paths, differences, try_corruptions
from support.vllm_workers import worker_report

VOCAB, BLOCK = 50, 4


def config(rows: int = 6, groups: int = 1, k: int = 0) -> ServingConfig:
    kv_groups = () if groups == 1 else tuple(jaxprep.KVCacheGroupSpec(block_size=BLOCK) for _ in range(groups))
    features = jaxprep.FeatureConfig(kv_groups=kv_groups, num_speculative_tokens=k)
    prep = jaxprep.PrepConfig(max_num_reqs=rows, max_model_len=40, max_num_batched_tokens=24, block_size=BLOCK,
                              num_blocks=64, features=features, token_buckets=(8, 24))
    return ServingConfig(prep=prep, vocab_size=VOCAB)


# --- a random scheduler speaking vLLM's field names --------------------------------------------------------------

class RandomScheduler:
    """Requests join (prompts of 1-12 tokens, some with prefix-cache hits), run chunked prefills and decodes with
    new blocks as they need them, finish and are preempted (re-sent as new, V2's way); outputs as vLLM's."""

    def __init__(self, rng: np.random.Generator, groups: int):
        self.rng, self.groups, self.made = rng, groups, 0
        self.running: dict[str, dict] = {}  # req_id -> tokens, computed, blocks per group
        self.free_blocks = list(range(1, 64))
        self.finished: set = set()

    def _blocks(self, count: int) -> list[int]:
        taken, self.free_blocks = self.free_blocks[:count], self.free_blocks[count:]
        return taken

    def schedule(self, max_rows: int):
        rng, new, cached, scheduled, preempted = self.rng, [], [], {}, set()
        budget = 24
        for req_id, request in list(self.running.items()):
            if rng.random() < 0.08:  # preempted: its blocks freed, re-sent as new later
                preempted.add(req_id)
                self.free_blocks += [b for blocks in request["blocks"] for b in blocks]
                del self.running[req_id]
                continue
            left = len(request["tokens"]) - request["computed"]
            count = min(left, budget, int(rng.integers(1, 6)))
            if count < 1:
                continue
            needed = -(-(request["computed"] + count) // BLOCK) - len(request["blocks"][0])
            if needed > len(self.free_blocks) // self.groups:
                continue
            added = tuple(self._blocks(max(needed, 0)) for _ in range(self.groups))
            for g, ids in enumerate(added):
                request["blocks"][g] += ids
            cached.append((req_id, request["computed"], added if needed > 0 else None))
            scheduled[req_id] = count
            request["scheduled"] = count
            budget -= count
        while budget > 0 and len(self.running) < max_rows and rng.random() < 0.6:
            req_id, length = f"r{self.made}", int(rng.integers(1, 13))
            self.made += 1
            hit = int(rng.integers(0, (length - 1) // BLOCK + 1)) * BLOCK if rng.random() < 0.3 else 0
            count = min(length - hit, budget)
            blocks = -(-(hit + count) // BLOCK)
            if blocks * self.groups > len(self.free_blocks):
                break
            tokens = rng.integers(0, VOCAB, length).tolist()
            ids = tuple(self._blocks(blocks) for _ in range(self.groups))
            self.running[req_id] = dict(tokens=tokens, computed=hit, blocks=[list(b) for b in ids], scheduled=count)
            new.append(SimpleNamespace(req_id=req_id, prompt_token_ids=tokens, prefill_token_ids=None,
                                       block_ids=ids, num_computed_tokens=hit, sampling_params=None,
                                       lora_request=None))
            scheduled[req_id] = count
            budget -= count
        finished, self.finished = self.finished, set()
        cached_reqs = SimpleNamespace(req_ids=[c[0] for c in cached], num_computed_tokens=[c[1] for c in cached],
                                      new_block_ids=[c[2] for c in cached], resumed_req_ids=set(), all_token_ids={})
        return SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached_reqs,
                               num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                               scheduled_spec_decode_tokens={}, finished_req_ids=finished,
                               preempted_req_ids=preempted)

    def advance(self, so) -> dict:
        """The step ran: each scheduled request computed its tokens; those that reached their end sampled one
        (some finish). Returns {req_id: sampled tokens}."""
        sampled = {}
        for req_id in so.num_scheduled_tokens:
            request = self.running[req_id]
            request["computed"] += request.pop("scheduled")
            sampled[req_id] = []
            if request["computed"] == len(request["tokens"]):
                token = int(self.rng.integers(0, VOCAB))
                request["tokens"].append(token)
                sampled[req_id] = [token]
                if len(request["tokens"]) >= 30 or self.rng.random() < 0.1:
                    self.finished.add(req_id)
                    self.free_blocks += [b for blocks in request["blocks"] for b in blocks]
                    del self.running[req_id]
        return sampled


def record(adapter: VllmAdapter, step, sampled: dict) -> None:
    rows = step.inputs.idx_mapping.shape[0]
    tokens, counts = np.zeros((rows, 1), np.int32), np.zeros(rows, np.int32)
    for req_id, values in sampled.items():
        b = step.req_id_to_index[req_id]
        tokens[b, :len(values)], counts[b] = values, len(values)
    adapter.record_sampled(jnp.asarray(tokens), jnp.asarray(counts))


# --- corruptions of a scheduler output (one field each) ----------------------------------------------------------

def _any_new(change):
    def corrupt(so, rng):
        if not so.scheduled_new_reqs:
            return False
        change(so.scheduled_new_reqs[int(rng.integers(len(so.scheduled_new_reqs)))], so)
    return corrupt


def _any_cached(change):
    def corrupt(so, rng):
        cached = so.scheduled_cached_reqs
        if not cached.req_ids:
            return False
        change(cached, int(rng.integers(len(cached.req_ids))), so)
    return corrupt


def _set_count(value):
    def corrupt(so, rng):
        if not so.num_scheduled_tokens:
            return False
        req_id = list(so.num_scheduled_tokens)[int(rng.integers(len(so.num_scheduled_tokens)))]
        so.num_scheduled_tokens[req_id] = value(so.num_scheduled_tokens[req_id])
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    return corrupt


def _new_blocks(value):
    def change(cached, i, so):
        cached.new_block_ids[i] = value(cached.new_block_ids[i])
    return _any_cached(change)


CORRUPTIONS = {
    "count 1.5": _set_count(lambda n: n + 0.5),
    "count 0": _set_count(lambda n: 0),
    "count past the known tokens": _set_count(lambda n: n + 30),
    "total + 1": lambda so, rng: setattr(so, "total_num_scheduled_tokens", so.total_num_scheduled_tokens + 1),
    "token id past the vocabulary": _any_new(lambda new, so: new.prompt_token_ids.__setitem__(0, VOCAB)),
    "token id -1": _any_new(lambda new, so: new.prompt_token_ids.__setitem__(0, -1)),
    "token id 2**40": _any_new(lambda new, so: new.prompt_token_ids.__setitem__(0, 2**40)),
    "token id 1.0": _any_new(lambda new, so: new.prompt_token_ids.__setitem__(0, 1.0)),
    "no prompt tokens": _any_new(lambda new, so: setattr(new, "prompt_token_ids", [])),
    "block id 0": _any_new(lambda new, so: setattr(new, "block_ids", tuple([0] + ids for ids in new.block_ids))),
    "block id past the cache": _any_new(lambda new, so: setattr(new, "block_ids",
                                                                tuple(ids + [64] for ids in new.block_ids))),
    "too many blocks": _any_new(lambda new, so: setattr(new, "block_ids", tuple(ids + [1] * 12
                                                                                for ids in new.block_ids))),
    "computed past the prompt": _any_new(lambda new, so: setattr(new, "num_computed_tokens", 40)),
    "computed not covered by blocks": _any_new(lambda new, so: setattr(new, "block_ids",
                                                                       tuple([] for _ in new.block_ids))),
    "computed 0.5": _any_new(lambda new, so: setattr(new, "num_computed_tokens", 0.5)),
    "flat block_ids": _any_new(lambda new, so: setattr(new, "block_ids", list(new.block_ids[0]))),
    "a new request twice": _any_new(lambda new, so: so.scheduled_new_reqs.append(copy.deepcopy(new))),
    "cached computed + 1": _any_cached(lambda c, i, so: c.num_computed_tokens.__setitem__(
        i, c.num_computed_tokens[i] + 1)),
    "unknown running request": _any_cached(lambda c, i, so: c.req_ids.__setitem__(i, "zz")),
    "appended block id 0": _new_blocks(lambda ids: tuple([0] for _ in range(len(ids or ([],))))),
    "appended block id past the cache": _new_blocks(lambda ids: tuple([99] for _ in range(len(ids or ([],))))),
    "appended blocks past the width": _new_blocks(lambda ids: tuple([1] * 11 for _ in range(len(ids or ([],))))),
    "appended flat list": _new_blocks(lambda ids: [5]),
    "appended 1.5": _new_blocks(lambda ids: tuple([1.5] for _ in range(len(ids or ([],))))),
    "a running request finished": _any_cached(lambda c, i, so: so.finished_req_ids.add(c.req_ids[i])),
}
"""One field of a scheduler output broken; a corruption that does not apply to the output returns False."""


def run_random(seed: int, cfg: ServingConfig, steps: int = 40) -> dict:
    rng = np.random.default_rng(seed)
    groups = max(len(cfg.prep.features.kv_groups), 1)
    scheduler, adapter = RandomScheduler(rng, groups), VllmAdapter(cfg)
    seen = dict(common=0, general=0, refused=0, corrupt_refused=0, corrupt_common=0, problems=[])
    for number in range(steps):
        so = scheduler.schedule(cfg.max_num_reqs)
        paths = both_paths(adapter, so)
        seen[paths.kind] += 1
        seen["problems"] += [f"step {number}: {d}" for d in differences(paths)]
        seen["problems"] += try_corruptions(adapter, so, CORRUPTIONS, rng, seen, f"step {number}")
        step = adapter.step(so)
        sampled = scheduler.advance(so)
        if step.buffer is not None:
            record(adapter, step, sampled)
    return seen


@pytest.mark.parametrize("groups", [1, 2])
def test_random_steps_read_as_columns_equal_the_general_path(groups):
    seen = run_random(groups, config(groups=groups))
    assert seen["problems"] == []
    assert seen["common"] >= 30  # every step of the random scheduler is a common one...
    assert seen["refused"] == 0
    assert seen["corrupt_refused"] >= 200 and seen["corrupt_common"] > 0  # ...and most corruptions are refused


def test_the_comparison_sees_a_changed_word_and_a_changed_mirror():
    """Negative controls: the common path's step buffer with one word changed, its mirror with one count
    changed, its request map with one row changed: each is a difference."""
    cfg = config()
    scheduler, adapter = RandomScheduler(np.random.default_rng(0), 1), VllmAdapter(cfg)
    paths = both_paths(adapter, scheduler.schedule(cfg.max_num_reqs))
    assert paths.kind == "common" and differences(paths) == []
    checked = paths.common.checked
    step = checked.packed.step.copy()
    step[12] += 1
    changed_word = dataclasses.replace(checked, packed=dataclasses.replace(checked.packed, step=step))
    rows = checked.rows.copy()
    rows.num_tokens[0] += 1
    changed_mirror = dataclasses.replace(checked, rows=rows)
    for changed in (changed_word, changed_mirror):
        found = differences(dataclasses.replace(paths, common=dataclasses.replace(paths.common, checked=changed)))
        assert len(found) == 1, found
    requests = copy.copy(paths.common.requests)
    requests.rows = {**requests.rows, "r0": 5}
    assert differences(dataclasses.replace(paths, common=dataclasses.replace(paths.common, requests=requests)))


def test_steps_with_drafts_take_the_general_path():
    """Drafts (spec decode) are the general path's: the common reader declines, the step is served."""
    cfg = config(k=2)
    adapter = VllmAdapter(cfg)
    new = SimpleNamespace(req_id="a", prompt_token_ids=[1, 2, 3], prefill_token_ids=None, block_ids=([1],),
                          num_computed_tokens=0, sampling_params=None, lora_request=None)
    cached = SimpleNamespace(req_ids=[], num_computed_tokens=[], new_block_ids=[], resumed_req_ids=set(),
                             all_token_ids={})
    so = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached, num_scheduled_tokens={"a": 3},
                         total_num_scheduled_tokens=3, scheduled_spec_decode_tokens={}, finished_req_ids=set(),
                         preempted_req_ids=set())
    assert both_paths(adapter, so).kind == "common"
    record(adapter, adapter.step(so), {"a": [7]})
    cached = SimpleNamespace(req_ids=["a"], num_computed_tokens=[3], new_block_ids=[([2],)], resumed_req_ids=set(),
                             all_token_ids={})
    drafted = SimpleNamespace(**{**vars(so), "scheduled_new_reqs": [], "scheduled_cached_reqs": cached,
                                 "num_scheduled_tokens": {"a": 3}, "scheduled_spec_decode_tokens": {"a": [8, 9]}})
    paths = both_paths(adapter, drafted)
    assert paths.kind == "general" and differences(paths) == []
    assert adapter.step(drafted).req_ids == ["a"]


# --- calls per decode step --------------------------------------------------------------------------------------

def decode_output(num_running: int, with_blocks: bool):
    req_ids = [f"r{i}" for i in range(num_running)]
    cached = SimpleNamespace(req_ids=req_ids, num_computed_tokens=[2] * num_running,
                             new_block_ids=[([100 + i],) if with_blocks and i % 8 == 0 else None
                                            for i in range(num_running)],
                             resumed_req_ids=set(), all_token_ids={})
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens=dict.fromkeys(req_ids, 1), total_num_scheduled_tokens=num_running,
                           scheduled_spec_decode_tokens={}, finished_req_ids=set(), preempted_req_ids=set())


def calls_of(function) -> int:
    profile = cProfile.Profile()
    profile.enable()
    function()
    profile.disable()
    return pstats.Stats(profile).total_calls


@pytest.mark.parametrize("with_blocks", [False, True], ids=["decode", "decode with new blocks"])
def test_a_decode_step_costs_the_same_calls_at_any_batch_size(with_blocks):
    """A decode step of 4 or 64 running requests (one in eight with a new block, or none): the same function
    calls (cProfile: Python functions and the C functions they call, NumPy's included) to read, check and pack
    it. Control: the general path's calls grow with the requests that get a new block."""
    prep = jaxprep.PrepConfig(max_num_reqs=64, max_model_len=64, max_num_batched_tokens=64, block_size=4,
                              num_blocks=512, token_buckets=(64,))
    cfg = ServingConfig(prep=prep, vocab_size=VOCAB)
    common, general = [], []
    for size in (4, 64):
        adapter = VllmAdapter(cfg)
        admit = [SimpleNamespace(req_id=f"r{i}", prompt_token_ids=[1, 2], prefill_token_ids=None,
                                 block_ids=([1 + i, 300 + i],), num_computed_tokens=1, sampling_params=None,
                                 lora_request=None) for i in range(size)]
        first = SimpleNamespace(**{**vars(decode_output(0, False)), "scheduled_new_reqs": admit,
                                   "num_scheduled_tokens": {f"r{i}": 1 for i in range(size)},
                                   "total_num_scheduled_tokens": size})
        record(adapter, adapter.step(first), {f"r{i}": [3] for i in range(size)})
        so = decode_output(size, with_blocks)
        adapter._plan(so, GRAMMAR_NOT_GIVEN)  # the running rows kept from here on
        assert both_paths(adapter, so).kind == "common"
        common.append(calls_of(functools.partial(adapter._plan, so, GRAMMAR_NOT_GIVEN)))
        general.append(calls_of(functools.partial(both_paths, adapter, so)) - common[-1])
    assert common[0] == common[1], common
    if with_blocks:
        assert general[1] > general[0] + 7, general


@pytest.mark.parametrize("value", [1.0, True, np.int64(1)], ids=["float", "bool", "numpy int"])
def test_a_count_equal_to_the_last_steps_but_not_an_int_is_read_as_before(value):
    """The reader keeps the last step's counts for a decode step whose counts equal them; a count that equals its
    int but is not one (``1.0``, ``True``, NumPy's int64), its total still the int, is read as it always was, by
    NumPy: a float the common path declines and the general path refuses, naming the field; a bool or a NumPy
    int among ints (NumPy reads them as int64) both paths take, to the same buffers."""
    prep = jaxprep.PrepConfig(max_num_reqs=8, max_model_len=64, max_num_batched_tokens=64, block_size=4,
                              num_blocks=512, token_buckets=(8, 64))
    adapter = VllmAdapter(ServingConfig(prep=prep, vocab_size=VOCAB))
    admit = [SimpleNamespace(req_id=f"r{i}", prompt_token_ids=[1, 2], prefill_token_ids=None,
                             block_ids=([1 + i, 300 + i],), num_computed_tokens=1, sampling_params=None,
                             lora_request=None) for i in range(4)]
    first = SimpleNamespace(**{**vars(decode_output(0, False)), "scheduled_new_reqs": admit,
                               "num_scheduled_tokens": {f"r{i}": 1 for i in range(4)}, "total_num_scheduled_tokens": 4})
    record(adapter, adapter.step(first), {f"r{i}": [3] for i in range(4)})
    so = decode_output(4, False)
    record(adapter, adapter.step(so), {f"r{i}": [4] for i in range(4)})  # the reader now holds [1, 1, 1, 1]
    so = decode_output(4, False)
    so.scheduled_cached_reqs.num_computed_tokens = [3] * 4
    assert both_paths(adapter, so).kind == "common"  # the same counts, ints: the reuse
    so.num_scheduled_tokens["r2"] = value
    paths = both_paths(adapter, so)
    assert differences(paths) == []
    if isinstance(value, float):
        assert paths.kind == "refused" and "num_scheduled_tokens['r2']" in paths.error and paths.common is None
    else:
        assert paths.kind == "common"


# --- vLLM's real scheduler ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def columns_report() -> dict:
    return worker_report("vllm_columns_worker.py")


def test_vllms_steps_read_as_columns_equal_the_general_path(columns_report):
    assert columns_report["problems"] == []
    runs = columns_report["runs"]
    assert sum(run["common"] for run in runs.values()) >= 150
    for name, run in runs.items():
        if "spec decode" not in name:
            assert run["common"] > run["general"], (name, run)  # most of vLLM's steps are common ones
    assert sum(run["general"] for run in runs.values()) > 0  # resumes, drafts: the general path's
    assert sum(run["corrupt_refused"] for run in runs.values()) >= 100
    assert all(run["controls_caught"] == run["common"] for run in runs.values())
