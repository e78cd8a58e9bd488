"""The `Engine`'s common path (the host scheduler's output read straight into the buffer's columns,
`scheduler_columns`, checked at once by `column_checks`, packed by `pack_columns`) against its general path
(`scheduler_updates` -> `StepUpdates`, `checks.check_updates`, `pack_step`): every step of real serving runs
(admissions, chunked prefill, preemption, multi-step decode, n-gram drafts, stops) gives the same buffers bit for
bit and the same mirror; a changed word is seen (the comparison's negative control); the loop's tokens are the
same either way."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from jaxprep import PrepConfig
from jaxprep.serving import Engine, ModelConfig, ServingConfig, random_workload
from jaxprep.serving.host import checks, column_checks
from jaxprep.serving.host.batch import ColumnsUpdate
from jaxprep.serving.host.engine import scheduler_updates
from jaxprep.serving.spec_decode.ngram import NgramConfig
from jaxprep.serving.update_packing import pack_columns, pack_step

MODEL = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=2, d_ff=64)
PREP = PrepConfig(max_num_reqs=6, max_model_len=48, max_num_batched_tokens=24, block_size=4, num_blocks=30)
CONFIGS = {
    "multi-step decode, a pool that preempts": ServingConfig(prep=PREP, eos_token_id=1, decode_steps=4),
    "n-gram drafts": ServingConfig(prep=PREP, eos_token_id=1, decode_steps=1, num_speculative_tokens=2,
                                   ngram=NgramConfig(prompt_lookup_min=2, prompt_lookup_max=2)),
}


def differences(config: ServingConfig, batch, payload: ColumnsUpdate, out) -> list[str]:
    """The columns' buffers and mirror against the `StepUpdates`' of the same scheduler output."""
    updates = scheduler_updates(config, out)
    mine = pack_columns(config, payload.columns)
    theirs = pack_step(config, updates, batch.rows.table_blocks)
    found = [f"buffer {i}" for i, (a, b) in enumerate(zip(mine.buffers, theirs.buffers))
             if a.shape != b.shape or not np.array_equal(a, b)]
    if len(mine.buffers) != len(theirs.buffers):
        found.append(f"{len(mine.buffers)} buffers, the general path {len(theirs.buffers)}")
    if (mine.content_words, mine.changed_words) != (theirs.content_words, theirs.changed_words):
        found.append("words")
    rows = column_checks.check_columns(batch.rows, payload.columns, config)
    expected = checks.check_updates(batch.rows, updates, config)
    if rows is None:
        return [*found, "the columns' check refused what the general check takes"]
    return found + [f"mirror.{f.name}" for f in dataclasses.fields(rows)
                    if not np.array_equal(getattr(rows, f.name), getattr(expected, f.name))
                    or getattr(rows, f.name).dtype != getattr(expected, f.name).dtype]


class ComparingEngine(Engine):
    """An `Engine` that, every step, compares its columns with the `StepUpdates` of the same output."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = dict(columns=0, general=0, problems=[])

    def _rank_updates(self, outs):
        payloads = super()._rank_updates(outs)
        for out, payload in zip(outs, payloads):
            if isinstance(payload, ColumnsUpdate):
                self.seen["columns"] += 1
                self.seen["problems"] += [f"dispatch {self.stats.dispatches}: {d}"
                                          for d in differences(self.config, self.batch, payload, out)]
            else:
                self.seen["general"] += 1
        return payloads


def serve(engine_class, config: ServingConfig, seed: int):
    workload = random_workload(seed, num_requests=14, vocab_size=MODEL.vocab_size, prompt_len=(3, 30),
                               max_tokens=(1, 14), arrival_spread=6, repetitive=config.ngram is not None)
    engine = engine_class(config, MODEL, seed=seed)
    engine.submit(copy.deepcopy(workload.requests), workload.arrival_steps)
    finished = engine.run()
    return engine, {r.request_id: r.output_token_ids for r in finished}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_schedulers_columns_equal_its_step_updates(name):
    config = CONFIGS[name]
    engine, tokens = serve(ComparingEngine, config, 3)
    seen = engine.seen
    assert seen["problems"] == []
    assert seen["columns"] == engine.stats.dispatches and seen["general"] == 0
    stats = engine.stats
    assert stats.preemptions > 0 or stats.draft_tokens > 0
    if config.decode_steps > 1:
        assert stats.multi_step_dispatches > 0
    # the loop serves the same tokens when every step goes the general way
    general = type("GeneralEngine", (Engine,), {"_rank_updates": lambda self, outs: [
        scheduler_updates(self.config, out) for out in outs]})
    assert serve(general, config, 3)[1] == tokens


def test_the_comparison_sees_a_changed_word():
    """Negative control: the scheduler's columns with one appended block id changed differ from its updates."""
    config = CONFIGS["multi-step decode, a pool that preempts"]
    found = []

    class ChangedEngine(Engine):
        def _rank_updates(self, outs):
            payloads = super()._rank_updates(outs)
            (payload,), (out,) = payloads, outs
            if isinstance(payload, ColumnsUpdate) and len(payload.columns.segment_data) and not found:
                changed = payload.columns.segment_data.copy()
                changed[0] += 1
                columns = dataclasses.replace(payload.columns, segment_data=changed)
                found.extend(differences(self.config, self.batch, dataclasses.replace(payload, columns=columns), out))
            return payloads

    serve(ChangedEngine, config, 3)
    assert found and found[0].startswith("buffer")


def test_a_feature_value_per_request_takes_the_step_updates():
    """Sampling parameters per request are not in the columns' records: the engine builds `StepUpdates`."""
    from jaxprep.cli._sampling import with_sampling

    config = with_sampling(CONFIGS["multi-step decode, a pool that preempts"], MODEL.vocab_size)
    assert not column_checks.covers(config)
    engine, _ = serve(ComparingEngine, config, 4)
    assert engine.seen["columns"] == 0 and engine.seen["general"] == engine.stats.dispatches
