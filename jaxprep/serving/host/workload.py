"""Random workloads for the serving loop, and the dense-recomputation check of its greedy tokens."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep.models.tiny import ServingModel
from jaxprep.serving.host.scheduler import Request

FIRST_PROMPT_TOKEN = 2
"""Prompt ids are drawn from [FIRST_PROMPT_TOKEN, vocab_size): 0 is the pad id, 1 the default EOS."""

REPEAT_PHRASE_MAX = 8
"""Longest phrase a repetitive prompt repeats."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """Requests and the host iteration at which each one arrives."""

    requests: tuple[Request, ...]
    arrival_steps: tuple[int, ...]


def random_workload(seed: int, *, num_requests: int, vocab_size: int, prompt_len: tuple[int, int],
                    max_tokens: tuple[int, int], arrival_spread: int = 0, repetitive: bool = False) -> Workload:
    """Prompt lengths and max_tokens uniform in their inclusive ranges; arrivals uniform in [0, spread].

    ``repetitive``: each prompt repeats a random phrase of 2..REPEAT_PHRASE_MAX tokens (text that
    n-gram drafting can match), instead of uniform random tokens.
    """
    rng = np.random.default_rng(seed)
    requests, arrivals = [], []
    for request_id in range(num_requests):
        length = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        if repetitive:
            phrase = rng.integers(FIRST_PROMPT_TOKEN, vocab_size, size=int(rng.integers(2, REPEAT_PHRASE_MAX + 1)))
            prompt = np.resize(phrase, length).tolist()
        else:
            prompt = rng.integers(FIRST_PROMPT_TOKEN, vocab_size, size=length).tolist()
        requests.append(Request(request_id=request_id, prompt_token_ids=prompt,
                                max_tokens=int(rng.integers(max_tokens[0], max_tokens[1] + 1))))
        arrivals.append(int(rng.integers(0, arrival_spread + 1)))
    return Workload(requests=tuple(requests), arrival_steps=tuple(arrivals))


@dataclasses.dataclass(frozen=True)
class DenseCheck:
    """Outcome of `check_against_dense`."""

    num_requests: int
    num_tokens: int  # generated tokens checked
    mismatches: int  # tokens that are not the dense argmax (beyond a near-tie)
    near_ties: int  # tokens that differ from the dense argmax by less than the tolerance

    @property
    def passed(self) -> bool:
        return self.mismatches == 0 and self.num_tokens > 0


def check_against_dense(params, model: ServingModel, requests, max_model_len: int, *,
                        tie_tolerance: float = 1e-3) -> DenseCheck:
    """Recomputes every request densely (no cache, teacher-forced on its own tokens) and checks that
    each generated token is the greedy pick: the argmax of the dense logits at the position before it.

    All generated tokens being dense argmaxes is exactly "dense greedy decoding yields the same
    tokens". A token whose dense logit is within ``tie_tolerance`` of the max counts as a near-tie
    (float summation order differs between paged and dense attention), not as a mismatch.
    """
    checked = mismatches = near_ties = 0
    for request in requests:
        tokens = np.zeros(max_model_len, np.int32)
        all_ids = request.all_token_ids
        tokens[: len(all_ids)] = all_ids
        logits = np.asarray(dense_logits(params, tokens, model=model))
        prompt_len = len(request.prompt_token_ids)
        for position, token in enumerate(request.output_token_ids, start=prompt_len - 1):
            row = logits[position]
            checked += 1
            if int(np.argmax(row)) != token:
                if row.max() - row[token] <= tie_tolerance:
                    near_ties += 1
                else:
                    mismatches += 1
    return DenseCheck(num_requests=len(requests), num_tokens=checked, mismatches=mismatches, near_ties=near_ties)


@functools.partial(jax.jit, static_argnames=("model",))
def dense_logits(params, token_ids, *, model: ServingModel):
    """The model's dense (cache-free) logits of one sequence, jitted per model."""
    return model.dense_forward(params, jnp.asarray(token_ids, jnp.int32))
