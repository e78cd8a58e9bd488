"""`ServingState`, the device-resident serving tables, and the host payloads of one step's updates.

`ServingState` wraps the `BatchState` that `prepare_inputs` reads and adds the serving-only
bookkeeping (vLLM V2 ``RequestState``: ``total_len``, ``num_blocks``; docs/semantics.md#v2-state, #jax-design). A row is
busy while ``num_tokens > 0``. Draft counts live in one place, ``state.batch.num_draft_tokens``.

The payloads (`StepUpdates` and its parts) are host objects holding only what changes: a request's
tokens, its blocks per KV-cache group, its feature values. `jaxprep.serving.update_packing` lays them out
in one int32 buffer whose length comes from a small ladder (docs/guides/serving_updates.md).
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import numpy as np

from jaxprep._constants import INT32_MAX, NO_GRAMMAR, NO_LORA_ID, NULL_BLOCK_ID
from jaxprep.bounds import InvalidBatchError, max_block_id
from jaxprep.config import block_table_width
from jaxprep.features import MROPE_NUM_DIMS
from jaxprep.serving._values import integer, integer_array
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.device_state import ServingState as ServingState  # re-exported: its home since the state's arrays

PAD_ROW = -1
"""Row of a padded payload entry: it changes nothing."""


class InvalidUpdateError(InvalidBatchError):
    """A serving-state update breaks a bound; nothing was changed."""

MAMBA = "mamba"
"""Key of the Mamba state blocks in an `AppendBlocks` entry given as a dict."""


ERROR_BITS = {"sampled_token_id": 1, "num_sampled": 2, "idx_mapping": 4, "packed_counts": 8, "draft_token_id": 16,
              "packed_values": 32}
"""Bits of `ServingState.errors`, set by `record_sampled` on device inputs it could not take:
a sampled token outside [0, vocab_size) (written as 0), a ``num_sampled`` outside
[0, num_draft_tokens + 1] (clamped), an ``idx_mapping`` entry outside [-1, max_num_reqs) (skipped);
by `transitions.record_prev_tokens` on a drafter's proposal outside [-1, vocab_size) (written as -1,
a placeholder never accepted) or a last sampled token outside [0, vocab_size) (kept as 0);
and by `transitions.apply_updates_body` on a packed buffer it refuses whole (nothing written):
``packed_counts`` for a header that claims more entries than the buffer holds, a header flag outside
{0, 1} or data runs that disagree with ``n_data`` (`packing.SectionSizes`), ``packed_values`` for a
value outside its bounds or a row the state cannot take (`jaxprep.serving.update_bounds`)."""


# --- the payloads ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FinishRequests:
    """Rows to free (finished or preempted requests)."""

    rows: np.ndarray  # [F] int64 state rows

    @classmethod
    def build(cls, config: ServingConfig, rows=()) -> FinishRequests:
        rows = integer_array("FinishRequests.rows", [] if rows is None else list(rows)).ravel()  # 2.7: an error
        return cls(rows=rows[rows != PAD_ROW])


@dataclasses.dataclass(frozen=True)
class AddEntry:
    """One request written into a free row (normalised from the dict `AddRequests.build` takes)."""

    row: int
    token_ids: np.ndarray  # [n] int64: prompt (+ outputs of a resumed request)
    block_ids: tuple[np.ndarray, ...]  # one int64 array per table (`table_names`)
    num_computed_tokens: int = 0
    stop_len: int = 0
    prefill_len: int = 0
    lora_id: int = NO_LORA_ID
    mrope_positions: np.ndarray | None = None  # [3, m] int64, m <= n
    mrope_position_delta: int = 0
    is_token_ids: np.ndarray | None = None  # [m] bool, m <= n
    prompt_embeds_start: int = 0
    sampling: dict | None = None  # `jaxprep.features.sampling_params.state_row` values, + prompt_len


@dataclasses.dataclass(frozen=True)
class AddRequests:
    """New (or resumed-as-new) requests: each one's tokens, blocks and feature values, nothing padded."""

    entries: tuple[AddEntry, ...]
    # the bound `build` checked the token ids against; None: not checked (built by hand, or any
    # `dataclasses.replace` of a built payload: the field is not an argument, so a copy starts unchecked)
    token_id_bound: int | None = dataclasses.field(default=None, init=False, compare=False, repr=False)

    @classmethod
    def build(cls, config: ServingConfig, requests=()) -> AddRequests:
        """``requests``: dicts with ``row``, ``token_ids``, ``block_ids`` (a list for one KV group, a list
        of per-group lists with several), optional ``num_computed_tokens`` (prefix-cache hit, default
        0), ``stop_len`` (default max_model_len: no stop), ``prefill_len`` (default len(token_ids)),
        and where the feature is on ``lora_id``, ``mrope_positions`` ([3, m]) + ``mrope_position_delta``,
        ``is_token_ids`` ([m] bool) + ``prompt_embeds_start``, ``mamba_block_ids``, ``sampling``
        (`jaxprep.SamplingParams`, None: greedy) + ``prompt_len``. Any number up to max_num_reqs."""
        requests = requests if type(requests) is list else list(requests)
        fast = _add_entries_at_once(config, requests) if len(requests) > 1 else None
        if fast is not None:  # the common case: every value converted in one pass per field
            return _ids_checked_against(cls(entries=fast), config)
        return _ids_checked_against(cls(entries=tuple(_add_entry(config, i, request)
                                                      for i, request in enumerate(requests))), config)


