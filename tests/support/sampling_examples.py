"""The running example (`mrv2_examples`) with the sampling worked example's parameters, slot by slot.

| slot | request | parameters |
|---|---|---|
| 5 | r0 | T 0.7, top_k 20, top_p 0.9, seed 11 |
| 3 | r1 | T 0, top_k 5 |
| 2 | r2 | T 1.0, min_p 0.1, repetition 1.2, presence 0.5 |
| 1 | r3 | T 1.5, top_p 0.8, frequency 0.3 |
| 4 | live, unscheduled | T 0.5, top_k 3, top_p 0.5, min_p 0.2, seed 99, repetition 1.5 |
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxprep import SamplingConfig, SamplingParams
from jaxprep.features.sampling import empty_sampling_rows
from jaxprep.features.sampling_params import state_row
from jaxprep.reference.sampling import bins_reference
from support import mrv2_examples as ex

V = ex.VOCAB
SAMPLING = SamplingConfig(vocab_size=V)
PARAMS = {
    5: SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=11),
    3: SamplingParams(temperature=0.0, top_k=5),
    2: SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5),
    1: SamplingParams(temperature=1.5, top_p=0.8, frequency_penalty=0.3),
    4: SamplingParams(temperature=0.5, top_k=3, top_p=0.5, min_p=0.2, seed=99, repetition_penalty=1.5),
}
PROMPT = {5: 5, 3: 20, 2: 8, 1: 4, 4: 3}  # prompt length per slot; outputs follow in the token table
NUM_TOKENS = {5: 10, 3: 20, 2: 13, 1: 8, 4: 3}  # prompt + outputs (drafts not included)


def slot_arrays(params: dict, token_ids: np.ndarray, num_tokens: dict, prompt: dict, rows: int = 6) -> dict:
    """The sampling state rows as admission writes them (host normalisation, bins by the reference)."""
    out = empty_sampling_rows(rows, SAMPLING)
    rng = np.random.default_rng(0)
    for slot, p in params.items():
        for name, value in state_row(p, V, rng).items():
            out[name][slot] = value
        out["prompt_bin_mask"][slot], out["output_bin_counts"][slot] = bins_reference(
            token_ids[slot], prompt[slot], num_tokens[slot], V)
    return out


def example_arrays() -> dict:
    arrays = ex.arrays(ex.V2_SLOTS)
    arrays.update(slot_arrays(PARAMS, arrays["token_ids"], NUM_TOKENS, PROMPT))
    return arrays


def example_config():
    config = ex.config("v2")
    return dataclasses.replace(config, features=dataclasses.replace(config.features, sampling=SAMPLING))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Bins:
    """The penalty tables the sampler reads (a `BatchState` has the same two fields)."""

    prompt_bin_mask: np.ndarray  # [R, ceil(V/32)] int32
    output_bin_counts: np.ndarray  # [R, V] int32


def sampler_rows(params: list, vocab: int, pos=None, seeds=None):
    """A `SamplingMetadata` of one logits row per entry of ``params`` (row j reads slot j, local
    position 0), flags computed here in NumPy; ``seeds`` overrides the rows' seeds (ints)."""
    from jaxprep.features.sampling import SamplingMetadata
    from jaxprep.features.sampling_params import seed_words

    n = len(params)
    values = [state_row(p, vocab, np.random.default_rng(j)) for j, p in enumerate(params)]
    column = {name: np.array([v[name] for v in values]) for name in values[0]}
    if seeds is not None:
        column["seeds"] = np.array([seed_words(s) for s in seeds], np.int32)
    floats = {name: column[name].astype(np.float32) for name in
              ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")}
    penalty = ((floats["repetition_penalty"] != 1) | (floats["frequency_penalty"] != 0)
               | (floats["presence_penalty"] != 0))
    greedy = floats["temperature"] == 0
    return SamplingMetadata(
        idx_mapping=np.arange(n, dtype=np.int32), expanded_local_pos=np.zeros(n, np.int32),
        pos=np.zeros(n, np.int32) if pos is None else np.asarray(pos, np.int32), input_ids=np.zeros(n, np.int32),
        cu_num_logits=np.arange(n + 1, dtype=np.int32), top_k=column["top_k"].astype(np.int32),
        seeds=column["seeds"].astype(np.int32), **floats,
        any_greedy=np.bool_(greedy.any()), all_greedy=np.bool_(greedy.all()), all_random=np.bool_(~greedy.any()),
        any_explicit_seed=np.bool_(column["seeds_set"].any()), do_top_k=np.bool_((column["top_k"] != vocab).any()),
        do_top_p=np.bool_((floats["top_p"] != 1).any()), do_min_p=np.bool_((floats["min_p"] != 0).any()),
        do_penalties=np.bool_(penalty.any()),
        has_topp_only_rows=np.bool_(((floats["top_p"] != 1) & (column["top_k"] == vocab)).any()))
