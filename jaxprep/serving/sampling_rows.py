"""The serving loop's sampling rows: admission writes them, every sampled token counts in them.

Admission (vLLM V2 `vllm/v1/worker/gpu/sample/sampler.py::Sampler.add_request`, then
``apply_staged_writes``): the request's normalised parameters (`jaxprep.SamplingParams`,
`jaxprep.features.sampling_params.state_row`) go into its state row, and the penalty bins are built on
the device from the token row: ``prompt_bin_mask`` has bit ``t % 32`` of word ``t // 32`` for every
prompt token t, ``output_bin_counts`` counts the tokens in ``[prompt_len, num_tokens)`` (the
outputs a resumed request recomputes). vLLM builds the bins only for penalty requests; here every
request gets them (the bins of a request without penalties are never read, so nothing observable
differs). Nothing is reset when a request finishes.

After each step (vLLM ``post_update``) every appended token adds 1 to its row's ``output_bin_counts``.

The payload travels in the one int32 update buffer (`jaxprep.serving.packing`): float parameters
as their float32 bit patterns, bit-cast back inside the jit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep.features.sampling import FLOAT_PARAMS, check_parameter_bounds, empty_sampling_rows
from jaxprep.features.sampling_params import state_row

PAD_ENTRY = -1
"""`AddRequests` row of a padded entry (the serving payloads' ``PAD_ROW``)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AddSampling:
    """The sampling part of an `AddRequests` payload, one entry per added request; every leaf int32."""

    temperature: np.ndarray  # [A] float32 bits
    top_k: np.ndarray  # [A] in [1, V]
    top_p: np.ndarray  # [A] float32 bits
    min_p: np.ndarray  # [A] float32 bits
    seeds: np.ndarray  # [A, 2] (high, low) words of the int64 seed
    seeds_set: np.ndarray  # [A] 1: the request set its seed
    repetition_penalty: np.ndarray  # [A] float32 bits
    frequency_penalty: np.ndarray  # [A] float32 bits
    presence_penalty: np.ndarray  # [A] float32 bits
    prompt_len: np.ndarray  # [A] prompt tokens at the front of the row (the rest: resumed outputs)

    @classmethod
    def build(cls, sampling, requests: list[dict], size: int) -> AddSampling:
        """``requests``: dicts with optional ``sampling`` (`SamplingParams`, None: greedy) and
        ``prompt_len`` (default: all of ``token_ids``). Seeds of unseeded requests are drawn here."""
        rows = empty_sampling_rows(size, sampling)
        prompt_len = np.zeros(size, np.int32)
        for i, request in enumerate(requests):
            for name, value in state_row(request.get("sampling"), sampling.vocab_size).items():
                rows[name][i] = value
            prompt_len[i] = request.get("prompt_len", len(request["token_ids"]))
        floats = {name: rows[name].astype(np.float32).view(np.int32) for name in FLOAT_PARAMS}
        return cls(**floats, top_k=rows["top_k"], seeds=rows["seeds"], seeds_set=rows["seeds_set"].astype(np.int32),
                   prompt_len=prompt_len)

    def host_values(self) -> dict[str, np.ndarray]:
        """The parameters as the state stores them (floats decoded), for the host checks."""
        values = {name: np.asarray(getattr(self, name), np.int32).view(np.float32) for name in FLOAT_PARAMS}
        return dict(values, top_k=np.asarray(self.top_k))


def check_add_sampling(payload: AddSampling, entries: np.ndarray, num_tokens: np.ndarray, vocab_size: int,
                       fail) -> None:
    """Host check of the real entries: parameters in vLLM's bounds, ``0 <= prompt_len <= num_tokens``."""
    real = np.zeros(len(payload.prompt_len), bool)
    real[entries] = True
    try:
        check_parameter_bounds(payload.host_values(), vocab_size, "AddRequests.sampling", rows=real)
    except ValueError as error:
        fail(str(error))
    prompt_len = np.asarray(payload.prompt_len)
    bad = real & ((prompt_len < 0) | (prompt_len > num_tokens))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        fail(f"AddRequests.sampling.prompt_len[{i}] = {int(prompt_len[i])} is outside [0, num_tokens={num_tokens[i]}]")


def admit(batch, rows: jax.Array, payload: AddSampling, token_ids: jax.Array, num_tokens: jax.Array):
    """``batch`` (a `BatchState`) with the added rows' parameters and bins written; ``rows`` are
    scatter indices (padded entries: the out-of-range sentinel, dropped).

    # V 64, prompt [3, 40, 3], prompt_len 3, then outputs [7, 7] -> mask words [1 << 3, 1 << 8], counts[7] = 2
    """
    vocab = batch.output_bin_counts.shape[1]
    column = jnp.arange(token_ids.shape[1], dtype=jnp.int32)[None, :]
    in_vocab = (token_ids >= 0) & (token_ids < vocab)
    in_prompt = in_vocab & (column < payload.prompt_len[:, None])
    is_output = in_vocab & (column >= payload.prompt_len[:, None]) & (column < num_tokens[:, None])
    entry = jnp.broadcast_to(jnp.arange(token_ids.shape[0], dtype=jnp.int32)[:, None], token_ids.shape)
    # bincount per entry; ids outside [0, V) and tokens outside the range go to column V and are dropped
    counts = jnp.zeros((token_ids.shape[0], vocab), jnp.int32)
    outputs = counts.at[entry, jnp.where(is_output, token_ids, vocab)].add(1, mode="drop")
    prompt = counts.at[entry, jnp.where(in_prompt, token_ids, vocab)].add(1, mode="drop") > 0
    values = {name: jax.lax.bitcast_convert_type(getattr(payload, name), jnp.float32) for name in FLOAT_PARAMS}
    values.update(top_k=payload.top_k, seeds=payload.seeds, seeds_set=payload.seeds_set != 0,
                  prompt_bin_mask=_pack_bits(prompt, batch.prompt_bin_mask.shape[1]), output_bin_counts=outputs)
    return dataclasses.replace(batch, **{name: getattr(batch, name).at[rows].set(value, mode="drop")
                                         for name, value in values.items()})


def _pack_bits(present: jax.Array, num_words: int) -> jax.Array:
    """[A, V] bools -> [A, ceil(V/32)] int32 words, token t at bit t % 32 of word t // 32.

    # present at tokens [3, 40] of V 64 -> words [1 << 3, 1 << 8]
    """
    padded = jnp.pad(present, ((0, 0), (0, num_words * 32 - present.shape[1])))
    bits = padded.reshape(present.shape[0], num_words, 32).astype(jnp.uint32)
    words = jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32)[None, None, :], axis=2, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def count_sampled(batch, rows: jax.Array, sampled_token_ids: jax.Array, num_sampled: jax.Array):
    """``output_bin_counts[s, token] += 1`` for the first ``num_sampled[b]`` tokens of each batch
    row b (``rows``: its state row as a scatter index, the sentinel for padding).

    # rows [2], sampled [[9, 4]], num_sampled [1] -> output_bin_counts[2, 9] += 1
    """
    vocab = batch.output_bin_counts.shape[1]
    offsets = jnp.arange(sampled_token_ids.shape[1], dtype=jnp.int32)[None, :]
    valid = (offsets < num_sampled[:, None]) & (sampled_token_ids >= 0) & (sampled_token_ids < vocab)
    target = jnp.broadcast_to(rows[:, None], sampled_token_ids.shape)
    counts = batch.output_bin_counts.at[target, jnp.where(valid, sampled_token_ids, vocab)].add(1, mode="drop")
    return dataclasses.replace(batch, output_bin_counts=counts)
