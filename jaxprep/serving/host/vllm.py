"""vLLM's scheduler drives jaxprep: one `SchedulerOutput` in, one checked update, one prepared step out.

`VllmAdapter` sits at the edge (STYLE rule 17): it reads vLLM 0.33.0's
`vllm/v1/core/sched/output.py::SchedulerOutput` by attribute (vLLM itself is imported only by
`VllmAdapter.runner_output`), keeps the request-id -> state-row map, and turns each step into ONE
`StepUpdates` for `ServingBatch.apply_updates`; the core never sees a vLLM name.

A step is never half taken: `VllmAdapter.step` first reads the whole output into a plan (the checks
of `jaxprep.serving.host.vllm_checks`, one pass, and the translation, on copies of the request map made
only when the step changes it), then the batch checks the plan's `StepUpdates` on the host and
applies it, and only then does the adapter keep the plan's request map, free rows and LoRA slots.
A malformed output raises `InvalidSchedulerOutputError` (or `InvalidUpdateError`) naming the object
and the field, with nothing written anywhere.

The common step (no request resumed, no drafts or grammar rows, no feature value per request: most of
vLLM's steps) skips the `StepUpdates`: `jaxprep.serving.host.vllm_columns` reads it in one pass straight
into the buffer's columns, `jaxprep.serving.host.column_checks` checks them at once against the mirror,
and they are packed as they are (issue 37). A step of any other shape, and one that breaks a bound, is
read the general way, which names what is wrong; both ways give the same buffer, bit for bit
(tests/serving/test_vllm_columns.py).

What each part of the scheduler output becomes, following the two runners that consume it
(`vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._update_states`, "V1", and
`vllm/v1/worker/gpu/model_runner.py::GPUModelRunner` ``finish_requests`` / ``add_requests`` /
``update_requests``, "V2"):

- ``finished_req_ids``: the row is freed and the request forgotten.
- ``preempted_req_ids``: the row is freed (V2 ``finish_requests`` frees preempted requests too; V1
  drops them from its persistent batch and keeps only host state). The request's admission values
  (sampling parameters, prompt length, adapter, M-RoPE positions) stay on the host for its return.
- ``scheduled_new_reqs``: an `AddRequests` entry in the lowest free row: ``prefill_token_ids``
  (V2: prompt plus the outputs of a request resumed as new) or ``prompt_token_ids``, its block ids
  per KV-cache group, ``num_computed_tokens`` (prefix-cache hits), ``prefill_len`` = the tokens given,
  the LoRA adapter id, the sampling parameters and the M-RoPE positions where those features are on.
- ``scheduled_cached_reqs``: a request in ``resumed_req_ids`` (V1) comes back in a free row with
  ``all_token_ids`` and its new blocks replacing the old; any other appends ``new_block_ids`` per
  group (`AppendBlocks`) and, when the host mirror disagrees with ``num_computed_tokens`` or still
  waits for a draft outcome (`ResumeRequests`), has its computed count set.
- ``num_scheduled_tokens`` and ``scheduled_spec_decode_tokens``: the `Schedule` (draft counts and
  draft ids, -1 placeholders included, below).
- the step's ``GrammarOutput`` (``scheduler.get_grammar_bitmask(scheduler_output)``, given to `step`):
  each structured-output request's bitmask row block (`Schedule.grammar_index`), and the bitmask itself
  on `AdapterStep` for `jaxprep.features.grammar.apply_grammar_bitmask`.

-1 placeholder drafts, as vLLM has them. vLLM's schedulers send ``[-1] * K`` drafts in two cases: the
sync ``Scheduler`` pads a new or resumed request that has exactly one token left to compute, when no
prefill is scheduled yet in that step, to ``1 + K`` tokens "to preserve full cudagraph"
(``pad_spec_decode`` in `vllm/v1/core/sched/scheduler.py::Scheduler.schedule`); the ``AsyncScheduler``
schedules every decoding request's drafts as placeholders (below). Both runners read them as drafts
that are never accepted and feed the model 0 there: V1 writes them into its token table
(`InputBatch.update_req_spec_token_ids`), gathers the draft ids before ``_preprocess`` clamps
``input_ids`` to >= 0, and the rejection sampler never matches -1; V2 writes its own (zeroed) drafts of
a new request into ``input_ids`` and marks the drafts of a step that starts inside the prefill as -1
(`vllm/v1/worker/gpu/spec_decode/rejection_sampler.py::_gather_draft_sampled_kernel`). jaxprep's step
does the same whenever spec decode is on (`jaxprep.features.async_tokens.clamp_placeholders`). The sync
scheduler's count stays exact (a pad request computes its last prompt token; its drafts are rejected).

Async scheduling with drafts (EAGLE/MTP-style drafters: V1 refuses n-gram there,
`vllm/config/vllm.py::VllmConfig.__post_init__`): `vllm/v1/core/sched/async_scheduler.py::AsyncScheduler`
schedules step N + 1 before step N's drafts are verified, with ``[-1] * K`` placeholder drafts and a
``num_computed_tokens`` that counts step N's drafts as accepted; `Scheduler.update_from_output` takes the
rejected ones back later. V1 fills the placeholders on the device from its drafter
(`GPUModelRunner._prepare_input_ids`) and corrects the count there
(`vllm/v1/spec_decode/utils.py::update_num_computed_tokens_for_batch_change`). The adapter does the same:
such a row is restated with ``unverified_drafts`` (the device keeps its own count), and
`VllmAdapter.record_sampled` takes the drafter's ``draft_token_ids`` for the next step's ``input_ids``.

The batch order is the state-row order of the scheduled rows (``FeatureConfig.reorder=None``):
`AdapterStep.req_ids` / ``req_id_to_index`` give it to vLLM's ``ModelRunnerOutput``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from jaxprep._constants import NO_LORA_ID
from jaxprep.features.config import MROPE_NUM_DIMS
from jaxprep.features.sampling_params import SamplingParams
from jaxprep.metadata import StepInputs
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.host import column_checks, vllm_checks
from jaxprep.serving.host.batch import CheckedUpdate, ServingBatch
from jaxprep.serving.host.vllm_checks import InvalidSchedulerOutputError, fail
from jaxprep.serving.host.vllm_columns import ColumnReader
from jaxprep.serving.host.vllm_config import (
    AdapterUsageError,
    batch_rows,
    check_new_blocks,
    check_recorded,
    host_lists,
    sampled_counts,
    serving_config_from_vllm,
)
from jaxprep.serving.host.vllm_requests import Admission, RequestMap
from jaxprep.serving.state import AppendBlocks, StepUpdates, draft_width, num_kv_groups
from jaxprep.step_buffer import StepBuffer

GRAMMAR_NOT_GIVEN = object()
"""`VllmAdapter.step`'s default ``grammar_output``: none given (an explicit None is the ``None`` that
``Scheduler.get_grammar_bitmask`` returns for a step without structured-output rows)."""


@dataclasses.dataclass(frozen=True)
class AdapterStep:
    """One prepared step and the request ids of its batch rows.

    The step leaves the device call as ONE int32 buffer, ``buffer`` (`jaxprep.step_buffer.StepBuffer`): a JAX
    model reads its fields inside its own jit (``buffer.views()``), torch takes it with one DLPack handoff
    (``torch_bridge.to_torch(step.buffer)``), NumPy views it (``buffer.to_numpy()``). ``inputs`` is the same
    step as `StepInputs` of JAX arrays (unpacked by one more jitted call, on first use).

    Attributes:
      buffer: the prepared step at ``num_tokens_padded`` tokens, as one buffer; ``None`` when the output
        scheduled nothing (vLLM sends such a step to report finished requests).
      req_ids: batch row -> request id, vLLM's ``ModelRunnerOutput.req_ids``.
      num_tokens_padded: the bucket of ``PrepConfig.token_buckets`` the step was prepared at (0: nothing
        scheduled).
      grammar_bitmask: the ``GrammarOutput``'s bitmask ``[G * (1 + K), words]`` int32, rows in its
        ``structured_output_request_ids`` order (``inputs.grammar`` maps each logits row to its bitmask
        row); ``None``: no structured-output rows this step.
      num_acceptable_drafts: the ``GrammarOutput``'s ``num_acceptable_drafts``, per bitmask block.
    """

    buffer: StepBuffer | None
    req_ids: list[str]
    num_tokens_padded: int
    grammar_bitmask: np.ndarray | None = None
    num_acceptable_drafts: list[int] | None = None

    @functools.cached_property
    def req_id_to_index(self) -> dict[str, int]:
        """request id -> batch row, vLLM's ``ModelRunnerOutput.req_id_to_index`` (built on first use: a loop that
        reads the rows from ``req_ids`` alone never pays for it)."""
        return _batch_rows(self.req_ids)

    @functools.cached_property
    def inputs(self) -> StepInputs | None:
        """`prepare_padded`'s `StepInputs` of this step (JAX arrays, equal field for field); None: nothing scheduled."""
        return None if self.buffer is None else self.buffer.inputs()


