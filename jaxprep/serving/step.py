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

from jaxprep.models.tiny import KVCache, ServingModel
from jaxprep.prepare import prepare_padded
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.sample.sampler import sample_requests
from jaxprep.serving.spec_decode.spec_step import forward_verify_record, next_drafts
from jaxprep.serving.state import ServingState
from jaxprep.serving.transitions import apply_updates_body, computed_advance, record_rows
from jaxprep.serving.update_packing import unpack_updates
from jaxprep.step_buffer import StepBuffer, pack_step_body

NO_TOKEN = -1
"""Entry of `serve_step`'s token output for a row that sampled nothing in that iteration."""


@dataclasses.dataclass(frozen=True)
class AppendedTokens:
    """What one `serve_step` appended, read on the host from its ``tokens`` output: the one place
    the host mirrors (`HostRows`, the scheduler's requests, the loop's counters) advance from.

    Iteration 0 computes the scheduled tokens and appends a token to the rows that sample; every
    later iteration computes, and appends, one decode token per row it appends to.

    ```
    # tokens [[7, -1, 9], [8, -1, -1]] -> per row appended [2, 0, 1], decoded [1, 0, 0]; 2 iterations
    ```

    With ``K = num_speculative_tokens > 0`` iteration 0 has K + 1 slots (the accepted drafts, then
    one token from the target), each later iteration one, and K more slots hold the drafts proposed
    for the next step (docs/semantics.md#spec-decode-loop):

    ```
    # K 2, decode_steps 2: slots [first 0, first 1, first 2, iteration 1, draft 0, draft 1]
    ```
    """

    tokens: np.ndarray  # [slots, rows] appended token ids (then the next drafts), NO_TOKEN = none
    num_speculative_tokens: int = 0  # K

    @property
    def appended(self) -> np.ndarray:
        """[K + iterations, rows]: which slots hold an appended token."""
        return self.tokens[: self.tokens.shape[0] - self.num_speculative_tokens] != NO_TOKEN

    @property
    def num_appended(self) -> np.ndarray:
        """[rows] tokens appended to each row."""
        return self.appended.sum(axis=0)

    @property
    def num_first(self) -> np.ndarray:
        """[rows] tokens the first iteration appended (accepted drafts + 1, or 0)."""
        return self.appended[: self.num_speculative_tokens + 1].sum(axis=0)

    @property
    def num_decoded(self) -> np.ndarray:
        """[rows] tokens the iterations after the first computed (one per token they appended)."""
        return self.appended[self.num_speculative_tokens + 1:].sum(axis=0)

    @property
    def num_iterations(self) -> int:
        """Iterations that ran: the first, and every later one that appended a token."""
        return 1 + int(np.count_nonzero(self.appended[self.num_speculative_tokens + 1:].any(axis=1)))

    def num_rejected(self, num_draft_tokens: np.ndarray) -> np.ndarray:
        """[rows] scheduled drafts not kept: ``D + 1 - num_first`` on rows that sampled."""
        return np.where(self.num_first > 0, num_draft_tokens + 1 - self.num_first, 0)

    def computed_advance(self, num_scheduled_tokens: np.ndarray, num_draft_tokens: np.ndarray) -> np.ndarray:
        """[rows] what the step adds to ``num_computed_tokens``: the first iteration's
        (`transitions.computed_advance`: rejected drafts are not computed), plus one per later decode iteration."""
        first = computed_advance(num_scheduled_tokens, num_draft_tokens, self.num_first, self.num_first > 0)
        return first + self.num_decoded

    def row_tokens(self, row: int) -> list[int]:
        """The tokens appended to ``row``, in order."""
        column = self.tokens[: self.appended.shape[0], row]
        return [int(t) for t in column[self.appended[:, row]]]

    @property
    def draft_token_ids(self) -> np.ndarray:
        """[rows, K] the drafts proposed for the next step, NO_TOKEN past each row's count."""
        return self.tokens[self.appended.shape[0]:].T

    @property
    def num_draft_tokens(self) -> np.ndarray:
        return (self.draft_token_ids != NO_TOKEN).sum(axis=1)


@functools.partial(jax.jit, static_argnames=("config", "model", "num_tokens_padded"),
                   donate_argnames=("state", "kv_cache"))
