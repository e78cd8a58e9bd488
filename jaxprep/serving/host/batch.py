"""`ServingBatch`: a device `ServingState` and its host mirror, updated only by checked transitions."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxprep.compilation import counted, describe_buckets
from jaxprep.executables import Executable, run, warm
from jaxprep.models.tiny import KVCache, ServingModel
from jaxprep.prepare import prepare_padded
from jaxprep.serving import transitions
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.host import checks, column_checks
from jaxprep.serving.state import (
    ERROR_BITS,
    AddRequests,
    AppendBlocks,
    FinishRequests,
    ResumeRequests,
    Schedule,
    ServingState,
    StepUpdates,
    check_token_ids,
    draft_width,
)
from jaxprep.serving.step import AppendedTokens, run_step, serve_step, update_and_prepare_buffer
from jaxprep.serving.update_packing import (
    HEADER_WORDS,
    SEGMENT_FIELDS,
    PackedStep,
    UpdateColumns,
    bulk_rungs,
    pack_columns,
    pack_step,
    pad_to,
    payload_buckets,
    payload_layout,
    step_payload_buckets,
    widen_packed,
)
from jaxprep.step_buffer import StepBuffer


@dataclasses.dataclass(frozen=True)
class ColumnsUpdate:
    """An update read straight into `UpdateColumns` (the host scheduler's: `scheduler_columns`), and the way
    to read it as a `StepUpdates` (``as_updates``): where `column_checks.check_columns` finds a bound broken,
    or does not cover the columns, the general checks take the `StepUpdates` and name the bound. `ServingBatch`
    takes one wherever it takes a `StepUpdates`."""

    columns: UpdateColumns
    as_updates: Callable[[], StepUpdates]

    @property
    def decode_steps(self) -> np.ndarray:
        """[1] as `StepUpdates.decode_steps`."""
        return np.array([self.columns.decode_steps], np.int32)


@dataclasses.dataclass(frozen=True)
class CheckedUpdate:
    """An update checked against the mirror and packed (`ServingBatch.check_columns`): its buffers, and the
    mirror once the batch has taken them."""

    packed: PackedStep
    rows: checks.HostRows


class ServingBatch:
    """Owns a `ServingState` (donated by every update) and the `HostRows` mirror its checks read.

    Every method checks its payload on the host first and raises `InvalidUpdateError` before
    anything is dispatched, so on error ``state`` is still the old, live state. On success the old
    state's buffers are donated: use ``batch.state``, never a reference kept from before.
    ``h2d_bytes`` adds up the bytes of every update buffer sent to the device.

    ``separate_updates``: `serve` applies a step's updates in dispatches of their own (`apply_buffer`: one
    update executable at the top payload rung, shared by every bucket) and then runs the step without them
    (`step.run_step`), instead of one `serve_step` that carries them. Each bucket's step then compiles without
    the update program (about half of its compile: ``benchmarks/bench_compile.py --parts update``), at the
    price of two more dispatches per step (the widening and the update). The same state and tokens either way.
    """

    def __init__(self, config: ServingConfig, state: ServingState | None = None, *, separate_updates: bool = False):
        if state is not None and int(np.asarray(state.num_tokens).max(initial=0)) > 0:
            raise ValueError("ServingBatch starts from an empty state (its host mirror starts empty)")
        self.config, self.separate_updates = config, bool(separate_updates)
        self.state = ServingState.empty(config) if state is None else state
        self.rows = checks.HostRows.for_config(config)
        self.h2d_bytes = 0  # bytes of the update buffers sent, all calls together
        self.changed_words = 0  # state entries those updates wrote
        self.executables: dict = {}  # what a warm-up compiled or loaded, by key (`jaxprep.executables.run`)
        # steady buffers go to their own programs (`update_packing.is_steady`): set by the warm-up that compiles
        # them; a batch driven without one compiles the general program alone (set it to compile each on first use)
        self.steady_programs = False

    # --- updates ---------------------------------------------------------------------------

    def apply_updates(self, updates: StepUpdates | ColumnsUpdate | CheckedUpdate) -> None:
        """finish, add, resume, append, lora_slots and schedule: checked, then one dispatch per buffer."""
        rows, updates = self._checked(updates)
        packed = self.pack(updates)
        for buffer in packed.buffers:
            self._apply(buffer)
        self.rows = rows

    def finish_requests(self, payload: FinishRequests) -> None:
        self.apply_updates(_only(self.config, finish=payload))

    def add_requests(self, payload: AddRequests) -> None:
        self.apply_updates(_only(self.config, add=payload))

    def resume_requests(self, payload: ResumeRequests) -> None:
        self.apply_updates(_only(self.config, resume=payload))

    def append_block_ids(self, payload: AppendBlocks) -> None:
        self.apply_updates(_only(self.config, append=payload))

    def schedule(self, payload: Schedule) -> None:
        self.apply_updates(_only(self.config, schedule=payload))

    def pack(self, updates: StepUpdates | ColumnsUpdate | CheckedUpdate,
             num_tokens_padded: int | None = None) -> PackedStep:
        """``updates`` (checked by the caller) as the buffers to send; counts their bytes. ``num_tokens_padded``:
        the bucket of the step that takes them (the door's `update_and_prepare`, the `Engine`'s `serve`), whose
        top rung the step's buffer may fill (`door_step_words`); None for updates applied alone."""
        if isinstance(updates, CheckedUpdate):
            return self._counted(updates.packed)
        words = door_step_words(self.config, num_tokens_padded)
        if isinstance(updates, ColumnsUpdate):
            return self._counted(pack_columns(self.config, updates.columns, words))
        return self._counted(pack_step(self.config, updates, self.rows.table_blocks, words))

    def _checked(self, updates: StepUpdates | ColumnsUpdate | CheckedUpdate
                 ) -> tuple[checks.HostRows, StepUpdates | ColumnsUpdate | CheckedUpdate]:
        """The mirror after ``updates`` (a copy), and the payload checked (the one to pack and send): a
        `CheckedUpdate`'s own (`check_columns` checked it); `column_checks.check_columns` of columns, else (or
        where it finds a bound broken) `checks.check_updates` of the `StepUpdates`, which raises
        `InvalidUpdateError` naming the bound."""
        if isinstance(updates, CheckedUpdate):
            return updates.rows, updates
        if isinstance(updates, ColumnsUpdate):
            rows = column_checks.check_columns(self.rows, updates.columns, self.config)
            if rows is not None:
                return rows, updates
            updates = updates.as_updates()
        return checks.check_updates(self.rows, updates, self.config), updates

    def _counted(self, packed: PackedStep) -> PackedStep:
        self.h2d_bytes += packed.nbytes
        self.changed_words += packed.changed_words
        return packed

    # --- an update read straight into columns (`UpdateColumns`) ----------------------------------

    def check_columns(self, columns: UpdateColumns, num_tokens_padded: int | None = None) -> CheckedUpdate | None:
        """``columns`` checked at once against the mirror (`column_checks.check_columns`) and packed, for
        `apply_updates` or `update_and_prepare` to send as they are; None, with nothing changed, if a bound breaks
        or the columns hold what that check does not cover: check the update the general way then, which names
        the bound. ``num_tokens_padded``: the bucket `update_and_prepare` will prepare them at (packed for its door
        rungs, as `pack` packs); None for `apply_updates`."""
        rows = column_checks.check_columns(self.rows, columns, self.config)
        if rows is None:
            return None
        return CheckedUpdate(pack_columns(self.config, columns, door_step_words(self.config, num_tokens_padded)), rows)

    # --- a step driven from outside (a torch runner, vLLM's scheduler) -------------------------

    def warmup(self, threads: int | None = None, on_compiled=None, *,
               cache_dir: str | os.PathLike | None = None) -> float:
        """Compiles what a step driven from outside can use, so no update or step compiles later; returns
        seconds. Per token bucket a step can reach (`PrepConfig.reachable_buckets`) and each of its door rungs
        (`door_rungs`: one or two payload rungs, the bulk rung on top where a bucket takes admissions whole) the
        door's step (`update_and_prepare`), and its steady program at the buckets of a decode step
        (`steady_buckets`, at the step rungs); the updates sent alone or
        first (`transitions.apply_packed` at the top payload rung, `widen_packed` for each smaller rung, and at
        the bulk rung of a large update's leading buffers, `update_packing.bulk_rungs`);
        `prepare` per bucket. One pool compiles them all, the largest first, while the next is lowered
        (`jaxprep.executables.warm`: from disk without tracing, where the persistent compilation cache is on
        and holds them). What it compiles is logged on ``jaxprep.warmup`` (INFO; `jaxprep.compilation`).

        Args:
          threads: compile threads (default: the CPU count).
          on_compiled: ``on_compiled(done, total, what)`` after each compile.
          cache_dir: turn on JAX's persistent compilation cache there first (`jaxprep.use_compile_cache`).
        """
        start = time.perf_counter()
        buckets, updates = self.config.prep.reachable_buckets, payload_buckets(self.config)
        doors = sum(map(len, door_programs(self.config, buckets).values()))
        why = (f"the update and the step at {describe_buckets(buckets)}, {counted(doors, 'door program')} (one or "
               f"two update sizes each), each for any update and at a decode's buckets for steady ones, the updates "
               f"alone at the top of "
               f"{counted(len(updates), 'size')} (a widening for each other){_bulk_words(self.config)} and "
               f"prepare_padded at each bucket")
        self.executables.update(warm(self._warmup_executables(), threads, on_compiled, why=why, cache_dir=cache_dir))
        self.steady_programs = True
        return time.perf_counter() - start

    def _warmup_executables(self):
        config, buckets = self.config, self.config.prep.reachable_buckets[::-1]
        for steady in (False, True):  # any update, then the steady ones' smaller programs at a decode's buckets
            at = tuple(b for b in buckets if not steady or b in steady_buckets(config))
            for words, door_buckets in door_programs(config, at, steady).items():
                for bucket in door_buckets:
                    yield Executable(("door", bucket, words, steady), update_and_prepare_buffer,
                                     (self.state, _empty(words)), dict(config=config, num_tokens_padded=bucket,
                                                                       steady=steady),
                                     f"update and prepare at {bucket} tokens, {'steady ' if steady else ''}updates "
                                     f"of {words} words")
        yield from self.update_executables(_empty)
        for bucket in buckets:
            yield Executable(("prepare", bucket), prepare_padded, (self.state.batch,),
                             dict(config=config.prep, num_tokens_padded=bucket), f"prepare_padded at {bucket} tokens")

    def update_executables(self, empty):
        """What `apply_buffer` runs; ``empty(words)``: a buffer of that length. With ``separate_updates`` also the
        steady program, which applies the common step's buffer (`update_packing.is_steady`)."""
        return update_executables(self.state, self.config, empty, steady=self.separate_updates)

    def _apply(self, buffer, steady: bool = False) -> None:
        self.state = apply_buffer(self.executables, self.state, buffer, self.config, steady=steady)

    def prepare(self, num_tokens_padded: int):
        """The step's `StepInputs` from the current state (`prepare_padded`, ``config.prep``)."""
        return run(self.executables, ("prepare", num_tokens_padded), prepare_padded, self.state.batch,
                   config=self.config.prep, num_tokens_padded=num_tokens_padded)

    def update_and_prepare(self, updates: StepUpdates | ColumnsUpdate | CheckedUpdate,
                           num_tokens_padded: int) -> StepBuffer:
        """Checks ``updates``, then applies them and prepares the step in ONE jitted call (the state donated,
        `step.update_and_prepare_buffer`); returns the step as one `StepBuffer` (`StepBuffer.inputs` for its
        `StepInputs`, `torch_bridge.to_torch` for torch). An update too big for the bucket's door rungs
        (`door_rungs`: the step payload rungs, and at a bucket that takes admissions whole the bulk rung) sends
        its leading buffers first (`transitions.apply_packed`), as `serve` does past the step payload rungs.
        Raises `InvalidUpdateError` with nothing dispatched, also for a bucket that is not one of
        ``config.prep.token_buckets`` or that the scheduled total does not fit."""
        rows, updates = self._checked(updates)
        check_bucket(rows, num_tokens_padded, self.config)
        step = self.dispatch_prepare(self.pack(updates, num_tokens_padded), num_tokens_padded)
        self.rows = rows
        return step

    def dispatch_prepare(self, packed: PackedStep, num_tokens_padded: int) -> StepBuffer:
        """`update_and_prepare`'s device part for a checked update already packed (``batch.pack(updates)``):
        the leading buffers (if any), then the one call; the caller keeps the checked mirror."""
        for buffer in packed.before:
            self._apply(buffer)
        # a decode step: the smaller program (`steady_programs`, `update_packing.is_steady`, `steady_buckets`)
        steady = self.steady_programs and packed.steady and num_tokens_padded in steady_buckets(self.config)
        buffer = door_buffer(self.config, num_tokens_padded, packed.step, steady)
        self.state, step = run(self.executables, ("door", num_tokens_padded, len(buffer), steady),
                               update_and_prepare_buffer, self.state, buffer, config=self.config,
                               num_tokens_padded=num_tokens_padded, steady=steady)
        return step

    def record_sampled(self, idx_mapping, sampled_token_ids, num_sampled) -> None:
        """Records one step's samples (``idx_mapping`` [B], ``sampled_token_ids`` [B, n] or [B],
        ``num_sampled`` [B]). ``idx_mapping`` may be the step's `StepBuffer` (`update_and_prepare`'s): its
        field is read inside the record's own jit, no dispatch of its own.

        Host arrays are checked (shapes, rows, counts, token ids against vocab_size) and the mirror
        advances exactly. Device arrays (`jax.Array`) are never read: only their shapes are checked;
        the device sets `ServingState.errors` bits for values it cannot take (`errors`), and the
        mirror advances by what the host knows (`checks.advance_unread`): rows with drafts become
        pending until a `ResumeRequests` entry states their ``num_computed_tokens``.
        """
        rows, arrays = self._record(idx_mapping, sampled_token_ids, num_sampled)
        self.state = transitions.record_sampled(self.state, *arrays, vocab_bound=self.config.vocab_size)
        self.rows = rows

    def _record(self, idx_mapping, sampled_token_ids, num_sampled):
        """`record_sampled`'s checks: the mirror after the record, and the arrays to send (sampled [B, n])."""
        arrays = (idx_mapping, sampled_token_ids, num_sampled)
        if any(isinstance(a, (jax.Array, StepBuffer)) for a in arrays):
            return checks.advance_unread(self.rows, self.config), _device_shapes(*arrays)
        rows = checks.check_record(self.rows, *arrays, self.config)
        idx_mapping, num_sampled = (np.asarray(a, np.int32) for a in (idx_mapping, num_sampled))
        sampled_token_ids = np.asarray(sampled_token_ids, np.int64).astype(np.int32)
        if sampled_token_ids.ndim == 1:
            sampled_token_ids = sampled_token_ids[:, None]
        return rows, (idx_mapping, sampled_token_ids, num_sampled)

    def record_prev_tokens(self, idx_mapping, sampled_token_ids, num_sampled, draft_token_ids=None) -> None:
        """Under async scheduling with `FeatureConfig.async_tokens`: keeps this step's batch rows, last
        sampled tokens and the drafter's ``draft_token_ids`` [B, K] (device arrays, never read) for the
        next step's ``input_ids`` (`transitions.record_prev_tokens`). Call it before `record_sampled`, or
        call both as one (`record_with_prev_tokens`)."""
        self._need_prev_tokens("record_prev_tokens")
        idx_mapping, sampled_token_ids, num_sampled = _device_shapes(idx_mapping, sampled_token_ids, num_sampled)
        if draft_token_ids is not None:
            draft_token_ids = self._checked_drafts(draft_token_ids, sampled_token_ids.shape[0])
        self.state = transitions.record_prev_tokens(self.state, idx_mapping, sampled_token_ids, num_sampled,
                                                    draft_token_ids, vocab_bound=self.config.vocab_size)

    def record_with_prev_tokens(self, idx_mapping, sampled_token_ids, num_sampled, draft_token_ids=None) -> None:
        """`record_prev_tokens` and then `record_sampled` in one jitted call (`transitions.record_with_prev_tokens`):
        a step's record under async scheduling, one dispatch instead of two. Every check of both comes first, so
        an input either refuses (`InvalidUpdateError`, naming it) with nothing recorded, or is recorded whole."""
        self._need_prev_tokens("record_with_prev_tokens")
        rows, (idx_mapping, sampled_token_ids, num_sampled) = self._record(idx_mapping, sampled_token_ids,
                                                                           num_sampled)
        if draft_token_ids is not None:
            draft_token_ids = self._checked_drafts(draft_token_ids, sampled_token_ids.shape[0])
        self.state = transitions.record_with_prev_tokens(self.state, idx_mapping, sampled_token_ids, num_sampled,
                                                         draft_token_ids, vocab_bound=self.config.vocab_size)
        self.rows = rows

    def _need_prev_tokens(self, call: str) -> None:
        if "prev_sampled_token_ids" not in self.state.layout:
            raise ValueError(f"{call} needs FeatureConfig.async_tokens")

    def _checked_drafts(self, draft_token_ids, num_batch_rows: int):
        """The drafter's proposals [B, <= K]: shape and dtype always; the ids too when they are on the host
        (-1 allowed: a placeholder). Device ids are not read: the device sets ``ERROR_BITS["draft_token_id"]``."""
        on_device = isinstance(draft_token_ids, jax.Array)
        drafts = draft_token_ids if on_device else np.asarray(draft_token_ids)
        width = draft_width(self.config)
        if drafts.ndim != 2 or drafts.shape[0] != num_batch_rows or drafts.shape[1] > width:
            raise checks.InvalidUpdateError(f"record_prev_tokens.draft_token_ids has shape {drafts.shape}, expected "
                                            f"[B={num_batch_rows}, <= num_speculative_tokens={width}]")
        if on_device:
            if not jax.numpy.issubdtype(drafts.dtype, jax.numpy.integer):
                raise checks.InvalidUpdateError(f"record_prev_tokens.draft_token_ids must hold integers, got dtype "
                                                f"{drafts.dtype}")
            return drafts
        check_token_ids("record_prev_tokens.draft_token_ids", drafts, self.config.token_id_bound,
                        checks.InvalidUpdateError, allow_placeholder=True)
        return drafts.astype(np.int32)

    def errors(self) -> dict[str, bool]:
        """The device's error word read back (a host read): which `ERROR_BITS` are set."""
        word = int(np.asarray(self.state.errors)[0])
        return {name: bool(word & bit) for name, bit in ERROR_BITS.items()}

    # --- jaxprep's own serving step ------------------------------------------------------------

    def serve(self, kv_cache: KVCache, params, updates: StepUpdates, *, model: ServingModel,
              num_tokens_padded: int, packed: PackedStep | None = None) -> tuple[KVCache, np.ndarray]:
        """Checks ``updates``, runs `serve_step` (donating the state and ``kv_cache``) and reads back
        the appended tokens [config.decode_steps, max_num_reqs] (-1 = none).

        ``packed``: ``batch.pack(updates)`` if the caller has it already.
        """
        rows, kv_cache, tokens = self._run(kv_cache, params, updates, model, num_tokens_padded, packed)
        tokens = np.asarray(tokens)
        self.rows = advance_rows(rows, tokens, self.config.num_speculative_tokens)
        return kv_cache, tokens

    def dispatch(self, kv_cache: KVCache, params, updates: StepUpdates, predicted: np.ndarray, *,
                 model: ServingModel, num_tokens_padded: int, packed: PackedStep | None = None):
        """`serve` without waiting: returns the KV cache and the step's tokens as a device array, and
        advances the mirror by ``predicted`` ([1, max_num_reqs]: the rows that will append a token,
        `jaxprep.serving.host.overlap.predicted_tokens`). Async scheduling's half of a step."""
        if int(np.asarray(updates.decode_steps)[0]) != 1:
            raise checks.InvalidUpdateError("dispatch runs single steps: decode_steps must be 1")
        check_dispatchable(self.config)
        rows, kv_cache, tokens = self._run(kv_cache, params, updates, model, num_tokens_padded, packed)
        self.rows = advance_rows(rows, predicted)
        return kv_cache, tokens

    def _run(self, kv_cache, params, updates, model, num_tokens_padded, packed):
        rows, checked = self._checked(updates)
        decode_steps = int(np.asarray(checked.decode_steps)[0])
        checks.check_step(rows, decode_steps, num_tokens_padded, self.config)
        if packed is None or checked is not updates:  # what was checked, packed for the step's bucket
            packed = self.pack(checked, num_tokens_padded)
        for buffer in packed.before:
            self._apply(buffer)
        if self.separate_updates:
            self._apply(packed.step, self.steady_programs and packed.steady)
            self.state, kv_cache, tokens = run(self.executables, ("run_step", model, num_tokens_padded), run_step,
                                               self.state, kv_cache, params, np.int32(decode_steps), config=self.config,
                                               model=model, num_tokens_padded=num_tokens_padded)
            return rows, kv_cache, tokens
        buffer = door_buffer(self.config, num_tokens_padded, packed.step)  # at most two programs per bucket
        self.state, kv_cache, tokens = run(self.executables, ("serve_step", model, num_tokens_padded, len(buffer)),
                                           serve_step, self.state, kv_cache, params, buffer, config=self.config,
                                           model=model, num_tokens_padded=num_tokens_padded)
        return rows, kv_cache, tokens


