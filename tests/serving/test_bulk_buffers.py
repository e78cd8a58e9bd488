"""An `Engine` whose top payload rung cannot hold a step's admission (`update_packing.bulk_rungs`): the warm-up
compiles `apply_packed` at the bulk rung too, a crowded admission's leading buffers go to it (one call each, no
widening), nothing compiles after the warm-up, and the tokens are those of the same loop with the leading buffers
cut at the top rung (the split before the bulk rung), fused and separate alike, each checked against a dense
recomputation. Negative control: other weights give other tokens, and the comparison sees it."""

from __future__ import annotations

import pytest

from jaxprep.serving import Engine, check_against_dense, random_workload, update_packing
from support.loop_workloads import MODEL, make_config
from support.run_keys import run_after_warmup

# 16 rows, max_model_len 32: the top rung (96 words) holds one request of 32 tokens; the first step admits 16
# requests of 2-6 tokens at once (~180 words)
CONFIG = make_config(budget=64, block_size=4, num_blocks=160, max_num_reqs=16, max_model_len=32, decode_steps=2)
WORKLOAD = random_workload(4, num_requests=20, vocab_size=MODEL.vocab_size, prompt_len=(2, 6), max_tokens=(3, 8))


def served(separate: bool, monkeypatch, *, top_only: bool = False, seed: int = 0):
    """The engine after the workload, each request's tokens, what compiled after the warm-up, and the keys run."""
    ladder = update_packing._ladder
    if top_only:  # the leading buffers cut at the top rung, as before the bulk rung
        monkeypatch.setattr(update_packing, "_ladder", lambda config: ladder(config)._replace(
            leading=ladder(config).buckets))
    engine = Engine(CONFIG, MODEL, seed=seed, separate_updates=separate)
    finished, compiles, keys = run_after_warmup(engine, WORKLOAD, monkeypatch)
    monkeypatch.undo()
    assert len(finished) == len(WORKLOAD.requests)
    return engine, {r.request_id: r.output_token_ids for r in finished}, compiles, keys


@pytest.mark.parametrize("separate", [False, True])
def test_a_crowded_admission_goes_to_the_bulk_program(separate, monkeypatch):
    (bulk,) = update_packing.bulk_rungs(CONFIG)
    assert bulk > update_packing.payload_buckets(CONFIG)[-1]
    engine, tokens, compiled, keys = served(separate, monkeypatch)
    warmed = [e.key for e in engine._warmup_executables()]
    assert ("apply", False, bulk) in warmed and engine.num_executables == len(warmed)
    assert f"a large update at {bulk} words" in engine.warmup_plan()
    assert compiled == 0 and all(key in engine.batch.executables for key in keys)
    at_bulk = [i for i, key in enumerate(keys) if key == ("apply", False, bulk)]
    assert at_bulk and all(keys[i - 1][0] != "widen" for i in at_bulk if i)
    assert check_against_dense(engine.params, MODEL, engine.finished, CONFIG.max_model_len).passed
    _, at_top, _, top_keys = served(separate, monkeypatch, top_only=True)
    assert ("apply", False, bulk) not in top_keys
    assert top_keys.count(("apply", False)) > len(at_bulk)  # more calls for the same leading content
    assert tokens == at_top
    if separate:  # negative control (once): other weights give other tokens, and it is seen
        _, other, _, _ = served(separate, monkeypatch, seed=1)
        assert other != tokens