def serve_step(state: ServingState, kv_cache: KVCache, params, packed_updates: jax.Array, *,
               config: ServingConfig, model: ServingModel, num_tokens_padded: int):
    """Applies the `StepUpdates` in ``packed_updates`` (`pack_updates`), then runs the step
    (1 iteration, or up to ``updates.decode_steps`` decode iterations).

    Returns ``(state, kv_cache, tokens)``; ``tokens`` [config.decode_steps, max_num_reqs] holds
    the token each state row appended in each iteration, or NO_TOKEN; with speculative decoding
    (K > 0) it is [2K + config.decode_steps, max_num_reqs], laid out as `AppendedTokens` reads it.
    """
    return serve_body(state, kv_cache, params, packed_updates, config, model, num_tokens_padded)


def serve_body(state: ServingState, kv_cache: KVCache, params, packed_updates: jax.Array, config: ServingConfig,
               model: ServingModel, num_tokens_padded: int):
    """The traced body of `serve_step` (no jit of its own), for callers that wrap it further
    (`jaxprep.serving.data_parallel` runs it on every device of a mesh)."""
    updates = unpack_updates(packed_updates, config)
    state = apply_updates_body(state, updates)
    return _run_iterations(state, kv_cache, params, jnp.clip(updates.decode_steps, 1, config.decode_steps),
                           config, model, num_tokens_padded)


@functools.partial(jax.jit, static_argnames=("config", "model", "num_tokens_padded"),
                   donate_argnames=("state", "kv_cache"))
def run_step(state: ServingState, kv_cache: KVCache, params, decode_steps: jax.Array, *, config: ServingConfig,
             model: ServingModel, num_tokens_padded: int):
    """`serve_step` without its update: the step runs on the state as it is, its updates applied before in a
    dispatch of their own (`transitions.apply_packed`, shared by every bucket: ``ServingBatch(...,
    separate_updates=True)``). ``decode_steps`` [] int32: the update's iteration count (clipped to
    [1, config.decode_steps], as `serve_body` clips the buffer's). Returns what `serve_step` returns."""
    return _run_iterations(state, kv_cache, params, jnp.clip(decode_steps, 1, config.decode_steps), config, model,
                           num_tokens_padded)


@functools.partial(jax.jit, static_argnames=("config", "num_tokens_padded"))
def update_and_prepare(state: ServingState, packed_updates: jax.Array, *, config: ServingConfig,
                       num_tokens_padded: int):
    """The input-preparation part of `serve_step` alone (unpack, updates, `prepare_padded`), not
    donating: the state is read, and every table the updates touch is copied
    (`update_and_prepare_donated` is the in-place twin the simulator times)."""
    return update_and_prepare_body(state, packed_updates, config, num_tokens_padded)


@functools.partial(jax.jit, static_argnames=("config", "num_tokens_padded"), donate_argnames=("state",))
def update_and_prepare_donated(state: ServingState, packed_updates: jax.Array, *, config: ServingConfig,
                               num_tokens_padded: int):
    """`update_and_prepare` as `serve_step` runs it: the state donated, updated in place and returned
    with the prepared step, so no table is copied. Returns ``(state, step)``; its time is the prepare
    part of a serving step (``jaxprep simulate``'s ``prepare_us``, `jaxprep.serving.host.prep_timing`)."""
    state = apply_updates_body(state, unpack_updates(packed_updates, config))
    return state, prepare_padded(state.batch, config.prep, num_tokens_padded)


