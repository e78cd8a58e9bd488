"""Host-side checks of update payloads against a host mirror of the per-row counters.

`HostRows` mirrors the small per-row counters of a `ServingState` (vLLM's CPU
``num_computed_tokens_np``): checks read it, never the device, so no check waits on a step. Every
``check_*`` function works on a copy and returns it; the caller keeps the copy only if the whole
update passed, so a failed update leaves both the mirror and the device state as they were.

A row whose step verified drafts is *pending* after a read-free `record_sampled`: how many drafts
it kept is on the device only. The next update states its ``num_computed_tokens`` (a `resume`
entry) before the row is scheduled again. Under async scheduling that count may still count the
drafts of the row's last step as accepted (`ResumeEntry.unverified_drafts`): the mirror then holds
the high end of what the device may hold, and ``slack`` how far below it the device may be.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxprep._constants import EMPTY_LORA_SLOT, INT32_MAX, NO_GRAMMAR, PAD_STATE_ROW
from jaxprep.bounds import InvalidBatchError
from jaxprep.config import cdiv
from jaxprep.features.sampling import FLOAT_PARAMS, check_parameter_bounds
from jaxprep.serving._values import check_payload_leaves
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.state import (
    InvalidUpdateError,
    block_bounds,
    check_token_ids,
    draft_width,
    placeholders_allowed,
    table_names,
    table_widths,
    token_ids_fit,
)
from jaxprep.serving.transitions import computed_advance


@dataclasses.dataclass
class HostRows:
    """Host copies of the per-row counters (int64 [max_num_reqs] each; ``table_blocks`` per table)."""

    num_tokens: np.ndarray
    stop_len: np.ndarray
    num_computed_tokens: np.ndarray
    table_blocks: np.ndarray  # [max_num_reqs, tables] blocks of each table (`table_names`)
    num_scheduled_tokens: np.ndarray
    num_draft_tokens: np.ndarray
    pending_drafts: np.ndarray  # drafts whose fate the host has not learnt; -1: not pending
    slack: np.ndarray  # the device's counts may be this far below num_computed_tokens / num_tokens (unverified drafts)

    @classmethod
    def empty(cls, num_rows: int, num_tables: int = 1) -> HostRows:
        rows = {f.name: np.zeros(num_rows, np.int64) for f in dataclasses.fields(cls)}
        rows.update(table_blocks=np.zeros((num_rows, num_tables), np.int64),
                    pending_drafts=np.full(num_rows, -1, np.int64))
        return cls(**rows)

    @classmethod
    def for_config(cls, config: ServingConfig) -> HostRows:
        return cls.empty(config.max_num_reqs, len(table_names(config)))

    def copy(self) -> HostRows:
        return HostRows(*(getattr(self, name).copy() for name in _ROW_FIELDS))

    def clear(self, rows: np.ndarray) -> None:
        """Frees ``rows``: every counter 0, no drafts pending."""
        for name in _ROW_FIELDS:
            getattr(self, name)[rows] = -1 if name == "pending_drafts" else 0

    @property
    def busy(self) -> np.ndarray:
        return self.num_tokens > 0

    @property
    def num_blocks(self) -> np.ndarray:
        """[max_num_reqs] blocks of KV group 0 (a view of ``table_blocks``)."""
        return self.table_blocks[:, 0]

    @property
    def pending(self) -> np.ndarray:
        return self.pending_drafts >= 0


_ROW_FIELDS = tuple(field.name for field in dataclasses.fields(HostRows))


def _fail(message: str):
    raise InvalidUpdateError(message)


def _check_rows(name: str, rows, num_rows: int, pad: int | None = None) -> np.ndarray:
    """The rows of a payload, each a valid row named once (``pad`` entries skipped)."""
    rows = np.asarray(rows, np.int64).ravel()
    real = rows if pad is None else rows[rows != pad]
    bad = (real < 0) | (real >= num_rows)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        _fail(f"{name}[{i}] = {int(real[i])} is outside the rows [0, max_num_reqs={num_rows})")
    if len(np.unique(real)) != len(real):
        _fail(f"{name} names a row twice: {real.tolist()}")
    return real


def _check_tables(where: str, tables, config: ServingConfig, used=None) -> None:
    """Each table's block count fits its width, and its ids are allocatable in its group (the null
    block 0 allowed only in sliding-window groups and the Mamba table)."""
    names, widths = table_names(config), table_widths(config)
    for t, ids in enumerate(tables):
        count = len(ids) + (0 if used is None else int(used[t]))
        if count > widths[t]:
            _fail(f"{where}: {names[t]} would hold {count} blocks, more than its width {widths[t]}")
        low, high = block_bounds(config, t)
        bad = (ids < low) | (ids > high)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            _fail(f"{where}: {names[t]} block id [{i}] = {int(ids[i])} is outside [{low}, {high}] "
                  f"({'block 0 is the null block; ' if low else ''}num_blocks - 1 = {high})")


def group_block_sizes(config: ServingConfig) -> list[int]:
    groups = config.prep.features.kv_groups
    return [config.block_size] + [g.block_size for g in groups[1:]]


def _check_blocks_cover(where: str, rows: HostRows, row: int, tokens: int, config: ServingConfig, what: str) -> None:
    for g, size in enumerate(group_block_sizes(config)):
        if cdiv(tokens, size) > rows.table_blocks[row, g]:
            _fail(f"{where}: {what}={tokens} needs {cdiv(tokens, size)} blocks of {size} in "
                  f"{table_names(config)[g]}, the row holds {int(rows.table_blocks[row, g])}")


def _finish(rows: HostRows, payload, config: ServingConfig) -> None:
    if np.size(payload.rows) == 0:
        return
    real = _check_rows("FinishRequests.rows", payload.rows, config.max_num_reqs)
    idle = real[~rows.busy[real]]
    if len(idle):
        _fail(f"FinishRequests.rows: row {int(idle[0])} holds no request")
    rows.clear(real)


def _add(rows: HostRows, payload, config: ServingConfig) -> None:
    """Rows free; 1 <= num_tokens <= stop_len <= max_model_len; token ids in [0, vocab_size);
    prefix-cache hits inside the tokens and their blocks; each table's blocks within its width and
    its group's ids; feature values within their bounds."""
    if not payload.entries:
        return
    prep = config.prep
    real = _check_rows("AddRequests.rows", [e.row for e in payload.entries], config.max_num_reqs)
    busy = real[rows.busy[real]]
    if len(busy):
        _fail(f"AddRequests.rows: row {int(busy[0])} is busy; finish its request first")
    checked = _ids_checked(payload, config)
    if len(payload.entries) > 1 and _adds_fit(rows, payload.entries, real, config, checked):
        rows.num_scheduled_tokens[real] = rows.num_draft_tokens[real] = 0
        rows.pending_drafts[real] = -1
        return
    for i, entry in enumerate(payload.entries):
        where = f"AddRequests entry {i} (row {entry.row})"
        num_tokens, stop_len, computed = len(entry.token_ids), entry.stop_len, entry.num_computed_tokens
        if not 1 <= num_tokens <= stop_len <= prep.max_model_len:
            _fail(f"{where}: need 1 <= num_tokens={num_tokens} <= stop_len={stop_len} "
                  f"<= max_model_len={prep.max_model_len}")
        if not checked:
            check_token_ids(f"{where}: token_ids", entry.token_ids, config.token_id_bound, InvalidUpdateError)
        _check_tables(where, entry.block_ids, config)
        rows.table_blocks[entry.row] = [len(b) for b in entry.block_ids]
        if not 0 <= computed < num_tokens:
            _fail(f"{where}: num_computed_tokens={computed} must lie in [0, num_tokens={num_tokens})")
        _check_blocks_cover(where, rows, entry.row, computed, config, "num_computed_tokens")
        if not 0 <= entry.prefill_len <= num_tokens:
            _fail(f"{where}: prefill_len={entry.prefill_len} is outside [0, num_tokens={num_tokens}]")
        _check_features(where, entry, config)
        rows.num_tokens[entry.row], rows.stop_len[entry.row] = num_tokens, stop_len
        rows.num_computed_tokens[entry.row] = computed
    rows.num_scheduled_tokens[real] = rows.num_draft_tokens[real] = 0
    rows.pending_drafts[real] = -1