@functools.lru_cache(maxsize=64)
def steady_buckets(config: ServingConfig) -> tuple[int, ...]:
    """The token buckets the door's step has a steady program at (`update_and_prepare_buffer`'s ``steady``): those
    a decode step of every row can use, up to the first holding max_num_reqs x (1 + K) tokens (K:
    `state.draft_width`). A steady step above them (a chunked prefill going on) takes the general program, where
    the prepare's work outweighs the update's.

    ```
    # 16 rows, no drafts, buckets (8, 16, 32, 64) -> (8, 16); 16 rows, 3 drafts -> (8, 16, 32, 64)
    ```
    """
    prep = config.prep
    decode = min(prep.max_num_reqs * (1 + draft_width(config)), prep.max_tokens_per_step)
    return tuple(b for b in prep.reachable_buckets if b <= prep.bucket_for(decode))


@functools.lru_cache(maxsize=256)
def door_rungs(config: ServingConfig, bucket: int, steady: bool = False) -> tuple[int, ...]:
    """The step payload rungs (`step_payload_buckets`) the door's step is compiled at for ``bucket``: the smallest
    that holds a step of as many scheduled rows as the bucket has tokens (max_num_reqs at most), each a sparse
    schedule entry with its drafts and an appended block in every table, with the LoRA slots; and the top one.
    A step's buffer is padded on the host to the first of them that holds it (`door_buffer`), so a warm-up
    compiles at most two door programs per bucket, not one per rung (at 256 requests 28 in place of 140,
    `ServingBatch.warmup`), and the `Engine`'s fused serving step likewise (`serve`); the device reads a buffer
    only as far as its header counts, so the padding changes nothing but the sections' static sizes.

    A general program (any update: the door's, the `Engine`'s serving step) at a bucket that takes a step's
    admissions whole (`takes_admissions_whole`) has the bulk rung (`bulk_rungs`) for its top, so such a step's
    update and the step go in one call, not a bulk `transitions.apply_packed` and then the step; as many programs
    as before. A ``steady`` program (the door's, for updates that add no row) keeps the top step rung.

    ```
    # 256 rows, rungs (64, 96, 144, 224, 336, 512, 768), 2 schedule fields, 1 table:
    #   bucket 8: 10 + 8 * 2 + 8 * 5 = 66 words -> (96, 768); bucket 256 -> (768,)
    # and with a bulk rung of 3888 words: bucket 1024 (more tokens than 768 words) -> (3888,), steady (768,)
    ```
    """
    lay, rungs = payload_layout(config), step_payload_buckets(config)
    n = min(bucket, config.max_num_reqs)
    words = (HEADER_WORDS + n * len(lay.schedule_fields) + n * lay.num_tables * (len(SEGMENT_FIELDS) + 1)
             + lay.max_loras)
    smallest, top = next((r for r in rungs if r >= words), rungs[-1]), rungs[-1]
    if not steady and takes_admissions_whole(config, bucket):
        return (*((smallest,) if smallest < top else ()), bulk_rungs(config)[0])
    return tuple(sorted({smallest, top}))


