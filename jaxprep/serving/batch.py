"""`ServingBatch`: a device `ServingState` and its host mirror, updated only by checked transitions."""

from __future__ import annotations

import numpy as np

from jaxprep.serving import checks, transitions
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.model import KVCache, ServingModel
from jaxprep.serving.packing import pack_updates
from jaxprep.serving.state import AddRequests, AppendBlocks, FinishRequests, Schedule, ServingState, StepUpdates
from jaxprep.serving.step import AppendedTokens, serve_step


class ServingBatch:
    """Owns a `ServingState` (donated by every update) and the `HostRows` mirror its checks read.

    Every method checks its payload on the host first and raises `InvalidUpdateError` before
    anything is dispatched, so on error ``state`` is still the old, live state. On success the old
    state's buffers are donated: use ``batch.state``, never a reference kept from before.
    """

    def __init__(self, config: ServingConfig, state: ServingState | None = None):
        if state is not None and int(np.asarray(state.num_tokens).max(initial=0)) > 0:
            raise ValueError("ServingBatch starts from an empty state (its host mirror starts empty)")
        self.config = config
        self.state = ServingState.empty(config) if state is None else state
        self.rows = checks.HostRows.empty(config.max_num_reqs)

    def finish_requests(self, payload: FinishRequests) -> None:
        self._apply(checks.check_finish(self.rows, payload, self.config), transitions.finish, payload)

    def add_requests(self, payload: AddRequests) -> None:
        self._apply(checks.check_add(self.rows, payload, self.config), transitions.add, payload)

    def append_block_ids(self, payload: AppendBlocks) -> None:
        self._apply(checks.check_append(self.rows, payload, self.config), transitions.append, payload)

    def schedule(self, payload: Schedule) -> None:
        self._apply(checks.check_schedule(self.rows, payload, self.config), transitions.schedule, payload)

    def apply_updates(self, updates: StepUpdates) -> None:
        """finish, add, append and schedule in one dispatch."""
        self._apply(checks.check_updates(self.rows, updates, self.config), transitions.apply_updates, updates)

    def record_sampled(self, idx_mapping, sampled_token_ids, num_sampled) -> None:
        """Records one step's sampled tokens (``sampled_token_ids`` [R_pad, n], ``num_sampled`` [R_pad])."""
        idx_mapping, num_sampled = np.asarray(idx_mapping, np.int32), np.asarray(num_sampled, np.int32)
        sampled_token_ids = np.asarray(sampled_token_ids, np.int32)
        rows = checks.check_record(self.rows, idx_mapping, sampled_token_ids, num_sampled, self.config)
        self.state = transitions.record_sampled(self.state, idx_mapping, sampled_token_ids, num_sampled)
        self.rows = rows

    def serve(self, kv_cache: KVCache, params, updates: StepUpdates, *, model: ServingModel,
              num_tokens_padded: int, packed: np.ndarray | None = None) -> tuple[KVCache, np.ndarray]:
        """Checks ``updates``, runs `serve_step` (donating the state and ``kv_cache``) and reads back
        the appended tokens [config.decode_steps, max_num_reqs] (-1 = none).

        ``packed``: ``pack_updates(updates)`` if the caller has it already.
        """
        rows, kv_cache, tokens = self._run(kv_cache, params, updates, model, num_tokens_padded, packed)
        tokens = np.asarray(tokens)
        self.rows = advance_rows(rows, tokens, self.config.num_speculative_tokens)
        return kv_cache, tokens

    def dispatch(self, kv_cache: KVCache, params, updates: StepUpdates, predicted: np.ndarray, *,
                 model: ServingModel, num_tokens_padded: int, packed: np.ndarray | None = None):
        """`serve` without waiting: returns the KV cache and the step's tokens as a device array, and
        advances the mirror by ``predicted`` ([1, max_num_reqs]: the rows that will append a token,
        `jaxprep.serving.overlap.predicted_tokens`). Async scheduling's half of a step."""
        if int(np.asarray(updates.decode_steps)[0]) != 1:
            raise checks.InvalidUpdateError("dispatch runs single steps: decode_steps must be 1")
        check_dispatchable(self.config)
        rows, kv_cache, tokens = self._run(kv_cache, params, updates, model, num_tokens_padded, packed)
        self.rows = advance_rows(rows, predicted)
        return kv_cache, tokens

    def _run(self, kv_cache, params, updates, model, num_tokens_padded, packed):
        rows = checks.check_updates(self.rows, updates, self.config)
        checks.check_step(rows, int(np.asarray(updates.decode_steps)[0]), num_tokens_padded, self.config)
        packed = pack_updates(updates) if packed is None else packed
        self.state, kv_cache, tokens = serve_step(self.state, kv_cache, params, packed, config=self.config,
                                                  model=model, num_tokens_padded=num_tokens_padded)
        return rows, kv_cache, tokens

    def _apply(self, rows: checks.HostRows, update, payload) -> None:
        self.state = update(self.state, payload)
        self.rows = rows


def check_dispatchable(config: ServingConfig) -> None:
    """`ServingBatch.dispatch` (async scheduling) runs without drafts: how many drafts a row keeps is
    known only after its step, so the host cannot predict the tokens it appends."""
    if config.num_speculative_tokens:
        raise checks.InvalidUpdateError("dispatch runs without drafts: ServingConfig.num_speculative_tokens "
                                        f"must be 0, got {config.num_speculative_tokens}")


def advance_rows(rows: checks.HostRows, tokens: np.ndarray, num_speculative_tokens: int = 0) -> checks.HostRows:
    """The mirror after a serving step appended ``tokens`` [slots, max_num_reqs] (`AppendedTokens`);
    rejected drafts are not computed."""
    appended = AppendedTokens(tokens, num_speculative_tokens)
    rows.num_computed_tokens += (rows.num_scheduled_tokens - appended.num_rejected(rows.num_draft_tokens)
                                 + appended.num_decoded)
    rows.num_tokens += appended.num_appended
    rows.num_scheduled_tokens[:] = 0
    rows.num_draft_tokens[:] = 0
    return rows
