"""The serving step: one jitted function per token bucket that updates, prepares, runs the model,
samples (greedily, or with each request's parameters under `FeatureConfig.sampling`) and records,
with the state and the KV cache donated.

The step runs its body in a ``lax.while_loop`` of at most ``config.decode_steps`` (K) iterations;
the payload's ``decode_steps`` (a traced count) says how many it may run. Iteration 0 runs the
scheduled batch (prefill chunks and decodes alike). With ``decode_steps > 1`` the host promises
every scheduled row is decoding, and each further iteration decodes one more token for every row
still active (tpu-inference's continue_decode, docs/semantics.md#continue-decode). A row stops at EOS, at its
``stop_len``, or when its next token has no allocated block. One executable per token bucket
therefore serves single steps and multi-step decode alike.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep.prepare import prepare_padded
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.model import KVCache, ServingModel
from jaxprep.serving.packing import unpack_updates
from jaxprep.serving.sampler import sample_requests
from jaxprep.serving.state import ServingState
from jaxprep.serving.transitions import apply_updates_body, record_sampled_body, row_index

NO_TOKEN = -1
"""Entry of `serve_step`'s token output for a row that sampled nothing in that iteration."""


@dataclasses.dataclass(frozen=True)
class AppendedTokens:
    """What one `serve_step` appended, read on the host from its ``tokens`` output: the one place
    the host mirrors (`HostRows`, the scheduler's requests, the loop's counters) advance from.

    Iteration 0 computes the scheduled tokens and appends a token to the rows that sample; every
    later iteration computes, and appends, one decode token per row it appends to.
    # tokens [[7, -1, 9], [8, -1, -1]] -> per row appended [2, 0, 1], decoded [1, 0, 0]; 2 iterations
    """

    tokens: np.ndarray  # [iterations, rows] appended token ids, NO_TOKEN = none

    @property
    def appended(self) -> np.ndarray:
        return self.tokens != NO_TOKEN

    @property
    def num_appended(self) -> np.ndarray:
        """[rows] tokens appended to each row."""
        return self.appended.sum(axis=0)

    @property
    def num_decoded(self) -> np.ndarray:
        """[rows] tokens the iterations after the first computed (one per token they appended)."""
        return self.appended[1:].sum(axis=0)

    @property
    def num_iterations(self) -> int:
        """Iterations that ran: the first, and every later one that appended a token."""
        return 1 + int(np.count_nonzero(self.appended[1:].any(axis=1)))


@functools.partial(jax.jit, static_argnames=("config", "model", "num_tokens_padded"),
                   donate_argnames=("state", "kv_cache"))
def serve_step(state: ServingState, kv_cache: KVCache, params, packed_updates: jax.Array, *,
               config: ServingConfig, model: ServingModel, num_tokens_padded: int):
    """Applies the `StepUpdates` in ``packed_updates`` (`pack_updates`), then runs the step
    (1 iteration, or up to ``updates.decode_steps`` decode iterations).

    Returns ``(state, kv_cache, tokens)``; ``tokens`` [config.decode_steps, max_num_reqs] holds
    the token each state row appended in each iteration, or NO_TOKEN.
    """
    return serve_body(state, kv_cache, params, packed_updates, config, model, num_tokens_padded)


def serve_body(state: ServingState, kv_cache: KVCache, params, packed_updates: jax.Array, config: ServingConfig,
               model: ServingModel, num_tokens_padded: int):
    """The traced body of `serve_step` (no jit of its own), for callers that wrap it further
    (`jaxprep.serving.data_parallel` runs it on every device of a mesh)."""
    updates = unpack_updates(packed_updates, config)
    state = apply_updates_body(state, updates)
    return _run_iterations(state, kv_cache, params, jnp.clip(updates.decode_steps[0], 1, config.decode_steps),
                           config, model, num_tokens_padded)


@functools.partial(jax.jit, static_argnames=("config", "num_tokens_padded"))
def update_and_prepare(state: ServingState, packed_updates: jax.Array, *, config: ServingConfig,
                       num_tokens_padded: int):
    """The input-preparation part of `serve_step` alone (unpack, updates, `prepare_padded`), not
    donating: what the simulator times as prep."""
    return update_and_prepare_body(state, packed_updates, config, num_tokens_padded)


def update_and_prepare_body(state: ServingState, packed_updates: jax.Array, config: ServingConfig,
                            num_tokens_padded: int):
    """The traced body of `update_and_prepare`."""
    state = apply_updates_body(state, unpack_updates(packed_updates, config))
    return prepare_padded(state.batch, config.prep, num_tokens_padded)


def _forward_and_record(state, kv_cache, params, config: ServingConfig, model: ServingModel, num_tokens_padded: int):
    """prepare -> model -> sample -> record; tokens [max_num_reqs] per state row."""
    inputs = prepare_padded(state.batch, config.prep, num_tokens_padded)
    kv_cache, logits = model.forward(params, kv_cache, inputs, block_size=config.block_size,
                                     max_model_len=config.max_model_len)
    if inputs.sampling is None:  # greedy
        sampled = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [R_pad]
    else:  # FeatureConfig.sampling: each request's parameters (jaxprep.serving.sampler)
        sampled = sample_requests(logits, inputs.sampling, state.batch)
    num_tokens_before = state.num_tokens
    state = record_sampled_body(state, inputs.idx_mapping, sampled[:, None], jnp.ones_like(sampled))
    # idx_mapping [2, 0, -1], sampled [a, b, c] -> per row [b, -, a, -]; discarded rows stay NO_TOKEN
    rows = row_index(inputs.idx_mapping, state.num_tokens.shape[0])
    per_row = jnp.full(state.num_tokens.shape, NO_TOKEN, jnp.int32).at[rows].set(sampled, mode="drop")
    appended = state.num_tokens > num_tokens_before
    return state, kv_cache, jnp.where(appended, per_row, NO_TOKEN)


def _run_iterations(state, kv_cache, params, num_iterations: jax.Array, config: ServingConfig,
                    model: ServingModel, num_tokens_padded: int):
    """Runs the scheduled batch, then single-token decodes of the rows still active, while
    ``iteration < num_iterations``; schedules each next iteration on the device."""
    block_size = config.block_size

    def still_active(state, tokens):
        stop = (tokens == NO_TOKEN) | (tokens == config.eos_token_id) | (state.num_tokens >= state.stop_len)
        # the next iteration computes position num_computed_tokens: its block must be allocated
        return ~(stop | (state.batch.num_computed_tokens >= state.num_blocks * block_size))

    def body(carry):
        state, kv_cache, out, iteration = carry
        state, kv_cache, tokens = _forward_and_record(state, kv_cache, params, config, model, num_tokens_padded)
        next_scheduled = still_active(state, tokens).astype(jnp.int32)
        state = dataclasses.replace(state, batch=dataclasses.replace(state.batch, num_scheduled_tokens=next_scheduled))
        return state, kv_cache, out.at[iteration].set(tokens), iteration + 1

    def cond(carry):
        state, _, _, iteration = carry
        return (iteration < num_iterations) & ((iteration == 0) | jnp.any(state.batch.num_scheduled_tokens > 0))

    out = jnp.full((config.decode_steps,) + state.num_tokens.shape, NO_TOKEN, jnp.int32)
    state, kv_cache, out, _ = jax.lax.while_loop(cond, body, (state, kv_cache, out, jnp.int32(0)))
    # a finished step leaves nothing scheduled
    zeros = jnp.zeros_like(state.batch.num_scheduled_tokens)
    return dataclasses.replace(state, batch=dataclasses.replace(state.batch, num_scheduled_tokens=zeros)), kv_cache, out
