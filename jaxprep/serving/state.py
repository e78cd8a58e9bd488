"""`ServingState`, the device-resident serving tables, and the padded per-step update payloads.

`ServingState` wraps the `BatchState` that `prepare_inputs` reads and adds the serving-only
bookkeeping (vLLM V2 ``RequestState``: ``total_len``, ``num_blocks``; docs/semantics.md#v2-state, #jax-design). A row is
busy while ``num_tokens > 0``.

The payloads are pytrees of host (NumPy) arrays padded to sizes fixed by `ServingConfig`, so a
jitted update sees the same shapes every step; padded entries use row -1, which updates nothing.
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import INT32_MAX, NULL_BLOCK_ID
from jaxprep.serving._values import check_entry, integer, integer_array
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.sampling_rows import AddSampling
from jaxprep.state import BatchState

PAD_ROW = -1
"""Row of a padded payload entry: it changes nothing."""

HostOrDevice = np.ndarray | jax.Array
"""Payload leaves are NumPy arrays on the host and traced arrays inside a jitted update."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ServingState:
    """The batch tables plus per-row serving counters; every leaf is an int32 device array."""

    batch: BatchState  # token_ids, block_table, num_computed_tokens (authoritative), num_scheduled_tokens
    num_tokens: jax.Array  # [max_num_reqs] prompt + sampled tokens in token_ids; 0 = free row
    stop_len: jax.Array  # [max_num_reqs] num_tokens at which the request stops: min(prompt + max_tokens, max_model_len)
    num_blocks: jax.Array  # [max_num_reqs] allocated block-table columns
    num_draft_tokens: jax.Array  # [max_num_reqs] draft tokens scheduled this step (spec decode)

    @classmethod
    def empty(cls, config: ServingConfig) -> ServingState:
        """No requests: every row free."""
        def zeros():  # one buffer per field: donation rejects a buffer passed twice
            return jnp.zeros((config.max_num_reqs,), jnp.int32)

        return cls(batch=BatchState.empty(config.prep), num_tokens=zeros(), stop_len=zeros(),
                   num_blocks=zeros(), num_draft_tokens=zeros())

    def to_numpy(self) -> dict[str, np.ndarray]:
        """Host copies of every leaf, by field name (the batch's fields included)."""
        host = self.batch.to_numpy()
        for field in dataclasses.fields(self):
            if field.name != "batch":
                host[field.name] = np.asarray(getattr(self, field.name))
        return host


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FinishRequests:
    """Rows to free (finished or preempted requests)."""

    rows: HostOrDevice  # [max_num_reqs] state rows; pad -1

    @classmethod
    def build(cls, config: ServingConfig, rows=()) -> FinishRequests:
        return cls(rows=_padded(rows, config.max_num_reqs, where="FinishRequests.rows"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AddRequests:
    """New (or resumed) requests written into free rows: whole rows of the token and block tables."""

    rows: HostOrDevice  # [A] state rows; pad -1 (A = max_new_reqs_per_step)
    token_ids: HostOrDevice  # [A, max_model_len] prompt (+ resumed outputs), zero past num_tokens
    num_tokens: HostOrDevice  # [A] tokens written
    stop_len: HostOrDevice  # [A] num_tokens at which the request stops
    num_computed_tokens: HostOrDevice  # [A] > 0 after a prefix-cache hit
    block_ids: HostOrDevice  # [A, max_blocks_per_req] allocated blocks, null block 0 past num_blocks
    num_blocks: HostOrDevice  # [A]
    sampling: AddSampling | None = None  # FeatureConfig.sampling: parameters and prompt lengths

    @classmethod
    def build(cls, config: ServingConfig, requests=()) -> AddRequests:
        """``requests``: dicts with row, token_ids, stop_len, block_ids and optionally
        num_computed_tokens (default 0), and with the sampling feature ``sampling``
        (`jaxprep.SamplingParams`, None: greedy) and ``prompt_len``. At most ``max_new_reqs_per_step``."""
        size, prep = config.max_new_reqs_per_step, config.prep
        requests = list(requests)
        if len(requests) > size:
            raise ValueError(f"AddRequests holds at most max_new_reqs_per_step={size} requests, got {len(requests)}")
        arrays = dict(rows=np.full(size, PAD_ROW, np.int32),
                      token_ids=np.zeros((size, prep.max_model_len), np.int32),
                      num_tokens=np.zeros(size, np.int32), stop_len=np.zeros(size, np.int32),
                      num_computed_tokens=np.zeros(size, np.int32),
                      block_ids=np.full((size, prep.max_blocks_per_req), NULL_BLOCK_ID, np.int32),
                      num_blocks=np.zeros(size, np.int32))
        for i, request in enumerate(requests):
            check_entry(f"AddRequests entry {i}", request, ("row", "stop_len", "num_computed_tokens"))
            where = f"AddRequests entry {i} (row {request['row']}): token_ids"
            tokens = check_token_ids(where, request["token_ids"], config.token_id_bound)
            blocks = _row_values(request["block_ids"])
            arrays["rows"][i] = request["row"]
            _fill_row(arrays["token_ids"], i, tokens, "AddRequests.token_ids", "max_model_len")
            _fill_row(arrays["block_ids"], i, blocks, "AddRequests.block_ids", "max_blocks_per_req")
            arrays["num_tokens"][i] = len(tokens)
            arrays["num_blocks"][i] = len(blocks)
            arrays["stop_len"][i] = request["stop_len"]
            arrays["num_computed_tokens"][i] = request.get("num_computed_tokens", 0)
        if prep.features.sampling is not None:
            arrays["sampling"] = AddSampling.build(prep.features.sampling, requests, size)
        return cls(**arrays)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AppendBlocks:
    """Block ids appended to rows after their last allocated column, in payload order."""

    rows: HostOrDevice  # [P] state rows; pad -1 (P = max_block_appends_per_step)
    block_ids: HostOrDevice  # [P]

    @classmethod
    def build(cls, config: ServingConfig, appends=None) -> AppendBlocks:
        """``appends``: {row: [block ids]}."""
        size = config.max_block_appends_per_step
        pairs = [(row, block) for row, blocks in (appends or {}).items() for block in blocks]
        if len(pairs) > size:
            raise ValueError(f"AppendBlocks holds at most max_block_appends_per_step={size} blocks, got {len(pairs)}")
        rows, blocks = np.full(size, PAD_ROW, np.int32), np.full(size, NULL_BLOCK_ID, np.int32)
        if pairs:
            rows[: len(pairs)], blocks[: len(pairs)] = integer_array("AppendBlocks (row, block id)", pairs).T
        return cls(rows=rows, block_ids=blocks)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Schedule:
    """Tokens (and drafts) every row runs this step; 0 = not in the batch."""

    num_scheduled_tokens: HostOrDevice  # [max_num_reqs]
    num_draft_tokens: HostOrDevice  # [max_num_reqs] D; a row with drafts schedules D + 1 tokens
    draft_token_ids: HostOrDevice  # [max_num_reqs, num_speculative_tokens] written after num_tokens

    @classmethod
    def build(cls, config: ServingConfig, num_scheduled_tokens=None, num_draft_tokens=None,
              draft_token_ids=None) -> Schedule:
        rows, width = config.max_num_reqs, config.num_speculative_tokens
        return cls(num_scheduled_tokens=_padded(num_scheduled_tokens, rows, 0, "Schedule.num_scheduled_tokens"),
                   num_draft_tokens=_padded(num_draft_tokens, rows, 0, "Schedule.num_draft_tokens"),
                   draft_token_ids=integer_array("Schedule.draft_token_ids", np.zeros((rows, width), np.int32)
                                                 if draft_token_ids is None else draft_token_ids
                                                 ).astype(np.int32).reshape(rows, width))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepUpdates:
    """Everything the host sends for one step, applied in field order: finish, add, append, schedule.

    ``decode_steps`` is read by the serving step, not by the state transitions: 1 runs the scheduled
    step once; k > 1 (every scheduled row decoding its last token) lets it decode up to k tokens.
    """

    finish: FinishRequests
    add: AddRequests
    append: AppendBlocks
    schedule: Schedule
    decode_steps: HostOrDevice  # [1] iterations the serving step may run, 1 <= k <= config.decode_steps

    @classmethod
    def build(cls, config: ServingConfig, *, finish=(), add=(), append=None, num_scheduled_tokens=None,
              num_draft_tokens=None, draft_token_ids=None, decode_steps: int = 1) -> StepUpdates:
        return cls(finish=FinishRequests.build(config, finish), add=AddRequests.build(config, add),
                   append=AppendBlocks.build(config, append),
                   schedule=Schedule.build(config, num_scheduled_tokens, num_draft_tokens, draft_token_ids),
                   decode_steps=np.array([integer("StepUpdates.decode_steps", decode_steps)], np.int32))


def _padded(values, size: int, fill: int = PAD_ROW, where: str = "payload") -> np.ndarray:
    """A [size] int32 array holding ``values`` then ``fill``."""
    values = integer_array(where, values).ravel()  # 2.7 is an error, never truncated to 2
    if len(values) > size:
        raise ValueError(f"got {len(values)} entries, the payload holds {size}")
    out = np.full(size, fill, np.int32)
    out[: len(values)] = values
    return out


def check_token_ids(where: str, token_ids, bound: int, error: type[Exception] = ValueError) -> np.ndarray:
    """``token_ids`` as an int64 array if each is an integer in [0, ``bound``); otherwise raises
    ``error`` naming ``where``, the position, the value and the bound (nothing is stored first, so an
    id like 2**40 is never wrapped into int32).
    # where "request 3: prompt_token_ids", ids [5, 2**40], bound 64
    #   -> "request 3: prompt_token_ids[1] = 1099511627776 is outside [0, 64)"
    """
    values = np.asarray(token_ids)
    if values.dtype.kind in "iu":
        bad = (values < 0) | (values >= bound)
        if not bad.any():
            return values.astype(np.int64).ravel()
        values = values.ravel()
    else:  # Python ints beyond int64, floats, anything else: one by one
        values = list(np.ravel(np.asarray(token_ids, dtype=object)))
    for position, value in enumerate(values):
        try:
            value = operator.index(value)
        except TypeError:
            raise error(f"{where}[{position}] = {value!r} is not an integer token id") from None
        if not 0 <= value < bound:
            raise error(f"{where}[{position}] = {value} is outside [0, {_bound_name(bound)})")
    return np.asarray(values, np.int64)


def _bound_name(bound: int) -> str:
    return "2**31 (int32)" if bound == INT32_MAX + 1 else f"vocab_size={bound}"


def _row_values(values) -> np.ndarray:
    return np.asarray(values, np.int64).ravel()


def _fill_row(table: np.ndarray, i: int, values: np.ndarray, name: str, bound: str) -> None:
    if len(values) > table.shape[1]:
        raise ValueError(f"{name}[{i}] has {len(values)} entries, more than {bound}={table.shape[1]}")
    table[i, : len(values)] = values