def takes_admissions_whole(config: ServingConfig, bucket: int) -> bool:
    """Whether the general programs at ``bucket`` run at the bulk rung (`door_rungs`): where the bucket
    holds more tokens than the top step rung has words, so a step that fills it with new requests' prompts
    (a word per token) never fits that rung, and there is a bulk rung (`bulk_rungs`) to hold it.

    ```
    # 64 rows, step rungs (64, 96, 144), bulk rung 1728: buckets 192, 256, ..., 1024 -> True; 128 -> False
    ```
    """
    return bucket > step_payload_buckets(config)[-1] and bool(bulk_rungs(config))


def door_programs(config: ServingConfig, buckets: tuple[int, ...], steady: bool = False) -> dict[int, tuple[int, ...]]:
    """The door programs (general, or ``steady``) a warm-up compiles at ``buckets``: per payload rung (`door_rungs`,
    rung by rung), the buckets, in their order, whose `door_rungs` include it."""
    rungs = {b: door_rungs(config, b, steady) for b in buckets}
    return {words: tuple(b for b in buckets if words in rungs[b]) for words in sorted(set().union(*rungs.values()))}


def door_words(config: ServingConfig, bucket: int, words: int, steady: bool = False) -> int:
    """The first of ``bucket``'s `door_rungs` that holds a step's buffer of ``words`` words (``words`` itself for a
    buffer longer than the top rung, which `pack_step` never makes: it goes as it is)."""
    return next((r for r in door_rungs(config, bucket, steady) if r >= words), words)