def _ids_checked(payload, config: ServingConfig) -> bool:
    """Whether ``payload``'s token ids were checked when it was built (`AddRequests.build`,
    `ResumeRequests.build`) against a bound no looser than ``config``'s: each id is checked once, where it
    enters; a payload built by hand, or for a looser vocabulary, is checked here."""
    return payload.token_id_bound is not None and payload.token_id_bound <= config.token_id_bound


def _adds_fit(rows: HostRows, entries: tuple, real: np.ndarray, config: ServingConfig, checked: bool = False) -> bool:
    """`_add`'s checks of every entry at once (the common entry: no M-RoPE or is_token_ids rows), and the
    rows written if all pass; False (nothing written) sends `_add` through the entries one by one, to
    name the first value that fails.

    ```
    # token ids of every entry concatenated, one bound check; each table's ids likewise; counts as arrays
    ```
    """
    try:  # a value of an odd type (a payload built by hand): the entries one by one name it
        return _adds_fit_values(rows, entries, real, config, checked)
    except (TypeError, ValueError):
        return False


def _adds_fit_values(rows: HostRows, entries: tuple, real: np.ndarray, config: ServingConfig,
                     checked: bool = False) -> bool:
    prep, features = config.prep, config.prep.features
    if any(e.mrope_positions is not None or e.is_token_ids is not None for e in entries):
        return False
    if any(np.ndim(e.token_ids) != 1 for e in entries):
        return False
    num_tokens = np.fromiter((len(e.token_ids) for e in entries), np.int64, len(entries))
    stop_len = np.fromiter((e.stop_len for e in entries), np.int64, len(entries))
    computed = np.fromiter((e.num_computed_tokens for e in entries), np.int64, len(entries))
    prefill = np.fromiter((e.prefill_len for e in entries), np.int64, len(entries))
    if not ((num_tokens >= 1) & (num_tokens <= stop_len) & (stop_len <= prep.max_model_len)).all():
        return False
    if not ((computed >= 0) & (computed < num_tokens) & (prefill >= 0) & (prefill <= num_tokens)).all():
        return False
    if not checked and not token_ids_fit(np.concatenate([e.token_ids for e in entries]), config.token_id_bound):
        return False
    names, widths = table_names(config), table_widths(config)
    counts = np.array([[len(ids) for ids in e.block_ids] for e in entries], np.int64).reshape(len(entries), -1)
    if counts.shape[1] != len(names) or (counts > np.asarray(widths, np.int64)).any():
        return False
    for t in range(len(names)):
        ids = np.concatenate([e.block_ids[t] for e in entries])
        low, high = block_bounds(config, t)
        if ids.dtype.kind not in "iu" or ids.size and (ids.min() < low or ids.max() > high):
            return False
    for g, size in enumerate(group_block_sizes(config)):
        if (-(-computed // size) > counts[:, g]).any():
            return False
    if (np.fromiter((e.lora_id for e in entries), np.int64, len(entries)) < 0).any():
        return False
    if (np.fromiter((e.prompt_embeds_start for e in entries), np.int64, len(entries)) < 0).any():
        return False
    sampled = [e.sampling for e in entries if e.sampling is not None]
    if sampled:
        values = {name: np.array([s[name] for s in sampled], np.float32) for name in FLOAT_PARAMS}
        values["top_k"] = np.array([s["top_k"] for s in sampled])
        prompt_len = np.array([s["prompt_len"] for s in sampled])
        within = np.array([len(e.token_ids) for e in entries if e.sampling is not None])
        try:
            check_parameter_bounds(values, features.sampling.vocab_size, "AddRequests.sampling")
        except InvalidBatchError:
            return False
        if prompt_len.dtype.kind not in "iu" or ((prompt_len < 0) | (prompt_len > within)).any():
            return False
    rows.table_blocks[real] = counts
    rows.num_tokens[real], rows.stop_len[real], rows.num_computed_tokens[real] = num_tokens, stop_len, computed
    return True


def _check_features(where: str, entry, config: ServingConfig) -> None:
    """LoRA id >= 0; M-RoPE and is_token_ids rows within the tokens; sampling parameters in vLLM's bounds."""
    features, num_tokens = config.prep.features, len(entry.token_ids)
    if entry.lora_id < 0:
        _fail(f"{where}: lora_id={entry.lora_id} must be >= 0 (0: no adapter)")
    for name, values in (("mrope_positions", entry.mrope_positions), ("is_token_ids", entry.is_token_ids)):
        if values is not None and values.shape[-1] > num_tokens:
            _fail(f"{where}: {name} has {values.shape[-1]} positions, more than num_tokens={num_tokens}")
    if entry.mrope_positions is not None and ((entry.mrope_positions < 0) | (entry.mrope_positions > INT32_MAX)).any():
        _fail(f"{where}: mrope_positions hold a value outside [0, 2**31)")
    if entry.prompt_embeds_start < 0:
        _fail(f"{where}: prompt_embeds_start={entry.prompt_embeds_start} must be >= 0")
    if entry.sampling is not None:
        values = {name: np.array([entry.sampling[name]], np.float32) for name in FLOAT_PARAMS}
        values["top_k"] = np.array([entry.sampling["top_k"]])
        try:
            check_parameter_bounds(values, features.sampling.vocab_size, f"{where}: AddRequests.sampling")
        except InvalidBatchError as error:
            _fail(str(error))
        if not 0 <= entry.sampling["prompt_len"] <= num_tokens:
            _fail(f"{where}: AddRequests.sampling.prompt_len={entry.sampling['prompt_len']} is outside "
                  f"[0, num_tokens={num_tokens}]")


def _resume(rows: HostRows, payload, config: ServingConfig) -> None:
    """Rows busy; stated tokens within stop_len and the vocabulary; a pending row's computed count
    among those its drafts allow; computed tokens inside the known tokens and the row's blocks."""
    if not payload.entries:
        return
    real = _check_rows("ResumeRequests.rows", [e.row for e in payload.entries], config.max_num_reqs)
    idle = real[~rows.busy[real]]
    if len(idle):
        _fail(f"ResumeRequests.rows: row {int(idle[0])} holds no request (add it instead)")
    for i, entry in enumerate(payload.entries):
        where, row, computed = f"ResumeRequests entry {i} (row {entry.row})", entry.row, entry.num_computed_tokens
        if entry.unverified_drafts and (entry.unverified_drafts < 0 or entry.token_ids is not None
                                        or not rows.pending[row]):
            _fail(f"{where}: unverified_drafts={entry.unverified_drafts} needs to be >= 0, a row whose drafts are "
                  "pending and no token_ids")
        if entry.token_ids is not None:
            num_tokens = len(entry.token_ids)
            if not 1 <= num_tokens <= rows.stop_len[row]:
                _fail(f"{where}: need 1 <= len(token_ids)={num_tokens} <= stop_len={int(rows.stop_len[row])}")
            if not _ids_checked(payload, config):
                check_token_ids(f"{where}: token_ids", entry.token_ids, config.token_id_bound, InvalidUpdateError)
        elif rows.pending[row]:
            low, extra, unverified = int(rows.num_computed_tokens[row]), int(rows.pending_drafts[row]), \
                entry.unverified_drafts
            # exact: low <= C <= low + extra; with U unverified drafts the device holds C - rejected, in [C - U, C]
            if not (low <= computed and computed - unverified <= low + extra):
                less = f" (less up to {unverified} unverified drafts)" if unverified else ""
                _fail(f"{where}: num_computed_tokens={computed}{less} is outside [{low}, {low + extra}], what the "
                      f"row's {extra} verified drafts allow")
            num_tokens = computed + 1
        else:
            num_tokens = int(rows.num_tokens[row])
        if not 0 <= computed <= num_tokens:
            _fail(f"{where}: num_computed_tokens={computed} is outside [0, num_tokens={num_tokens}]")
        if entry.block_ids is not None:
            _check_tables(where, entry.block_ids, config)
            rows.table_blocks[row] = [len(b) for b in entry.block_ids]
        _check_blocks_cover(where, rows, row, computed, config, "num_computed_tokens")
        if entry.prefill_len is not None and not 0 <= entry.prefill_len <= num_tokens:
            _fail(f"{where}: prefill_len={entry.prefill_len} is outside [0, num_tokens={num_tokens}]")
        if entry.unverified_drafts:  # the device holds computed - rejected: at least the pending range's low end
            rows.slack[row] = min(entry.unverified_drafts, computed - int(rows.num_computed_tokens[row]))
        else:
            rows.slack[row] = 0
        rows.num_tokens[row], rows.num_computed_tokens[row] = num_tokens, computed
        rows.num_scheduled_tokens[row] = rows.num_draft_tokens[row] = 0
        rows.pending_drafts[row] = -1


def _append(rows: HostRows, payload, config: ServingConfig) -> None:
    """Rows busy; a table's blocks after the append fit its width; ids allocatable in its group."""
    counts = _appends_fit(rows, payload, config)
    if counts is not None:
        rows.table_blocks = counts
        return
    num_tables = len(table_names(config))  # a segment breaks a bound: find the first, name it
    for row, table, ids in payload.segments:
        where = f"AppendBlocks row {row}"
        if not 0 <= row < config.max_num_reqs:
            _fail(f"{where}: the row is outside [0, max_num_reqs={config.max_num_reqs})")
        if not rows.busy[row]:
            _fail(f"AppendBlocks.rows: row {row} holds no request")
        if not 0 <= table < num_tables:
            _fail(f"{where}: table {table} is outside the row's tables [0, {num_tables})")
        tables = [np.zeros(0, np.int64)] * num_tables
        tables[table] = ids
        _check_tables(where, tables, config, used=rows.table_blocks[row])
        rows.table_blocks[row, table] += len(ids)


def _appends_fit(rows: HostRows, payload, config: ServingConfig) -> np.ndarray | None:
    """All of `_append`'s bounds at once (NumPy over every segment): rows in range and busy, each
    table's final block count within its width (counts only grow, so every prefix fits too), every id
    within its group's bounds. Returns the block counts after the append, or None: `_append` then walks
    the segments to name the first that breaks a bound."""
    seg_rows, seg_tables, lengths = payload.rows, payload.tables, payload.lengths
    if not len(seg_rows):
        return rows.table_blocks
    num_rows, num_tables = rows.table_blocks.shape
    if seg_rows.min() < 0 or seg_rows.max() >= num_rows or seg_tables.min() < 0 or seg_tables.max() >= num_tables \
            or not rows.busy[seg_rows].all() or lengths.min() < 1:
        return None
    widths, low, high = _table_bounds(config)
    if num_tables == 1:  # one table: a row's appended blocks add up by a bincount
        counts = rows.table_blocks + np.bincount(seg_rows, lengths, minlength=num_rows).astype(np.int64)[:, None]
        ids = payload.block_ids
        fits = counts.max() <= widths[0] and ids.min() >= low[0] and ids.max() <= high[0]
        return counts if fits else None
    counts = rows.table_blocks.copy()
    np.add.at(counts, (seg_rows, seg_tables), lengths)
    per_id = np.repeat(seg_tables, lengths)
    if (counts > widths).any() or ((payload.block_ids < low[per_id]) | (payload.block_ids > high[per_id])).any():
        return None
    return counts


@functools.lru_cache(maxsize=64)
def _table_bounds(config: ServingConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per table: its width, and the lowest and highest block id it takes (`block_bounds`)."""
    bounds = np.array([block_bounds(config, t) for t in range(len(table_names(config)))], np.int64)
    return np.array(table_widths(config), np.int64), bounds[:, 0], bounds[:, 1]


def _lora_slots(rows: HostRows, slots, config: ServingConfig) -> None:
    lora = config.prep.features.lora
    if slots is None:
        return
    if lora is None:
        _fail("StepUpdates.lora_slots given, but FeatureConfig.lora is off")
    if slots.shape != (lora.max_loras,):
        _fail(f"StepUpdates.lora_slots has shape {slots.shape}, expected [max_loras={lora.max_loras}]")
    bad = (slots != EMPTY_LORA_SLOT) & (slots < 1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        _fail(f"StepUpdates.lora_slots[{i}] = {int(slots[i])} must be an adapter id >= 1 or -1 (empty)")


def _schedule(rows: HostRows, payload, config: ServingConfig) -> None:
    """Counts non-negative; only busy, settled rows scheduled; total within the token budget; S >= D + 1
    for rows with drafts, draft ids in the vocabulary (-1 only where `placeholders_allowed`); C + S
    within the known tokens (+ drafts), max_model_len and every group's allocated blocks; a row that
    samples has room for its new tokens below max_model_len; grammar rows only on scheduled rows.

    Every bound is evaluated at once (`schedule_fits`, one pass of NumPy over the rows); only a schedule
    that breaks one walks the bounds in order (`_schedule_named`) to name the first."""
    if payload is None:
        return
    if not schedule_fits(rows, payload, config):
        _schedule_named(rows, payload, config)
        raise AssertionError("a schedule bound failed without a named error")  # pragma: no cover
    rows.num_scheduled_tokens[:] = payload.num_scheduled_tokens
    rows.num_draft_tokens[:] = payload.num_draft_tokens


def schedule_fits(rows: HostRows, payload, config: ServingConfig) -> bool:
    """Whether ``payload`` keeps every bound of `_schedule` (the same bounds as `_schedule_named`, joined): the
    bounds of every row as one boolean vector of element-wise compares, then one reduction (and the sum)."""
    prep, width = config.prep, draft_width(config)
    scheduled, drafts, grammar = payload.num_scheduled_tokens, payload.num_draft_tokens, payload.grammar_index
    num_tokens, budget = rows.num_tokens, prep.max_num_batched_tokens
    active = scheduled > 0
    wrong = (num_tokens <= 0) | (rows.pending_drafts >= 0) | sequence_faults(
        rows.num_computed_tokens + scheduled, num_tokens, num_tokens + drafts, rows.table_blocks, config)
    bad = ((scheduled < 0) | (scheduled > budget) | (drafts < 0) | (drafts > width) | (active & wrong)
           | ((drafts > 0) & (scheduled <= drafts)) | ((grammar != NO_GRAMMAR) & ((grammar < 0) | ~active)))
    if bad.any() or int(scheduled.sum()) > budget:  # each count within the budget already: the sum cannot wrap
        return False
    if width and drafts.any():
        ids = payload.draft_token_ids
        low = -1 if placeholders_allowed(config) else 0
        drafted = np.arange(width)[None, :] < drafts[:, None]
        if not token_ids_fit(ids[drafted], config.token_id_bound, low):
            return False
    return True


def sequence_faults(seq_lens: np.ndarray, num_tokens: np.ndarray, known: np.ndarray, table_blocks: np.ndarray,
                    config: ServingConfig) -> np.ndarray:
    """Per row, whether ``seq_lens`` (num_computed_tokens + num_scheduled_tokens) passes the tokens the row knows
    (``known``: num_tokens, and the drafts written this step), max_model_len or the row's allocated blocks
    (``table_blocks`` [rows, tables]), or reaches the row's end without a column for the sampled token.

    ```
    # max_model_len 8, block size 4: seq 5 of known 5, 2 blocks -> ok; 2 blocks, known 8, seq 8 -> no column
    ```
    """
    max_len = config.prep.max_model_len
    faults = (seq_lens > known) | (seq_lens > max_len) | ((seq_lens >= num_tokens) & (known >= max_len))
    for g, size in enumerate(group_block_sizes(config)):
        faults |= (seq_lens + (size - 1)) // size > table_blocks[:, g]
    return faults


def _schedule_named(rows: HostRows, payload, config: ServingConfig) -> None:
    """`_schedule`'s bounds one by one, in order: raises naming the first that ``payload`` breaks."""
    prep, width = config.prep, draft_width(config)
    scheduled, drafts = payload.num_scheduled_tokens, payload.num_draft_tokens
    _require(scheduled >= 0, "Schedule.num_scheduled_tokens", scheduled, "is negative")
    _require((drafts >= 0) & (drafts <= width), "Schedule.num_draft_tokens", drafts,
             f"is outside [0, num_speculative_tokens={width}]")
    _require((scheduled == 0) | rows.busy, "Schedule.num_scheduled_tokens", scheduled, "is set on a free row")
    _require((scheduled == 0) | ~rows.pending, "Schedule.num_scheduled_tokens", scheduled,
             "is set on a row whose drafts are pending: state its num_computed_tokens with a resume entry first")
    _require((drafts == 0) | (scheduled >= drafts + 1), "Schedule.num_scheduled_tokens", scheduled,
             "is below num_draft_tokens + 1")
    total = sum(map(int, scheduled))  # Python ints: a sum of huge counts does not wrap
    if total > prep.max_num_batched_tokens:
        _fail(f"Schedule: sum(num_scheduled_tokens)={total} exceeds max_num_batched_tokens="
              f"{prep.max_num_batched_tokens}")
    for row in np.flatnonzero(drafts > 0):
        check_token_ids(f"Schedule.draft_token_ids[{row}]", payload.draft_token_ids[row, : drafts[row]],
                        config.token_id_bound, InvalidUpdateError, allow_placeholder=placeholders_allowed(config))
    grammar = payload.grammar_index
    _require((grammar == NO_GRAMMAR) | ((grammar >= 0) & (scheduled > 0)), "Schedule.grammar_index", grammar,
             "must be -1 (none) or a bitmask row >= 0 of a scheduled row")
    seq_lens = rows.num_computed_tokens + scheduled
    active = scheduled > 0
    _require(~active | (seq_lens <= rows.num_tokens + drafts), "num_computed_tokens + num_scheduled_tokens",
             seq_lens, "passes the row's num_tokens + num_draft_tokens (tokens not known yet)")
    _require(~active | (seq_lens <= prep.max_model_len), "num_computed_tokens + num_scheduled_tokens", seq_lens,
             f"exceeds max_model_len={prep.max_model_len}")
    for g, size in enumerate(group_block_sizes(config)):
        needed = -(-seq_lens // size)
        _require(~active | (needed <= rows.table_blocks[:, g]),
                 f"blocks of {table_names(config)[g]} needed by num_computed_tokens + num_scheduled_tokens",
                 needed, "exceeds the row's allocated blocks: append its blocks first")
    samples = active & (seq_lens >= rows.num_tokens)
    new_len = rows.num_tokens + drafts + 1
    _require(~samples | (new_len <= prep.max_model_len), "num_tokens + num_draft_tokens + 1", new_len,
             f"exceeds max_model_len={prep.max_model_len}: the sampled token has no column")


def check_updates(rows: HostRows, updates, config: ServingConfig) -> HostRows:
    """The mirror after ``updates`` (finish, add, resume, append, lora_slots, schedule), on a copy."""
    check_payload_leaves(updates, InvalidUpdateError)  # 2.7 tokens is an error, never truncated to 2
    rows = rows.copy()
    _finish(rows, updates.finish, config)
    _add(rows, updates.add, config)
    _resume(rows, updates.resume, config)
    _append(rows, updates.append, config)
    _lora_slots(rows, updates.lora_slots, config)
    _schedule(rows, updates.schedule, config)
    return rows


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
    """Host arrays of one step's samples: shapes [B], [B, n] (or [B]), [B]; batch rows map to
    scheduled rows; 0 <= num_sampled <= D + 1; the kept tokens in the vocabulary and below
    max_model_len. Returns the advanced mirror (a copy)."""
    idx = _int_array("record_sampled.idx_mapping", idx_mapping, 1)
    sampled = _int_array("record_sampled.sampled_token_ids", sampled_token_ids, 2)
    counts = _int_array("record_sampled.num_sampled", num_sampled, 1)
    if sampled.shape[0] != len(idx) or len(counts) != len(idx):
        _fail(f"record_sampled: idx_mapping has {len(idx)} batch rows, sampled_token_ids {sampled.shape[0]} "
              f"and num_sampled {len(counts)}: they must agree")
    entries = np.flatnonzero(idx != PAD_STATE_ROW)
    real = _check_rows("record_sampled.idx_mapping", idx, config.max_num_reqs, pad=PAD_STATE_ROW)
    unscheduled = real[rows.num_scheduled_tokens[real] == 0]
    if len(unscheduled):
        _fail(f"record_sampled.idx_mapping: row {int(unscheduled[0])} was not scheduled")
    computed, scheduled = rows.num_computed_tokens[real], rows.num_scheduled_tokens[real]
    num_tokens, drafts = rows.num_tokens[real], rows.num_draft_tokens[real]
    discarded = computed + scheduled < num_tokens
    kept = np.where(discarded, 0, counts[entries])
    bad = (kept < 0) | (kept > np.minimum(drafts + 1, sampled.shape[1]))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        _fail(f"record_sampled.num_sampled for row {int(real[i])} is {int(kept[i])}, outside "
              f"[0, num_draft_tokens + 1 = {int(drafts[i]) + 1}] (and the sampled width {sampled.shape[1]})")
    for i, b in enumerate(entries):
        check_token_ids(f"record_sampled.sampled_token_ids[{b}]", sampled[b, : kept[i]], config.token_id_bound,
                        InvalidUpdateError)
    new_len = num_tokens + kept
    if (new_len > config.max_model_len).any():
        i = int(np.flatnonzero(new_len > config.max_model_len)[0])
        _fail(f"record_sampled: row {int(real[i])} would hold {int(new_len[i])} tokens, more than "
              f"max_model_len={config.max_model_len}")
    rows = rows.copy()
    rows.num_computed_tokens[real] += computed_advance(scheduled, drafts, kept, ~discarded)
    rows.num_tokens[real] = new_len
    rows.num_scheduled_tokens[real] = rows.num_draft_tokens[real] = 0
    return _fold_slack(rows, real)


def _fold_slack(rows: HostRows, real: np.ndarray) -> HostRows:
    """After a step of ``real`` rows: a row whose counts were high by up to ``slack`` (unverified drafts)
    becomes pending, its counts at their low end and ``pending_drafts`` widened by the slack.

    ```
    # C 12 (slack 2), advanced to C 14, N 15, not pending -> C 12, N 13, pending_drafts 2, slack 0
    ```
    """
    slack = rows.slack[real]
    uncertain = real[slack > 0]
    slack = slack[slack > 0]
    rows.num_computed_tokens[uncertain] -= slack
    rows.num_tokens[uncertain] -= slack
    rows.pending_drafts[uncertain] = np.maximum(rows.pending_drafts[uncertain], 0) + slack
    rows.slack[uncertain] = 0
    return rows


def advance_unread(rows: HostRows, config: ServingConfig) -> HostRows:
    """The mirror after a `record_sampled` whose arrays stay on the device (no host read), assuming
    prepare's batch (every scheduled row once): a prefill chunk computes its tokens; a row without
    drafts that reaches its last token appends one; a row with D drafts keeps 1..D + 1 tokens, so it
    becomes pending: ``num_computed_tokens`` holds its least value, ``pending_drafts`` D.

    ```
    # C 9, S 3, D 2, N 10 -> pending: C 10 (all drafts rejected), N 11, pending_drafts 2
    ```
    """
    rows = rows.copy()
    scheduled, drafts = rows.num_scheduled_tokens, rows.num_draft_tokens
    active = scheduled > 0
    samples = active & (rows.num_computed_tokens + scheduled >= rows.num_tokens)
    rows.num_computed_tokens += computed_advance(scheduled, drafts, 1, active)  # the least: every draft rejected
    rows.num_tokens += samples.astype(np.int64)
    pending = samples & (drafts > 0)
    rows.pending_drafts[pending] = drafts[pending]
    rows.num_scheduled_tokens[:] = 0
    rows.num_draft_tokens[:] = 0
    return _fold_slack(rows, np.flatnonzero(active))


def _int_array(name: str, values, ndim: int) -> np.ndarray:
    """``values`` as int64 with ``ndim`` dims (a [B] sampled array reads as [B, 1]); a named error otherwise."""
    array = np.asarray(values)
    if array.dtype.kind not in "iu" and not (array.dtype == object and array.size == 0):
        _fail(f"{name} must hold integers, got dtype {array.dtype}")
    if ndim == 2 and array.ndim == 1:
        array = array[:, None]
    if array.ndim != ndim:
        _fail(f"{name} must be {ndim}-D, got shape {array.shape}")
    if array.dtype == np.uint64 and array.size and array.max() > np.iinfo(np.int64).max:
        _fail(f"{name} holds a value outside int64")
    return array.astype(np.int64)


def _require(ok: np.ndarray, name: str, values: np.ndarray, problem: str) -> None:
    if not np.all(ok):
        row = int(np.flatnonzero(~ok)[0])
        _fail(f"{name} at row {row} is {int(values[row])}, which {problem}")
