"""The combined check of a step's update as `UpdateColumns` (what the buffer will hold) against the host mirror.

The columns' structure is the caller's own bookkeeping (`jaxprep.serving.host.vllm_columns` builds it from the
adapter's request map and the mirror): the finished and appended rows hold requests, the added rows are free,
each appended segment starts at its row's current column, each row appears once per section. What came from
outside (vLLM's counts, token ids and block ids) is bounded here, each value once, in a few element-wise
compares and one reduction per section: the added records, every data word against its kind's bounds, the
appended block counts against their tables' widths, then the schedule (`checks.schedule_fits`, the bounds the
general path checks). The result is the mirror after the update, or None: the caller then checks the update
the general way (`checks.check_updates`), which names the first bound it breaks. None is also the answer for
what this check does not cover (resumed rows, LoRA slots, add records with a feature's fields, a Mamba table):
the columns of vLLM's common steps have none of them.

The bounds are `checks`' (tests/serving/test_vllm_columns.py holds the two paths to the same verdicts and mirrors):

- add: 1 <= num_tokens <= stop_len <= max_model_len; 0 <= num_computed_tokens < num_tokens, covered by each
  table's blocks; 0 <= prefill_len <= num_tokens; each table's block count within its width;
- append: each table's blocks after the append within its width;
- data: token ids in [0, token_id_bound), block ids in their table's [low, high];
- schedule: `checks.schedule_fits`; of a `plain_schedule` (the common steps'), the bounds it can break: each
  count within the budget, every row's sequence within its tokens and blocks (`checks.sequence_faults`, as
  each row's longest sequence).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxprep._constants import NO_GRAMMAR
from jaxprep.serving.config import ServingConfig, last_config
from jaxprep.serving.host.checks import HostRows, group_block_sizes, schedule_fits
from jaxprep.serving.state import Schedule, block_bounds, draft_width, num_kv_groups, table_names, table_widths
from jaxprep.serving.update_packing import TABLE, TOKENS, UpdateColumns, payload_layout

PLAIN_ADD_FIELDS = ("row", "num_tokens", "stop_len", "num_computed_tokens", "prefill_len")
"""The add record's fields without a feature's: those this check reads (then ``blocks_t`` per table)."""


@dataclasses.dataclass(frozen=True)
class _Bounds:
    """A configuration's bounds as arrays, per table and per data kind."""

    covered: bool  # the configuration's add records are the plain ones and every table is a KV group's
    widths: np.ndarray  # [T]
    block_sizes: np.ndarray  # [T, 1]
    run_kinds: np.ndarray  # [1 + T] the data runs of an added row: TOKENS, then TABLE + t
    low: np.ndarray  # [TABLE + T] lowest value of each data kind (TOKENS: 0; TABLE + t: the table's lowest id)
    high: np.ndarray  # [TABLE + T] highest value
    plain: tuple[np.ndarray, np.ndarray, np.ndarray]  # a `plain_schedule`'s drafts, draft ids, grammar rows
    max_model_len: int
    budget: int  # max_num_batched_tokens


@last_config
@functools.lru_cache(maxsize=64)
def _bounds(config: ServingConfig) -> _Bounds:
    lay, tables = payload_layout(config), len(table_names(config))
    covered = (lay.add_fields == PLAIN_ADD_FIELDS + tuple(f"blocks_{t}" for t in range(tables))
               and tables == num_kv_groups(config))
    low, high = np.zeros(TABLE + tables, np.int64), np.full(TABLE + tables, -1, np.int64)
    low[TOKENS], high[TOKENS] = 0, config.token_id_bound - 1
    for t in range(tables):
        low[TABLE + t], high[TABLE + t] = block_bounds(config, t)
    sizes = np.array(group_block_sizes(config)[:tables], np.int64)[:, None]
    rows = config.max_num_reqs
    plain = (np.zeros(rows, np.int64), np.zeros((rows, draft_width(config)), np.int64), np.full(rows, NO_GRAMMAR))
    for array in plain:
        array.flags.writeable = False
    return _Bounds(covered=covered, widths=np.array(table_widths(config), np.int64), block_sizes=sizes,
                   run_kinds=np.array([TOKENS] + [TABLE + t for t in range(tables)], np.int64), low=low, high=high,
                   plain=plain, max_model_len=config.max_model_len, budget=config.prep.max_num_batched_tokens)