def door_step_words(config: ServingConfig, bucket: int | None) -> int | None:
    """The largest buffer a general program takes at ``bucket`` (its top `door_rungs`): what a step's update is
    packed to fit whole (`update_packing.pack_columns`' ``step_words``); None for no bucket (updates applied
    alone: the packing's default)."""
    return None if bucket is None else door_rungs(config, bucket)[-1]


def door_buffer(config: ServingConfig, bucket: int, buffer: np.ndarray, steady: bool = False) -> np.ndarray:
    """A step's buffer padded with zeros to the first of ``bucket``'s `door_rungs` that holds it."""
    return pad_to(buffer, door_words(config, bucket, len(buffer), steady))


def apply_buffer(executables: dict, state: ServingState, buffer, config: ServingConfig, apply=None,
                 steady: bool = False, **static) -> ServingState:
    """One packed buffer of any rung applied by ONE executable, ``apply`` (default `transitions.apply_packed`;
    ``static``: its other static arguments) at the top rung of `payload_buckets`: a shorter buffer is sent as it
    is and widened on the device first (`widen_packed`, a copy per rung); a large update's leading buffer at the
    bulk rung (`update_packing.bulk_rungs`) by ``apply`` at that rung. ``executables``: the owner's warm-up
    table (`update_executables`). ``steady``: a steady buffer (`update_packing.is_steady`) of a step rung
    (`step_payload_buckets`: a step's own buffer) is applied at its rung by `transitions.apply_packed`'s steady
    program, without the widening (the default ``apply`` only)."""
    words = buffer.shape[-1]
    if steady and words in step_payload_buckets(config):
        return run(executables, ("apply", True, words), transitions.apply_packed, state, buffer, config=config,
                   steady=True)
    top = payload_buckets(config)[-1]
    if words > top:  # a leading buffer of a large update, at the bulk rung (`update_packing.bulk_rungs`)
        return run(executables, ("apply", False, words), apply or transitions.apply_packed, state, buffer,
                   config=config, **static)
    if words < top:
        buffer = run(executables, ("widen", words), widen_packed, buffer, config=config)
    return run(executables, ("apply", False), apply or transitions.apply_packed, state, buffer, config=config,
               **static)


