"""Device transitions ``ServingState -> ServingState``: each ``*_body`` is the pure traced
transition, the plain name its jitted form that donates the state.

The state is three int32 arrays (`jaxprep.serving.device_state`), and each transition writes them by a
handful of scatters with ``mode='drop'``, whatever its payload holds: row records (every per-row scalar
of a few rows at once), cells of the token and block tables, whole per-row columns. Payload rows past a
section's count (-1) are first mapped to the out-of-range sentinel ``max_num_reqs``: JAX wraps a -1
index to the last row even with ``mode='drop'`` (docs/semantics.md#jax-traps), so -1 must never reach
a scatter.

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
from jaxprep.features.config import MROPE_NUM_DIMS
from jaxprep.features.sampling import FLOAT_PARAMS
from jaxprep.serving import state_layout, update_bounds
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.device_state import Cells, RecordBlock, assemble
from jaxprep.serving.sample.sampling_rows import sampled_count_cells
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


FREED = {"num_computed_tokens": 0, "num_scheduled_tokens": 0, "num_draft_tokens": 0, "num_tokens": 0, "stop_len": 0,
         "num_blocks": 0, "prefill_len": 0, "num_accepted_tokens": 1, "grammar_index": NO_GRAMMAR,
         "lora_ids": NO_LORA_ID, "mamba_checkpoint_offsets": 0, "prev_batch_rows": NO_PREV_ROW}
"""A freed (finished, preempted) row's per-row values: no tokens, no work, no draft, no grammar row, no
adapter, one accepted token, no last-step batch row (a new request never reads the sampled token of the
row's former one). Its block tables are nulled; its token ids and sampling rows are left stale."""


def admit_body(block: RecordBlock, finish_rows: jax.Array, add: dict) -> RecordBlock:
    """Finished rows freed (`FREED`) and added rows written: their counters and per-request values (their
    tokens and blocks follow as data segments). One gather of the old records, one scatter of the new.
    A row both finished and added takes the added record alone (it starts from the freed values too)."""
    layout, num_rows = block.layout, block.num_rows
    finish = row_index(finish_rows, num_rows)
    add_rows = row_index(add["row"], num_rows)
    readded = jnp.zeros((num_rows + 1,), bool).at[add_rows].set(True)[finish]  # the sentinel row: never
    finish = jnp.where(readded & (finish < num_rows), num_rows, finish)
    rows = jnp.concatenate([finish, add_rows])
    old = block.gather(rows)
    freed = assemble(layout, old[: finish.shape[0]], FREED)
    values = dict(FREED, num_computed_tokens=add["num_computed_tokens"], prefill_len=add["prefill_len"],
                  num_tokens=add["num_tokens"], stop_len=add["stop_len"])
    for name, key in (("lora_ids", "lora_id"), ("mrope_position_delta", "mrope_position_delta"),
                      ("prompt_embeds_start", "prompt_embeds_start")):
        if key in add:
            values[name] = add[key]
    if "top_k" in layout:  # FeatureConfig.sampling: the row's parameters (floats as their bit patterns)
        values.update({name: jax.lax.bitcast_convert_type(add[name], jnp.float32) for name in FLOAT_PARAMS})
        values.update(top_k=add["top_k"], seeds_set=add["seeds_set"] != 0)
    added = assemble(layout, old[finish.shape[0]:], values)
    return block.write(rows, jnp.concatenate([freed, added]))


def resume_body(block: RecordBlock, resume: dict) -> RecordBlock:
    """Sets, where given (>= 0), ``num_computed_tokens`` (-1: the device's own count stays, drafts
    still being verified), ``num_tokens`` and ``prefill_len``; no work scheduled; ``num_blocks`` 0 where the
    blocks are replaced (their tables are nulled by `clear_rows_body`, the new blocks follow as data)."""
    layout = block.layout
    rows = row_index(resume["row"], block.num_rows)
    old = block.gather(rows)

    def current(name):
        return old[:, layout[name].start]

    def kept(name, values):  # values, or the row's current value where -1
        return jnp.where(values >= 0, values, current(name))

    values = dict(num_computed_tokens=kept("num_computed_tokens", resume["num_computed_tokens"]),
                  num_scheduled_tokens=0, num_draft_tokens=0,
                  num_tokens=kept("num_tokens", resume["num_tokens"]),
                  num_blocks=jnp.where(resume["replace_blocks"] == 1, 0, current("num_blocks")))
    if "prefill_len" in layout:
        values["prefill_len"] = kept("prefill_len", resume["prefill_len"])
    return block.write(rows, assemble(layout, old, values))


def clear_rows_body(state: ServingState, updates: DeviceUpdates) -> ServingState:
    """Every block table of the finished, added and block-replaced rows nulled (one scatter); the added
    rows' M-RoPE positions missing, their is_token_ids all tokens and their penalty bins empty."""
    num_rows = state.num_rows
    add_rows = row_index(updates.add["row"], num_rows)
    replaced = jnp.where(updates.resume["replace_blocks"] == 1, row_index(updates.resume["row"], num_rows), num_rows)
    cleared = jnp.concatenate([row_index(updates.finish_rows, num_rows), add_rows, replaced])
    state = state.fill_rows(state_layout.TABLES, cleared, NULL_BLOCK_ID)
    for name, value in (("mrope_positions", MROPE_MISSING_POSITION), ("is_token_ids", 1), ("prompt_bin_mask", 0),
                        ("output_bin_counts", 0)):
        if name in state.layout:
            place = state.layout[name]
            state = state.fill_rows(place.array, add_rows, value, place.start, place.stop)
    return state


def _data_targets(state: ServingState, kinds: tuple[tuple[int, str, int], ...], kind: jax.Array, col: jax.Array):
    """Per data word: its absolute column and whether it lands in this array (a known kind, a column inside
    its field). ``kinds``: (segment kind, field, column offset inside the field) of the array's fields."""
    starts = [state.layout[name].start + offset for _, name, offset in kinds]
    widths = [state.layout[name].shape[-1] for _, name, _ in kinds]
    start, width, known = jnp.zeros_like(col), jnp.zeros_like(col), jnp.zeros(col.shape, bool)
    for (k, _, _), s, w in zip(kinds, starts, widths):  # a few static kinds: a chain of selects, no gather
        hit = kind == k
        start, width, known = jnp.where(hit, s, start), jnp.where(hit, w, width), known | hit
    inside = known & (col >= 0) & (col < width)
    return start + col, inside


def write_data_body(state: ServingState, updates: DeviceUpdates, draft_rows: jax.Array, draft_columns: jax.Array,
                    drafts: jax.Array) -> ServingState:
    """Every data word at its segment's (row, column) of its field, and the schedule's drafts after their
    rows' tokens: one scatter into ``tokens``, one into ``tables`` (KV group 0's allocated columns follow
    from the segments' ends, `allocated_body`).

    ```
    # word 9 of kind TABLE + 1, row 2, column 3 -> extra_block_tables[0][2, 3] = 9
    ```
    """
    num_rows, layout = state.num_rows, state.layout
    kind, value, col = updates.data_kind, updates.data_value, updates.data_col
    row = row_index(updates.data_row, num_rows)
    token_kinds = [(TOKENS, "token_ids", 0)]
    if "mrope_positions" in layout:
        token_kinds += [(MROPE + d, "mrope_positions", d * layout["token_ids"].width) for d in range(MROPE_NUM_DIMS)]
    if "is_token_ids" in layout:
        token_kinds.append((IS_TOKEN_IDS, "is_token_ids", 0))
    # the drafts: columns of token_ids past the row's tokens (draft_columns: -1 where none)
    token_ids = layout["token_ids"]
    draft_inside = (draft_columns >= 0) & (draft_columns < token_ids.width)
    rows = [draft_rows.reshape(-1)]
    columns = [jnp.where(draft_inside, token_ids.start + draft_columns, -1).reshape(-1)]
    words = [drafts.reshape(-1)]
    if _entries(updates.add) or _entries(updates.resume):  # else no token word (a steady buffer's data: blocks)
        data_columns, inside = _data_targets(state, tuple(token_kinds), kind, col)
        rows.insert(0, jnp.where(inside, row, num_rows))
        columns.insert(0, data_columns)
        words.insert(0, jnp.where(kind == IS_TOKEN_IDS, (value != 0).astype(jnp.int32), value))
    if sum(part.shape[0] for part in rows):  # a steady program without drafts writes no token
        state = state.write_array(state_layout.TOKENS, jnp.concatenate(rows), jnp.concatenate(columns),
                                  jnp.concatenate(words))
    table_kinds = tuple((TABLE + t, name, 0) for t, name in enumerate(layout.table_fields))
    columns, inside = _data_targets(state, table_kinds, kind, col)
    return state.write_array(state_layout.TABLES, jnp.where(inside, row, num_rows), columns, value)


def _entries(section: dict) -> int:
    """A section's static entries (0: a steady program's finish, add and resume, `unpack_updates`)."""
    return next(iter(section.values())).shape[0]


def allocated_body(block: RecordBlock, updates: DeviceUpdates) -> RecordBlock:
    """KV group 0's allocated columns (``num_blocks``) raised to the end of its last segment of data."""
    ends = updates.segment_end
    group0 = jnp.where(ends["kind"] == TABLE, row_index(ends["row"], block.num_rows), block.num_rows)
    return block.raise_to("num_blocks", group0, ends["end"])


def admit_sampling_body(state: ServingState, updates: DeviceUpdates) -> ServingState:
    """The added rows' seeds, and their penalty bins from the token words of this update (vLLM V2
    ``Sampler.add_request``): ``prompt_bin_mask`` bit t % 32 of word t // 32 for each prompt token t,
    ``output_bin_counts`` for the tokens in [prompt_len, num_tokens) (the other parameters are in the
    added row's record, `admit_body`; the bins were emptied by `clear_rows_body`).

    ```
    # V 64, tokens [3, 40, 3, 7, 7], prompt_len 3 -> mask words [1 << 3, 1 << 8], counts[7] = 2
    ```
    """
    add, num_rows = updates.add, state.num_rows
    vocab = state.layout["output_bin_counts"].width
    rows = row_index(add["row"], num_rows)
    state = state.write_cells([Cells("seeds", rows[:, None], jnp.stack([add["seed_high"], add["seed_low"]], axis=1),
                                     jnp.arange(2, dtype=jnp.int32)[None, :])])
    # per data word: is it a token of an added row, in its prompt or its outputs?
    prompt_len = jnp.full((num_rows + 1,), -1, jnp.int32).at[rows].set(add["prompt_len"], mode="drop")
    num_tokens = jnp.zeros((num_rows + 1,), jnp.int32).at[rows].set(add["num_tokens"], mode="drop")
    row = jnp.where(updates.data_kind == TOKENS, row_index(updates.data_row, num_rows), num_rows)
    token, col = updates.data_value, updates.data_col
    known = (row < num_rows) & (token >= 0) & (token < vocab) & (prompt_len[row] >= 0)
    is_prompt = known & (col < prompt_len[row])
    is_output = known & (col >= prompt_len[row]) & (col < num_tokens[row])
    # each (row, token) of the prompt once: sorted, then the first of each run adds its bit
    sorted_row, sorted_token = jax.lax.sort((jnp.where(is_prompt, row, num_rows), token), num_keys=2)
    first = jnp.concatenate([jnp.ones((1,), bool), (sorted_row[1:] != sorted_row[:-1])
                             | (sorted_token[1:] != sorted_token[:-1])])
    bit = jnp.left_shift(jnp.int32(1), sorted_token % 32)
    cells = [Cells("output_bin_counts", jnp.where(is_output, row, num_rows), 1, token),
             Cells("prompt_bin_mask", jnp.where(first, sorted_row, num_rows), bit, sorted_token // 32)]
    return state.write_cells(cells, mode="add")


SCHEDULE_FIELDS = ("num_scheduled_tokens", "num_draft_tokens", "grammar_index")
"""The per-row fields a schedule sets (``grammar_index`` where structured outputs are on)."""


def draft_columns(block: RecordBlock, schedule: dict, present: jax.Array) -> jax.Array:
    """[entries, K] each schedule entry's drafts' token_ids columns: ``num_tokens + k`` for k < D, -1 past D
    (or when the schedule is absent).

    ```
    # entry row 0, num_tokens 5, D 2, K 3 -> [5, 6, -1]
    ```
    """
    rows = row_index(schedule["entry_rows"], block.num_rows)
    offsets = jnp.arange(schedule["draft_token_ids"].shape[1], dtype=jnp.int32)[None, :]
    drafts = _gather(schedule["num_draft_tokens"], rows)[:, None]
    return jnp.where(present & (offsets < drafts), _gather(block.field("num_tokens"), rows)[:, None] + offsets, -1)


def apply_updates_body(state: ServingState, updates: DeviceUpdates) -> ServingState:
    """finish, add, resume, data segments, sampling admission, LoRA slots, then the schedule.

    A buffer the device cannot take is refused whole, before any write: its verdicts
    (`DeviceUpdates.bad_counts`, ``value_faults``) and its rows against the state's
    (`update_bounds.state_faults`) make one scalar, and `packing.refused` sends every write to
    the drop sentinel; ``ERROR_BITS["packed_counts"]`` (header, layout) or ``["packed_values"]`` is
    set, and the rest of the state is as it was, bit for bit.

    Each array of the state is written by a few scatters whatever the update holds: the row records of
    the finished and added rows, then of the resumed rows; the nulled block tables; one scatter of every
    token (and draft) into ``tokens`` and of every block id into ``tables``; the counts of the schedule."""
    block = state.record_block()
    bad_values = update_bounds.verdict([updates.value_faults, *update_bounds.state_faults(
        block.field("num_tokens"), updates.finish_rows, updates.add, updates.resume, updates.append_rows,
        updates.schedule["entry_rows"], updates.entry_scheduled)])
    errors = (jnp.where(updates.bad_counts, ERROR_BITS["packed_counts"], 0)
              | jnp.where(bad_values, ERROR_BITS["packed_values"], 0))
    updates = refused(updates, updates.bad_counts | bad_values)
    moving = updates.finish_rows.shape[0] + _entries(updates.add) + _entries(updates.resume)  # static: 0 if steady
    if moving:
        block = resume_body(admit_body(block, updates.finish_rows, updates.add), updates.resume)
    present = updates.has_schedule == 1
    columns = draft_columns(block, updates.schedule, present)
    block = allocated_body(block, updates)
    block = block.replace_where(present, **{name: updates.schedule[name] for name in SCHEDULE_FIELDS
                                            if name in state.layout})
    state = state.with_record_block(block)
    if moving:
        state = clear_rows_body(state, updates)
    rows = jnp.broadcast_to(row_index(updates.schedule["entry_rows"], state.num_rows)[:, None], columns.shape)
    state = write_data_body(state, updates, rows, columns, updates.schedule["draft_token_ids"])
    if "output_bin_counts" in state.layout and _entries(updates.add):
        state = admit_sampling_body(state, updates)
    if "lora_slots" in state.layout:
        state = state.replace_where(updates.has_lora_slots == 1, lora_slots=updates.lora_slots)
    return state.with_error_bits(errors)


@functools.partial(jax.jit, static_argnames=("config", "steady"), donate_argnames=("state",))
def apply_packed(state: ServingState, packed: jax.Array, *, config: ServingConfig, steady: bool = False
                 ) -> ServingState:
    """`apply_updates_body` of one packed buffer (`jaxprep.serving.update_packing.pack_step`); one
    executable per buffer length of the ladder. ``steady``: the program for buffers that finish, add and
    resume no row (`update_packing.is_steady`; any other is refused whole, `unpack_updates`)."""
    return apply_updates_body(state, unpack_updates(packed, config, steady))


def column(state: ServingState, records: jax.Array, name: str) -> jax.Array:
    """Field ``name`` of row records ``records`` (as stored: int32)."""
    return records[:, state.layout[name].start]


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
    records = state.records(rows)
    seq_lens = column(state, records, "num_computed_tokens") + column(state, records, "num_scheduled_tokens")
    return seq_lens < column(state, records, "num_tokens")


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


@dataclasses.dataclass(frozen=True)
class Recorded:
    """What `record_rows` did per batch row, from the values it read before writing (a caller that needs
    them after the record reads them here, not from the old state: a read of the state after its in-place
    write would make XLA keep a copy of its array)."""

    rows: jax.Array  # [B] state row (scatter index: the sentinel for padding)
    num_appended: jax.Array  # [B] tokens appended (n)
    num_tokens_before: jax.Array  # [B] num_tokens before the record
    num_draft_tokens: jax.Array  # [B] drafts the row had scheduled (D)


def record_sampled_body(state: ServingState, idx_mapping: jax.Array, sampled_token_ids: jax.Array,
                        num_sampled: jax.Array, vocab_bound: int | None = None) -> ServingState:
    """`record_rows`' state alone."""
    return record_rows(state, idx_mapping, sampled_token_ids, num_sampled, vocab_bound)[0]


def record_rows(state: ServingState, idx_mapping: jax.Array, sampled_token_ids: jax.Array, num_sampled: jax.Array,
                vocab_bound: int | None = None) -> tuple[ServingState, Recorded]:
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
    ``idx_mapping`` may be the step's `StepBuffer` (its field is read here). One gather of the batch
    rows' records, one scatter of the new ones, one scatter of the tokens.

    Inputs it cannot take set a bit of ``state.errors`` (`ERROR_BITS`) and stay in bounds: a token
    outside [0, ``vocab_bound``) is written as 0, ``n`` is clamped to [0, D + 1], an ``idx_mapping``
    entry outside [-1, max_num_reqs) is skipped.
    """
    num_rows = state.num_rows
    idx_mapping = batch_rows_of(idx_mapping)
    sampled_token_ids = jnp.asarray(sampled_token_ids, jnp.int32)
    rows = row_index(idx_mapping, num_rows)
    bad_row = jnp.any((idx_mapping < -1) | (idx_mapping >= num_rows))
    old = state.records(rows)
    computed, scheduled = column(state, old, "num_computed_tokens"), column(state, old, "num_scheduled_tokens")
    num_tokens, num_draft = column(state, old, "num_tokens"), column(state, old, "num_draft_tokens")
    discarded = computed + scheduled < num_tokens  # the sentinel row reads 0s: not discarded
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
    values = dict(num_computed_tokens=computed + advance, num_scheduled_tokens=0, num_draft_tokens=0,
                  num_tokens=num_tokens + num_sampled)
    if "num_accepted_tokens" in state.layout:
        values["num_accepted_tokens"] = jnp.where(num_sampled > 0, num_sampled,
                                                  column(state, old, "num_accepted_tokens"))
    state = state.write_records(rows, assemble(state.layout, old, values))
    cells = [Cells("token_ids", rows[:, None], sampled_token_ids, jnp.where(kept, num_tokens[:, None] + offsets, -1))]
    state = state.write_cells(cells)
    if "output_bin_counts" in state.layout:  # FeatureConfig.sampling: every appended token counts
        state = state.write_cells(sampled_count_cells(state.layout["output_bin_counts"].width, rows,
                                                      sampled_token_ids, num_sampled), mode="add")
    errors = (jnp.where(jnp.any(bad_token), ERROR_BITS["sampled_token_id"], 0)
              | jnp.where(bad_count, ERROR_BITS["num_sampled"], 0) | jnp.where(bad_row, ERROR_BITS["idx_mapping"], 0))
    return state.with_error_bits(errors), Recorded(rows=rows, num_appended=num_sampled, num_tokens_before=num_tokens,
                                                   num_draft_tokens=num_draft)


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
    num_rows, width = state.num_rows, sampled_token_ids.shape[1]
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
    if "prev_draft_token_ids" in state.layout:
        drafts = jnp.full((num_rows, *state.layout["prev_draft_token_ids"].shape), PLACEHOLDER_TOKEN_ID, jnp.int32)
        if draft_token_ids is not None:
            given = jnp.asarray(draft_token_ids, jnp.int32)[:, :drafts.shape[1]]
            bad_draft = _outside_vocab(given, vocab_bound, low=PLACEHOLDER_TOKEN_ID)
            errors = errors | jnp.where(jnp.any(bad_draft), ERROR_BITS["draft_token_id"], 0)
            drafts = drafts.at[batch_rows, :given.shape[1]].set(jnp.where(bad_draft, PLACEHOLDER_TOKEN_ID, given),
                                                               mode="drop")
        fields["prev_draft_token_ids"] = drafts
    return state.replace(**fields).with_error_bits(errors)


@functools.partial(jax.jit, static_argnames=("vocab_bound",), donate_argnames=("state",))
def record_prev_tokens(state: ServingState, idx_mapping, sampled_token_ids, num_sampled, draft_token_ids=None,
                       vocab_bound: int | None = None) -> ServingState:
    """`record_prev_tokens_body`, jitted, the state donated."""
    return record_prev_tokens_body(state, idx_mapping, sampled_token_ids, num_sampled, draft_token_ids, vocab_bound)


@functools.partial(jax.jit, static_argnames=("vocab_bound",), donate_argnames=("state",))
def record_with_prev_tokens(state: ServingState, idx_mapping, sampled_token_ids, num_sampled, draft_token_ids=None,
                            vocab_bound: int | None = None) -> ServingState:
    """`record_prev_tokens_body`, then `record_sampled_body`, in one jitted call, the state donated: a step's record
    under async scheduling (`FeatureConfig.async_tokens`), one dispatch where `record_prev_tokens` and
    `record_sampled` take two; ``sampled_token_ids`` [B, n]."""
    state = record_prev_tokens_body(state, idx_mapping, sampled_token_ids, num_sampled, draft_token_ids, vocab_bound)
    return record_sampled_body(state, idx_mapping, sampled_token_ids, num_sampled, vocab_bound)
