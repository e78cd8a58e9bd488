"""Host-side checks of update payloads against a host mirror of the per-row counters.

`HostRows` mirrors the small [max_num_reqs] counters of a `ServingState` (vLLM's CPU
``num_computed_tokens_np``): checks read it, never the device, so no check waits on a step. Every
``check_*`` function works on a copy and returns it; the caller keeps the copy only if the whole
update passed, so a failed update leaves both the mirror and the device state as they were.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxprep._constants import NULL_BLOCK_ID, PAD_STATE_ROW
from jaxprep.config import cdiv
from jaxprep.serving._values import check_payload_leaves
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.sampling_rows import check_add_sampling
from jaxprep.serving.state import PAD_ROW, check_token_ids
from jaxprep.validate import InvalidBatchError


class InvalidUpdateError(InvalidBatchError):
    """A serving-state update breaks a bound; nothing was changed."""


@dataclasses.dataclass
class HostRows:
    """Host copies of the per-row counters (int64 [max_num_reqs] each)."""

    num_tokens: np.ndarray
    stop_len: np.ndarray
    num_computed_tokens: np.ndarray
    num_blocks: np.ndarray
    num_scheduled_tokens: np.ndarray
    num_draft_tokens: np.ndarray

    @classmethod
    def empty(cls, num_rows: int) -> HostRows:
        return cls(**{f.name: np.zeros(num_rows, np.int64) for f in dataclasses.fields(cls)})

    def copy(self) -> HostRows:
        return HostRows(**{f.name: getattr(self, f.name).copy() for f in dataclasses.fields(self)})

    @property
    def busy(self) -> np.ndarray:
        return self.num_tokens > 0


def _fail(message: str):
    raise InvalidUpdateError(message)


def _check_rows(name: str, rows: np.ndarray, num_rows: int, pad: int = PAD_ROW) -> np.ndarray:
    """The real rows of a payload; ``pad`` (-1) is padding, anything else must be a valid row."""
    rows = np.asarray(rows, np.int64)
    bad = (rows != pad) & ((rows < 0) | (rows >= num_rows))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        _fail(f"{name}[{i}] = {int(rows[i])} is outside the rows [0, max_num_reqs={num_rows}) (-1 pads)")
    real = rows[rows != pad]
    if len(np.unique(real)) != len(real):
        _fail(f"{name} names a row twice: {real.tolist()}")
    return real


def _check_block_ids(name: str, block_ids: np.ndarray, config: ServingConfig) -> None:
    bad = (block_ids <= NULL_BLOCK_ID) | (block_ids > config.prep.max_block_id)
    if bad.any():
        index = tuple(int(i[0]) for i in np.nonzero(bad))
        _fail(f"{name}{list(index)} = {int(block_ids[index])} is outside the allocatable block ids "
              f"[1, num_blocks - 1 = {config.prep.max_block_id}] (block 0 is the null block)")


def _finish(rows: HostRows, payload, config: ServingConfig) -> None:
    real = _check_rows("FinishRequests.rows", payload.rows, config.max_num_reqs)
    idle = real[~rows.busy[real]]
    if len(idle):
        _fail(f"FinishRequests.rows: row {int(idle[0])} holds no request")
    for field in dataclasses.fields(rows):
        getattr(rows, field.name)[real] = 0


def _add(rows: HostRows, payload, config: ServingConfig) -> None:
    """Rows free, 1 <= num_tokens <= stop_len <= max_model_len, token ids in [0, vocab_size),
    prefix-cache hits inside the tokens and their blocks, block counts within the row, block ids
    allocatable."""
    prep = config.prep
    entries = np.flatnonzero(np.asarray(payload.rows) != PAD_ROW)
    real = _check_rows("AddRequests.rows", payload.rows, config.max_num_reqs)
    busy = real[rows.busy[real]]
    if len(busy):
        _fail(f"AddRequests.rows: row {int(busy[0])} is busy; finish its request first")
    for i in entries:
        num_tokens, stop_len = int(payload.num_tokens[i]), int(payload.stop_len[i])
        computed, num_blocks = int(payload.num_computed_tokens[i]), int(payload.num_blocks[i])
        where = f"AddRequests entry {i} (row {int(payload.rows[i])})"
        if not 1 <= num_tokens <= stop_len <= prep.max_model_len:
            _fail(f"{where}: need 1 <= num_tokens={num_tokens} <= stop_len={stop_len} "
                  f"<= max_model_len={prep.max_model_len}")
        if not 0 <= num_blocks <= prep.max_blocks_per_req:
            _fail(f"{where}: num_blocks={num_blocks} is outside [0, max_blocks_per_req={prep.max_blocks_per_req}]")
        if not 0 <= computed < num_tokens or cdiv(computed, prep.block_size) > num_blocks:
            _fail(f"{where}: num_computed_tokens={computed} must lie in [0, num_tokens={num_tokens}) and fit "
                  f"its num_blocks={num_blocks} blocks of {prep.block_size}")
        _check_block_ids(f"AddRequests.block_ids[{i}]", np.asarray(payload.block_ids[i][:num_blocks]), config)
        check_token_ids(f"{where}: token_ids", np.asarray(payload.token_ids[i][:num_tokens]), config.token_id_bound,
                        InvalidUpdateError)
    if getattr(payload, "sampling", None) is not None:
        check_add_sampling(payload.sampling, entries, np.asarray(payload.num_tokens),
                           prep.features.sampling.vocab_size, _fail)
    rows.num_tokens[real] = payload.num_tokens[entries]
    rows.stop_len[real] = payload.stop_len[entries]
    rows.num_computed_tokens[real] = payload.num_computed_tokens[entries]
    rows.num_blocks[real] = payload.num_blocks[entries]
    rows.num_scheduled_tokens[real] = rows.num_draft_tokens[real] = 0


def _append(rows: HostRows, payload, config: ServingConfig) -> None:
    """Rows busy; a row's blocks after the append fit ``max_blocks_per_req`` columns."""
    targets = np.asarray(payload.rows, np.int64)
    bad = (targets != PAD_ROW) & ((targets < 0) | (targets >= config.max_num_reqs))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        _fail(f"AppendBlocks.rows[{i}] = {int(targets[i])} is outside the rows [0, max_num_reqs="
              f"{config.max_num_reqs}) (-1 pads)")
    real = targets != PAD_ROW
    idle = targets[real][~rows.busy[targets[real]]]
    if len(idle):
        _fail(f"AppendBlocks.rows: row {int(idle[0])} holds no request")
    _check_block_ids("AppendBlocks.block_ids", np.where(real, payload.block_ids, 1), config)
    np.add.at(rows.num_blocks, targets[real], 1)
    over = rows.num_blocks > config.max_blocks_per_req
    if over.any():
        row = int(np.flatnonzero(over)[0])
        _fail(f"AppendBlocks: row {row} would hold {int(rows.num_blocks[row])} blocks, more than "
              f"max_blocks_per_req={config.max_blocks_per_req}")