def update_executables(state: ServingState, config: ServingConfig, empty, apply=None, steady: bool = False,
                       **static):
    """The executables `apply_buffer` runs, for a warm-up: ``apply`` at the top payload rung and at the bulk rung
    (`update_packing.bulk_rungs`), with ``steady``
    `transitions.apply_packed`'s steady program at each step rung, then `widen_packed` for each smaller rung;
    ``empty(words)``: a buffer of that length (sharded as the live ones are)."""
    rungs = payload_buckets(config)
    yield Executable(("apply", False), apply or transitions.apply_packed, (state, empty(rungs[-1])),
                     dict(config=config, **static), f"state updates of {rungs[-1]} words")
    for bulk in bulk_rungs(config):
        yield Executable(("apply", False, bulk), apply or transitions.apply_packed, (state, empty(bulk)),
                         dict(config=config, **static), f"a large update's leading buffers of {bulk} words")
    for words in step_payload_buckets(config) if steady else ():
        yield Executable(("apply", True, words), transitions.apply_packed, (state, empty(words)),
                         dict(config=config, steady=True), f"steady state updates of {words} words")
    for words in rungs[:-1]:
        yield Executable(("widen", words), widen_packed, (empty(words),), dict(config=config),
                         f"updates of {words} words widened to {rungs[-1]}")