@dataclasses.dataclass(frozen=True)
class ResumeEntry:
    """A running row re-stated: its computed tokens, and optionally its blocks and tokens."""

    row: int
    num_computed_tokens: int
    block_ids: tuple[np.ndarray, ...] | None = None  # replaces every table of the row
    token_ids: np.ndarray | None = None  # replaces the row's tokens (num_tokens = len)
    prefill_len: int | None = None
    unverified_drafts: int = 0  # drafts of the row's last step counted as accepted (async scheduling)


@dataclasses.dataclass(frozen=True)
class ResumeRequests:
    """Rows whose ``num_computed_tokens`` (and blocks, tokens) the host sets: a request resumed after
    preemption keeps its row; an outside scheduler re-syncs the computed count after drafts."""

    entries: tuple[ResumeEntry, ...]
    # the bound `build` checked the token ids against; None: not checked (built by hand, or any
    # `dataclasses.replace` of a built payload: the field is not an argument, so a copy starts unchecked)
    token_id_bound: int | None = dataclasses.field(default=None, init=False, compare=False, repr=False)

    @classmethod
    def build(cls, config: ServingConfig, resumes=()) -> ResumeRequests:
        """``resumes``: dicts with ``row``, ``num_computed_tokens``, optional ``block_ids`` (as in
        `AddRequests`), ``mamba_block_ids``, ``token_ids``, ``prefill_len`` (default
        len(token_ids) when token_ids are given, else unchanged) and ``unverified_drafts`` (default 0).

        ``unverified_drafts`` = D > 0: ``num_computed_tokens`` counts the D drafts of the row's last step
        as accepted before their verification is known (vLLM's async scheduler schedules step N + 1
        before step N's output arrives); the device keeps its own count, which is
        ``num_computed_tokens`` minus the drafts it rejected, and the host mirror knows it within
        [num_computed_tokens - D, num_computed_tokens]."""
        entries = []
        for i, resume in enumerate(resumes):
            where = f"ResumeRequests entry {i} (row {resume['row']})"
            tokens = resume.get("token_ids")
            if tokens is not None:
                tokens = check_token_ids(f"{where}: token_ids", tokens, config.token_id_bound)
            blocks = None
            if resume.get("block_ids") is not None or resume.get("mamba_block_ids") is not None:
                blocks = _table_blocks(config, where, resume.get("block_ids", []), resume.get("mamba_block_ids"))
            prefill = resume.get("prefill_len", None if tokens is None else len(tokens))
            entries.append(ResumeEntry(row=_int(resume["row"], f"{where}: row"),
                                       num_computed_tokens=_int(resume["num_computed_tokens"],
                                                                f"{where}: num_computed_tokens"),
                                       block_ids=blocks, token_ids=tokens,
                                       prefill_len=None if prefill is None else _int(prefill, f"{where}: prefill_len"),
                                       unverified_drafts=_int(resume.get("unverified_drafts", 0),
                                                              f"{where}: unverified_drafts")))
        return _ids_checked_against(cls(entries=tuple(entries)), config)