def _schedule(rows: HostRows, payload, config: ServingConfig) -> None:
    """Counts non-negative; only busy rows scheduled; total within the token budget; S >= D + 1 for
    rows with drafts; C + S within the known tokens (+ drafts), max_model_len and the allocated
    blocks; a row that samples has room for its new tokens below max_model_len."""
    prep = config.prep
    scheduled = np.asarray(payload.num_scheduled_tokens, np.int64)
    drafts = np.asarray(payload.num_draft_tokens, np.int64)
    _require(scheduled >= 0, "Schedule.num_scheduled_tokens", scheduled, "is negative")
    _require((drafts >= 0) & (drafts <= config.num_speculative_tokens), "Schedule.num_draft_tokens", drafts,
             f"is outside [0, num_speculative_tokens={config.num_speculative_tokens}]")
    _require((scheduled == 0) | rows.busy, "Schedule.num_scheduled_tokens", scheduled, "is set on a free row")
    _require((drafts == 0) | (scheduled >= drafts + 1), "Schedule.num_scheduled_tokens", scheduled,
             "is below num_draft_tokens + 1")
    if scheduled.sum() > prep.max_num_batched_tokens:
        _fail(f"Schedule: sum(num_scheduled_tokens)={int(scheduled.sum())} exceeds max_num_batched_tokens="
              f"{prep.max_num_batched_tokens}")
    seq_lens = rows.num_computed_tokens + scheduled
    active = scheduled > 0
    _require(~active | (seq_lens <= rows.num_tokens + drafts), "num_computed_tokens + num_scheduled_tokens",
             seq_lens, "passes the row's num_tokens + num_draft_tokens (tokens not known yet)")
    _require(~active | (seq_lens <= prep.max_model_len), "num_computed_tokens + num_scheduled_tokens", seq_lens,
             f"exceeds max_model_len={prep.max_model_len}")
    needed = -(-seq_lens // prep.block_size)
    _require(~active | (needed <= rows.num_blocks), "blocks needed by num_computed_tokens + num_scheduled_tokens",
             needed, "exceeds the row's allocated num_blocks: append its blocks first")
    samples = active & (seq_lens >= rows.num_tokens)
    new_len = rows.num_tokens + drafts + 1
    _require(~samples | (new_len <= prep.max_model_len), "num_tokens + num_draft_tokens + 1", new_len,
             f"exceeds max_model_len={prep.max_model_len}: the sampled token has no column")
    rows.num_scheduled_tokens[:] = scheduled
    rows.num_draft_tokens[:] = drafts


def _checked(*steps):
    """A check of a payload: runs ``steps`` on a copy of the mirror, returns the copy."""

    def check(rows: HostRows, payload, config: ServingConfig) -> HostRows:
        check_payload_leaves(payload, InvalidUpdateError)  # 2.7 tokens is an error, never truncated to 2
        rows = rows.copy()
        for step, part in steps:
            step(rows, payload if part is None else getattr(payload, part), config)
        return rows

    return check


check_finish = _checked((_finish, None))
check_add = _checked((_add, None))
check_append = _checked((_append, None))
check_schedule = _checked((_schedule, None))
check_updates = _checked((_finish, "finish"), (_add, "add"), (_append, "append"), (_schedule, "schedule"))


def check_step(rows: HostRows, decode_steps: int, num_tokens_padded: int, config: ServingConfig) -> None:
    """A serving step's extra bounds, on the mirror after its updates: the scheduled total fits the
    bucket; ``decode_steps`` lies in [1, config.decode_steps] and, above 1, every scheduled row
    decodes exactly its last token without drafts."""
    total = int(rows.num_scheduled_tokens.sum())
    if total > num_tokens_padded:
        _fail(f"sum(num_scheduled_tokens)={total} exceeds num_tokens_padded={num_tokens_padded}")
    if not 1 <= decode_steps <= config.decode_steps:
        _fail(f"StepUpdates.decode_steps={decode_steps} is outside [1, config.decode_steps={config.decode_steps}]")
    scheduled = rows.num_scheduled_tokens
    decoding = (scheduled == 1) & (rows.num_computed_tokens + 1 == rows.num_tokens) & (rows.num_draft_tokens == 0)
    if decode_steps > 1 and ((scheduled > 0) & ~decoding).any():
        row = int(np.flatnonzero((scheduled > 0) & ~decoding)[0])
        _fail(f"StepUpdates.decode_steps={decode_steps} needs every scheduled row to decode its last token, "
              f"but row {row} schedules {int(scheduled[row])} tokens at num_computed_tokens="
              f"{int(rows.num_computed_tokens[row])} of num_tokens={int(rows.num_tokens[row])}")


def check_record(rows: HostRows, idx_mapping, sampled_token_ids, num_sampled, config: ServingConfig) -> HostRows:
    """Batch rows map to scheduled rows; 0 <= num_sampled <= D + 1 and fits below max_model_len."""
    real = _check_rows("record_sampled.idx_mapping", idx_mapping, config.max_num_reqs, pad=PAD_STATE_ROW)
    entries = np.flatnonzero(np.asarray(idx_mapping) != PAD_STATE_ROW)
    unscheduled = real[rows.num_scheduled_tokens[real] == 0]
    if len(unscheduled):
        _fail(f"record_sampled.idx_mapping: row {int(unscheduled[0])} was not scheduled")
    sampled = np.asarray(num_sampled, np.int64)[entries]
    width = np.asarray(sampled_token_ids).shape[1]
    computed, scheduled = rows.num_computed_tokens[real], rows.num_scheduled_tokens[real]
    num_tokens, drafts = rows.num_tokens[real], rows.num_draft_tokens[real]
    discarded = computed + scheduled < num_tokens
    sampled = np.where(discarded, 0, sampled)
    bad = (sampled < 0) | (sampled > np.minimum(drafts + 1, width))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        _fail(f"record_sampled.num_sampled for row {int(real[i])} is {int(sampled[i])}, outside "
              f"[0, num_draft_tokens + 1 = {int(drafts[i]) + 1}] (and the sampled width {width})")
    new_len = num_tokens + sampled
    if (new_len > config.max_model_len).any():
        i = int(np.flatnonzero(new_len > config.max_model_len)[0])
        _fail(f"record_sampled: row {int(real[i])} would hold {int(new_len[i])} tokens, more than "
              f"max_model_len={config.max_model_len}")
    rows = rows.copy()
    rows.num_computed_tokens[real] += np.where(discarded, scheduled, scheduled - (drafts + 1 - sampled))
    rows.num_tokens[real] = new_len
    rows.num_scheduled_tokens[real] = rows.num_draft_tokens[real] = 0
    return rows


def _require(ok: np.ndarray, name: str, values: np.ndarray, problem: str) -> None:
    if not np.all(ok):
        row = int(np.flatnonzero(~ok)[0])
        _fail(f"{name} at row {row} is {int(values[row])}, which {problem}")
