"""Speculative decoding with sampling parameters (`FeatureConfig.sampling` + n-gram drafts): the step
verifies drafts by rejection sampling against each row's sampling distribution.

- greedy requests (penalties included) give the same tokens with and without drafts;
- a seeded request gives the same tokens whatever its neighbours;
- sampled requests' tokens follow the same distribution with and without drafts (a two-sample
  chi-square over many seeds, on a vocabulary small enough that most steps carry drafts).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from jaxprep import FeatureConfig, PrepConfig, SamplingConfig, SamplingParams
from jaxprep.serving import Engine, ModelConfig, ServingConfig, random_workload
from jaxprep.serving.host.scheduler import Request
from jaxprep.serving.spec_decode.ngram import NgramConfig

LOOKUP = NgramConfig(prompt_lookup_min=1, prompt_lookup_max=3)
MODEL = ModelConfig(vocab_size=8, num_layers=2, d_model=32, num_heads=2, d_ff=64)
"""One model for every test (eight ids: the n-gram drafter finds matches), so tests with the same
serving configuration share its executables."""


def make_config(model: ModelConfig, *, k: int) -> ServingConfig:
    """Every test's configuration (4 rows, 16 tokens a step): with drafts (``k``) and without, one each, so the
    long sampling runs reuse the executables the greedy test compiled."""
    prep = PrepConfig(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, block_size=4, num_blocks=33,
                      features=FeatureConfig(sampling=SamplingConfig(vocab_size=model.vocab_size)))
    return ServingConfig(prep=prep, eos_token_id=-1, num_speculative_tokens=k, ngram=LOOKUP if k else None,
                         decode_steps=1)


def serve(config: ServingConfig, model: ModelConfig, requests: list[Request], arrivals=None):
    engine = Engine(config, model, seed=0)
    engine.submit(requests, arrivals)
    engine.run()
    return {r.request_id: r.output_token_ids for r in engine.finished}, engine


def requests_of(prompts, params) -> list[Request]:
    return [Request(request_id=i, prompt_token_ids=list(p), max_tokens=m, sampling_params=s)
            for i, (p, m, s) in enumerate(zip(prompts, *zip(*params)))]


def test_greedy_with_penalties_is_identical_with_and_without_drafts():
    model = MODEL
    workload = random_workload(5, num_requests=10, vocab_size=8, prompt_len=(4, 12), max_tokens=(4, 12),
                               arrival_spread=4)  # prompts over 8 ids: the n-gram drafter finds matches
    params = [(r.max_tokens, SamplingParams.greedy(repetition_penalty=1.3 if i % 2 else 1.0,
                                                   presence_penalty=0.2 * (i % 3)))
              for i, r in enumerate(workload.requests)]
    prompts = [r.prompt_token_ids for r in workload.requests]
    plain, _ = serve(make_config(model, k=0), model, requests_of(prompts, params), workload.arrival_steps)
    spec, engine = serve(make_config(model, k=3), model, requests_of(prompts, params), workload.arrival_steps)
    assert spec == plain and len(plain) == 10
    assert engine.stats.draft_tokens > 0  # drafts were verified


def test_seeded_request_with_drafts_is_reproducible_whatever_its_neighbours():
    model = MODEL
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7]
    mine = (12, SamplingParams(temperature=1.0, seed=77))
    alone, engine = serve(make_config(model, k=3), model, requests_of([prompt], [mine]))
    assert engine.stats.draft_tokens > 0
    others = [(8, SamplingParams(temperature=0.7, seed=s)) for s in (1, 2, 3)]
    mixed, _ = serve(make_config(model, k=3), model,
                     requests_of([[3, 2, 1, 3, 2, 1], prompt, [5, 5, 5, 5], [7, 1, 7, 1, 7]],
                                 [others[0], mine, *others[1:]]), [0, 1, 0, 2])
    assert mixed[1] == alone[0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_tokens_follow_the_same_distribution_with_and_without_drafts(temperature):
    """Two samples of 320 requests, one seed each, the same prompt: the 2nd, 3rd and 4th output tokens
    (the ones drafts can produce) are distributed alike with drafts (rejection sampling) and without.
    The prompt holds every token id, so after any sampled token the n-gram drafter finds a match."""
    model = MODEL
    prompt = [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0]
    n = 320
    params = [(4, SamplingParams(temperature=temperature, seed=1000 + i)) for i in range(n)]
    tokens = {}
    for k in (0, 3):
        config = make_config(model, k=k)
        out, engine = serve(config, model, requests_of([prompt] * n, params))
        tokens[k] = np.array([out[i] for i in range(n)])
        if k:
            assert engine.stats.accepted_draft_tokens > 0.1 * n  # drafts were accepted, and often
    for position in (1, 2, 3):
        table = np.stack([np.bincount(tokens[k][:, position], minlength=model.vocab_size) for k in (0, 3)])
        table = table[:, table.sum(axis=0) > 0]
        p_value = stats.chi2_contingency(table).pvalue
        assert p_value > 1e-3, (position, table)
    assert not np.array_equal(tokens[0][:, 1:], tokens[3][:, 1:])  # two independent samples, not one copied