@dataclasses.dataclass(frozen=True)
class AppendBlocks:
    """Block ids appended to rows after their last allocated column, per table: segment ``s`` appends
    ``block_ids[starts[s] : starts[s] + lengths[s]]`` to table ``tables[s]`` of row ``rows[s]`` (arrays, so
    the checks and the packing handle every segment at once; `segments` lists them one by one).

    ```
    # {2: [5, 6], 0: [9]} -> rows [2, 0], tables [0, 0], lengths [2, 1], block_ids [5, 6, 9]
    ```
    """

    rows: np.ndarray  # [S] int64
    tables: np.ndarray  # [S] int64 (`table_names` order)
    lengths: np.ndarray  # [S] int64, each >= 1
    block_ids: np.ndarray  # [sum(lengths)] int64, segment after segment

    @classmethod
    def build(cls, config: ServingConfig, appends=None) -> AppendBlocks:
        """``appends``: {row: [ids]} with one KV group; {row: [[g0 ids], [g1 ids], ...]} with several
        (a last list for the Mamba blocks on a hybrid model); or {row: {group: [ids], "mamba": [ids]}}."""
        appends = appends or {}
        if len(table_names(config)) == 1 and all(type(value) is list for value in appends.values()):
            fast = cls.from_lists(appends.keys(), [0] * len(appends), list(appends.values()))
            if fast is not None:  # the common case: one table, lists of ints inside int32
                return fast
        rows, tables, ids = [], [], []
        for row, value in appends.items():
            where = f"AppendBlocks row {row}"
            for table, blocks in _per_table(config, where, value, allow_mamba_in_list=True).items():
                if len(blocks):
                    rows.append(_int(row, f"{where}: row"))
                    tables.append(table)
                    ids.append(blocks)
        return cls.of_segments(rows, tables, ids)

    @classmethod
    def from_lists(cls, rows, tables, lists) -> AppendBlocks | None:
        """Segments from ``rows``, ``tables`` and one list of block ids each (empty lists dropped), in one
        conversion; None if an id or a row is not a plain integer inside int32 (`build` then names it)."""
        lengths = np.fromiter(map(len, lists), np.int64, len(lists))
        try:
            ids = np.array([i for ids in lists for i in ids]) if lengths.any() else np.zeros(0, np.int64)
            rows = np.array(list(rows))
        except (ValueError, TypeError):  # ragged nesting, an unconvertible value
            return None
        if ids.dtype != np.int64 or ids.ndim != 1 or (rows.size and (rows.dtype != np.int64 or rows.ndim != 1)):
            return None
        if ids.size and (ids.max() > INT32_MAX or ids.min() < -INT32_MAX - 1) or \
                rows.size and (rows.max() > INT32_MAX or rows.min() < -INT32_MAX - 1):
            return None
        kept = lengths > 0
        return cls(rows=rows[kept] if rows.size else np.zeros(0, np.int64),
                   tables=np.asarray(tables, np.int64)[kept] if len(tables) else np.zeros(0, np.int64),
                   lengths=lengths[kept], block_ids=ids)

    @classmethod
    def of_segments(cls, rows, tables, ids) -> AppendBlocks:
        """From per-segment values: rows, tables and int64 id arrays (each non-empty)."""
        return cls(rows=np.asarray(rows, np.int64).reshape(-1), tables=np.asarray(tables, np.int64).reshape(-1),
                   lengths=np.fromiter(map(len, ids), np.int64, len(ids)),
                   block_ids=np.concatenate(ids).astype(np.int64, copy=False) if ids else np.zeros(0, np.int64))

    @functools.cached_property
    def starts(self) -> np.ndarray:
        """[S] the first index of each segment in ``block_ids``."""
        return np.cumsum(self.lengths) - self.lengths

    @functools.cached_property
    def segments(self) -> tuple[tuple[int, int, np.ndarray], ...]:
        """(row, table, block ids) per segment, in payload order (views of ``block_ids``)."""
        return tuple((int(r), int(t), self.block_ids[s: s + n])
                     for r, t, s, n in zip(self.rows, self.tables, self.starts, self.lengths))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Tokens (and drafts) every row runs this step; 0 = not in the batch."""

    num_scheduled_tokens: np.ndarray  # [max_num_reqs] int64
    num_draft_tokens: np.ndarray  # [max_num_reqs] D; a row with drafts schedules D + 1 tokens
    draft_token_ids: np.ndarray  # [max_num_reqs, num_speculative_tokens] int64, written after num_tokens
    grammar_index: np.ndarray  # [max_num_reqs] bitmask row block of each row this step, NO_GRAMMAR = none

    @classmethod
    def build(cls, config: ServingConfig, num_scheduled_tokens=None, num_draft_tokens=None,
              draft_token_ids=None, grammar_index=None) -> Schedule:
        rows, width = config.max_num_reqs, draft_width(config)
        if draft_token_ids is None:
            drafts = np.zeros((rows, width), np.int64)
        else:
            drafts = _int64_array(draft_token_ids, "Schedule.draft_token_ids")
            if drafts.size != rows * width:
                raise ValueError(f"Schedule.draft_token_ids has shape {drafts.shape}, expected "
                                 f"[max_num_reqs={rows}, num_speculative_tokens={width}]")
            drafts = drafts.reshape(rows, width)
        if isinstance(grammar_index, dict):
            grammar = np.full(rows, NO_GRAMMAR, np.int64)
            for row, index in grammar_index.items():
                grammar[_int(row, "Schedule.grammar_index row")] = _int(index, "Schedule.grammar_index")
        else:
            grammar = _dense(grammar_index, rows, NO_GRAMMAR, "Schedule.grammar_index")
        return cls(num_scheduled_tokens=_dense(num_scheduled_tokens, rows, 0, "Schedule.num_scheduled_tokens"),
                   num_draft_tokens=_dense(num_draft_tokens, rows, 0, "Schedule.num_draft_tokens"),
                   draft_token_ids=drafts, grammar_index=grammar)


@dataclasses.dataclass(frozen=True)
class StepUpdates:
    """Everything the host sends for one step, applied in field order: finish, add, resume, append,
    lora_slots, schedule.

    ``decode_steps`` is read by the serving step, not by the state transitions: 1 runs the scheduled
    step once; k > 1 (every scheduled row decoding its last token) lets it decode up to k tokens.
    """

    finish: FinishRequests
    add: AddRequests
    append: AppendBlocks
    schedule: Schedule
    decode_steps: np.ndarray  # [1] iterations the serving step may run, 1 <= k <= config.decode_steps
    resume: ResumeRequests = ResumeRequests(entries=())
    lora_slots: np.ndarray | None = None  # [max_loras] adapter id per LoRA slot (-1 empty); None: unchanged

    @classmethod
    def build(cls, config: ServingConfig, *, finish=(), add=(), resume=(), append=None, num_scheduled_tokens=None,
              num_draft_tokens=None, draft_token_ids=None, grammar_index=None, lora_slots=None,
              decode_steps: int = 1) -> StepUpdates:
        if lora_slots is not None:
            lora_slots = _int64_array(lora_slots, "StepUpdates.lora_slots").ravel()
        if not isinstance(append, AppendBlocks):
            append = AppendBlocks.build(config, append)
        return cls(finish=FinishRequests.build(config, finish), add=AddRequests.build(config, add),
                   resume=ResumeRequests.build(config, resume), append=append,
                   schedule=Schedule.build(config, num_scheduled_tokens, num_draft_tokens, draft_token_ids,
                                           grammar_index),
                   lora_slots=lora_slots,
                   decode_steps=np.array([integer("StepUpdates.decode_steps", decode_steps)], np.int32))


# --- tables ------------------------------------------------------------------------------------


def draft_width(config: ServingConfig) -> int:
    """Draft slots per scheduled row: the larger of the serving and the prepare configs' K."""
    return max(config.num_speculative_tokens, config.prep.features.num_speculative_tokens)


