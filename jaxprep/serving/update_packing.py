"""One step's updates in one int32 buffer whose length grows with the change, not with the maxima.

Layout (all int32 words; field ``f`` of entry ``i`` of a section of ``n`` entries at ``start + f * n + i``):

    header [HEADER_WORDS]  decode_steps, n_finish, n_add, n_resume, n_segments, n_schedule,
                           schedule_dense, has_lora_slots, n_data, has_schedule (0: counts kept)
    finish   [n_finish]                   rows to free
    add      [len(add_fields) x n_add]     per added request: row, num_tokens, stop_len, ... (`Layout`)
    resume   [len(resume_fields) x n_resume]  row, num_computed_tokens (-1 keep), num_tokens (-1 keep),
                                           prefill_len (-1 keep), replace_blocks, the blocks of each table
    segments [4 x n_segments]              kind, row, col, len: where each appended run of ``data`` goes
    schedule [width x n_schedule]          (row,) num_scheduled_tokens (, num_draft_tokens, K drafts)(, grammar)
    lora     [max_loras if has_lora_slots]
    data     [n_data]                      token ids, M-RoPE positions, is_token_ids, block ids, run after run

An added row's data runs (its tokens, M-RoPE rows, is_token_ids, blocks of each table) are
implied by its record's lengths (`add_runs`), a resumed row's likewise (`resume_runs`); appended
blocks come as explicit segments. A run of kind ``TOKENS`` writes ``token_ids[row, col : col + len]``;
``MROPE + d`` writes ``mrope_positions[row, d, col : col + len]``; ``IS_TOKEN_IDS`` writes
``is_token_ids``; ``TABLE + t`` writes block table t (`jaxprep.serving.state.table_names`).

```
# add row 2 tokens [7, 8, 9], blocks [5] (record num_tokens 3, blocks_0 1), append row 0 block 6 at
#   column 2: segments [(TABLE, 0, 2, 1)], data [7, 8, 9, 5, 6]
```

The schedule section is dense (rows 0..n-1, no row field) or sparse (a row field), whichever is
shorter. The buffer is padded with zeros to a rung of the ladder `payload_buckets` (64, 128, ...
words): the device reads only what the header counts, so the same executable serves every update
of its rung, and the rungs are compiled at warm-up. It reads each section at a static size bounded
by what the rung's words can hold (`section_sizes`), so its gathers and scatters grow with the rung,
not with max_num_reqs. An update that does not fit the serving step's
rungs (`step_payload_words`) is split: leading buffers are applied by `transitions.apply_packed`,
the last one (the schedule) goes with the step (`pack_step`).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import NO_GRAMMAR
from jaxprep.serving import update_bounds
from jaxprep.serving.config import ServingConfig, last_config
from jaxprep.serving.state import (
    InvalidUpdateError,
    Schedule,
    StepUpdates,
    draft_width,
    table_names,
    table_widths,
)

HEADER = ("decode_steps", "n_finish", "n_add", "n_resume", "n_segments", "n_schedule", "schedule_dense",
          "has_lora_slots", "n_data", "has_schedule")
HEADER_WORDS = len(HEADER)
TOKENS, IS_TOKEN_IDS, MROPE, TABLE = (update_bounds.TOKENS, update_bounds.IS_TOKEN_IDS, update_bounds.MROPE,
                                      update_bounds.TABLE)  # segment kinds; MROPE + d (d < 3); TABLE + t
SEGMENT_FIELDS = ("kind", "row", "col", "len")
RESUME_FIELDS = ("row", "num_computed_tokens", "num_tokens", "prefill_len", "replace_blocks")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed_high", "seed_low", "seeds_set",
                   "repetition_penalty", "frequency_penalty", "presence_penalty", "prompt_len")
SMALLEST_BUCKET = 64


@dataclasses.dataclass(frozen=True)
class Layout:
    """The static part of the buffer layout of a `ServingConfig`."""

    add_fields: tuple[str, ...]
    num_drafts: int  # K draft words per schedule entry (0: no draft fields)
    grammar: bool
    max_loras: int
    num_tables: int

    @property
    def schedule_fields(self) -> tuple[str, ...]:
        drafts = ("num_draft_tokens", *(f"draft_{i}" for i in range(self.num_drafts))) if self.num_drafts else ()
        return ("row", "num_scheduled_tokens", *drafts, *(("grammar_index",) if self.grammar else ()))


@functools.lru_cache(maxsize=64)
def payload_layout(config: ServingConfig) -> Layout:
    features = config.prep.features
    fields = ["row", "num_tokens", "stop_len", "num_computed_tokens", "prefill_len"]
    fields += ["lora_id"] if features.lora is not None else []
    fields += ["mrope_position_delta"] if features.mrope else []
    fields += ["prompt_embeds_start"] if features.prompt_embeds else []
    fields += list(SAMPLING_FIELDS) if features.sampling is not None else []
    fields += list(_length_fields(config))
    return Layout(add_fields=tuple(fields), num_drafts=draft_width(config), grammar=features.structured_outputs,
                  max_loras=features.lora.max_loras if features.lora is not None else 0,
                  num_tables=len(table_names(config)))


def _length_fields(config: ServingConfig) -> tuple[str, ...]:
    """The data runs of an added row, in data order, each named by the field holding its length."""
    features = config.prep.features
    names = ["num_tokens"] + (["mrope_len"] * 3 if features.mrope else [])
    names += ["is_token_len"] if features.prompt_embeds else []
    return tuple(dict.fromkeys(names[1:])) + tuple(f"blocks_{t}" for t in range(len(table_names(config))))


def add_runs(config: ServingConfig) -> tuple[tuple[int, str], ...]:
    """(segment kind, length field) of each data run of an added row, in data order."""
    features = config.prep.features
    runs = [(TOKENS, "num_tokens")] + ([(MROPE + d, "mrope_len") for d in range(3)] if features.mrope else [])
    runs += [(IS_TOKEN_IDS, "is_token_len")] if features.prompt_embeds else []
    return tuple(runs + [(TABLE + t, f"blocks_{t}") for t in range(len(table_names(config)))])


def resume_fields(config: ServingConfig) -> tuple[str, ...]:
    return RESUME_FIELDS + tuple(f"blocks_{t}" for t in range(len(table_names(config))))


def resume_runs(config: ServingConfig) -> tuple[tuple[int, str], ...]:
    return ((TOKENS, "num_tokens"),) + tuple((TABLE + t, f"blocks_{t}") for t in range(len(table_names(config))))


@functools.lru_cache(maxsize=64)
def payload_buckets(config: ServingConfig) -> tuple[int, ...]:
    """The ladder of buffer lengths: 64, 96, 144, ... (x1.5, multiples of 16: a buffer is at most
    1.5x its content) up to the first that holds the largest single item (one request of
    max_model_len tokens with all its blocks and feature rows, or a full schedule)."""
    lay, rows = payload_layout(config), config.max_num_reqs
    one_request = len(lay.add_fields) + _words_per_token(config) * config.max_model_len + sum(table_widths(config))
    largest = HEADER_WORDS + max(one_request, rows * len(lay.schedule_fields), rows, lay.max_loras)
    buckets = [SMALLEST_BUCKET]
    while buckets[-1] < largest:
        buckets.append(_next_rung(buckets[-1]))
    return tuple(buckets)


def _next_rung(words: int) -> int:
    """The ladder's rung after ``words``: x1.5, rounded up to a multiple of 16."""
    return -(-words * 3 // 2 // 16) * 16


def _words_per_token(config: ServingConfig) -> int:
    """Data words per added token: its id, its three M-RoPE positions and its ``is_token_ids`` flag where on."""
    features = config.prep.features
    return 1 + (3 if features.mrope else 0) + (1 if features.prompt_embeds else 0)


@functools.lru_cache(maxsize=64)
def step_payload_buckets(config: ServingConfig) -> tuple[int, ...]:
    """The rungs the serving step is compiled for: up to the first that holds a full schedule and a
    finish of every row (a steady step); bigger updates go first, by `transitions.apply_packed`."""
    lay = payload_layout(config)
    steady = HEADER_WORDS + config.max_num_reqs * (1 + len(lay.schedule_fields) - 1) + lay.max_loras
    buckets = payload_buckets(config)
    return tuple(b for b in buckets if b < steady) + (next(b for b in buckets if b >= steady),)


@functools.lru_cache(maxsize=64)
def bulk_rungs(config: ServingConfig) -> tuple[int, ...]:
    """The bulk rung, the length of the leading buffers (`PackedStep.before`) of an update that the top rung of
    `payload_buckets` cannot hold: the ladder continued past its top to the rung that holds a whole step's
    admission (max_num_reqs add records, max_num_batched_tokens tokens of data and their blocks in every
    table), so that such a step sends one buffer (`transitions.apply_packed` at this length, one call), not
    one per top rung; none where the top rung holds the admission. The one more update program a warm-up
    compiles (`batch.update_executables`).

    ```
    # 64 rows, 6 add fields, 1024 tokens a step, blocks of 16, top rung 336:
    #   10 + 64 * 6 + 1024 + (64 + 64) = 1546 words -> (1728,) (336, 512, 768, 1152, 1728)
    ```
    """
    lay, prep = payload_layout(config), config.prep
    budget = prep.max_num_batched_tokens
    admission = (HEADER_WORDS + prep.max_num_reqs * len(lay.add_fields) + _words_per_token(config) * budget
                 + lay.num_tables * (-(-budget // prep.block_size) + prep.max_num_reqs))
    top = rung = payload_buckets(config)[-1]
    while rung < admission:
        rung = _next_rung(rung)
    return (rung,) if rung > top else ()


def packed_size(config: ServingConfig) -> int:
    """The smallest buffer: an empty update."""
    return payload_buckets(config)[0]


# --- host side ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PackedStep:
    """An update as buffers: ``before`` (applied by `transitions.apply_packed`, in order) and ``step``
    (the serving step's, or the last `apply_packed`). ``content_words`` counts the words that carry
    a value (header and padding excluded), ``changed_words`` the state entries the update writes."""

    before: tuple[np.ndarray, ...]
    step: np.ndarray
    content_words: int
    changed_words: int

    @property
    def nbytes(self) -> int:
        """Host-to-device bytes of the whole update."""
        return 4 * (sum(len(b) for b in self.before) + len(self.step))

    @property
    def buffers(self) -> tuple[np.ndarray, ...]:
        return (*self.before, self.step)

    @property
    def steady(self) -> bool:
        """Whether the step's buffer is steady (`is_steady`): a steady executable may apply it."""
        return is_steady(self.step)


STEADY_COUNTS = tuple(HEADER.index(name) for name in ("n_finish", "n_add", "n_resume"))
"""The header words a steady buffer holds 0 in (`is_steady`)."""


def is_steady(buffer: np.ndarray) -> bool:
    """Whether a host buffer finishes, adds and resumes no row (the common decode step): what a steady
    executable (`unpack_updates` with ``steady``) takes.

    ```
    # header [1, 0, 0, 0, 0, 64, 1, ...] (a dense schedule alone) -> True; n_add 2 -> False
    ```
    """
    return not any(buffer[i] for i in STEADY_COUNTS)


NO_ENTRIES = np.zeros(0, np.int64)
NO_ENTRIES.flags.writeable = False
"""An empty section (read-only: shared by every update that has none)."""


@dataclasses.dataclass(frozen=True)
class UpdateColumns:
    """A step's update as the buffer's sections hold it, before `pack_columns` cuts it into buffers: each
    section's records as columns (field-major, the buffer's order), each entry's data runs flat, entry after
    entry. `update_columns` reads a checked `StepUpdates` into it; `jaxprep.serving.host.vllm_columns` writes
    vLLM's common steps straight into it.

    ```
    # add row 2 tokens [7, 8, 9], blocks [5]; append row 0 block 6 at column 2 (fields row, num_tokens, ..., blocks_0)
    #   -> add [[2], [3], ..., [1]], add_data [7, 8, 9, 5], add_data_len [4],
    #      segments [[TABLE], [0], [2], [1]], segment_data [6]
    ```
    """

    finish: np.ndarray  # [F] rows to free
    add: np.ndarray  # [len(add_fields), A] one record per added row (`Layout.add_fields`)
    add_data: np.ndarray  # [sum(add_data_len)] each added row's data runs (`add_runs`), row after row
    add_data_len: np.ndarray  # [A]
    resume: np.ndarray  # [len(resume_fields), R]
    resume_data: np.ndarray  # [sum(resume_data_len)] each resumed row's runs (`resume_runs`)
    resume_data_len: np.ndarray  # [R]
    segments: np.ndarray  # [4, S] kind, row, col, len of each appended run (`SEGMENT_FIELDS`)
    segment_data: np.ndarray  # [sum(len)] the appended block ids, segment after segment
    lora: np.ndarray | None  # [max_loras] adapter id per slot; None: unchanged
    schedule: Schedule | None  # the dense counts; None: the scheduled counts are kept
    decode_steps: int
    changed_words: int  # state entries the sections before the schedule write (`pack_columns` adds its own)


@functools.lru_cache(maxsize=16)
def empty_records(fields: int) -> np.ndarray:
    """A section of no entries, ``fields`` wide (read-only, shared)."""
    records = np.zeros((fields, 0), np.int64)
    records.flags.writeable = False
    return records


@functools.lru_cache(maxsize=64)
def empty_columns(config: ServingConfig) -> UpdateColumns:
    """An update with nothing in it (the schedule's buffer of a split update holds only the schedule)."""
    lay = payload_layout(config)
    return UpdateColumns(finish=NO_ENTRIES, add=empty_records(len(lay.add_fields)), add_data=NO_ENTRIES,
                         add_data_len=NO_ENTRIES, resume=empty_records(len(resume_fields(config))),
                         resume_data=NO_ENTRIES, resume_data_len=NO_ENTRIES,
                         segments=empty_records(len(SEGMENT_FIELDS)), segment_data=NO_ENTRIES, lora=None,
                         schedule=None, decode_steps=1, changed_words=0)


def pack_step(config: ServingConfig, updates: StepUpdates, num_blocks_before: np.ndarray,
              step_words: int | None = None) -> PackedStep:
    """``updates`` (checked) as buffers of the ladder. ``num_blocks_before`` [max_num_reqs, tables]:
    the rows' block counts before the update (`HostRows.table_blocks`), to place the appended blocks.
    ``step_words``: as in `pack_columns`."""
    return pack_columns(config, update_columns(config, updates, num_blocks_before), step_words)


class _Ladder(NamedTuple):
    """What packing reads of a configuration, looked up once per update."""

    layout: Layout
    buckets: tuple[int, ...]  # `payload_buckets`
    step_words: int  # the serving step's top rung (`step_payload_buckets`)
    leading: tuple[int, ...]  # the leading buffers' rungs: `payload_buckets`, then `bulk_rungs`


@last_config
@functools.lru_cache(maxsize=64)
def _ladder(config: ServingConfig) -> _Ladder:
    buckets = payload_buckets(config)
    return _Ladder(payload_layout(config), buckets, step_payload_buckets(config)[-1], buckets + bulk_rungs(config))


def pack_columns(config: ServingConfig, columns: UpdateColumns, step_words: int | None = None) -> PackedStep:
    """``columns`` as buffers of the ladder: one, when it fits the serving step's rungs
    (`step_payload_buckets`); else the sections before the schedule greedily in buffers of at most the bulk rung
    (`bulk_rungs`; a split falls between entries, or between appended segments; each at the smallest rung that
    holds it, the bulk rung above the top), applied first, and the schedule alone last.

    ``step_words``: the largest buffer the step that takes it runs at (default: the top step rung); where that is
    the bulk rung (the door at a bucket that takes a step's admissions whole, `batch.door_rungs`), an update that
    fits it, schedule included, goes as one buffer at the smallest rung of the ladder (bulk rung included) that
    holds it."""
    ladder = _ladder(config)
    whole = ladder.step_words if step_words is None else step_words
    lay = ladder.layout
    section = None if columns.schedule is None else _schedule_section(columns.schedule, lay)
    schedule_words = 0 if section is None else section[1]
    changed = columns.changed_words + (0 if section is None else section[2])
    content = (len(columns.finish) + columns.add.size + columns.resume.size + columns.segments.size + schedule_words
               + (0 if columns.lora is None else lay.max_loras)
               + len(columns.add_data) + len(columns.resume_data) + len(columns.segment_data))
    if HEADER_WORDS + content <= whole:  # up to the top payload rung `leading` is `buckets`; past it, the bulk rung
        step = _encode(ladder.leading, columns, section, columns.decode_steps)
        return PackedStep(before=(), step=step, content_words=content, changed_words=changed)
    parts = _split(ladder.leading[-1], columns, _item_words(lay, columns))
    before = tuple(_encode(ladder.leading, part, None, 1) for part in parts)
    step = _encode(ladder.buckets, empty_columns(config), section, columns.decode_steps)
    return PackedStep(before=before, step=step, content_words=content, changed_words=changed)


def _item_words(lay: Layout, columns: UpdateColumns) -> np.ndarray:
    """The words of each item a split may fall between, in buffer order: the finish rows (one item), each added
    and each resumed row (record and data), each appended segment, the LoRA slots."""
    finish = [len(columns.finish)] if len(columns.finish) else []
    lora = [] if columns.lora is None else [lay.max_loras]
    return np.concatenate([np.array(finish, np.int64), len(columns.add) + columns.add_data_len,
                           len(columns.resume) + columns.resume_data_len,
                           len(SEGMENT_FIELDS) + columns.segments[3], np.array(lora, np.int64)])


def _split(top: int, columns: UpdateColumns, items: np.ndarray) -> list[UpdateColumns]:
    """The items greedily into buffers of ``top`` words (the bulk rung, `bulk_rungs`), in order (an item that
    fills one alone goes alone).

    ```
    # top 64, header 10, item words [30, 30, 30] -> [[30], [30], [30]]; [20, 20, 20] -> [[20, 20], [20]]
    ```
    """
    ends, words = [], HEADER_WORDS
    for i, size in enumerate(items.tolist()):
        if words + size > top and words > HEADER_WORDS:
            ends.append(i)
            words = HEADER_WORDS
        words += size
    bounds = [0, *ends, len(items)]
    return [_part(columns, start, end) for start, end in zip(bounds[:-1], bounds[1:])]


def _part(columns: UpdateColumns, start: int, end: int) -> UpdateColumns:
    """The items [start, end) of ``columns`` (in `_item_words` order) as columns of their own, without the schedule."""
    counts = [int(len(columns.finish) > 0), columns.add.shape[1], columns.resume.shape[1], columns.segments.shape[1],
              int(columns.lora is not None)]
    offsets = np.cumsum([0, *counts]).tolist()
    picked = [slice(min(max(start - at, 0), n), min(max(end - at, 0), n)) for at, n in zip(offsets, counts)]
    finish, add, resume, segments, lora = picked
    return dataclasses.replace(
        columns, finish=columns.finish if finish.start < finish.stop else NO_ENTRIES,
        add=columns.add[:, add], add_data=_runs_of(columns.add_data, columns.add_data_len, add),
        add_data_len=columns.add_data_len[add], resume=columns.resume[:, resume],
        resume_data=_runs_of(columns.resume_data, columns.resume_data_len, resume),
        resume_data_len=columns.resume_data_len[resume], segments=columns.segments[:, segments],
        segment_data=_runs_of(columns.segment_data, columns.segments[3], segments),
        lora=columns.lora if lora.start < lora.stop else None, schedule=None, decode_steps=1)


def _runs_of(data: np.ndarray, lengths: np.ndarray, picked: slice) -> np.ndarray:
    """The data of the entries ``picked`` (``lengths`` words each, entry after entry)."""
    start = int(lengths[: picked.start].sum())
    return data[start: start + int(lengths[picked].sum())]


def pad_to(buffer: np.ndarray, words: int) -> np.ndarray:
    """``buffer`` padded with zeros to ``words`` (a buffer is read only as far as its header counts)."""
    if words <= len(buffer):
        return buffer
    padded = np.zeros(words, buffer.dtype)
    padded[: len(buffer)] = buffer
    return padded


def bucket_for(config: ServingConfig, words: int) -> int:
    buckets = payload_buckets(config)
    return buckets[bisect.bisect_left(buckets, words)]


def update_columns(config: ServingConfig, updates: StepUpdates, num_blocks_before: np.ndarray) -> UpdateColumns:
    """A checked ``updates`` as `UpdateColumns`; ``num_blocks_before`` places the appended blocks."""
    lay, blocks = payload_layout(config), np.array(num_blocks_before, np.int64)
    finish = np.asarray(updates.finish.rows, np.int64).reshape(-1)
    blocks[finish] = 0
    changed = len(finish)
    entries = updates.add.entries
    add, add_data, add_data_len = empty_records(len(lay.add_fields)), NO_ENTRIES, NO_ENTRIES
    if entries:
        add = (_add_records(entries, lay) if len(entries) > 1 else np.array([_add_record(entries[0], lay)])).T
        add_data, add_data_len = _entry_data([_row_data(e.token_ids, e.block_ids, e) for e in entries])
        for entry in entries:
            blocks[entry.row] = [len(b) for b in entry.block_ids]
        changed += len(entries) * (len(lay.add_fields) - 1 - lay.num_tables) + len(add_data)
    resume, resume_data, resume_data_len = _resume_columns(updates.resume.entries, lay, blocks)
    changed += len(updates.resume.entries) + len(resume_data)
    append = updates.append
    segments = np.stack([TABLE + append.tables, append.rows, _append_columns(blocks, append.rows, append.tables,
                                                                              append.lengths), append.lengths])
    changed += len(append.block_ids)
    lora = None if updates.lora_slots is None else updates.lora_slots.astype(np.int32)
    changed += 0 if lora is None else lay.max_loras
    return UpdateColumns(finish=finish, add=add, add_data=add_data, add_data_len=add_data_len, resume=resume,
                         resume_data=resume_data, resume_data_len=resume_data_len, segments=segments.astype(np.int64),
                         segment_data=np.asarray(append.block_ids, np.int64), lora=lora, schedule=updates.schedule,
                         decode_steps=int(np.asarray(updates.decode_steps).ravel()[0]), changed_words=changed)


def _resume_columns(entries, lay: Layout, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The resume records [fields, R], their data and its length per entry; ``blocks`` updated for replaced tables."""
    if not entries:
        return empty_records(len(RESUME_FIELDS) + lay.num_tables), NO_ENTRIES, NO_ENTRIES
    records, data = [], []
    for entry in entries:
        replace = entry.block_ids is not None
        # -1: the device keeps its own count (drafts still being verified, `ResumeEntry.unverified_drafts`)
        computed = -1 if entry.unverified_drafts else entry.num_computed_tokens
        record = [entry.row, computed, -1 if entry.token_ids is None else len(entry.token_ids),
                  -1 if entry.prefill_len is None else entry.prefill_len, int(replace)]
        record += [len(b) for b in entry.block_ids] if replace else [0] * lay.num_tables
        records.append(record)
        data.append(_row_data(entry.token_ids, entry.block_ids if replace else (), None))
        if replace:
            blocks[entry.row] = [len(b) for b in entry.block_ids]
    return (np.array(records, np.int64).T, *_entry_data(data))


def _entry_data(runs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Each entry's data (one array per entry) as one array and each entry's length."""
    lengths = np.fromiter(map(len, runs), np.int64, len(runs))
    return (np.concatenate(runs) if lengths.any() else NO_ENTRIES), lengths


def _append_columns(blocks: np.ndarray, rows: np.ndarray, tables: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The first column of each appended segment (the table's blocks so far), advancing ``blocks``.

    ```
    # blocks[2, 0] = 3, segments (row 2: 2 blocks), (row 2: 1 block) -> columns [3, 5], blocks[2, 0] = 6
    ```
    """
    keys = rows * blocks.shape[1] + tables
    if len(keys) > 1 and len(np.unique(keys)) < len(keys):  # a (row, table) twice: in payload order
        columns = np.empty_like(rows)
        for i, (row, table, length) in enumerate(zip(rows, tables, lengths)):
            columns[i] = blocks[row, table]
            blocks[row, table] += length
        return columns
    columns = blocks[rows, tables]
    blocks[rows, tables] = columns + lengths
    return columns


def _add_record(entry, lay: Layout) -> list[int]:
    sampling = entry.sampling or {}
    floats = {name: int(np.float32(sampling.get(name, 0.0)).view(np.int32)) for name in
              ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")}
    seeds = sampling.get("seeds", (0, 0))
    lengths = {f"blocks_{t}": len(ids) for t, ids in enumerate(entry.block_ids)}
    lengths.update(mrope_len=0 if entry.mrope_positions is None else entry.mrope_positions.shape[1],
                   is_token_len=0 if entry.is_token_ids is None else len(entry.is_token_ids))
    values = dict(lengths, row=entry.row, num_tokens=len(entry.token_ids), stop_len=entry.stop_len,
                  num_computed_tokens=entry.num_computed_tokens, prefill_len=entry.prefill_len, lora_id=entry.lora_id,
                  mrope_position_delta=entry.mrope_position_delta, prompt_embeds_start=entry.prompt_embeds_start,
                  top_k=int(sampling.get("top_k", 0)), seed_high=int(seeds[0]), seed_low=int(seeds[1]),
                  seeds_set=int(bool(sampling.get("seeds_set", False))), prompt_len=int(sampling.get("prompt_len", 0)),
                  **floats)
    return [int(values[name]) for name in lay.add_fields]


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def _add_records(entries, lay: Layout) -> np.ndarray:
    """`_add_record` of every entry at once: [entries, add_fields] int64, each field one column (the
    float parameters as float32 bit patterns, one conversion per field).

    ```
    # entries (row 2, 3 tokens, 1 block), (row 0, 1 token, 2 blocks), fields (row, num_tokens, ..., blocks_0)
    #   -> [[2, 3, ..., 1], [0, 1, ..., 2]]
    ```
    """
    n = len(entries)
    sampling = [entry.sampling or {} for entry in entries]
    columns = dict(row=[e.row for e in entries], num_tokens=[len(e.token_ids) for e in entries],
                   stop_len=[e.stop_len for e in entries], num_computed_tokens=[e.num_computed_tokens for e in entries],
                   prefill_len=[e.prefill_len for e in entries])
    for name in lay.add_fields:
        if name in columns:
            continue
        if name in _FLOAT_FIELDS:
            columns[name] = np.array([s.get(name, 0.0) for s in sampling], np.float32).view(np.int32)
        elif name.startswith("blocks_"):
            t = int(name[len("blocks_"):])
            columns[name] = [len(e.block_ids[t]) for e in entries]
        elif name in ("seed_high", "seed_low"):
            columns[name] = [int(s.get("seeds", (0, 0))[0 if name == "seed_high" else 1]) for s in sampling]
        elif name == "seeds_set":
            columns[name] = [int(bool(s.get("seeds_set", False))) for s in sampling]
        elif name in ("top_k", "prompt_len"):
            columns[name] = [int(s.get(name, 0)) for s in sampling]
        elif name == "mrope_len":
            columns[name] = [0 if e.mrope_positions is None else e.mrope_positions.shape[1] for e in entries]
        elif name == "is_token_len":
            columns[name] = [0 if e.is_token_ids is None else len(e.is_token_ids) for e in entries]
        else:  # lora_id, mrope_position_delta, prompt_embeds_start
            columns[name] = [getattr(e, name) for e in entries]
    return np.stack([np.asarray(columns[name], np.int64).reshape(n) for name in lay.add_fields], axis=1)


def _row_data(tokens, tables, entry) -> list[int]:
    """The data runs of one added or resumed row, in `add_runs` order (the lengths are in its record)."""
    runs = [] if tokens is None else [tokens]
    if entry is not None and entry.mrope_positions is not None:
        runs += list(entry.mrope_positions)
    if entry is not None and entry.is_token_ids is not None:
        runs.append(entry.is_token_ids.astype(np.int64))
    runs += list(tables)
    return np.concatenate([np.asarray(r, np.int64).ravel() for r in runs]) if runs else np.zeros(0, np.int64)


_last_section = (None, None, None)  # (schedule, layout, its `_schedule_record`) of the last read-only schedule


def _schedule_section(schedule: Schedule, lay: Layout):
    """`_schedule_record` of ``schedule``; kept for the next call where its arrays are read-only and their own (a
    schedule no one changes: `vllm_columns` gives a decode step of the same requests the last step's again)."""
    global _last_section
    held, held_lay, section = _last_section
    if held is schedule and held_lay is lay:
        return section
    section = _schedule_record(schedule, lay)
    if all(array is None or not array.flags.writeable and array.base is None
           for array in (schedule.num_scheduled_tokens, schedule.num_draft_tokens, schedule.draft_token_ids,
                         schedule.grammar_index)):
        _last_section = (schedule, lay, section)
    return section


def _schedule_record(schedule, lay: Layout):
    """(dense, rows, columns [fields, n]), its words and its changed entries: the rows with work or a
    grammar, as a dense prefix or sparse rows, whichever is shorter.

    ```
    # scheduled [2, 0, 1, 0, 0, 0, 0, 3], no drafts: live rows [0, 2, 7]; dense 8 words > sparse 6 -> rows [0, 2, 7],
    #   columns [[2, 1, 3]]
    ```
    """
    scheduled, grammar = schedule.num_scheduled_tokens, schedule.grammar_index
    # a checked schedule gives grammar rows to scheduled rows only (`checks.schedule_fits`): read where packed
    live = ((scheduled > 0) | (grammar != NO_GRAMMAR) if lay.grammar else scheduled > 0).nonzero()[0]
    columns = [scheduled]
    if lay.num_drafts:
        columns += [schedule.num_draft_tokens, *np.asarray(schedule.draft_token_ids).T]
    if lay.grammar:
        columns.append(grammar)
    width, count = len(columns), len(live)
    dense = count == 0 or (int(live[-1]) + 1) * width <= count * (width + 1)
    n = 0 if count == 0 else (int(live[-1]) + 1 if dense else count)
    picked = slice(n) if dense else live
    table = scheduled[None, picked] if width == 1 else np.array([column[picked] for column in columns], np.int64)
    drafts = int(schedule.num_draft_tokens[live].sum()) if lay.num_drafts else 0
    return (dense, None if dense else live, table), n * (width + (0 if dense else 1)), count + drafts


def _encode(buckets: tuple[int, ...], columns: UpdateColumns, section, decode_steps: int) -> np.ndarray:
    """One buffer: the header, then each section at its offset (the module's layout), zeros to its rung.
    ``section``: the schedule's (`_schedule_record`), or None (the header says the counts are kept)."""
    dense, rows, table = section[0] if section is not None else (True, None, None)
    n_schedule = 0 if table is None or not table.size else table.shape[1]
    data = (columns.add_data, columns.resume_data, columns.segment_data)
    header = (decode_steps, len(columns.finish), columns.add.shape[1], columns.resume.shape[1],
              columns.segments.shape[1], n_schedule, int(dense), int(columns.lora is not None), sum(map(len, data)),
              int(section is not None))
    sections = [columns.finish, columns.add.ravel(), columns.resume.ravel(), columns.segments.ravel()]
    if n_schedule:
        sections += [table.ravel()] if dense else [rows, table.ravel()]
    if columns.lora is not None:
        sections.append(columns.lora)
    return write_buffer(buckets, header, [*sections, *data])


def write_buffer(buckets: tuple[int, ...], header, sections) -> np.ndarray:
    """``header`` (`HEADER`'s values) and ``sections`` (flat integer arrays, in buffer order) in one int32
    buffer of the rung of ``buckets`` (`payload_buckets`) that holds them, zero past the last section.

    ```
    # header (1, 0, ..., 3, 1), sections [[], [1, 1, 1], [5, 6, 7]] -> [1, 0, ..., 3, 1, 1, 1, 1, 5, 6, 7, 0, ...]
    ```
    """
    words = HEADER_WORDS + sum(map(len, sections))
    buffer = np.zeros(buckets[bisect.bisect_left(buckets, words)], np.int32)
    buffer[:HEADER_WORDS] = header
    at = HEADER_WORDS
    for section in sections:
        if len(section):
            buffer[at: at + len(section)] = section
            at += len(section)
    return buffer


# --- device side -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SectionSizes:
    """The static entries `unpack_updates` reads of each section of a buffer of ``words`` words: no
    more than the words after the header can hold, since every entry takes at least one word per
    field (a dense schedule entry has no row field, an appended segment at least one block id), and
    no more than max_num_reqs rows. `_encode` writes exactly ``HEADER_WORDS`` + the words of its
    sections and `bucket_for` never picks a rung below that, so a packed buffer's counts never
    exceed the sizes of its rung; a header that claims more sets `DeviceUpdates.bad_counts`.

    ```
    # max_num_reqs 256, 6 add fields, words 64: body 54 -> finish 54, add 9, schedule 54, segments 10
    ```
    """

    finish: int
    add: int
    resume: int
    segments: int
    schedule: int
    data: int


@functools.lru_cache(maxsize=256)
def section_sizes(config: ServingConfig, words: int, steady: bool = False) -> SectionSizes:
    """``steady``: the finish, add and resume sections are read at size 0 (`unpack_updates`)."""
    lay, rows, body = payload_layout(config), config.max_num_reqs, max(words - HEADER_WORDS, 0)

    def fit(entry_words: int, cap: int = rows) -> int:  # at least 1 where a section is read at all
        return max(min(cap, body // entry_words), 1)

    moving = dict(finish=0, add=0, resume=0) if steady else dict(
        finish=fit(1), add=fit(len(lay.add_fields)), resume=fit(len(resume_fields(config))))
    return SectionSizes(**moving, segments=fit(len(SEGMENT_FIELDS) + 1, body),
                        schedule=fit(len(lay.schedule_fields) - 1), data=fit(1, body))



@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceUpdates:
    """A buffer read back inside the jit, every section at its static size (`section_sizes` of the
    buffer's length); rows past a section's count read as -1 (nothing)."""

    decode_steps: jax.Array  # [] int32
    finish_rows: jax.Array  # [sizes.finish]
    add: dict  # name -> [sizes.add] (add_fields)
    resume: dict  # name -> [sizes.resume] (RESUME_FIELDS)
    data_kind: jax.Array  # [sizes.data] segment kind of each data word; -1 past n_data
    data_row: jax.Array  # [sizes.data]
    data_col: jax.Array  # [sizes.data]
    data_value: jax.Array  # [sizes.data]
    append_rows: jax.Array  # [sizes.segments] row of each appended (explicit) segment; -1 past the count
    segment_end: dict  # kind, row, end column of each segment [sizes.add * runs + sizes.resume * runs + sizes.segments]
    schedule: dict  # num_scheduled_tokens, num_draft_tokens, grammar_index [R]; per entry: entry_rows [sizes.schedule]
    #                 (R past the count), draft_token_ids [sizes.schedule, K]
    has_lora_slots: jax.Array  # []
    lora_slots: jax.Array  # [max_loras]
    has_schedule: jax.Array  # [] 0: the schedule section is absent, the counts are kept
    bad_counts: jax.Array  # [] bool: the header claims more than the buffer holds, a flag outside {0, 1}, or the
    #                         data length disagrees with its runs (`update_bounds`)
    value_faults: jax.Array  # [n] bool: values outside their bounds (`update_bounds`), one entry per record or word;
    #                           any of them, or of the state's faults, refuses the buffer (`apply_updates_body`)
    entry_scheduled: jax.Array  # [sizes.schedule] each schedule entry's num_scheduled_tokens (0 past the count)


def unpack_updates(blob: jax.Array, config: ServingConfig, steady: bool = False) -> DeviceUpdates:
    """The `DeviceUpdates` of a packed buffer (traced; every read is a clamped gather, all sections in one), with
    its two verdicts: ``bad_counts`` (the header and the layout) and ``value_faults`` (`update_bounds`). Raises
    `InvalidUpdateError` at trace time (on the host, before anything runs) for a buffer that is not
    1-D int32 with at least the header's words.

    ``steady``: a program for the common decode step (`is_steady`): the finish, add and resume sections are read
    at size 0, so nothing of theirs is traced (their records, data runs, faults and writes: about a third of the
    update's kernels); a buffer that has any of them is refused whole, its counts past their sizes
    (``packed_counts``), as any buffer whose header claims more than its sizes."""
    lay = payload_layout(config)
    blob = _checked_blob(blob)
    sizes = section_sizes(config, blob.shape[0], steady)
    head = dict(zip(HEADER, blob[:HEADER_WORDS]))
    tables, valid = _read_sections(blob, head, lay, resume_fields(config), sizes)
    finish = tables["finish"]["row"]
    add, resume, explicit = tables["add"], tables["resume"], tables["segments"]
    schedule, entries = _schedule_rows(head, tables["schedule"], valid["schedule"], lay, config.max_num_reqs)
    lora_slots = tables["lora"]["slot"][: lay.max_loras]
    segments = _all_segments(config, add, resume, explicit, blob.shape[0])
    kind, row, col, data_disagrees = _data_places(head["n_data"], segments, sizes.data, blob.shape[0])
    value = tables["data"]["value"]
    ends = dict(kind=segments["kind"], row=segments["row"], end=segments["col"] + segments["len"])
    bad_counts = _bad_counts(head, config, sizes, blob.shape[0]) | update_bounds.verdict(
        [*update_bounds.flag_faults(head), data_disagrees])
    value_faults = jnp.concatenate([jnp.reshape(fault, (-1,)) for fault in (
        *update_bounds.record_faults(config, valid, finish, add, resume, explicit),
        *update_bounds.data_faults(config, kind, row, col, value),
        *update_bounds.schedule_faults(config, entries, head["schedule_dense"] == 0),
        *update_bounds.lora_faults(lora_slots, head["has_lora_slots"] == 1))])
    return DeviceUpdates(decode_steps=head["decode_steps"], finish_rows=finish, add=add, resume=resume, data_kind=kind,
                         data_row=row, data_col=col, data_value=value, append_rows=explicit["row"],
                         segment_end=ends, schedule=schedule,
                         has_lora_slots=head["has_lora_slots"], lora_slots=lora_slots,
                         has_schedule=head["has_schedule"], bad_counts=bad_counts, value_faults=value_faults,
                         entry_scheduled=entries["num_scheduled_tokens"])


def _read_sections(blob, head: dict, lay: Layout, resume_names: tuple[str, ...], sizes: SectionSizes):
    """Every section's table by field, read by ONE gather: ``{section: {field: [size]}}`` (entries past the
    section's count read -1; the schedule's entries as stored, its row field absent when dense), and each
    section's ``valid`` mask. Field f of entry i of a section of n entries starting at word s is word
    ``s + f * n + i``; the sections follow each other in `HEADER` order, the data last.

    ```
    # n_finish 2, n_add 1 with 3 fields: finish words [10, 11], add field f at word 12 + f
    ```
    """
    dense = head["schedule_dense"]
    stored = len(lay.schedule_fields) - dense  # a dense schedule has no row field
    plan = [("finish", head["n_finish"], ("row",), sizes.finish, 1),
            ("add", head["n_add"], lay.add_fields, sizes.add, len(lay.add_fields)),
            ("resume", head["n_resume"], resume_names, sizes.resume, len(resume_names)),
            ("segments", head["n_segments"], SEGMENT_FIELDS, sizes.segments, len(SEGMENT_FIELDS)),
            ("schedule", head["n_schedule"], lay.schedule_fields, sizes.schedule, stored),
            ("lora", head["has_lora_slots"], ("slot",), max(lay.max_loras, 1), lay.max_loras),
            ("data", head["n_data"], ("value",), sizes.data, 1)]
    start, indices, valid = jnp.int32(HEADER_WORDS), [], {}
    for name, count, fields, size, words_per_entry in plan:
        entry = jnp.arange(size, dtype=jnp.int32)
        field = jnp.arange(len(fields), dtype=jnp.int32)[:, None]
        if name == "schedule":  # dense: field f is stored f - 1 (no row field); the row field reads the entry
            field = field - dense
        if name == "lora":  # one record of max_loras words when present
            valid[name] = jnp.broadcast_to(count == 1, (size,))
            indices.append((start + entry)[None, :])
            start = start + count * words_per_entry
            continue
        valid[name] = entry < count
        indices.append(start + field * count + entry[None, :])
        start = start + words_per_entry * count
    words = _read(blob, jnp.concatenate([i.reshape(-1) for i in indices]))
    tables, offset = {}, 0
    for (name, _, fields, _, _), index in zip(plan, indices):
        block = words[offset: offset + index.size].reshape(index.shape)
        offset += index.size
        block = jnp.where(valid[name][None, :], block, -1) if name not in ("lora", "data") else block
        tables[name] = {field: block[f] for f, field in enumerate(fields if name != "lora" else ("slot",))}
    return tables, valid


def _schedule_rows(head: dict, table: dict, valid: jax.Array, lay: Layout, rows: int) -> tuple[dict, dict]:
    """Every row's counts [rows] from the schedule's entries (rows not listed: 0; one scatter), and each
    entry's state row and drafts [size] (drafts are written per entry, not per row); and the entries as
    read, for `update_bounds.schedule_faults` (``valid``, ``row``, each field)."""
    index = jnp.arange(valid.shape[0], dtype=jnp.int32)
    given = jnp.where(head["schedule_dense"] == 1, index, table["row"])
    row = jnp.where(valid & (given >= 0) & (given < rows), given, rows)  # the sentinel: a -1 would wrap in a scatter

    def column(name):
        return jnp.where(valid, table[name], 0)

    entries = dict(valid=valid, row=given, num_scheduled_tokens=column("num_scheduled_tokens"))
    k = lay.num_drafts
    per_row = {"num_scheduled_tokens": 0}
    if k:
        entries.update(num_draft_tokens=column("num_draft_tokens"),
                       draft_token_ids=jnp.stack([column(f"draft_{i}") for i in range(k)], axis=1))
        per_row["num_draft_tokens"] = 0
    if lay.grammar:
        entries["grammar_index"] = jnp.where(valid, table["grammar_index"], NO_GRAMMAR)
        per_row["grammar_index"] = NO_GRAMMAR
    fills = jnp.array(list(per_row.values()), jnp.int32)
    scattered = jnp.broadcast_to(fills, (rows, len(per_row))).at[row].set(
        jnp.stack([entries[name] for name in per_row], axis=1), mode="drop")
    out = {name: scattered[:, i] for i, name in enumerate(per_row)}
    out.setdefault("num_draft_tokens", jnp.zeros((rows,), jnp.int32))
    out["entry_rows"] = row
    out["draft_token_ids"] = entries["draft_token_ids"] if k else jnp.zeros((valid.shape[0], 0), jnp.int32)
    return out, entries


REFUSED_FLAG = 2
"""What `widen_packed` writes into ``has_schedule`` of a buffer its own length refuses: a flag outside {0, 1}
(`update_bounds.flag_faults`), refused at any length, and read by nothing else while unpacking."""


@functools.partial(jax.jit, static_argnames=("config",))
def widen_packed(buffer: jax.Array, *, config: ServingConfig) -> jax.Array:
    """``buffer`` [words] (or one per DP rank, [ranks, words]) zero-padded on the device to the top rung of
    `payload_buckets`, so that ONE `transitions.apply_packed` executable applies a buffer of any rung: the host
    still sends the rung's words (the bytes grow with the change), and a rung below the top costs only this copy.

    The padded buffer is read as the original is at its own length: every word past the original reads 0 as
    `_read` fills it there, and the header is unchanged, so the sections, the data and every value verdict are
    the same. What the top rung's larger sizes would let through, counts the original's length cannot hold
    (`_bad_counts` at that length), is refused all the same: ``has_schedule`` becomes `REFUSED_FLAG`, which
    sets the same ``packed_counts`` bit, and nothing else reads it while unpacking.

    ```
    # rungs (64, 96, 144), buffer [64] -> [144]: words 0..63 as sent, 64..143 zero
    ```
    """
    words = payload_buckets(config)[-1]
    if buffer.ndim == 2:
        return jax.vmap(lambda blob: _widened(blob, config, words))(buffer)
    return _widened(buffer, config, words)


def _widened(blob: jax.Array, config: ServingConfig, words: int) -> jax.Array:
    blob = _checked_blob(blob)
    length = blob.shape[0]
    head = dict(zip(HEADER, blob[:HEADER_WORDS]))
    bad = _bad_counts(head, config, section_sizes(config, length), length)
    flag = HEADER.index("has_schedule")
    wide = jnp.pad(blob, (0, max(words - length, 0)))
    return wide.at[flag].set(jnp.where(bad, REFUSED_FLAG, blob[flag]))


def _checked_blob(blob) -> jax.Array:
    """The buffer as given, if it can be one: 1-D int32 of at least `HEADER_WORDS` words (static facts,
    checked while tracing); an empty or float buffer is refused by name, never indexed or truncated."""
    shape, dtype = jnp.shape(blob), jnp.result_type(blob)
    if len(shape) != 1 or shape[0] < HEADER_WORDS or dtype != jnp.int32:
        raise InvalidUpdateError(f"packed update buffer has shape {tuple(shape)} and dtype {dtype}: it must be 1-D "
                                 f"int32 with at least the {HEADER_WORDS} header words (pack_step's buffers are)")
    return jnp.asarray(blob)


def refused(updates: DeviceUpdates, bad: jax.Array) -> DeviceUpdates:
    """``updates`` with nothing to write when ``bad``: every section's rows and data kinds -1 (past
    the count, so every write goes to the drop sentinel), no schedule and no LoRA slots, one step.
    Costs a select per section entry, never one over a state table."""
    def drop(rows):
        return jnp.where(bad, -1, rows)

    schedule = dict(updates.schedule, entry_rows=jnp.where(bad, updates.schedule["num_scheduled_tokens"].shape[0],
                                                           updates.schedule["entry_rows"]))
    return dataclasses.replace(
        updates, decode_steps=jnp.where(bad, 1, updates.decode_steps), finish_rows=drop(updates.finish_rows),
        add=dict(updates.add, row=drop(updates.add["row"])),
        resume=dict(updates.resume, row=drop(updates.resume["row"])), append_rows=drop(updates.append_rows),
        data_kind=drop(updates.data_kind),
        segment_end=dict(updates.segment_end, kind=drop(updates.segment_end["kind"])), schedule=schedule,
        has_lora_slots=jnp.where(bad, 0, updates.has_lora_slots), has_schedule=jnp.where(bad, 0, updates.has_schedule))


def _bad_counts(head: dict, config: ServingConfig, sizes: SectionSizes, words: int) -> jax.Array:
    """Whether a header count is negative, over its static size, or the counts need more than
    ``words`` words (a buffer `pack_step` did not write: `SectionSizes`).

    ```
    # 6 add fields, words 64: n_add 9 -> 10 + 54 words, fine; n_add 10 -> over sizes.add 9
    ```
    """
    lay = payload_layout(config)
    counts = jnp.stack([head[name] for name in ("n_finish", "n_add", "n_resume", "n_segments", "n_schedule", "n_data")])
    size = jnp.array([sizes.finish, sizes.add, sizes.resume, sizes.segments, sizes.schedule, sizes.data], jnp.int32)
    entry_words = jnp.array([1, len(lay.add_fields), len(resume_fields(config)), len(SEGMENT_FIELDS),
                             len(lay.schedule_fields), 1], jnp.int32)
    clipped = jnp.clip(counts, 0, size)  # no int32 overflow below
    needed = (HEADER_WORDS + jnp.sum(clipped * entry_words) + jnp.clip(head["has_lora_slots"], 0, 1) * lay.max_loras
              - clipped[4] * jnp.clip(head["schedule_dense"], 0, 1))  # a dense schedule entry has no row field
    return jnp.any((counts < 0) | (counts > size)) | (needed > words)


def _all_segments(config: ServingConfig, add: dict, resume: dict, explicit: dict, words: int) -> dict:
    """The runs of the data in data order: each added row's (`add_runs`), each resumed row's
    (`resume_runs`), then the explicit (appended) segments; a padded entry's runs have length 0, and
    every length is clipped to [0, ``words``] (no sum overflows; a longer claim is a value fault).

    ```
    # add rows [2, -1], num_tokens [3, -1], blocks_0 [1, -1] -> runs (TOKENS, 2, 0, 3), (TABLE, 2, 0, 1),
    #   (TOKENS, -1, 0, 0), (TABLE, -1, 0, 0), then the resume runs and the explicit segments
    ```
    """
    parts = []
    for entries, runs in ((add, add_runs(config)), (resume, resume_runs(config))):
        rows = entries["row"]
        kinds = jnp.broadcast_to(jnp.array([k for k, _ in runs], jnp.int32)[None, :], (rows.shape[0], len(runs)))
        lengths = jnp.stack([jnp.clip(entries[name], 0, words) for _, name in runs], axis=1)
        parts.append(dict(kind=kinds.reshape(-1), row=jnp.repeat(rows, len(runs)), col=jnp.zeros(kinds.size, jnp.int32),
                          len=jnp.where(jnp.repeat(rows, len(runs)) >= 0, lengths.reshape(-1), 0)))
    parts.append(dict(explicit, len=jnp.clip(explicit["len"], 0, words)))
    return {name: jnp.concatenate([part[name] for part in parts]) for name in SEGMENT_FIELDS}


def _read(blob: jax.Array, index: jax.Array) -> jax.Array:
    return jnp.take(blob, index, mode="fill", fill_value=0)


def _data_places(n_data, segments, length: int, words: int):
    """Per data word j < ``length``: its segment's kind and row, and its column ``col + j - segment start``;
    and whether the runs disagree with ``n_data`` (their total differs, or passes the buffer's ``words``: each
    run is clipped to the buffer's words, so the running total passes it before it could overflow int32).

    ```
    # segments len [3, 1], cols [0, 4] -> words 0..3 in segments [0, 0, 0, 1], columns [0, 1, 2, 4]
    ```
    """
    lengths = segments["len"]  # clipped to [0, words] by `_all_segments`
    ends = jnp.cumsum(lengths)
    j = jnp.arange(length, dtype=jnp.int32)
    seg = _segment_of_word(ends, lengths, length)
    valid = (j < n_data) & (j < ends[-1])
    first = ends[seg] - lengths[seg]
    kind = jnp.where(valid, segments["kind"][seg], -1)
    disagree = jnp.any(ends > words, keepdims=True) | (ends[-1:] != n_data)
    return kind, segments["row"][seg], segments["col"][seg] + j - first, disagree


def _segment_of_word(ends: jax.Array, lengths: jax.Array, length: int) -> jax.Array:
    """Per word j < ``length``: the segment holding it, ``#{s: ends[s] <= j}`` (the last segment past the
    data), without a search loop: each non-empty segment marks its first word with its index, and a running
    maximum carries the mark over the segment's words (the segments are contiguous, so the marks rise).

    ```
    # lengths [2, 0, 1] (ends [2, 2, 3]) -> marks [0, _, 2, _] -> words 0..3 in segments [0, 0, 2, 2]
    ```
    """
    count = lengths.shape[0]
    first = jnp.where(lengths > 0, ends - lengths, length)  # an empty segment marks nothing
    marks = jnp.zeros((length,), jnp.int32).at[first].max(jnp.arange(count, dtype=jnp.int32), mode="drop")
    return jnp.clip(jax.lax.cummax(marks), 0, count - 1)


def pack_updates(updates: StepUpdates, config: ServingConfig,
                 num_blocks_before: np.ndarray | None = None) -> np.ndarray:
    """``updates`` as one buffer (`pack_step` without a split); ``num_blocks_before`` defaults to
    empty rows (right when the update appends to no row it did not add)."""
    if num_blocks_before is None:
        num_blocks_before = np.zeros((config.max_num_reqs, payload_layout(config).num_tables), np.int64)
    packed = pack_step(config, updates, num_blocks_before)
    if packed.before:
        raise ValueError(f"the update needs {len(packed.buffers)} buffers; use pack_step")
    return packed.step
