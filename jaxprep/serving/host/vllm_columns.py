"""vLLM's common step read in one pass straight into `UpdateColumns`, the sections of the buffer it becomes.

The common step (issue 37): requests finish or are preempted, new ones join, running ones decode or continue a
chunked prefill and get new blocks; none resumes (V1's ``resumed_req_ids``), none has drafts or a grammar row,
every running request's computed count is the one the host mirror holds, and the configuration has no feature
that adds a value per request (LoRA, sampling parameters, M-RoPE, prompt embeddings, a Mamba table:
`column_checks.covers`). Such a step is read without a `StepUpdates`: each of vLLM's lists is converted once
(by NumPy, or by C-level iteration: no Python call per running request), into the add records, the data runs,
the appended segments and the dense schedule. `jaxprep.serving.host.column_checks` then bounds them at once.

A step of any other shape, or a value that is not what vLLM's scheduler sends (a count of 1.5, an unknown
request, a flat ``block_ids``), gives None and nothing changed: `VllmAdapter` then reads the step the general
way (`vllm_checks`, one `StepUpdates`), which serves the other shapes and names what is wrong. What this
reader checks is only what it must to read the lists (types, lengths, the request map); the bounds of the
values are `column_checks`'.

```
# finished {"c"}, new "d" (3 tokens, blocks ([9],)), running "a", "b" (decode, "b" new blocks ([4],)):
#   finish [row of c]; add [[row d], [3], [max_model_len], [0], [3], [1]] data [t0, t1, t2, 9];
#   segments [[TABLE], [row b], [b's blocks so far], [1]] data [4]; schedule {row a: 1, row b: 1, row d: 3}
```
"""

from __future__ import annotations

from itertools import chain, compress
from typing import NamedTuple

import numpy as np

from jaxprep._constants import NO_LORA_ID
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.host.checks import HostRows
from jaxprep.serving.host.column_checks import PLAIN_ADD_FIELDS, plain_arrays
from jaxprep.serving.host.vllm_requests import Admission, RequestMap
from jaxprep.serving.state import Schedule, draft_width, num_kv_groups
from jaxprep.serving.update_packing import (
    NO_ENTRIES,
    RESUME_FIELDS,
    SEGMENT_FIELDS,
    TABLE,
    UpdateColumns,
    empty_records,
)


class CommonStep(NamedTuple):
    """A common step read: its update's columns and the request map it leaves (a tuple: one per step)."""

    columns: UpdateColumns
    requests: RequestMap
    scheduled_rows: np.ndarray  # [len(num_scheduled_tokens)] the rows of the scheduled requests, in its order
    total: int  # total_num_scheduled_tokens


