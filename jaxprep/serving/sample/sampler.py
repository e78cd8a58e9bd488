"""The sampler: every logits row's token from its parameters (`jaxprep.features.sampling.SamplingMetadata`).

vLLM V2's order (`vllm/v1/worker/gpu/sample/sampler.py::Sampler.sample`): penalties
(`apply_penalties`), temperature, min-p, top-k and top-p, then a Gumbel-max draw
(`vllm/v1/worker/gpu/sample/gumbel.py::gumbel_sample`). A greedy row (temperature 0) takes the
argmax after penalties. Everything is per row: a row's token depends only on its logits, its
parameters, its seed and its position, never on its neighbours or the bucket.

Randomness: row j's noise is ``gumbel(fold_in(key(seed_j), pos_j), [V])``, the seed's two words
being the threefry key, so a seeded request draws the same token at the same position whatever
else is in the batch (DIVERGENCES.md: the noise is not vLLM's hash, so tokens are not bit-equal to
vLLM's).

Shapes: ``logits`` [L, V] float32, one row per `SamplingMetadata` row; ``batch`` is the
`BatchState` holding ``prompt_bin_mask`` [R, ceil(V/32)] and ``output_bin_counts`` [R, V].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxprep._ragged import take_rows
from jaxprep._typing import Array, Float32, Int32

Logits = Float32[Array, "num_logits_padded vocab_size"]


def apply_penalties(logits: Logits, rows, batch) -> Logits:
    """Repetition, frequency and presence penalties (`vllm/v1/worker/gpu/sample/penalties.py::_penalties_kernel`).

    Row j of slot s at local position p counts as outputs the slot's output counts plus the row's
    earlier drafts, the input ids of its rows 1..p:

    ```
    cnt  = output_bin_counts[s] + sum_{q=1..p} onehot(input_ids[j - p + q])
    seen = prompt_bin_mask[s] | cnt > 0
    x    = where(seen, where(x > 0, x / rep, x * rep), x);  x -= freq * cnt;  x -= pres * (cnt > 0)
    ```

    ```
    # rows of one request, input_ids [47, 60], p [0, 1] -> drafts counted [{}, {60}]
    ```
    """
    vocab = logits.shape[1]
    counts = take_rows(batch.output_bin_counts, rows.idx_mapping, fill_value=0) + _draft_counts(rows, vocab)
    token = jnp.arange(vocab, dtype=jnp.int32)
    words = take_rows(batch.prompt_bin_mask, rows.idx_mapping, fill_value=0)  # [L, ceil(V / 32)]
    # token t is bit t % 32 of word t // 32: t 37 -> word 1, bit 5
    in_prompt = ((words[:, token // 32] >> (token % 32)[None, :]) & 1) == 1
    rep = rows.repetition_penalty[:, None]
    seen = in_prompt | (counts > 0)
    x = jnp.where(seen & (rep != 1), jnp.where(logits > 0, logits / rep, logits * rep), logits)
    x = x - rows.frequency_penalty[:, None] * counts.astype(jnp.float32)
    return x - rows.presence_penalty[:, None] * (counts > 0).astype(jnp.float32)


def _draft_counts(rows, vocab: int) -> Int32[Array, "num_logits_padded vocab_size"]:
    """Per row, how often each token is among the input ids of its request's rows 1..p.

    cs = inclusive prefix sum of onehot(input_ids) over rows; row j gets cs[j] - cs[j - p].

    ```
    # input_ids [19, 50, 51], p [0, 1, 2] -> row 1 {50}, row 2 {50, 51}
    ```
    """
    onehot = (rows.input_ids[:, None] == jnp.arange(vocab, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    cs = jnp.cumsum(onehot, axis=0)
    row = jnp.arange(rows.input_ids.shape[0], dtype=jnp.int32)
    first = jnp.clip(row - rows.expanded_local_pos, 0, row)  # the request's first row (local position 0)
    return cs - cs[first]


def apply_temperature(logits: Logits, rows) -> Logits:
    """``x / T`` unless T is 0 (greedy) or 1 (`vllm/v1/worker/gpu/sample/temperature.py::_temperature_kernel`)."""
    temperature = rows.temperature[:, None]
    keep = (temperature == 0) | (temperature == 1)
    return jnp.where(keep, logits, logits / jnp.where(keep, 1.0, temperature))


def apply_min_p(logits: Logits, rows) -> Logits:
    """Masks tokens whose probability is below ``min_p`` times the largest
    (`vllm/v1/worker/gpu/sample/min_p.py::_min_p_kernel`): ``x < max(x) + log(min_p)`` -> -inf."""
    min_p = rows.min_p[:, None]
    threshold = jnp.max(logits, axis=1, keepdims=True) + jnp.log(jnp.where(min_p > 0, min_p, 1.0))
    return jnp.where((min_p > 0) & (logits < threshold), -jnp.inf, logits)


def apply_top_k_top_p(logits: Logits, rows) -> Logits:
    """Keeps the ``top_k`` largest logits (ties at the k-th kept), then the smallest set whose
    probability reaches ``top_p`` (`vllm/v1/sample/ops/topk_topp_sampler.py::apply_top_k_top_p`).

    On the ascending sort, top-p masks the prefix whose cumulative probability is <= 1 - p (never
    the largest token); its length m gives the cutoff ``sorted[m]``, and x >= cutoff is kept.

    ```
    # sorted probs [0.1, 0.2, 0.3, 0.4], p 0.6 -> cumsum [0.1, 0.3, 0.6, 1.0] <= 0.4: m 2, keep 0.3 and 0.4
    ```
    """
    vocab = logits.shape[1]
    descending = -jnp.sort(-logits, axis=1)
    kth = jnp.take_along_axis(descending, jnp.clip(rows.top_k - 1, 0, vocab - 1)[:, None], axis=1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    ascending = jnp.sort(logits, axis=1)
    cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=1), axis=1)
    masked = (cumulative <= 1 - rows.top_p[:, None]).at[:, -1].set(False)
    m = jnp.sum(masked, axis=1, dtype=jnp.int32)
    cutoff = jnp.take_along_axis(ascending, jnp.clip(m, 0, vocab - 1)[:, None], axis=1)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def processed_logits(logits: Logits, rows, batch) -> Logits:
    """The logits each row samples from: penalties, temperature, min-p, top-k/top-p; each step
    skipped (`jax.lax.cond`) when no request of the step uses it (vLLM's flags)."""
    logits = logits.astype(jnp.float32)
    logits = jax.lax.cond(rows.do_penalties, lambda x: apply_penalties(x, rows, batch), lambda x: x, logits)
    logits = apply_temperature(logits, rows)
    logits = jax.lax.cond(rows.do_min_p, lambda x: apply_min_p(x, rows), lambda x: x, logits)
    return jax.lax.cond(rows.do_top_k | rows.do_top_p, lambda x: apply_top_k_top_p(x, rows), lambda x: x, logits)


def row_probabilities(logits: Logits, rows, batch) -> Float32[Array, "num_logits_padded vocab_size"]:
    """The distribution each row samples from [L, V] float32: softmax of `processed_logits`, one-hot
    at the argmax for a greedy row (what rejection sampling compares drafts against)."""
    x = processed_logits(logits, rows, batch)
    greedy = jax.nn.one_hot(jnp.argmax(x, axis=1), x.shape[1], dtype=jnp.float32)
    return jnp.where(rows.temperature[:, None] == 0, greedy, jax.nn.softmax(x, axis=1))


def row_keys(rows) -> jax.Array:
    """Each row's PRNG key [L]: ``fold_in(key(seed), pos)``; the seed's (high, low) words are the threefry key."""
    keys = jax.random.wrap_key_data(jax.lax.bitcast_convert_type(rows.seeds, jnp.uint32), impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, rows.pos)


def sample(logits: Logits, rows, batch) -> Int32[Array, " num_logits_padded"]:
    """Each row's token: argmax of `processed_logits` plus the row's Gumbel noise (none for a greedy row)."""
    x = processed_logits(logits, rows, batch)

    def with_noise(x):
        noise = jax.vmap(lambda key: jax.random.gumbel(key, (x.shape[1],), jnp.float32))(row_keys(rows))
        return jnp.where(rows.temperature[:, None] == 0, x, x + noise)

    x = jax.lax.cond(rows.all_greedy, lambda x: x, with_noise, x)  # an all-greedy step draws no noise
    return jnp.argmax(x, axis=1).astype(jnp.int32)


def request_rows(rows):
    """The last logits row of every request (its bonus row): `SamplingMetadata` of ``R_pad`` rows, for
    logits taken at the requests' last tokens (``logits_indices``). A padded request reads row
    ``L - 1`` (its token is never recorded).

    ```
    # cu_num_logits [0, 3, 5, 6, 7] -> rows [2, 4, 5, 6]
    ```
    """
    last = jnp.clip(rows.cu_num_logits[1:] - 1, 0, rows.idx_mapping.shape[0] - 1)
    num_reqs_padded = last.shape[0]

    def take(name, value):
        if name == "cu_num_logits":
            return jnp.arange(num_reqs_padded + 1, dtype=jnp.int32)
        return value if value.ndim == 0 else value[last]

    return type(rows)(**{f.name: take(f.name, getattr(rows, f.name)) for f in dataclasses.fields(rows)})


def sample_requests(logits: Float32[Array, "num_reqs_padded vocab_size"], rows,
                    batch) -> Int32[Array, " num_reqs_padded"]:
    """`sample` of one logits row per request (the serving step's ``logits_indices`` rows)."""
    check_vocab(logits, batch)
    return sample(logits, request_rows(rows), batch)


def check_vocab(logits: Logits, batch) -> None:
    """Raises (at trace time) when the model's vocabulary differs from the sampling rows' (V)."""
    if logits.shape[1] != batch.output_bin_counts.shape[1]:
        raise ValueError(f"the model's vocabulary ({logits.shape[1]}) differs from SamplingConfig.vocab_size "
                         f"({batch.output_bin_counts.shape[1]})")
