"""Device transitions ``ServingState -> ServingState``: each ``*_body`` is the pure traced
transition, the plain name its jitted form that donates the state.

Each transition is a handful of scatters with ``mode='drop'``. Payload rows past a section's count
(-1) are first mapped to the out-of-range sentinel ``max_num_reqs``: JAX wraps a -1 index to the
last row even with ``mode='drop'`` (docs/semantics.md#jax-traps), so -1 must never reach a scatter.

`apply_updates_body` reads one packed buffer (`jaxprep.serving.update_packing`) and applies, in order:
finish, add, resume, the data segments (tokens, M-RoPE positions, is_token_ids, block ids of
every table), the sampling admission, the LoRA slots and the schedule. The buffers are checked on
the host (`jaxprep.serving.host.checks`) before dispatch; every read and write here stays in bounds
whatever a buffer holds.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxprep._constants import (
    INT32_MAX,
    MROPE_MISSING_POSITION,
    NO_GRAMMAR,
    NO_LORA_ID,
    NO_PREV_ROW,
    NULL_BLOCK_ID,
    PLACEHOLDER_TOKEN_ID,
)
from jaxprep.features.async_tokens import prev_batch_rows_from_step
from jaxprep.features.sampling import FLOAT_PARAMS
from jaxprep.serving import update_bounds
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.sample.sampling_rows import count_sampled
from jaxprep.serving.state import ERROR_BITS, ServingState
from jaxprep.serving.update_packing import IS_TOKEN_IDS, MROPE, TABLE, TOKENS, DeviceUpdates, refused, unpack_updates
from jaxprep.step_buffer import StepBuffer


def row_index(rows: jax.Array, num_rows: int) -> jax.Array:
    """Payload rows as scatter indices: anything outside [0, num_rows) becomes the sentinel num_rows.

    ```
    # num_rows 4: rows [2, -1, 0, 7] -> [2, 4, 0, 4]
    ```
    """
    rows = jnp.asarray(rows, jnp.int32)
    return jnp.where((rows >= 0) & (rows < num_rows), rows, num_rows)


def _set(array: jax.Array, rows: jax.Array, values) -> jax.Array:
    return array.at[rows].set(values, mode="drop")


def _gather(array: jax.Array, rows: jax.Array, fill: int = 0) -> jax.Array:
    return jnp.take(array, rows, axis=0, mode="fill", fill_value=fill)


def _replace_batch(state: ServingState, **fields) -> ServingState:
    return dataclasses.replace(state, batch=dataclasses.replace(state.batch, **fields))


def tables(batch) -> list[jax.Array]:
    """Every block table of a row, in `jaxprep.serving.state.table_names` order."""
    out = [batch.block_table, *(batch.extra_block_tables or ())]
    return out + ([batch.mamba_block_table] if batch.mamba_block_table is not None else [])


def _with_tables(batch, new: list[jax.Array]):
    extra = len(batch.extra_block_tables or ())
    fields = dict(block_table=new[0])
    if batch.extra_block_tables is not None:
        fields["extra_block_tables"] = tuple(new[1: 1 + extra])
    if batch.mamba_block_table is not None:
        fields["mamba_block_table"] = new[-1]
    return dataclasses.replace(batch, **fields)


def _set_optional(batch, rows: jax.Array, **values):
    """``batch`` with ``field[rows] = value`` for each field that the configuration keeps."""
    fields = {name: _set(getattr(batch, name), rows, value) for name, value in values.items()
              if getattr(batch, name) is not None}
    return dataclasses.replace(batch, **fields)


def _clear_rows(batch, rows: jax.Array):
    """A freed or re-admitted row: null blocks in every table, no draft, no grammar, no adapter, no
    last-step batch row (a new request never reads the sampled token of the row's former one)."""
    batch = _with_tables(batch, [_set(t, rows, NULL_BLOCK_ID) for t in tables(batch)])
    return _set_optional(batch, rows, num_computed_tokens=0, num_scheduled_tokens=0, num_draft_tokens=0,
                         prefill_len=0, num_accepted_tokens=1, grammar_index=NO_GRAMMAR, lora_ids=NO_LORA_ID,
                         mamba_checkpoint_offsets=0, prev_batch_rows=NO_PREV_ROW)


def finish_body(state: ServingState, rows: jax.Array) -> ServingState:
    """Frees rows: counters to 0 and block tables to the null block (token ids are left stale)."""
    rows = row_index(rows, state.num_tokens.shape[0])
    return dataclasses.replace(state, batch=_clear_rows(state.batch, rows), num_tokens=_set(state.num_tokens, rows, 0),
                               stop_len=_set(state.stop_len, rows, 0), num_blocks=_set(state.num_blocks, rows, 0))


def add_body(state: ServingState, add: dict) -> ServingState:
    """Writes the counters and per-request feature values of new requests (their tokens and blocks
    follow as data segments); M-RoPE rows are reset to missing and is_token_ids to all tokens."""
    rows = row_index(add["row"], state.num_tokens.shape[0])
    batch = _clear_rows(state.batch, rows)
    batch = _set_optional(batch, rows, num_computed_tokens=add["num_computed_tokens"], prefill_len=add["prefill_len"],
                          lora_ids=add.get("lora_id"), mrope_position_delta=add.get("mrope_position_delta"),
                          prompt_embeds_start=add.get("prompt_embeds_start"),
                          mrope_positions=MROPE_MISSING_POSITION if batch.mrope_positions is not None else None,
                          is_token_ids=True if batch.is_token_ids is not None else None)
    return dataclasses.replace(state, batch=batch, num_tokens=_set(state.num_tokens, rows, add["num_tokens"]),
                               stop_len=_set(state.stop_len, rows, add["stop_len"]),
                               num_blocks=_set(state.num_blocks, rows, 0))


def resume_body(state: ServingState, resume: dict) -> ServingState:
    """Sets, where given (>= 0), ``num_computed_tokens`` (-1: the device's own count stays, drafts
    still being verified), ``num_tokens`` and ``prefill_len``; nulls every table of the rows whose
    blocks are replaced (their new blocks follow as data segments)."""
    num_rows = state.num_tokens.shape[0]
    rows = row_index(resume["row"], num_rows)

    def kept(array, values):  # values, or the row's current value where -1
        return jnp.where(values >= 0, values, _gather(array, rows))

    computed = kept(state.batch.num_computed_tokens, resume["num_computed_tokens"])
    batch = _set_optional(state.batch, rows, num_computed_tokens=computed, num_scheduled_tokens=0, num_draft_tokens=0)
    if batch.prefill_len is not None:
        batch = dataclasses.replace(batch, prefill_len=_set(batch.prefill_len, rows,
                                                            kept(batch.prefill_len, resume["prefill_len"])))
    replaced = jnp.where(resume["replace_blocks"] == 1, rows, num_rows)
    batch = _with_tables(batch, [_set(t, replaced, NULL_BLOCK_ID) for t in tables(batch)])
    return dataclasses.replace(state, batch=batch,
                               num_tokens=_set(state.num_tokens, rows, kept(state.num_tokens, resume["num_tokens"])),
                               num_blocks=_set(state.num_blocks, replaced, 0))


def segments_body(state: ServingState, updates: DeviceUpdates) -> ServingState:
    """Writes every data word at its segment's (row, column) of its table.

    ```
    # word 9 of kind TABLE + 1, row 2, column 3 -> extra_block_tables[0][2, 3] = 9
    ```
    """
    num_rows = state.num_tokens.shape[0]
    kind, value, col = updates.data_kind, updates.data_value, updates.data_col

    def rows_of(k):
        return jnp.where(kind == k, row_index(updates.data_row, num_rows), num_rows)

    batch = state.batch
    batch = dataclasses.replace(batch, token_ids=batch.token_ids.at[rows_of(TOKENS), col].set(value, mode="drop"))
    if batch.mrope_positions is not None:
        positions = batch.mrope_positions
        for d in range(positions.shape[1]):
            positions = positions.at[rows_of(MROPE + d), d, col].set(value, mode="drop")
        batch = dataclasses.replace(batch, mrope_positions=positions)
    if batch.is_token_ids is not None:
        flags = batch.is_token_ids.at[rows_of(IS_TOKEN_IDS), col].set(value != 0, mode="drop")
        batch = dataclasses.replace(batch, is_token_ids=flags)
    batch = _with_tables(batch, [t.at[rows_of(TABLE + i), col].set(value, mode="drop")
                                 for i, t in enumerate(tables(batch))])
    ends = updates.segment_end  # group 0's allocated columns: the end of its last segment
    group0 = jnp.where(ends["kind"] == TABLE, row_index(ends["row"], num_rows), num_rows)
    return dataclasses.replace(state, batch=batch, num_blocks=state.num_blocks.at[group0].max(ends["end"], mode="drop"))


def admit_sampling_body(state: ServingState, updates: DeviceUpdates) -> ServingState:
    """The added rows' sampling parameters, and their penalty bins from the token words of this
    update (vLLM V2 ``Sampler.add_request``): ``prompt_bin_mask`` bit t % 32 of word t // 32 for
    each prompt token t, ``output_bin_counts`` for the tokens in [prompt_len, num_tokens).

    ```
    # V 64, tokens [3, 40, 3, 7, 7], prompt_len 3 -> mask words [1 << 3, 1 << 8], counts[7] = 2
    ```
    """
    batch, add = state.batch, updates.add
    num_rows, vocab = state.num_tokens.shape[0], batch.output_bin_counts.shape[1]
    rows = row_index(add["row"], num_rows)
    values = {name: jax.lax.bitcast_convert_type(add[name], jnp.float32) for name in FLOAT_PARAMS}
    values.update(top_k=add["top_k"], seeds=jnp.stack([add["seed_high"], add["seed_low"]], axis=1),
                  seeds_set=add["seeds_set"] != 0, prompt_bin_mask=0, output_bin_counts=0)
    batch = dataclasses.replace(batch, **{name: _set(getattr(batch, name), rows, value)
                                          for name, value in values.items()})
    # per data word: is it a token of an added row, in its prompt or its outputs?
    prompt_len = jnp.full((num_rows + 1,), -1, jnp.int32).at[rows].set(add["prompt_len"], mode="drop")
    num_tokens = jnp.zeros((num_rows + 1,), jnp.int32).at[rows].set(add["num_tokens"], mode="drop")
    row = jnp.where(updates.data_kind == TOKENS, row_index(updates.data_row, num_rows), num_rows)
    token, col = updates.data_value, updates.data_col
    known = (row < num_rows) & (token >= 0) & (token < vocab) & (prompt_len[row] >= 0)
    is_prompt = known & (col < prompt_len[row])
    is_output = known & (col >= prompt_len[row]) & (col < num_tokens[row])
    counts = batch.output_bin_counts.at[jnp.where(is_output, row, num_rows), token].add(1, mode="drop")
    # each (row, token) of the prompt once: sorted, then the first of each run adds its bit
    sorted_row, sorted_token = jax.lax.sort((jnp.where(is_prompt, row, num_rows), token), num_keys=2)
    first = jnp.concatenate([jnp.ones((1,), bool), (sorted_row[1:] != sorted_row[:-1])
                             | (sorted_token[1:] != sorted_token[:-1])])
    bit = jnp.left_shift(jnp.int32(1), sorted_token % 32)
    mask = batch.prompt_bin_mask.at[jnp.where(first, sorted_row, num_rows), sorted_token // 32].add(bit, mode="drop")
    return dataclasses.replace(state, batch=dataclasses.replace(batch, output_bin_counts=counts, prompt_bin_mask=mask))


def schedule_body(state: ServingState, schedule: dict, present: jax.Array | bool = True) -> ServingState:
    """Sets every row's scheduled and draft counts (in ``batch.num_draft_tokens``), writes each
    schedule entry's drafts after its row's ``num_tokens`` and the step's grammar rows; nothing where
    ``present`` is false.

    ```
    # entry_rows [0], num_tokens [5], num_draft [2], drafts [[41, 42, 0]] -> token_ids[0, 5:7] = [41, 42]
    ```
    """
    num_rows, max_model_len = state.batch.token_ids.shape
    present = jnp.asarray(present)

    def chosen(new, old):
        return jnp.where(present, new, old)

    num_draft = chosen(schedule["num_draft_tokens"], state.batch.num_draft_tokens)
    drafts = schedule["draft_token_ids"]  # [entries, K]
    token_ids = state.batch.token_ids
    if drafts.shape[1]:
        rows = row_index(schedule["entry_rows"], num_rows)  # [entries]
        offsets = jnp.arange(drafts.shape[1], dtype=jnp.int32)[None, :]
        columns = jnp.where(present & (offsets < _gather(num_draft, rows)[:, None]),
                            _gather(state.num_tokens, rows)[:, None] + offsets, max_model_len)
        token_ids = token_ids.at[rows[:, None], columns].set(drafts, mode="drop")
    fields = dict(token_ids=token_ids, num_draft_tokens=num_draft,
                  num_scheduled_tokens=chosen(schedule["num_scheduled_tokens"], state.batch.num_scheduled_tokens))
    if state.batch.grammar_index is not None:
        fields["grammar_index"] = chosen(schedule["grammar_index"], state.batch.grammar_index)
    return _replace_batch(state, **fields)


def apply_updates_body(state: ServingState, updates: DeviceUpdates) -> ServingState:
    """finish, add, resume, data segments, sampling admission, LoRA slots, then the schedule.

    A buffer the device cannot take is refused whole, before any write: its verdicts
    (`DeviceUpdates.bad_counts`, ``value_faults``) and its rows against the state's
    (`update_bounds.state_faults`) make one scalar, and `packing.refused` sends every write to
    the drop sentinel; ``ERROR_BITS["packed_counts"]`` (header, layout) or ``["packed_values"]`` is
    set, and the rest of the state is as it was, bit for bit."""
    bad_values = update_bounds.verdict([updates.value_faults, *update_bounds.state_faults(
        state.num_tokens, updates.finish_rows, updates.add, updates.resume, updates.append_rows,
        updates.schedule["entry_rows"], updates.entry_scheduled)])
    errors = (jnp.where(updates.bad_counts, ERROR_BITS["packed_counts"], 0)
              | jnp.where(bad_values, ERROR_BITS["packed_values"], 0))
    updates = refused(updates, updates.bad_counts | bad_values)
    state = dataclasses.replace(state, errors=state.errors | errors)
    state = finish_body(state, updates.finish_rows)
    state = add_body(state, updates.add)
    state = resume_body(state, updates.resume)
    state = segments_body(state, updates)
    if state.batch.output_bin_counts is not None:
        state = admit_sampling_body(state, updates)
    if state.batch.lora_slots is not None:
        slots = jnp.where(updates.has_lora_slots == 1, updates.lora_slots, state.batch.lora_slots)
        state = _replace_batch(state, lora_slots=slots)
    return schedule_body(state, updates.schedule, updates.has_schedule == 1)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def apply_packed(state: ServingState, packed: jax.Array, *, config: ServingConfig) -> ServingState:
    """`apply_updates_body` of one packed buffer (`jaxprep.serving.update_packing.pack_step`); one
    executable per buffer length of the ladder."""
    return apply_updates_body(state, unpack_updates(packed, config))


def batch_rows_of(idx_mapping) -> jax.Array:
    """A step's ``idx_mapping``: the array as given, or a `StepBuffer`'s field read inside the jit (a
    slice, no dispatch of its own)."""
    if isinstance(idx_mapping, StepBuffer):
        return idx_mapping.field("idx_mapping")
    return jnp.asarray(idx_mapping, jnp.int32)


def _outside_vocab(token_ids: jax.Array, vocab_bound: int | None, low: int = 0) -> jax.Array:
    """Per id: outside [``low``, ``vocab_bound``) (no upper bound when ``vocab_bound`` is None)."""
    limit = INT32_MAX if vocab_bound is None else vocab_bound
    return (token_ids < low) | (token_ids >= limit)


def _discarded(state: ServingState, rows: jax.Array) -> jax.Array:
    """Per batch row: a prefill chunk short of the row's known tokens (C + S < num_tokens), whose
    sampled token is thrown away (the sentinel row ``num_rows`` reads 0s: not discarded)."""
    seq_lens = _gather(state.batch.num_computed_tokens, rows) + _gather(state.batch.num_scheduled_tokens, rows)
    return seq_lens < _gather(state.num_tokens, rows)


def computed_advance(num_scheduled, num_draft, num_sampled, sampled):
    """What a step adds to a row's ``num_computed_tokens`` (vLLM V2 ``_post_update_kernel``): the
    scheduled tokens, less the rejected drafts where the row kept a sample (they are computed again
    next step), all of them where it kept none (a prefill chunk short of its known tokens).

    ```
    # S 3, D 2, n 2 (one draft accepted), sampled -> 3 - (2 + 1 - 2) = 2
    # S 4, D 0, a chunk short of its known tokens (not sampled) -> 4
    ```
    The one post-step counter update: the device (`record_sampled_body`) and the host mirrors
    (`checks.check_record`, `checks.advance_unread`, `AppendedTokens.computed_advance`) all call it, on
    traced or NumPy integer arrays alike (``sampled`` a bool array of their shape).
    """
    return num_scheduled - sampled.astype(num_draft.dtype) * (num_draft + 1 - num_sampled)


def record_sampled_body(state: ServingState, idx_mapping: jax.Array, sampled_token_ids: jax.Array,
                        num_sampled: jax.Array, vocab_bound: int | None = None) -> ServingState:
    """Post-update of one step (vLLM V2 ``_post_update_kernel``): advances the device counters.

    Per batch row b of state row s = idx_mapping[b] (pad -1 is skipped):
      discarded  = C + S < num_tokens (a prefill chunk short of the known tokens): nothing appended;
      n          = 0 if discarded else num_sampled[b] (accepted drafts + 1);
      C         += S if discarded else S - (D + 1 - n)   (rejected drafts are not computed);
      token_ids[s, num_tokens : num_tokens + n] = sampled_token_ids[b, :n]; num_tokens += n;
      S, D      -> 0; num_accepted_tokens -> n (hybrid models, where n > 0).

    ```
    # C 4, S 1, D 0, num_tokens 5, sampled [[77]], n 1 -> token_ids[s, 5] = 77, C 5, num_tokens 6
    ```
    ``idx_mapping`` may be the step's `StepBuffer` (its field is read here).

    Inputs it cannot take set a bit of ``state.errors`` (`ERROR_BITS`) and stay in bounds: a token
    outside [0, ``vocab_bound``) is written as 0, ``n`` is clamped to [0, D + 1], an ``idx_mapping``
    entry outside [-1, max_num_reqs) is skipped.
    """
    num_rows, max_model_len = state.batch.token_ids.shape
    idx_mapping = batch_rows_of(idx_mapping)
    sampled_token_ids = jnp.asarray(sampled_token_ids, jnp.int32)
    rows = row_index(idx_mapping, num_rows)
    bad_row = jnp.any((idx_mapping < -1) | (idx_mapping >= num_rows))
    scheduled = _gather(state.batch.num_scheduled_tokens, rows)
    num_tokens, num_draft = _gather(state.num_tokens, rows), _gather(state.num_draft_tokens, rows)
    discarded = _discarded(state, rows)
    requested = jnp.asarray(num_sampled, jnp.int32)
    width = sampled_token_ids.shape[1]
    bound = jnp.minimum(num_draft + 1, width)
    bad_count = jnp.any((rows < num_rows) & ~discarded & ((requested < 0) | (requested > bound)))
    num_sampled = jnp.where(discarded | (rows >= num_rows), 0, jnp.clip(requested, 0, bound))
    advance = computed_advance(scheduled, num_draft, num_sampled, ~discarded)
    offsets = jnp.arange(width, dtype=jnp.int32)[None, :]
    kept = offsets < num_sampled[:, None]
    bad_token = kept & _outside_vocab(sampled_token_ids, vocab_bound)
    sampled_token_ids = jnp.where(bad_token, 0, sampled_token_ids)
    columns = jnp.where(kept, num_tokens[:, None] + offsets, max_model_len)
    token_ids = state.batch.token_ids.at[rows[:, None], columns].set(sampled_token_ids, mode="drop")
    state = _replace_batch(state, token_ids=token_ids,
                           num_computed_tokens=state.batch.num_computed_tokens.at[rows].add(advance, mode="drop"),
                           num_scheduled_tokens=_set(state.batch.num_scheduled_tokens, rows, 0),
                           num_draft_tokens=_set(state.batch.num_draft_tokens, rows, 0))
    if state.batch.num_accepted_tokens is not None:
        accepted = jnp.where(num_sampled > 0, rows, num_rows)
        state = _replace_batch(state, num_accepted_tokens=_set(state.batch.num_accepted_tokens, accepted, num_sampled))
    if state.batch.output_bin_counts is not None:  # FeatureConfig.sampling: every appended token counts
        state = dataclasses.replace(state, batch=count_sampled(state.batch, rows, sampled_token_ids, num_sampled))
    errors = (jnp.where(jnp.any(bad_token), ERROR_BITS["sampled_token_id"], 0)
              | jnp.where(bad_count, ERROR_BITS["num_sampled"], 0) | jnp.where(bad_row, ERROR_BITS["idx_mapping"], 0))
    return dataclasses.replace(state, num_tokens=state.num_tokens.at[rows].add(num_sampled, mode="drop"),
                               errors=state.errors | errors)


@functools.partial(jax.jit, static_argnames=("vocab_bound",), donate_argnames=("state",))
def record_sampled(state: ServingState, idx_mapping, sampled_token_ids, num_sampled, *,
                   vocab_bound: int | None = None) -> ServingState:
    """`record_sampled_body`, jitted, the state donated."""
    return record_sampled_body(state, idx_mapping, sampled_token_ids, num_sampled, vocab_bound)


def record_prev_tokens_body(state: ServingState, idx_mapping: jax.Array, sampled_token_ids: jax.Array,
                            num_sampled: jax.Array, draft_token_ids: jax.Array | None,
                            vocab_bound: int | None = None) -> ServingState:
    """`FeatureConfig.async_tokens`' inputs of the next step from this one, before `record_sampled_body`:
    what V1 keeps on the device under async scheduling (``prev_req_id_to_index``,
    ``prev_sampled_token_ids``, ``_draft_token_ids``) for `jaxprep.features.async_tokens.write_prev_tokens`.

    ``prev_batch_rows``: the batch row each state row was sampled at (NO_PREV_ROW: not in the batch, or a
    discarded prefill chunk); ``prev_sampled_token_ids[b]``: batch row b's last kept token;
    ``prev_draft_token_ids[b]``: the drafter's proposals after this step (``draft_token_ids`` [B, <= K]),
    -1 where none (a placeholder no step fills, never accepted).

    Ids it cannot take set a bit of ``state.errors`` and are never written as given: a last sampled
    token outside [0, ``vocab_bound``) is kept as 0 (``sampled_token_id``), a proposal outside
    [-1, ``vocab_bound``) as -1 (``draft_token_id``).

    ```
    # idx_mapping [1, 0], sampled [[7, 8, -1], [9, -1, -1]], num_sampled [2, 1], drafts [[5, 6], [3, 4]]
    #   -> prev_batch_rows [1, 0, ...], prev_sampled_token_ids [8, 9, ...], prev_draft_token_ids [[5, 6], [3, 4], ...]
    ```
    """
    batch = state.batch
    num_rows, width = batch.prev_sampled_token_ids.shape[0], sampled_token_ids.shape[1]
    idx_mapping = batch_rows_of(idx_mapping)
    rows = row_index(idx_mapping, num_rows)
    counts = jnp.asarray(num_sampled, jnp.int32)
    discarded = _discarded(state, rows) | (counts <= 0)
    last = jnp.clip(counts - 1, 0, width - 1)
    sampled = jnp.take_along_axis(jnp.asarray(sampled_token_ids, jnp.int32), last[:, None], axis=1)[:, 0]
    bad_sampled = (rows < num_rows) & ~discarded & _outside_vocab(sampled, vocab_bound)
    batch_rows = jnp.arange(idx_mapping.shape[0], dtype=jnp.int32)
    fields = dict(prev_batch_rows=prev_batch_rows_from_step(rows, discarded, num_rows),
                  prev_sampled_token_ids=_set(jnp.zeros(num_rows, jnp.int32), batch_rows,
                                              jnp.where(bad_sampled, 0, sampled)))
    errors = jnp.where(jnp.any(bad_sampled), ERROR_BITS["sampled_token_id"], 0)
    if batch.prev_draft_token_ids is not None:
        drafts = jnp.full(batch.prev_draft_token_ids.shape, PLACEHOLDER_TOKEN_ID, jnp.int32)
        if draft_token_ids is not None:
            given = jnp.asarray(draft_token_ids, jnp.int32)[:, :drafts.shape[1]]
            bad_draft = _outside_vocab(given, vocab_bound, low=PLACEHOLDER_TOKEN_ID)
            errors = errors | jnp.where(jnp.any(bad_draft), ERROR_BITS["draft_token_id"], 0)
            drafts = drafts.at[batch_rows, :given.shape[1]].set(jnp.where(bad_draft, PLACEHOLDER_TOKEN_ID, given),
                                                               mode="drop")
        fields["prev_draft_token_ids"] = drafts
    state = _replace_batch(state, **fields)
    return dataclasses.replace(state, errors=state.errors | errors)


@functools.partial(jax.jit, static_argnames=("vocab_bound",), donate_argnames=("state",))
def record_prev_tokens(state: ServingState, idx_mapping, sampled_token_ids, num_sampled, draft_token_ids=None,
                       vocab_bound: int | None = None) -> ServingState:
    """`record_prev_tokens_body`, jitted, the state donated."""
    return record_prev_tokens_body(state, idx_mapping, sampled_token_ids, num_sampled, draft_token_ids, vocab_bound)
