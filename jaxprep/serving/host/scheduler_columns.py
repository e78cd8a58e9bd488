"""The host scheduler's output read straight into `UpdateColumns`, the sections of the buffer it becomes.

`Scheduler.schedule` already holds a step as the buffer wants it: the freed rows, each new request's row, tokens,
stop and blocks, the blocks appended per row, the dense counts of the schedule (and its drafts). `scheduler_columns`
lays them out as the add records, the data runs, the appended segments and the schedule, without the
`StepUpdates` between (`engine.scheduler_updates`, the general way, builds one from the same output: the
`Engine` takes it where the configuration has feature values per request, and to name a bound a step breaks);
`jaxprep.serving.host.column_checks` then checks them at once.

```
# finished_rows [3]; new row 0 tokens [5, 6, 7] stop 20 blocks [9]; new_block_ids {2: [4]} (row 2 holds 1 block);
#   scheduled [3, 0, 1, 0] -> finish [3]; add [[0], [3], [20], [0], [3], [1]] data [5, 6, 7, 9];
#   segments [[TABLE], [2], [1], [1]] data [4]; schedule [3, 0, 1, 0]
```
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from jaxprep.serving.config import ServingConfig
from jaxprep.serving.host.column_checks import PLAIN_ADD_FIELDS, plain_schedule
from jaxprep.serving.host.scheduler import SchedulerOutput
from jaxprep.serving.state import Schedule, draft_width
from jaxprep.serving.update_packing import (
    NO_ENTRIES,
    RESUME_FIELDS,
    SEGMENT_FIELDS,
    TABLE,
    UpdateColumns,
    empty_records,
)


def scheduler_columns(config: ServingConfig, out: SchedulerOutput, table_blocks: np.ndarray) -> UpdateColumns | None:
    """``out`` as `UpdateColumns` for a configuration `column_checks.covers` (one KV-cache table, no feature
    values per request); ``table_blocks`` [max_num_reqs, 1]: each row's blocks before the step (the mirror's),
    where the appended blocks go. None when ``out`` holds what the columns do not (a draft width other than the
    configuration's): build the `StepUpdates` then."""
    rows, width = config.max_num_reqs, draft_width(config)
    if table_blocks.shape[1] != 1 or out.draft_token_ids is None or out.draft_token_ids.shape != (rows, width) \
            or out.num_scheduled_tokens.dtype != np.int64 or out.num_draft_tokens.dtype != np.int64:
        return None
    added, appends = _added(config, out.new_requests), _appended(out.new_block_ids, table_blocks, out.new_requests)
    if added is None or appends is None:
        return None
    (records, data, data_len), (segments, appended) = added, appends
    finish = np.array(out.finished_rows, np.int64) if out.finished_rows else NO_ENTRIES
    changed = len(finish) + records.shape[1] * (len(PLAIN_ADD_FIELDS) - 1) + len(data) + len(appended)
    return UpdateColumns(finish=finish, add=records, add_data=data, add_data_len=data_len,
                         resume=empty_records(len(RESUME_FIELDS) + 1), resume_data=NO_ENTRIES,
                         resume_data_len=NO_ENTRIES, segments=segments, segment_data=appended, lora=None,
                         schedule=_schedule(config, out), decode_steps=out.decode_steps, changed_words=changed)


def _added(config: ServingConfig, requests: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The new requests' records [fields, A] (row, num_tokens, stop_len, num_computed_tokens 0, prefill_len =
    num_tokens, blocks), each one's tokens then blocks as one data array, and each one's data length; None for
    values that are not integers."""
    if not requests:
        return empty_records(len(PLAIN_ADD_FIELDS) + 1), NO_ENTRIES, NO_ENTRIES
    tokens = [request["token_ids"] for request in requests]
    blocks = [request["block_ids"] for request in requests]
    num_tokens = list(map(len, tokens))
    records = np.array([[request["row"] for request in requests], num_tokens,
                        [request.get("stop_len", config.max_model_len) for request in requests], [0] * len(requests),
                        num_tokens, list(map(len, blocks))], np.int64)
    data = np.array(list(chain.from_iterable(chain.from_iterable(zip(tokens, blocks)))))
    if data.dtype != np.int64 or data.ndim != 1:
        return None
    return records, data, records[1] + records[5]


def _appended(new_block_ids: dict[int, list[int]], table_blocks: np.ndarray,
              added: list[dict]) -> tuple[np.ndarray, np.ndarray] | None:
    """The blocks appended per row as segments [4, S] (kind, row, col, len) after each row's blocks (those of
    ``table_blocks``, or of its add in this step: multi-step decode grows a request the step admits), and their
    ids; None for an empty list or values that are not integers."""
    if not new_block_ids:
        return empty_records(len(SEGMENT_FIELDS)), NO_ENTRIES
    rows = np.fromiter(new_block_ids, np.int64, len(new_block_ids))
    lists = list(new_block_ids.values())
    lengths = list(map(len, lists))
    ids = np.array(list(chain.from_iterable(lists)))
    if 0 in lengths or ids.dtype != np.int64 or ids.ndim != 1:
        return None
    columns = table_blocks[rows, 0]
    if added:
        held = {request["row"]: len(request["block_ids"]) for request in added}
        columns = np.array([held.get(row, column) for row, column in zip(rows.tolist(), columns.tolist())], np.int64)
    segments = np.empty((len(SEGMENT_FIELDS), len(rows)), np.int64)
    segments[0], segments[1], segments[2], segments[3] = TABLE, rows, columns, lengths
    return segments, ids


def _schedule(config: ServingConfig, out: SchedulerOutput) -> Schedule:
    """The scheduler's dense counts (and drafts, where a row has some) as the `Schedule`."""
    plain = plain_schedule(config, out.num_scheduled_tokens)
    if not out.num_draft_tokens.any():
        return plain
    return Schedule(num_scheduled_tokens=out.num_scheduled_tokens, num_draft_tokens=out.num_draft_tokens,
                    draft_token_ids=out.draft_token_ids, grammar_index=plain.grammar_index)