def table_names(config: ServingConfig) -> tuple[str, ...]:
    """The block tables a row holds, in payload order: KV group 0 (``block_table``), groups 1..G-1
    (``extra_block_tables[g-1]``), then ``mamba_block_table`` on a hybrid model."""
    features = config.prep.features
    names = ["block_table"] + [f"extra_block_tables[{g}]" for g in range(max(len(features.kv_groups) - 1, 0))]
    if features.hybrid is not None:
        names.append("mamba_block_table")
    return tuple(names)


def table_widths(config: ServingConfig) -> tuple[int, ...]:
    """Columns of each table of `table_names`."""
    prep, features = config.prep, config.prep.features
    widths = [prep.max_blocks_per_req]
    widths += [block_table_width(prep.max_model_len, g.block_size) for g in features.kv_groups[1:]]
    if features.hybrid is not None:
        widths.append(features.hybrid.table_width(prep.max_model_len))
    return tuple(widths)


def num_kv_groups(config: ServingConfig) -> int:
    return max(len(config.prep.features.kv_groups), 1)


def block_bounds(config: ServingConfig, table: int) -> tuple[int, int]:
    """The block ids table ``table`` (`table_names`) may hold: ``(low, high)``, the null block 0 allowed
    only in sliding-window groups and the Mamba table (the host checks and the device's read both)."""
    features, groups = config.prep.features, num_kv_groups(config)
    if table >= groups:  # the Mamba state blocks
        return NULL_BLOCK_ID, config.prep.max_block_id
    if not features.kv_groups or table == 0:
        spec = features.kv_groups[0] if features.kv_groups else None
        high = config.prep.max_block_id
    else:
        spec = features.kv_groups[table]
        high = spec.max_block_id if spec.num_blocks is not None else max_block_id(config.num_blocks, spec.block_size)
    return (NULL_BLOCK_ID if spec is not None and spec.sliding_window else NULL_BLOCK_ID + 1), high