def _bulk_words(config: ServingConfig) -> str:
    """The bulk rung in the warm-up's words: ", the leading buffers of a large update at 1728 words" or ""."""
    return "".join(f", a large update's leading buffers at {words} words" for words in bulk_rungs(config))


def _empty(words: int) -> np.ndarray:
    """An empty update buffer of ``words`` words (what a warm-up lowers each rung with)."""
    return np.zeros(words, np.int32)


def _only(config: ServingConfig, **parts) -> StepUpdates:
    """A `StepUpdates` with only ``parts``; without a schedule the scheduled counts are kept."""
    empty = StepUpdates.build(config)
    fields = dict(finish=empty.finish, add=empty.add, resume=empty.resume, append=empty.append, schedule=None,
                  decode_steps=empty.decode_steps)
    return StepUpdates(**{**fields, **parts})


def _device_shapes(idx_mapping, sampled_token_ids, num_sampled):
    """Shape checks of device arrays (no read): [B], [B, n] (or [B]), [B], integers. A `StepBuffer` in place of
    ``idx_mapping`` is checked by its field's shape and passed on as it is."""
    given = idx_mapping
    if isinstance(idx_mapping, StepBuffer):
        idx_mapping = jax.ShapeDtypeStruct(idx_mapping.layout.by_name["idx_mapping"].shape, jax.numpy.int32)
    arrays = [a if isinstance(a, jax.ShapeDtypeStruct) else jax.numpy.asarray(a)
              for a in (idx_mapping, sampled_token_ids, num_sampled)]
    names = ("idx_mapping", "sampled_token_ids", "num_sampled")
    for name, array in zip(names, arrays):
        if not jax.numpy.issubdtype(array.dtype, jax.numpy.integer):
            raise checks.InvalidUpdateError(f"record_sampled.{name} must hold integers, got dtype {array.dtype}")
    idx, sampled, counts = arrays
    if sampled.ndim == 1:
        sampled = sampled[:, None]
    same_rows = idx.shape[:1] == sampled.shape[:1] == counts.shape[:1]
    if idx.ndim != 1 or sampled.ndim != 2 or counts.ndim != 1 or not same_rows:
        raise checks.InvalidUpdateError(f"record_sampled: shapes idx_mapping {idx.shape}, sampled_token_ids "
                                        f"{sampled.shape}, num_sampled {counts.shape} must be [B], [B, n], [B]")
    return given if isinstance(given, StepBuffer) else idx, sampled, counts


