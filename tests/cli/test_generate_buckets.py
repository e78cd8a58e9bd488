"""`jaxprep generate` compiles its step for the rungs its decodes use and for the budget (`generate_buckets`)."""

from __future__ import annotations

import pytest

from jaxprep import PrepConfig
from jaxprep.cli.generate import generate_buckets
from jaxprep.config import default_token_buckets


@pytest.mark.parametrize("rows, budget", [(1, 256), (16, 256), (300, 256), (2, 8), (1, 300), (100, 64), (5, 5)])
def test_the_ladder_holds_every_decode_step_and_the_budget(rows, budget):
    ladder = generate_buckets(rows, budget)
    config = PrepConfig(max_num_reqs=rows, max_model_len=4096, max_num_batched_tokens=budget, block_size=16,
                        token_buckets=ladder)  # a valid ladder: ascending, the budget on top
    assert set(ladder) <= set(default_token_buckets(budget))
    full = default_token_buckets(budget)
    for decodes in range(1, min(rows, budget) + 1):  # a decode step pads to the rung the default ladder picks
        assert config.bucket_for(decodes) == next(b for b in full if b >= decodes)
    assert ladder[-1] == budget


def test_worked_examples():
    assert generate_buckets(1, 256) == (8, 256)
    assert generate_buckets(16, 256) == (8, 16, 256)
    assert generate_buckets(300, 256) == default_token_buckets(256)