class ColumnReader:
    """Reads vLLM's common steps into `UpdateColumns` for one configuration (`read`)."""

    def __init__(self, config: ServingConfig):
        self.max_num_reqs, self.max_model_len, self.groups = config.max_num_reqs, config.max_model_len, \
            num_kv_groups(config)
        self.drafts = draft_width(config) > 0  # only then can a row wait for its drafts' outcome
        self.none_added = (empty_records(len(PLAIN_ADD_FIELDS) + self.groups), NO_ENTRIES, NO_ENTRIES)  # `_added`'s
        self.no_resumes = empty_records(len(RESUME_FIELDS) + self.groups)
        self.no_segments = empty_records(len(SEGMENT_FIELDS))
        self.tables = np.arange(self.groups, dtype=np.int64)  # the table of each group's segment
        self.plain = plain_arrays(config)  # a schedule's drafts, draft ids and grammar rows: none (`plain_schedule`)
        self._running = (None, None, None)  # (request map, req_ids, rows) of the last decode step read
        self._scheduled = (None, NO_ENTRIES, None)  # (rows, counts, Schedule) of the last step read
        self._held_counts = (None, None)  # (values, (counts, total)) of the last num_scheduled_tokens read (`_counts`)

    def read(self, scheduler_output, requests: RequestMap, mirror: HostRows) -> CommonStep | None:
        """``scheduler_output`` as `UpdateColumns`, on ``requests`` (changed only on its copies); None, with
        nothing changed, for a step that is not of the common shape or not of vLLM's types."""
        so = scheduler_output
        cached, scheduled, spec = so.scheduled_cached_reqs, so.num_scheduled_tokens, so.scheduled_spec_decode_tokens
        if type(scheduled) is not dict or type(spec) is not dict or spec or cached.resumed_req_ids:
            return None
        req_ids, total, news = cached.req_ids, so.total_num_scheduled_tokens, so.scheduled_new_reqs
        counts, computed = self._counts(list(scheduled.values())), _int64(cached.num_computed_tokens)
        if counts is None or computed is None or not len(computed) == len(cached.new_block_ids) == len(req_ids) \
                or len(news) + len(req_ids) != len(scheduled) or type(total) is not int or total != counts[1]:
            return None
        counts = counts[0]
        finish = _finished(requests, so) if so.finished_req_ids or so.preempted_req_ids else []
        add = self._added(requests, news) if news else self.none_added
        running = None if add is None else self._running_rows(requests.rows, req_ids, computed, mirror)
        segments = None if running is None else self._appended(cached.new_block_ids, running, mirror.table_blocks)
        if segments is None:
            return None
        rows = running if not add[0].shape[1] and list(scheduled) == req_ids else _rows_of(requests.rows, scheduled)
        if rows is None:
            return None
        records, data, data_len = add
        changed = len(finish) + records.shape[1] * (len(PLAIN_ADD_FIELDS) - 1) + len(data) + len(segments[1])
        columns = UpdateColumns(finish=np.array(finish, np.int64) if finish else NO_ENTRIES, add=records,
                                add_data=data, add_data_len=data_len, resume=self.no_resumes, resume_data=NO_ENTRIES,
                                resume_data_len=NO_ENTRIES, segments=segments[0], segment_data=segments[1], lora=None,
                                schedule=self._schedule(rows, counts), decode_steps=1, changed_words=changed)
        return CommonStep(columns=columns, requests=requests, scheduled_rows=rows, total=total)

    def _counts(self, values: list) -> tuple[np.ndarray, int] | None:
        """``num_scheduled_tokens``' values as int64 [n] (read-only) and their total; None for values NumPy does not
        read as int64 (`_int64`) or a count below 1 (vLLM schedules none of those). The last step's again where
        the values are its values, all Python ints (a decode step of the same requests: no NumPy call)."""
        held, answer = self._held_counts
        if values == held and set(map(type, values)) == {int}:  # equal and ints (1.0 == 1 and True == 1: types too)
            return answer
        counts = _int64(values)
        if counts is None or np.count_nonzero(counts < 1):
            return None
        counts.flags.writeable = False
        answer = (counts, int(np.add.reduce(counts)))
        self._held_counts = (values, answer)
        return answer

    def _added(self, requests: RequestMap, news: list):
        """New requests admitted in the lowest free rows: their records [fields, A] (`PLAIN_ADD_FIELDS`, the
        block counts of each group), each one's tokens then blocks as one data array, and each one's data
        length (``news`` not empty); None for a request not of vLLM's types, an id that holds a row, or no free
        row."""
        if len(news) > len(requests.free):
            return None
        records, runs, groups = [], [], self.groups
        for new in news:
            req_id, tokens, prompt = new.req_id, new.prefill_token_ids, new.prompt_token_ids
            tokens = prompt if tokens is None else tokens
            computed, block_ids = new.num_computed_tokens, new.block_ids
            if (type(tokens) is not list or type(computed) is not int or type(block_ids) is not tuple
                    or len(block_ids) != groups or not all(type(ids) is list for ids in block_ids)
                    or not _hashable(req_id) or req_id in requests.rows):
                return None
            lora = new.lora_request
            requests.admit(req_id, Admission(len(tokens if prompt is None else prompt),
                                             NO_LORA_ID if lora is None else lora.lora_int_id, None))
            row = requests.take_row(req_id, self.max_num_reqs)
            records.append((row, len(tokens), self.max_model_len, computed, len(tokens), *map(len, block_ids)))
            runs.append(tokens)
            runs += block_ids
        data = np.array(list(chain.from_iterable(runs)))
        records = np.array(records, np.int64).T
        if data.dtype != np.int64 or data.ndim != 1:
            return None
        return records, data, records[1] + records[len(PLAIN_ADD_FIELDS):].sum(axis=0)

    def _running_rows(self, row_of: dict, req_ids: list, computed: np.ndarray, mirror: HostRows):
        """The running requests' rows; None if one holds none, or if the mirror's computed count of one differs
        from vLLM's or waits for its drafts' outcome (the general path restates those rows). The rows of the
        last decode step are kept: the next one, with the same request map and requests, reuses them."""
        last_map, last_ids, last_rows = self._running
        if row_of is last_map and req_ids == last_ids:
            rows = last_rows
        else:
            try:
                rows = np.fromiter(map(row_of.__getitem__, req_ids), np.int64, len(req_ids))
            except (KeyError, TypeError):
                return None
            rows.flags.writeable = False  # kept for the next step: read only
            self._running = (row_of, list(req_ids), rows)
        differ = mirror.num_computed_tokens[rows] != computed
        if self.drafts:  # without drafts no row is ever pending (a row's drafts are what makes it so)
            differ |= mirror.pending_drafts[rows] >= 0
        return None if np.count_nonzero(differ) else rows

    def _appended(self, new_block_ids: list, rows: np.ndarray, table_blocks: np.ndarray):
        """``CachedRequestData.new_block_ids`` (None, or one list per group, per running request) as segments
        [4, S] (kind, row, col, len; empty lists dropped) placed after each row's blocks, and their ids; None
        for an entry not of vLLM's types.

        ```
        # rows [3, 5], new_block_ids [None, ([7, 8],)], row 5 holds 2 blocks
        #   -> segments [[TABLE], [5], [2], [2]], ids [7, 8]
        ```
        """
        nones = new_block_ids.count(None)
        if nones == len(new_block_ids):
            return self.no_segments, NO_ENTRIES
        index = list(compress(range(len(new_block_ids)), new_block_ids))  # the entries given (a tuple is truthy)
        entries = list(map(new_block_ids.__getitem__, index))
        lists = list(chain.from_iterable(entries))
        if (len(index) + nones != len(new_block_ids)  # an entry neither None nor truthy (an empty tuple)
                or set(map(type, entries)) != {tuple} or set(map(len, entries)) != {self.groups}
                or set(map(type, lists)) != {list}):
            return None
        lengths = list(map(len, lists))
        ids = np.array(list(chain.from_iterable(lists)))
        if ids.dtype != np.int64 or ids.ndim != 1:
            return None if len(ids) else (self.no_segments, NO_ENTRIES)
        return self._segments(rows.take(index), lengths, table_blocks), ids

    def _segments(self, entry_rows: np.ndarray, lengths: list[int], table_blocks: np.ndarray) -> np.ndarray:
        """The segments [4, S] of the appended lists (``lengths``: one per group, per row of ``entry_rows``),
        each after its row's blocks in its table; empty lists dropped."""
        groups = self.groups
        seg_rows = entry_rows if groups == 1 else np.repeat(entry_rows, groups)
        tables = 0 if groups == 1 else np.tile(self.tables, len(entry_rows))
        if 0 in lengths:  # an empty list (a group without new blocks) appends nothing
            kept = np.array(lengths) > 0
            seg_rows, lengths = seg_rows[kept], np.array(lengths)[kept]
            tables = tables if groups == 1 else tables[kept]
        segments = np.empty((len(SEGMENT_FIELDS), len(seg_rows)), np.int64)
        segments[0], segments[1], segments[2], segments[3] = TABLE + tables, seg_rows, \
            table_blocks[:, 0][seg_rows] if groups == 1 else table_blocks[seg_rows, tables], lengths
        return segments

    def _schedule(self, rows: np.ndarray, counts: np.ndarray) -> Schedule:
        """The dense schedule: ``counts`` at ``rows``, no drafts, no grammar rows, its arrays read-only. The last
        step's again where its rows (the same array, `_running_rows`') and counts are this one's: a decode step
        of the same requests (packing keeps a read-only schedule's section, `update_packing.pack_columns`)."""
        last_rows, last_counts, last = self._scheduled
        if rows is last_rows and (counts is last_counts or not np.count_nonzero(counts != last_counts)):
            return last
        scheduled = np.zeros(self.max_num_reqs, np.int64)
        scheduled[rows] = counts
        scheduled.flags.writeable = False
        drafts, draft_ids, grammar = self.plain
        schedule = Schedule(num_scheduled_tokens=scheduled, num_draft_tokens=drafts, draft_token_ids=draft_ids,
                            grammar_index=grammar)
        self._scheduled = (rows, counts, schedule)
        return schedule


def _int64(values) -> np.ndarray | None:
    """``values`` (a list of Python ints) as int64 [n]; None for anything else (1.5, True alone, 2**70)."""
    array = np.array(values) if len(values) else NO_ENTRIES
    return array if array.dtype == np.int64 and array.ndim == 1 else None


def _finished(requests: RequestMap, so) -> list[int]:
    """The rows of finished and preempted requests, freed in the map, in `VllmAdapter`'s order (finished as
    given, then preempted sorted); finished requests forgotten."""
    rows = []
    for req_id in so.finished_req_ids:
        requests.forget(req_id)
        if req_id in requests.rows:
            rows.append(requests.release(req_id))
    preempted = so.preempted_req_ids
    if preempted:
        rows += [requests.release(req_id) for req_id in sorted(set(preempted)) if req_id in requests.rows]
    return rows


def _hashable(req_id) -> bool:
    try:
        hash(req_id)
    except TypeError:
        return False
    return True


def _rows_of(row_of: dict, scheduled: dict) -> np.ndarray | None:
    try:
        return np.fromiter(map(row_of.__getitem__, scheduled), np.int64, len(scheduled))
    except KeyError:
        return None