def placeholders_allowed(config: ServingConfig) -> bool:
    """Whether a schedule's draft ids may hold vLLM's -1 placeholder: where the prepared step clamps
    ``input_ids`` to >= 0 (spec decode or async tokens on, as V1 clamps whenever a speculative config is
    set, `GPUModelRunner._preprocess`) and reads the drafts before that clamp (a -1 draft is never accepted)."""
    features = config.prep.features
    return features.spec_decode or features.async_tokens


def _table_blocks(config: ServingConfig, where: str, block_ids, mamba_block_ids=None) -> tuple[np.ndarray, ...]:
    """Blocks of every table from an add/resume dict: ``block_ids`` per KV group, ``mamba_block_ids``."""
    tables = _per_table(config, where, block_ids, allow_mamba_in_list=False)
    if mamba_block_ids is not None:
        if config.prep.features.hybrid is None:
            raise ValueError(f"{where}: mamba_block_ids given, but FeatureConfig.hybrid is off")
        tables[len(table_names(config)) - 1] = _int64_array(mamba_block_ids, f"{where}: mamba_block_ids").ravel()
    return tuple(tables.get(t, np.zeros(0, np.int64)) for t in range(len(table_names(config))))


def _per_table(config: ServingConfig, where: str, value, allow_mamba_in_list: bool) -> dict[int, np.ndarray]:
    """{table: int64 ids} from a flat list (one KV group), a list of per-group lists or a dict."""
    groups, names = num_kv_groups(config), table_names(config)
    hybrid = config.prep.features.hybrid is not None
    if isinstance(value, dict):
        out = {}
        for key, ids in value.items():
            table = len(names) - 1 if key == MAMBA and hybrid else key
            if not isinstance(table, int) or not 0 <= table < len(names):
                raise ValueError(f"{where}: table key {key!r} is not a KV group in [0, {groups}) or 'mamba'")
            out[table] = _int64_array(ids, f"{where}[{key!r}]").ravel()
        return out
    items = list(value)
    nested = bool(items) and all(isinstance(v, (list, tuple, np.ndarray, range)) for v in items)
    if not nested or (groups == 1 and not items):
        if groups > 1 and items:
            raise ValueError(f"{where}: block_ids must be one list per KV group ({groups} groups), got a flat list")
        return {0: _int64_array(items, f"{where}: block_ids").ravel()}
    allowed = groups + (1 if hybrid and allow_mamba_in_list else 0)
    if len(items) not in (groups, allowed):
        raise ValueError(f"{where}: block_ids has {len(items)} group lists, FeatureConfig.kv_groups has {groups}")
    return {t: _int64_array(ids, f"{where}: block_ids[{t}]").ravel() for t, ids in enumerate(items)}