def plain_schedule(config: ServingConfig, num_scheduled_tokens: np.ndarray) -> Schedule:
    """A schedule of ``num_scheduled_tokens`` (dense, each >= 0) without drafts or grammar rows (their arrays
    shared and read-only, `plain_arrays`): `check_columns` knows it as such and checks only the bounds it can
    break."""
    drafts, draft_ids, grammar = plain_arrays(config)
    return Schedule(num_scheduled_tokens=num_scheduled_tokens, num_draft_tokens=drafts, draft_token_ids=draft_ids,
                    grammar_index=grammar)


def plain_arrays(config: ServingConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A `plain_schedule`'s draft counts, draft ids and grammar rows (a caller building one per step keeps them)."""
    return _bounds(config).plain


def covers(config: ServingConfig) -> bool:
    """Whether `check_columns` can check an update of ``config``: its add records hold no feature's values and
    every table is a KV-cache group's (no Mamba table)."""
    return _bounds(config).covered


def check_columns(rows: HostRows, columns: UpdateColumns, config: ServingConfig) -> HostRows | None:
    """The mirror after ``columns`` if every bound holds (a new `HostRows`: the arrays the update changes are
    new, the others shared with ``rows``, which is left as it was); None if one breaks, or if the columns hold
    what this check does not cover (the caller then checks the update the general way, naming the bound)."""
    bounds = _bounds(config)
    if not bounds.covered or columns.resume.shape[1] or columns.lora is not None:
        return None
    add, schedule = columns.add, columns.schedule
    if add.shape[1] and not _records_fit(add, bounds, config) or not _data_fits(columns, bounds):
        return None
    joins = len(columns.finish) or add.shape[1]
    if joins:
        rows = rows.copy()
        if len(columns.finish):
            rows.clear(columns.finish)
        if add.shape[1]:
            _write_added(rows, add)
    table_blocks = _appended_blocks(rows.table_blocks, columns.segments, bounds, copy=not joins)
    if table_blocks is None:
        return None
    if not joins:  # a decode step: only the block counts and the schedule change (the other arrays are shared)
        rows = _sharing(rows, table_blocks)
    if schedule is not None:
        plain = schedule.num_draft_tokens is bounds.plain[0] and schedule.grammar_index is bounds.plain[2]
        if not (_plain_schedule_fits(rows, schedule.num_scheduled_tokens, bounds) if plain
                else schedule_fits(rows, schedule, config)):
            return None
        rows.num_scheduled_tokens = schedule.num_scheduled_tokens.copy()
        rows.num_draft_tokens = schedule.num_draft_tokens.copy()
    return rows


def _appended_blocks(table_blocks: np.ndarray, segments: np.ndarray, bounds: _Bounds, copy: bool) -> np.ndarray | None:
    """The block counts [rows, T] after the appended ``segments`` [4, S] (each starts at its row's count: the
    caller's bookkeeping), in a copy of ``table_blocks`` where ``copy`` (else in it); ``table_blocks`` itself
    when nothing is appended; None if a table's blocks pass its width."""
    if not segments.shape[1]:
        return table_blocks
    end = segments[2] + segments[3]
    table = 0 if len(bounds.widths) == 1 else segments[0] - TABLE
    if np.count_nonzero(end > bounds.widths[table]):
        return None
    if copy:
        table_blocks = table_blocks.copy()
    table_blocks[segments[1], table] = end
    return table_blocks


def _sharing(rows: HostRows, table_blocks: np.ndarray) -> HostRows:
    """``rows`` with ``table_blocks`` in place of its own, every other array shared."""
    return HostRows(num_tokens=rows.num_tokens, stop_len=rows.stop_len, num_computed_tokens=rows.num_computed_tokens,
                    table_blocks=table_blocks, num_scheduled_tokens=rows.num_scheduled_tokens,
                    num_draft_tokens=rows.num_draft_tokens, pending_drafts=rows.pending_drafts, slack=rows.slack)


def _plain_schedule_fits(rows: HostRows, scheduled: np.ndarray, bounds: _Bounds) -> bool:
    """`checks.schedule_fits` of a `plain_schedule` (no drafts, no grammar rows, counts >= 0) on rows the
    caller's bookkeeping made busy and settled (running rows without pending drafts, or rows just added): each
    count within the budget and its row's room (`_longest_sequence` past the computed tokens; a row scheduling
    none always fits), then the total.

    ```
    # budget 8: computed [2, 4, 0], longest [5, 4, 5] -> room [3, 0, 5]; scheduled [3, 0, 6] -> row 2 breaks
    ```
    """
    room = np.maximum(_longest_sequence(rows, bounds) - rows.num_computed_tokens, 0)
    budget = bounds.budget
    return not np.count_nonzero(scheduled > np.minimum(room, budget)) and int(np.add.reduce(scheduled)) <= budget


def _longest_sequence(rows: HostRows, bounds: _Bounds) -> np.ndarray:
    """Per row, the longest sequence a step can reach: `checks.sequence_faults` of a schedule without drafts, as a
    limit. A sequence ``s`` of a row of ``n`` tokens stays within them (``s <= n``) and max_model_len ``L``
    (``s <= L``), keeps a column for the sampled token when it reaches the row's end at ``L`` (not
    ``s >= n >= L``), and stays within each group's blocks (``cdiv(s, B_g) <= blocks_g``, that is
    ``s <= blocks_g * B_g``): ``s <= min(n - (n >= L), L, blocks_g * B_g)``.

    ```
    # L 8, block size 4: n 5, 2 blocks -> 5; n 8, 3 blocks -> 7 (no column left at 8); n 8, 1 block -> 4
    ```
    """
    num_tokens, max_len, sizes = rows.num_tokens, bounds.max_model_len, bounds.block_sizes  # [T, 1]: a covered
    # configuration's tables are its KV-cache groups
    in_blocks = rows.table_blocks[:, 0] * sizes[0, 0] if len(sizes) == 1 else \
        np.minimum.reduce(rows.table_blocks * sizes.T, axis=1)
    return np.minimum(np.minimum(num_tokens - (num_tokens >= max_len), max_len), in_blocks)


def _records_fit(add: np.ndarray, bounds: _Bounds, config: ServingConfig) -> bool:
    """Added records [fields, A] (``row, num_tokens, stop_len, num_computed_tokens, prefill_len, blocks_t...``)
    within their bounds.

    ```
    # block size 4: num_tokens 9, computed 8, blocks [2] -> covered (8 tokens in 2 blocks); blocks [1] -> not
    ```
    """
    _, num_tokens, stop_len, computed, prefill = add[: len(PLAIN_ADD_FIELDS)]
    blocks = add[len(PLAIN_ADD_FIELDS):]  # [T, A]
    bad = ((num_tokens < 1) | (num_tokens > stop_len) | (stop_len > config.max_model_len) | (computed < 0)
           | (computed >= num_tokens) | (prefill < 0) | (prefill > num_tokens))
    bad = bad | ((blocks > bounds.widths[:, None]) | ((computed + bounds.block_sizes - 1) // bounds.block_sizes
                                                       > blocks)).any(axis=0)
    return not bad.any()


def _write_added(rows: HostRows, add: np.ndarray) -> None:
    row, num_tokens, stop_len, computed, _ = add[: len(PLAIN_ADD_FIELDS)]
    rows.table_blocks[row] = add[len(PLAIN_ADD_FIELDS):].T
    rows.num_tokens[row], rows.stop_len[row], rows.num_computed_tokens[row] = num_tokens, stop_len, computed
    rows.num_scheduled_tokens[row] = rows.num_draft_tokens[row] = rows.slack[row] = 0
    rows.pending_drafts[row] = -1


def _data_fits(columns: UpdateColumns, bounds: _Bounds) -> bool:
    """Every data word within its kind's bounds, in one compare: each added row's tokens and blocks (their
    lengths in its record), then the appended blocks.

    ```
    # added row: 3 tokens, 1 block; a segment of 2 -> kinds [TOKENS x 3, TABLE, TABLE x 2]
    ```
    """
    add, segments, appended = columns.add, columns.segments, columns.segment_data
    if not add.shape[1]:  # a decode step: appended blocks only
        if not len(appended):
            return True
        if len(bounds.widths) == 1:
            return not np.count_nonzero((appended < bounds.low[TABLE]) | (appended > bounds.high[TABLE]))
        kinds, values = np.repeat(segments[0], segments[3]), appended
    else:
        lengths = add[[1, *range(len(PLAIN_ADD_FIELDS), len(add))]]  # [1 + T, A]: num_tokens, blocks_t
        kinds = np.concatenate([np.repeat(np.tile(bounds.run_kinds, add.shape[1]), lengths.T.ravel()),
                                np.repeat(segments[0], segments[3])])
        values = np.concatenate([columns.add_data, appended])
    return len(kinds) == len(values) and bool(((values >= bounds.low[kinds]) & (values <= bounds.high[kinds])).all())
