"""NumPy reference of the sampling metadata (`jaxprep.features.sampling`) and of the distribution
each logits row samples from (`jaxprep.serving.sample.sampler`), written for reading: one loop per row, float64.
"""

from __future__ import annotations

import numpy as np

FLOAT_NEUTRAL = {"temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
                 "frequency_penalty": 0.0, "presence_penalty": 0.0}


def sampling_rows_reference(slots: dict, expanded_idx_mapping, idx_mapping, vocab_size: int) -> dict:
    """Per logits row, the parameters of its state slot (`vllm/v1/worker/gpu/sample/sampler.py`), and
    vLLM's flags over the requests (``idx_mapping``, the real batch rows).

    ``slots``: the `BatchState` sampling arrays by name (``temperature``, ``top_k``, ...).
    """
    rows = {name: np.array([slots[name][s] for s in expanded_idx_mapping]) for name in
            (*FLOAT_NEUTRAL, "top_k", "seeds")}
    req = {name: np.array([slots[name][s] for s in idx_mapping]) for name in (*FLOAT_NEUTRAL, "top_k", "seeds_set")}
    penalty = (req["repetition_penalty"] != 1) | (req["frequency_penalty"] != 0) | (req["presence_penalty"] != 0)
    rows.update(
        any_greedy=bool((req["temperature"] == 0).any()), all_greedy=bool((req["temperature"] == 0).all()),
        all_random=bool((req["temperature"] != 0).all()), any_explicit_seed=bool(req["seeds_set"].any()),
        do_top_k=bool((req["top_k"] != vocab_size).any()), do_top_p=bool((req["top_p"] != 1).any()),
        do_min_p=bool((req["min_p"] != 0).any()), do_penalties=bool(penalty.any()),
        has_topp_only_rows=bool(((req["top_p"] != 1) & (req["top_k"] == vocab_size)).any()))
    return rows


def penalties_reference(logits, slot: int, local_pos: int, row_input_ids, prompt_tokens, output_counts,
                        rep: float, freq: float, pres: float) -> np.ndarray:
    """One row of `vllm/v1/worker/gpu/sample/penalties.py::_penalties_kernel`.

    ``row_input_ids``: the input ids of the request's logits rows up to this one (its earlier drafts
    are ``row_input_ids[1 : local_pos + 1]``); ``prompt_tokens``: the prompt's token ids;
    ``output_counts``: the slot's output bin counts [V].
    """
    x = np.array(logits, np.float64)
    counts = np.array(output_counts, np.int64)
    for token in row_input_ids[1:local_pos + 1]:
        counts[token] += 1
    for v in range(len(x)):
        seen = v in set(prompt_tokens) or counts[v] > 0
        if seen and rep != 1:
            x[v] = x[v] / rep if x[v] > 0 else x[v] * rep
        x[v] -= freq * counts[v]
        x[v] -= pres * (counts[v] > 0)
    return x


def distribution_reference(logits, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The probabilities one (already penalised) row samples from: temperature, min-p, top-k, top-p."""
    x = np.array(logits, np.float64)
    if temperature == 0:
        out = np.zeros(len(x))
        out[np.argmax(x)] = 1.0
        return out
    x = x / temperature
    if min_p > 0:
        probs = np.exp(x - x.max())
        x = np.where(probs < min_p * probs.max(), -np.inf, x)
    kth = np.sort(x)[::-1][top_k - 1]
    x = np.where(x < kth, -np.inf, x)
    order = np.argsort(x, kind="stable")  # ascending
    probs = np.exp(x[order] - x.max())
    probs /= probs.sum()
    cumulative = np.cumsum(probs)
    for i in range(len(x) - 1):
        if cumulative[i] <= 1 - top_p:
            x[order[i]] = -np.inf
    out = np.exp(x - x.max())
    return out / out.sum()


def bins_reference(token_ids, prompt_len: int, num_tokens: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A slot's penalty bins at admission (`vllm/v1/worker/gpu/sample/penalties.py::bincount`):
    ``prompt_bin_mask`` [ceil(V/32)] int32 bits of the prompt's tokens, ``output_bin_counts`` [V] of
    the tokens in ``[prompt_len, num_tokens)`` (a resumed request's outputs). Ids outside [0, V) count nowhere."""
    bits = np.zeros(-(-vocab_size // 32), np.uint32)
    for token in token_ids[:prompt_len]:
        if not 0 <= token < vocab_size:
            continue
        bits[token // 32] |= np.uint32(1) << np.uint32(token % 32)
    counts = np.zeros(vocab_size, np.int32)
    for token in token_ids[prompt_len:num_tokens]:
        if 0 <= token < vocab_size:
            counts[token] += 1
    return bits.view(np.int32), counts