_FAST_ADD_KEYS = frozenset(("row", "token_ids", "block_ids", "num_computed_tokens", "stop_len", "prefill_len",
                            "lora_id", "sampling", "prompt_len"))


def _add_entries_at_once(config: ServingConfig, requests: list) -> tuple[AddEntry, ...] | None:
    """`_add_entry` of every request in one pass: the token ids of all requests as one array, their block
    ids as another, each integer field as one, each checked once and split. Only for the common shape
    (one table, lists of ints, no M-RoPE, prompt-embeds or Mamba values); None when a request is not of
    it or a value fails a check, and `_add_entry` then takes the requests one by one (naming the value).

    ```
    # [{row: 2, token_ids: [7, 8], block_ids: [5]}, {row: 0, token_ids: [9], block_ids: [6, 4]}]
    #   -> tokens [7, 8, 9] split [[7, 8], [9]]; blocks [5, 6, 4] split [[5], [6, 4]]; rows [2, 0]
    ```
    """
    features, prep = config.prep.features, config.prep
    if len(table_names(config)) != 1:
        return None
    token_lists, block_lists = [], []
    for request in requests:
        if type(request) is not dict or not request.keys() <= _FAST_ADD_KEYS:
            return None
        tokens, blocks = request["token_ids"], request.get("block_ids", [])
        if type(tokens) is not list or type(blocks) is not list:
            return None
        token_lists.append(tokens)
        block_lists.append(blocks)
    num_tokens = np.fromiter(map(len, token_lists), np.int64, len(requests))
    num_blocks = np.fromiter(map(len, block_lists), np.int64, len(requests))
    try:
        tokens = np.array([t for ids in token_lists for t in ids])
        blocks = np.array([b for ids in block_lists for b in ids]) if num_blocks.any() else np.zeros(0, np.int64)
        fields = {name: np.array([request.get(name, default) for request in requests]) for name, default in (
            ("row", None), ("num_computed_tokens", 0), ("stop_len", prep.max_model_len), ("lora_id", NO_LORA_ID))}
        for name in ("prefill_len", "prompt_len"):  # default: the request's number of tokens
            fields[name] = np.array([request.get(name, n) for request, n in zip(requests, map(len, token_lists))])
    except (ValueError, TypeError, OverflowError):  # ragged nesting, an unconvertible value
        return None
    if tokens.dtype != np.int64 or tokens.ndim != 1 or blocks.dtype != np.int64 or blocks.ndim != 1:
        return None
    if not token_ids_fit(tokens, config.token_id_bound):
        return None
    if blocks.size and (blocks.max() > INT32_MAX or blocks.min() < -INT32_MAX - 1):
        return None
    for values in fields.values():
        if values.dtype != np.int64 or values.ndim != 1 or values.max() > INT32_MAX or values.min() < -INT32_MAX - 1:
            return None
    token_arrays, block_arrays = _split(tokens, num_tokens), _split(blocks, num_blocks)
    columns = {name: values.tolist() for name, values in fields.items()}
    if features.sampling is not None:
        from jaxprep.features.sampling_params import state_row

        vocab = features.sampling.vocab_size
        sampling = [dict(state_row(request.get("sampling"), vocab), prompt_len=prompt_len)
                    for request, prompt_len in zip(requests, columns["prompt_len"])]
    else:
        sampling = [None] * len(requests)
    lora = features.lora is not None
    return tuple(AddEntry(row=row, token_ids=ids, block_ids=(table,), num_computed_tokens=computed, stop_len=stop,
                          prefill_len=prefill, lora_id=lora_id if lora else NO_LORA_ID, sampling=params)
                 for row, ids, table, computed, stop, prefill, lora_id, params in zip(
                     columns["row"], token_arrays, block_arrays, columns["num_computed_tokens"], columns["stop_len"],
                     columns["prefill_len"], columns["lora_id"], sampling))