@dataclasses.dataclass(slots=True)
class _Plan:
    """A scheduler output read whole: the update (as a `StepUpdates`, or checked and packed already: a common
    step), and the adapter's state once the batch has taken it."""

    updates: StepUpdates | None
    requests: RequestMap
    lora_slots: np.ndarray | None
    verifying: dict
    scheduled: dict  # num_scheduled_tokens
    total: int
    num_tokens_padded: int
    grammar: tuple | None  # (rows, bitmask, num_acceptable_drafts) of the GrammarOutput
    scheduled_rows: np.ndarray | None = None  # the rows of ``scheduled``, in its order, where the plan knows them
    checked: CheckedUpdate | None = None  # a common step's update, read as columns (`vllm_columns`), checked, packed


class VllmAdapter:
    """Keeps a `ServingBatch` in step with vLLM's scheduler.

    Built from vLLM's own configuration with ``VllmAdapter.from_vllm(vllm_config, kv_cache_config)``. Per
    step: ``step = adapter.step(scheduler_output)`` (with structured outputs,
    ``adapter.step(scheduler_output, scheduler.get_grammar_bitmask(scheduler_output))``), run the model on
    ``step.inputs`` (``None`` when nothing is scheduled), then hand vLLM
    ``adapter.take_sampled(step, sampled_token_ids)``: the sampler's device array in batch order, recorded on
    the device and returned as vLLM's ``ModelRunnerOutput``. (`record_sampled` and `runner_output` are the
    two halves of that call.)

    ``async_scheduling``: vLLM's scheduler is the ``AsyncScheduler`` (``--async-scheduling``). With
    speculative decoding it needs ``FeatureConfig.async_tokens``, and ``record_sampled`` takes the
    drafter's proposals.

    ``mrope_positions`` (``FeatureConfig.mrope``): ``fn(new_request_data) -> (positions [3, P], delta)``
    for a request with multimodal features, as the model's ``get_mrope_input_positions(prompt_token_ids,
    mm_features)`` gives them to vLLM's runner (e.g. from `jaxprep.qwen2vl_prompt_positions`); text-only
    requests get vLLM's text positions (``arange`` on all three rows, delta 0) without it.
    """

    @classmethod
    def from_vllm(cls, vllm_config, kv_cache_config, *, features=None, mrope_positions: Callable | None = None,
                  **prep_options) -> VllmAdapter:
        """An adapter for the scheduler built from ``vllm_config`` (vLLM's ``VllmConfig``) and
        ``kv_cache_config`` (its ``KVCacheConfig``): block size, batch sizes, model length, number of blocks,
        KV-cache groups and sliding windows, speculative and LoRA settings, async scheduling and the
        vocabulary read from them (`jaxprep.serving.host.vllm_config.serving_config_from_vllm`, which also
        takes ``features`` vLLM does not decide and other ``PrepConfig`` fields, ``prep_options``)."""
        config = serving_config_from_vllm(vllm_config, kv_cache_config, features=features, **prep_options)
        return cls(config, async_scheduling=bool(vllm_config.scheduler_config.async_scheduling),
                   mrope_positions=mrope_positions)

    def __init__(self, config: ServingConfig, *, async_scheduling: bool = False,
                 mrope_positions: Callable | None = None):
        if config.prep.features.reorder is not None:
            raise ValueError("VllmAdapter gives the batch in state-row order: FeatureConfig.reorder must be None, "
                             f"got {config.prep.features.reorder!r}")
        if async_scheduling and draft_width(config) and not config.prep.features.async_tokens:
            raise ValueError("VllmAdapter(async_scheduling=True) with num_speculative_tokens > 0 needs "
                             "FeatureConfig.async_tokens: the drafts reach input_ids on the device")
        self.config = config
        self.async_scheduling = async_scheduling
        self.mrope_positions = mrope_positions
        self.batch = ServingBatch(config)
        self.rows: dict[str, int] = {}  # request id -> state row, for every request holding a row
        self.admitted: dict[str, Admission] = {}  # every request vLLM has not finished, preempted ones too
        self._free = list(range(config.max_num_reqs))  # kept sorted: the lowest free row is taken first
        self._lora_slots = np.full(config.prep.features.lora.max_loras, -1, np.int64) \
            if config.prep.features.lora is not None else None
        self._last: AdapterStep | None = None
        self._verifying: dict[str, int] = {}  # request id -> drafts the last prepared step verifies
        self._num_groups = num_kv_groups(config)
        self._sampling = config.prep.features.sampling is not None  # only then are the parameters read
        # common steps read as columns (`vllm_columns`), where the configuration allows
        self._columns = ColumnReader(config) if column_checks.covers(config) else None
        self._recorded = True  # the last prepared step's samples were recorded (none prepared yet)
        self._ordered = (None, False)  # (rows, whether they ascend) of the last read-only rows asked (`_in_row_order`)

    # --- one step --------------------------------------------------------------------------------

    def step(self, scheduler_output, grammar_output=GRAMMAR_NOT_GIVEN) -> AdapterStep:
        """Applies ``scheduler_output`` as one checked `StepUpdates` and prepares the step. A bad output
        raises (`InvalidSchedulerOutputError`, `InvalidUpdateError`, both ValueErrors naming the field)
        before anything is written: the adapter, its batch and the device state are unchanged.

        ``grammar_output``: the step's ``scheduler.get_grammar_bitmask(scheduler_output)`` (None or a
        ``GrammarOutput``); required when ``scheduler_output.has_structured_output_requests``.

        A step that schedules nothing (vLLM sends one to report finished requests) is applied and
        prepares nothing: ``inputs`` is ``None`` and ``req_ids`` is empty, as V1's ``execute_model``
        returns ``EMPTY_MODEL_RUNNER_OUTPUT`` after ``_update_states``."""
        plan = self._plan(scheduler_output, grammar_output)
        check_recorded(self._recorded)  # the door's own mistakes, named: the output itself passed its checks
        check_new_blocks(self.config, scheduler_output)
        # host checks first (they raise with nothing dispatched), then ONE jitted call: update and prepare
        update = plan.checked if plan.checked is not None else plan.updates  # a common step's, checked and packed
        buffer = None
        if plan.total == 0:
            self.batch.apply_updates(update)
        else:
            buffer = self.batch.update_and_prepare(update, plan.num_tokens_padded)
        self.rows, self.admitted, self._free = plan.requests.rows, plan.requests.admitted, plan.requests.free
        if plan.lora_slots is not None:
            self._lora_slots = plan.lora_slots
        self._verifying = plan.verifying
        if buffer is None:
            self._last = None
            return AdapterStep(buffer=None, req_ids=[], num_tokens_padded=0)
        req_ids, rows = list(plan.scheduled), plan.scheduled_rows
        if rows is None or not self._in_row_order(rows):  # already in row order: no sort
            req_ids.sort(key=self.rows.__getitem__)
        grammar = plan.grammar or (None, None, None)
        self._recorded = False
        self._last = AdapterStep(buffer=buffer, req_ids=req_ids, num_tokens_padded=plan.num_tokens_padded,
                                 grammar_bitmask=grammar[1], num_acceptable_drafts=grammar[2])
        return self._last

    def _in_row_order(self, rows: np.ndarray) -> bool:
        """Whether ``rows`` ascend; the answer for a read-only array kept for the next step (a decode step of the
        same requests hands the same array again, `vllm_columns.ColumnReader`)."""
        held, ascending = self._ordered
        if rows is not held:
            ascending = len(rows) < 2 or bool((rows[1:] > rows[:-1]).all())
            if not rows.flags.writeable:
                self._ordered = (rows, ascending)
        return ascending

    def record_sampled(self, sampled_token_ids, num_sampled, draft_token_ids=None) -> None:
        """Records the last step's samples on the device: ``sampled_token_ids`` [R_pad, n] and
        ``num_sampled`` [R_pad] in batch order (device arrays are not read back).

        ``draft_token_ids`` [R_pad, K] (async scheduling only): the drafter's proposals after this step, in
        batch order, as V1's ``_draft_token_ids``; they fill the next step's -1 placeholders of the
        requests in this batch (a request that skips a step gets -1 drafts, never accepted, as in V1)."""
        if draft_token_ids is not None and not self.async_scheduling:
            raise ValueError("record_sampled(draft_token_ids=...) is for async scheduling; without it vLLM's "
                             "scheduler sends the drafts (update_draft_token_ids)")
        if self._last is None:
            raise ValueError("record_sampled needs a prepared step first (VllmAdapter.step)")
        idx_mapping = self._last.buffer  # its idx_mapping is read inside the record's jit
        if self.async_scheduling and self.config.prep.features.async_tokens:  # both records, one call
            self.batch.record_with_prev_tokens(idx_mapping, sampled_token_ids, num_sampled, draft_token_ids)
        else:
            self.batch.record_sampled(idx_mapping, sampled_token_ids, num_sampled)
        self._recorded = True

    def take_sampled(self, step: AdapterStep, sampled_token_ids, num_sampled=None, draft_token_ids=None):
        """The sampler's output of ``step`` recorded on the device (`record_sampled`) and returned as vLLM's
        ``ModelRunnerOutput`` (`runner_output`), for ``scheduler.update_from_output(output, ...)``. Each array
        is read back once, for vLLM's host lists.

        Args:
          step: the step `step` returned last.
          sampled_token_ids: ``[R]`` or ``[R, n]`` in batch order, a JAX or NumPy array (torch:
            ``torch_bridge.from_torch``); ``R`` the real rows (``len(step.req_ids)``) or the padded ones
            (``R_pad``); ``n = 1 + K`` with spec decode, -1 after a row's accepted tokens, as vLLM's rejection
            sampler writes them. ``None`` for a step with no inputs.
          num_sampled: ``[R_pad]``, each row's tokens that count. By default the leading ids >= 0 of each
            real row, none for a partial prefill chunk (`vllm_config.sampled_counts`; it needs
            ``FeatureConfig(discard_request_mask=True)``, which `from_vllm` turns on).
          draft_token_ids: as in `record_sampled` (async scheduling with drafts).

        Raises:
          AdapterUsageError: a step that is not the last one prepared, tokens for a step with no inputs (or
            none for one with inputs), or the discard mask off without ``num_sampled``.
        """
        if step.buffer is None:
            if sampled_token_ids is not None:
                raise AdapterUsageError("take_sampled: this step scheduled nothing (step.inputs is None), so it "
                                        "samples nothing: pass None")
            return self.runner_output(step, [])
        if step is not self._last:
            raise AdapterUsageError("take_sampled(step): step is not the last one adapter.step prepared; take each "
                                    "step's samples before the next adapter.step")
        if sampled_token_ids is None:
            raise AdapterUsageError("take_sampled: this step has inputs; pass its sampled_token_ids [R_pad] or "
                                    "[R_pad, 1 + K]")
        sampled_token_ids = batch_rows(sampled_token_ids, step.inputs.idx_mapping.shape[0])
        if num_sampled is None:
            num_sampled = sampled_counts(self.config, step.inputs, sampled_token_ids)
        self.record_sampled(sampled_token_ids, num_sampled, draft_token_ids)
        return self.runner_output(step, host_lists(sampled_token_ids, num_sampled, len(step.req_ids)))

    @staticmethod
    def runner_output(step: AdapterStep, sampled_token_ids: list[list[int]]):
        """vLLM's ``ModelRunnerOutput`` for ``step``: ``sampled_token_ids[i]`` the valid tokens of batch row i."""
        from vllm.v1.outputs import ModelRunnerOutput

        return ModelRunnerOutput(req_ids=list(step.req_ids), req_id_to_index=_batch_rows(step.req_ids),
                                 sampled_token_ids=sampled_token_ids)

    # --- the translation ---------------------------------------------------------------------------

    def updates(self, scheduler_output, grammar_output=GRAMMAR_NOT_GIVEN) -> StepUpdates:
        """The `StepUpdates` of ``scheduler_output`` (checked as `step` checks it); nothing is changed."""
        return self._general_plan(scheduler_output, grammar_output).updates

    def _plan(self, scheduler_output, grammar_output) -> _Plan:
        """The whole output read, translated and checked, the adapter untouched: every check raises from here.
        A common step is read straight into the buffer's columns and checked at once (`_common_plan`); any other
        step, or one that breaks a bound, the general way (`_general_plan`), which names what is wrong."""
        plan = self._common_plan(scheduler_output, grammar_output) if self._columns is not None else None
        return plan if plan is not None else self._general_plan(scheduler_output, grammar_output)

    def _common_plan(self, scheduler_output, grammar_output) -> _Plan | None:
        """A common step (`vllm_columns`: no request resumed, no drafts, no grammar rows) as a checked, packed
        update; None for any other step, or when a check fails."""
        if grammar_output is not None and (grammar_output is not GRAMMAR_NOT_GIVEN
                                           or getattr(scheduler_output, "has_structured_output_requests", False)):
            return None
        step = self._columns.read(scheduler_output, RequestMap(self.rows, self.admitted, self._free), self.batch.rows)
        if step is None:
            return None
        prep = self.config.prep  # packed for the door at the step's bucket (a total past the budget: refused below)
        padded = prep.bucket_for(step.total) if 0 < step.total <= prep.max_num_batched_tokens else None
        checked = self.batch.check_columns(step.columns, padded)
        if checked is None:
            return None
        if padded is None:  # no tokens (0), or a total the checks let past the budget (bucket_for names it)
            padded = prep.bucket_for(step.total) if step.total else 0
        return _Plan(updates=None, checked=checked, requests=step.requests, lora_slots=None, verifying={},
                     scheduled=scheduler_output.num_scheduled_tokens, total=step.total, num_tokens_padded=padded,
                     grammar=None, scheduled_rows=step.scheduled_rows)

    def _general_plan(self, scheduler_output, grammar_output) -> _Plan:
        """Any step read the general way: the checks of `vllm_checks` and one `StepUpdates`."""
        scheduled, counts, total = vllm_checks.scheduled_counts(scheduler_output)
        vllm_checks.check_request_lists(scheduler_output, len(scheduled))
        cached = scheduler_output.scheduled_cached_reqs
        computed = vllm_checks.cached_computed(cached)
        grammar = self._grammar(scheduler_output, grammar_output, scheduled)
        requests = RequestMap(self.rows, self.admitted, self._free)
        finish = self._finished(requests, scheduler_output)
        add = [self._new_request(requests, new) for new in scheduler_output.scheduled_new_reqs]
        running = []  # indices into cached of the requests that keep their rows
        if not cached.resumed_req_ids:  # the common step: every cached request keeps its row
            running = list(range(len(cached.req_ids)))
        for i, req_id in enumerate(cached.req_ids if cached.resumed_req_ids else ()):
            if req_id in cached.resumed_req_ids:
                add.append(self._resumed_request(requests, cached, i, req_id, computed))
            else:
                running.append(i)
        resume, append, running_rows = self._running_requests(requests, cached, running, computed)
        # a decode step schedules exactly the running requests, in CachedRequestData's order (vLLM fills both from
        # its running list): their rows are known already
        known = running_rows if not add and list(scheduled) == cached.req_ids else None
        schedule, verifying = self._schedule(requests, scheduler_output, scheduled, counts, grammar, known)
        lora_slots = self._lora_update(requests, scheduled)
        updates = StepUpdates.build(self.config, finish=finish, add=add, resume=resume, append=append,
                                    lora_slots=lora_slots, **schedule)
        padded = self.config.prep.bucket_for(total) if 0 < total <= self.config.prep.max_num_batched_tokens else 0
        return _Plan(updates=updates, requests=requests, lora_slots=lora_slots, verifying=verifying,
                     scheduled=scheduled, total=total, num_tokens_padded=padded, grammar=grammar, scheduled_rows=known)

    def _finished(self, requests: RequestMap, scheduler_output) -> list[int]:
        """Rows of finished and preempted requests (and of V1-resumed ones still holding a row: vLLM's
        forced preemption by ``reset_prefix_cache`` resumes a request in the step that preempts it)."""
        rows = []
        for req_id in scheduler_output.finished_req_ids:
            requests.forget(req_id)
            if req_id in requests.rows:
                rows.append(requests.release(req_id))
        leaving = set(scheduler_output.preempted_req_ids or ()) | set(
            scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        rows += [requests.release(req_id) for req_id in sorted(leaving) if req_id in requests.rows]
        return rows

    def _new_request(self, requests: RequestMap, new) -> dict:
        req_id = new.req_id
        vllm_checks.hashable_id("NewRequestData.req_id", req_id)
        where = f"NewRequestData {req_id!r}"
        tokens = new.prefill_token_ids if new.prefill_token_ids is not None else new.prompt_token_ids
        if tokens is None:
            fail(f"{where}: prompt embeddings without token ids are not supported")
        prompt = new.prompt_token_ids if new.prompt_token_ids is not None else tokens
        lora = new.lora_request
        admission = Admission(prompt_len=len(prompt), lora_id=lora.lora_int_id if lora is not None else NO_LORA_ID,
                               sampling=_sampling_params(new.sampling_params) if self._sampling else None,
                               mrope=self._multimodal_positions(where, new, len(prompt)))
        requests.admit(req_id, admission)
        return self._entry(requests, req_id, tokens, vllm_checks.block_groups(where, new.block_ids, self._num_groups),
                           vllm_checks.token_count(f"{where}.num_computed_tokens", new.num_computed_tokens))

    def _resumed_request(self, requests: RequestMap, cached, i: int, req_id: str, computed: np.ndarray) -> dict:
        """V1: a preempted request returns with all its tokens and fresh blocks."""
        if req_id not in requests.admitted:
            fail(f"CachedRequestData.resumed_req_ids: request {req_id!r} was never admitted")
        if req_id not in cached.all_token_ids:
            fail(f"CachedRequestData.all_token_ids has no entry for resumed request {req_id!r} (vLLM's scheduler "
                 "sends them to the V1 runner, VLLM_USE_V2_MODEL_RUNNER=0)")
        where = f"CachedRequestData.new_block_ids[{i}] (resumed {req_id!r})"
        return self._entry(requests, req_id, cached.all_token_ids[req_id],
                           vllm_checks.block_groups(where, cached.new_block_ids[i], self._num_groups), int(computed[i]))

    def _entry(self, requests: RequestMap, req_id: str, tokens, block_ids, num_computed_tokens: int) -> dict:
        row = requests.take_row(req_id, self.config.max_num_reqs)
        admission, features = requests.admitted[req_id], self.config.prep.features
        tokens = tokens if type(tokens) is list else list(tokens)  # a list goes to AddRequests' one conversion
        entry = dict(row=row, token_ids=tokens, block_ids=block_ids, num_computed_tokens=num_computed_tokens,
                     prefill_len=len(tokens))
        if features.lora is not None:
            entry["lora_id"] = admission.lora_id
        if features.sampling is not None:
            entry.update(sampling=admission.sampling, prompt_len=admission.prompt_len)
        if features.mrope:
            entry["mrope_positions"], entry["mrope_position_delta"] = _mrope_columns(admission.mrope, len(tokens))
        return entry

    def _multimodal_positions(self, where: str, new, prompt_len: int) -> tuple[np.ndarray, int] | None:
        """A multimodal request's prompt M-RoPE positions and delta (from ``mrope_positions``); None for a
        text-only request (vLLM's ``get_mrope_input_positions`` gives text ``arange`` on every row, delta 0)
        or with M-RoPE off."""
        if not self.config.prep.features.mrope:
            return None
        media = [f for f in (getattr(new, "mm_features", None) or ())
                 if getattr(f, "modality", None) != "prompt_embeds"]
        if not media:
            return None
        if self.mrope_positions is None:
            fail(f"{where} carries multimodal features ({', '.join(sorted({str(f.modality) for f in media}))}): "
                 "its M-RoPE positions come from the model, whose get_mrope_input_positions(prompt_token_ids, "
                 "mm_features) vLLM's runner calls; build VllmAdapter(config, mrope_positions=fn) with "
                 "fn(new_request_data) -> (positions [3, prompt_len], delta), e.g. from "
                 "jaxprep.qwen2vl_prompt_positions")
        positions, delta = self.mrope_positions(new)
        positions = np.asarray(positions)
        if positions.shape != (MROPE_NUM_DIMS, prompt_len) or positions.dtype.kind not in "iu":
            fail(f"{where}: mrope_positions(...) gave positions of shape {positions.shape} and dtype {positions.dtype},"
                 f" expected integers [3, prompt_len={prompt_len}]")
        return positions.astype(np.int64), vllm_checks.integer_value(f"{where}: mrope_positions(...) delta", delta)

    def _running_requests(self, requests: RequestMap, cached, running: list[int],
                          computed_all: np.ndarray) -> tuple[list, AppendBlocks | dict, np.ndarray]:
        """Block appends of the running requests, a resume entry for each whose computed count the host
        mirror does not know (pending drafts) or knows differently from vLLM, and the requests' rows."""
        req_ids, row_of = cached.req_ids, requests.rows
        every = len(running) == len(req_ids)  # the common step: no request resumed, ``running`` is range(len)
        try:
            row_list = list(map(row_of.__getitem__, req_ids)) if every else [row_of[req_ids[i]] for i in running]
        except KeyError:
            missing = next(req_ids[i] for i in running if req_ids[i] not in row_of)
            fail(f"scheduled_cached_reqs: request {missing} holds no row (never added, or preempted and not resumed)")
        rows = np.array(row_list, np.int64)
        computed = computed_all if every else computed_all[running] if running else np.zeros(0, np.int64)
        mirror = self.batch.rows
        pending = mirror.pending[rows]
        restate = pending | (mirror.num_computed_tokens[rows] != computed)
        resume = []
        for k in np.flatnonzero(restate):
            # async scheduling: the count of a request verifying drafts in the last step takes them as accepted
            unverified = self._verifying.get(req_ids[running[k]], 0) if self.async_scheduling and pending[k] else 0
            resume.append(dict(row=int(rows[k]), num_computed_tokens=int(computed[k]), unverified_drafts=unverified))
        return resume, self._appended_blocks(cached.new_block_ids, row_list, running, every), rows

    def _appended_blocks(self, new_block_ids: list, row_list: list[int], running: list[int], every: bool):
        """The running requests' new blocks (``CachedRequestData.new_block_ids``, mostly None in a decode
        step) as one `AppendBlocks`, converted in one pass; a malformed entry is named by position."""
        groups = self._num_groups
        if every:
            given = [k for k, ids in enumerate(new_block_ids) if ids is not None]
        else:
            given = [k for k, i in enumerate(running) if new_block_ids[i] is not None]
        try:
            lists = [vllm_checks.block_groups("CachedRequestData.new_block_ids", new_block_ids[running[k]], groups)
                     for k in given]
        except TypeError:  # an entry that is not a tuple of lists: named by position
            for i in running:
                if new_block_ids[i] is not None:
                    vllm_checks.block_groups(f"CachedRequestData.new_block_ids[{i}]", new_block_ids[i], groups)
            raise
        rows = [row_list[k] for k in given]
        if groups == 1:
            fast = AppendBlocks.from_lists(rows, [0] * len(rows), lists)
        else:
            fast = AppendBlocks.from_lists([r for r in rows for _ in range(groups)], list(range(groups)) * len(rows),
                                           [ids for per_group in lists for ids in per_group])
        # a value that is not an int32 integer: StepUpdates' builder names it
        return fast if fast is not None else dict(zip(rows, lists))

    def _schedule(self, requests: RequestMap, scheduler_output, scheduled: dict, counts: np.ndarray,
                  grammar, rows: np.ndarray | None = None) -> tuple[dict, dict]:
        """The `Schedule`'s arrays, and the requests verifying drafts (their draft counts). ``rows``: the
        scheduled requests' rows, in ``scheduled``'s order, when the caller has them."""
        num_rows, width = self.config.max_num_reqs, draft_width(self.config)
        num_scheduled, drafts = np.zeros(num_rows, np.int64), np.zeros(num_rows, np.int64)
        draft_ids = np.zeros((num_rows, width), np.int64)
        row_of = requests.rows
        try:
            if rows is None:
                rows = np.array(list(map(row_of.__getitem__, scheduled)), np.int64)
        except KeyError:
            missing = next(r for r in scheduled if r not in row_of)
            fail(f"SchedulerOutput.num_scheduled_tokens names request {missing!r}, which holds no row (not among "
                 "scheduled_new_reqs, resumed or running requests)")
        num_scheduled[rows] = counts
        spec = scheduler_output.scheduled_spec_decode_tokens
        if not isinstance(spec, dict):
            fail(f"SchedulerOutput.scheduled_spec_decode_tokens must be a dict, got {type(spec).__name__}")
        verifying = {}
        for req_id, ids in spec.items():
            ids = vllm_checks.draft_ids(req_id, ids, scheduled, width)
            if not self.async_scheduling and -1 in ids and not _joins(scheduler_output, req_id):
                fail(f"SchedulerOutput.scheduled_spec_decode_tokens[{req_id!r}] holds -1 placeholders for a running "
                     "request: vLLM's sync Scheduler pads only a new or resumed request with them (pad_spec_decode); "
                     "its AsyncScheduler sends them for running requests, with a num_computed_tokens that counts the "
                     "drafts still being verified as accepted: build VllmAdapter(config, async_scheduling=True)")
            if ids:
                row = row_of[req_id]
                drafts[row] = verifying[req_id] = len(ids)
                draft_ids[row, :len(ids)] = ids
        out = dict(num_scheduled_tokens=num_scheduled, num_draft_tokens=drafts,
                   draft_token_ids=draft_ids if width else None)
        if grammar is not None:
            out["grammar_index"] = {row_of[req_id]: g for req_id, g in grammar[0].items()}
        return out, verifying

    def _grammar(self, scheduler_output, grammar_output, scheduled: dict):
        """The step's ``GrammarOutput`` read (`vllm_checks.grammar_rows`), or None."""
        if grammar_output is GRAMMAR_NOT_GIVEN:
            if getattr(scheduler_output, "has_structured_output_requests", False):
                fail("SchedulerOutput.has_structured_output_requests is set, but no GrammarOutput was given: call "
                     "adapter.step(scheduler_output, scheduler.get_grammar_bitmask(scheduler_output)) so each "
                     "structured-output request's bitmask rows reach the step (None when it returns None)")
            return None
        if grammar_output is None:
            return None
        features = self.config.prep.features
        if not features.structured_outputs:
            fail("adapter.step got a GrammarOutput, but FeatureConfig.structured_outputs is off: turn it on so "
                 "the step carries each logits row's bitmask row (StepInputs.grammar)")
        return vllm_checks.grammar_rows(grammar_output, scheduled, 1 + features.num_speculative_tokens)

    def _lora_update(self, requests: RequestMap, scheduled: dict) -> np.ndarray | None:
        """The adapter slots when a scheduled request's adapter has none yet (first free slot, else the
        slot of an adapter no scheduled request uses); ``None`` when unchanged."""
        if self._lora_slots is None:
            return None
        wanted = {requests.admitted[r].lora_id for r in scheduled} - {NO_LORA_ID}
        missing = sorted(wanted - set(self._lora_slots.tolist()))
        if not missing:
            return None
        slots = self._lora_slots.copy()
        for lora_id in missing:
            free = [s for s, held in enumerate(slots) if held < 0 or held not in wanted]
            if not free:
                fail(f"{len(wanted)} adapters scheduled in one step, more than max_loras={len(slots)}")
            slots[free[0]] = lora_id
        return slots


def _batch_rows(req_ids: list[str]) -> dict[str, int]:
    """request id -> batch row (its place in ``req_ids``), a new dict each call."""
    return dict(zip(req_ids, range(len(req_ids))))


def _joins(scheduler_output, req_id) -> bool:
    """Whether ``req_id`` joins the batch this step: a new request, or one resumed (V1) from preemption."""
    return (req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids
            or any(new.req_id == req_id for new in scheduler_output.scheduled_new_reqs))


def _mrope_columns(multimodal: tuple[np.ndarray, int] | None, num_tokens: int) -> tuple[np.ndarray, int]:
    """The M-RoPE table columns of a request's ``num_tokens`` tokens (prompt, and the outputs of a resumed or
    re-sent request) and its delta: text ``arange`` on every row (delta 0); a multimodal prompt's positions,
    then ``p + delta`` for the tokens past it, as vLLM's ``get_next_input_positions_tensor`` continues them.

    ```
    # text, 4 tokens -> [[0,1,2,3]] * 3, 0; prompt [[0,1,1],[0,1,2],[0,2,1]] delta -1, 5 tokens -> + columns [2, 3]
    ```
    """
    if multimodal is None:
        return np.broadcast_to(np.arange(num_tokens, dtype=np.int64), (MROPE_NUM_DIMS, num_tokens)), 0
    positions, delta = multimodal
    prompt = positions.shape[1]
    tail = np.broadcast_to(np.arange(prompt, max(num_tokens, prompt), dtype=np.int64) + delta,
                           (MROPE_NUM_DIMS, max(num_tokens - prompt, 0)))
    return np.concatenate([positions[:, :num_tokens], tail], axis=1), delta


def _sampling_params(params) -> SamplingParams | None:
    """vLLM's ``SamplingParams`` as jaxprep's (None: greedy)."""
    if params is None:
        return None
    return SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0),
                          min_p=params.min_p, seed=params.seed, repetition_penalty=params.repetition_penalty,
                          frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
                          stop_token_ids=tuple(params.stop_token_ids or ()))


__all__ = ["AdapterStep", "AdapterUsageError", "GRAMMAR_NOT_GIVEN", "InvalidSchedulerOutputError", "VllmAdapter"]