@functools.partial(jax.jit, static_argnames=("config", "num_tokens_padded", "steady"), donate_argnames=("state",))
def update_and_prepare_buffer(state: ServingState, packed_updates: jax.Array, *, config: ServingConfig,
                              num_tokens_padded: int, steady: bool = False) -> tuple[ServingState, StepBuffer]:
    """The door's one dispatch per step: the packed update applied (its device checks included: a bad
    buffer sets a bit of ``state.errors`` and writes nothing) and the step prepared, the state donated.
    Returns ``(state, step)``, the step as one `StepBuffer` (one array out instead of a dozen; its
    fields are views, `jaxprep.step_buffer`). `ServingBatch.update_and_prepare` calls it. ``steady``: the
    program for an update that finishes, adds and resumes no row (`update_packing.is_steady`: the common
    decode step), a third fewer kernels; it refuses any other buffer whole (`unpack_updates`)."""
    state = apply_updates_body(state, unpack_updates(packed_updates, config, steady))
    return state, pack_step_body(prepare_padded(state.batch, config.prep, num_tokens_padded))


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
    else:  # FeatureConfig.sampling: each request's parameters (jaxprep.serving.sample.sampler)
        sampled = sample_requests(logits, inputs.sampling, state.batch)
    state, recorded = record_rows(state, inputs.idx_mapping, sampled[:, None], jnp.ones_like(sampled))
    # idx_mapping [2, 0, -1], sampled [a, b, c] -> per row [b, -, a, -]; discarded rows stay NO_TOKEN
    kept = jnp.where(recorded.num_appended > 0, sampled, NO_TOKEN)
    return state, kv_cache, jnp.full((state.num_rows,), NO_TOKEN, jnp.int32).at[recorded.rows].set(kept, mode="drop")


def _run_iterations(state, kv_cache, params, num_iterations: jax.Array, config: ServingConfig,
                    model: ServingModel, num_tokens_padded: int):
    """Runs the scheduled batch, then single-token decodes of the rows still active, while
    ``iteration < num_iterations``; schedules each next iteration on the device. With K > 0,
    iteration 0 verifies the scheduled drafts and the step ends with the next step's drafts."""
    block_size, k = config.block_size, config.num_speculative_tokens
    num_slots = k + config.decode_steps  # appended slots: K + 1 for iteration 0, one per later iteration

    def still_active(state, last):
        stop = (last == NO_TOKEN) | (last == config.eos_token_id) | (state.num_tokens >= state.stop_len)
        # the next iteration computes position num_computed_tokens: its block must be allocated
        return ~(stop | (state.field("num_computed_tokens") >= state.num_blocks * block_size))

    def body(carry):
        state, kv_cache, out, iteration = carry
        state, kv_cache, block = _forward(state, kv_cache, params, config, model, num_tokens_padded)
        # iteration 0 fills slots 0..K; iteration i > 0 fills slot K + i with its one token
        slot = jnp.arange(k + 1, dtype=jnp.int32)
        targets = jnp.where(iteration == 0, slot, jnp.where(slot == 0, k + iteration, num_slots))
        next_scheduled = still_active(state, _last_token(block)).astype(jnp.int32)
        state = state.replace(num_scheduled_tokens=next_scheduled)
        return state, kv_cache, out.at[targets].set(block, mode="drop"), iteration + 1

    def cond(carry):
        state, _, _, iteration = carry
        return (iteration < num_iterations) & ((iteration == 0) | jnp.any(state.field("num_scheduled_tokens") > 0))

    out = jnp.full((num_slots,) + state.num_tokens.shape, NO_TOKEN, jnp.int32)
    state, kv_cache, out, _ = jax.lax.while_loop(cond, body, (state, kv_cache, out, jnp.int32(0)))
    if k:
        out = jnp.concatenate([out, next_drafts(state, jnp.any(out != NO_TOKEN, axis=0), config)])
    # a finished step leaves nothing scheduled
    return state.replace(num_scheduled_tokens=0), kv_cache, out


def _forward(state, kv_cache, params, config: ServingConfig, model: ServingModel, num_tokens_padded: int):
    """One iteration: ``(state, kv_cache, tokens [K + 1, max_num_reqs])``."""
    if config.num_speculative_tokens:
        return forward_verify_record(state, kv_cache, params, config, model, num_tokens_padded)
    state, kv_cache, tokens = _forward_and_record(state, kv_cache, params, config, model, num_tokens_padded)
    return state, kv_cache, tokens[None]


def _last_token(block: jax.Array) -> jax.Array:
    """[rows] the last appended token of each row in ``block`` [slots, rows], NO_TOKEN if none.

    ```
    # block [[4, 7], [5, -1]] -> [5, 7]
    ```
    """
    count = jnp.sum(block != NO_TOKEN, axis=0, dtype=jnp.int32)
    last = jnp.take_along_axis(block, jnp.clip(count - 1, 0, block.shape[0] - 1)[None, :], axis=0)[0]
    return jnp.where(count > 0, last, NO_TOKEN)