def _split(values: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """``values`` cut into consecutive pieces of ``lengths`` (views): [7, 8, 9], [2, 1] -> [[7, 8], [9]]."""
    ends = np.cumsum(lengths).tolist()
    return [values[start:end] for start, end in zip([0, *ends[:-1]], ends)]


def _add_entry(config: ServingConfig, i: int, request: dict) -> AddEntry:
    features, prep = config.prep.features, config.prep
    where = f"AddRequests entry {i} (row {request.get('row')})"
    tokens = check_token_ids(f"{where}: token_ids", request["token_ids"], config.token_id_bound)
    blocks = _table_blocks(config, where, request.get("block_ids", []), request.get("mamba_block_ids"))
    stop_len = request.get("stop_len")
    values = dict(row=_int(request["row"], f"{where}: row"), token_ids=tokens, block_ids=blocks,
                  num_computed_tokens=_int(request.get("num_computed_tokens", 0), f"{where}: num_computed_tokens"),
                  stop_len=prep.max_model_len if stop_len is None else _int(stop_len, f"{where}: stop_len"),
                  prefill_len=_int(request.get("prefill_len", len(tokens)), f"{where}: prefill_len"))
    if features.lora is not None:
        values["lora_id"] = _int(request.get("lora_id", NO_LORA_ID), f"{where}: lora_id")
    if features.mrope and request.get("mrope_positions") is not None:
        positions = _int64_array(request["mrope_positions"], f"{where}: mrope_positions")
        if positions.ndim != 2 or positions.shape[0] != MROPE_NUM_DIMS:
            raise ValueError(f"{where}: mrope_positions must have shape [3, m], got {positions.shape}")
        values.update(mrope_positions=positions, mrope_position_delta=_int(request.get("mrope_position_delta", 0),
                                                                            f"{where}: mrope_position_delta"))
    if features.prompt_embeds and request.get("is_token_ids") is not None:
        flags = np.asarray(request["is_token_ids"])
        if flags.dtype != np.bool_ or flags.ndim != 1:
            raise ValueError(f"{where}: is_token_ids must be a 1-D bool array, got {flags.dtype} {flags.shape}")
        values.update(is_token_ids=flags, prompt_embeds_start=_int(request.get("prompt_embeds_start", 0),
                                                                   f"{where}: prompt_embeds_start"))
    if features.sampling is not None:
        from jaxprep.features.sampling_params import state_row

        row = state_row(request.get("sampling"), features.sampling.vocab_size)
        values["sampling"] = dict(row, prompt_len=_int(request.get("prompt_len", len(tokens)), f"{where}: prompt_len"))
    return AddEntry(**values)


# --- value checks shared by the builders and the host checks ---------------------------------------


def _ids_checked_against(payload, config: ServingConfig):
    """``payload`` (just built, its token ids checked) marked with the bound they were checked against."""
    object.__setattr__(payload, "token_id_bound", config.token_id_bound)
    return payload


def token_ids_fit(values: np.ndarray, bound: int, low: int = 0) -> bool:
    """Whether ``values`` holds integers only, each in [``low``, ``bound``): the one bound test of token ids
    on the host (`check_token_ids` names the first id that fails it; the at-once paths fall back to it).

    ```
    # [5, 63], bound 64 -> True;  [5, 64] -> False;  [-1, 5], low -1 -> True;  [1.0] -> False
    ```
    """
    return values.dtype.kind in "iu" and (values.size == 0 or (int(values.min()) >= low and int(values.max()) < bound))


def check_token_ids(where: str, token_ids, bound: int, error: type[Exception] = ValueError,
                    allow_placeholder: bool = False) -> np.ndarray:
    """``token_ids`` as an int64 array if each is an integer in [0, ``bound``) (or -1 with
    ``allow_placeholder``); otherwise raises ``error`` naming ``where``, the position, the value and
    the bound (nothing is stored first, so an id like 2**40 is never wrapped into int32).

    ```
    # where "request 3: prompt_token_ids", ids [5, 2**40], bound 64
    #   -> "request 3: prompt_token_ids[1] = 1099511627776 is outside [0, 64)"
    ```
    """
    values = np.asarray(token_ids)
    low = -1 if allow_placeholder else 0
    if values.dtype.kind in "iu":
        if token_ids_fit(values, bound, low):
            return values.astype(np.int64).ravel()
        values = values.ravel()
    else:  # Python ints beyond int64, floats, anything else: one by one
        values = list(np.ravel(np.asarray(token_ids, dtype=object)))
    for position, value in enumerate(values):
        try:
            value = operator.index(value)
        except TypeError:
            raise error(f"{where}[{position}] = {value!r} is not an integer token id") from None
        if not low <= value < bound:
            raise error(f"{where}[{position}] = {value} is outside [0, {_bound_name(bound)})"
                        + (" (-1: vLLM's placeholder draft)" if allow_placeholder else ""))
    return np.asarray(values, np.int64)


def _bound_name(bound: int) -> str:
    return "2**31 (int32)" if bound == INT32_MAX + 1 else f"vocab_size={bound}"


def _int(value, where: str) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{where} = {value!r} is not an integer") from None
    if not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise ValueError(f"{where} = {value} is outside int32")
    return value


def _int64_array(values, where: str) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype == np.int64:  # Python ints, or int64 already: only the int32 range to check
        if array.size and (array.max() > INT32_MAX or array.min() < -INT32_MAX - 1):
            raise ValueError(f"{where} has values outside int32")
        return array.copy() if array is values else array
    if array.size == 0:
        return array.astype(np.int64)
    if array.dtype.kind not in "iu":
        if array.dtype == object:
            return np.asarray([_int(v, where) for v in array.ravel()], np.int64).reshape(array.shape)
        raise ValueError(f"{where} must hold integers, got dtype {array.dtype}")
    if array.dtype == np.uint64 and (array > INT32_MAX).any() or (array.astype(np.int64) != array).any():
        raise ValueError(f"{where} has values outside int64")
    array = array.astype(np.int64)
    if ((array > INT32_MAX) | (array < -INT32_MAX - 1)).any():
        raise ValueError(f"{where} has values outside int32")
    return array


def _dense(values, size: int, fill: int, where: str) -> np.ndarray:
    """A [size] int64 array holding ``values`` then ``fill``."""
    if values is None:
        return np.full(size, fill, np.int64)
    if type(values) is np.ndarray and values.dtype == np.int64 and values.shape == (size,):  # the adapter's own
        if size and (values.max() > INT32_MAX or values.min() < -INT32_MAX - 1):
            raise ValueError(f"{where} has values outside int32")
        return values.copy()
    values = _int64_array([] if values is None else values, where).ravel()
    if len(values) > size:
        raise ValueError(f"{where}: got {len(values)} entries, the payload holds {size}")
    out = np.full(size, fill, np.int64)
    out[: len(values)] = values
    return out