def check_bucket(rows: checks.HostRows, num_tokens_padded: int, config: ServingConfig) -> None:
    """The step's bucket is a rung of ``config.prep.token_buckets`` that holds the scheduled total (on the mirror
    after the update), so the prepared call cannot fail after an update went out."""
    buckets = config.prep.token_buckets
    if isinstance(num_tokens_padded, bool) or not isinstance(num_tokens_padded, (int, np.integer)) \
            or num_tokens_padded not in buckets:
        raise checks.InvalidUpdateError(f"num_tokens_padded={num_tokens_padded!r} is not one of "
                                        f"PrepConfig.token_buckets {buckets}")
    total = int(np.add.reduce(rows.num_scheduled_tokens))
    if total > num_tokens_padded:
        raise checks.InvalidUpdateError(f"sum(num_scheduled_tokens)={total} exceeds num_tokens_padded="
                                        f"{num_tokens_padded}")


def check_dispatchable(config: ServingConfig) -> None:
    """`ServingBatch.dispatch` (async scheduling) runs without drafts: how many drafts a row keeps is
    known only after its step, so the host cannot predict the tokens it appends."""
    if config.num_speculative_tokens:
        raise checks.InvalidUpdateError("dispatch runs without drafts: ServingConfig.num_speculative_tokens "
                                        f"must be 0, got {config.num_speculative_tokens}")


def advance_rows(rows: checks.HostRows, tokens: np.ndarray, num_speculative_tokens: int = 0) -> checks.HostRows:
    """The mirror after a serving step appended ``tokens`` [slots, max_num_reqs] (`AppendedTokens`);
    rejected drafts are not computed. The counters it advances are new arrays (``rows`` may share its arrays
    with the mirror it was checked from: `column_checks.check_columns`)."""
    appended = AppendedTokens(tokens, num_speculative_tokens)
    rows.num_computed_tokens = rows.num_computed_tokens + appended.computed_advance(rows.num_scheduled_tokens,
                                                                                    rows.num_draft_tokens)
    rows.num_tokens = rows.num_tokens + appended.num_appended
    rows.num_scheduled_tokens = np.zeros_like(rows.num_scheduled_tokens)
    rows.num_draft_tokens = np.zeros_like(rows.num_draft_tokens)
    return rows
