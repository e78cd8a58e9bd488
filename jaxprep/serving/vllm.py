"""vLLM's scheduler drives jaxprep: one `SchedulerOutput` in, one checked update, one prepared step out.

`VllmAdapter` sits at the edge (STYLE rule 17): it reads vLLM 0.33.0's
`vllm/v1/core/sched/output.py::SchedulerOutput` by attribute (vLLM itself is imported only by
`VllmAdapter.runner_output`), keeps the request-id -> state-row map, and turns each step into ONE
`StepUpdates` for `ServingBatch.apply_updates`; the core never sees a vLLM name.

What each part of the scheduler output becomes, following the two runners that consume it
(`vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._update_states`, "V1", and
`vllm/v1/worker/gpu/model_runner.py::GPUModelRunner` ``finish_requests`` / ``add_requests`` /
``update_requests``, "V2"):

- ``finished_req_ids``: the row is freed and the request forgotten.
- ``preempted_req_ids``: the row is freed (V2 ``finish_requests`` frees preempted requests too; V1
  drops them from its persistent batch and keeps only host state). The request's admission values
  (sampling parameters, prompt length, adapter) stay on the host for its return.
- ``scheduled_new_reqs``: an `AddRequests` entry in the lowest free row: ``prefill_token_ids``
  (V2: prompt plus the outputs of a request resumed as new) or ``prompt_token_ids``, its block ids
  per KV-cache group, ``num_computed_tokens`` (prefix-cache hits), ``prefill_len`` = the tokens given,
  the LoRA adapter id and the sampling parameters where those features are on.
- ``scheduled_cached_reqs``: a request in ``resumed_req_ids`` (V1) comes back in a free row with
  ``all_token_ids`` and its new blocks replacing the old; any other appends ``new_block_ids`` per
  group (`AppendBlocks`) and, when the host mirror disagrees with ``num_computed_tokens`` or still
  waits for a draft outcome (`ResumeRequests`), has its computed count set.
- ``num_scheduled_tokens`` and ``scheduled_spec_decode_tokens``: the `Schedule` (draft counts and
  draft ids; async scheduling's -1 placeholders pass through and are accepted only with
  ``async_scheduling=True`` and ``FeatureConfig.async_tokens``).

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

import numpy as np

from jaxprep._constants import NO_LORA_ID
from jaxprep.features.sampling_params import SamplingParams
from jaxprep.metadata import StepInputs
from jaxprep.serving.batch import ServingBatch
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.state import StepUpdates, draft_width


@dataclasses.dataclass(frozen=True)
class AdapterStep:
    """One prepared step and the request ids of its batch rows."""

    inputs: StepInputs | None  # prepare_padded's outputs, at num_tokens_padded; None: nothing scheduled
    req_ids: list[str]  # batch row -> request id (ModelRunnerOutput.req_ids)
    req_id_to_index: dict[str, int]  # request id -> batch row (ModelRunnerOutput.req_id_to_index)
    num_tokens_padded: int  # the bucket of PrepConfig.token_buckets the step was prepared at


@dataclasses.dataclass(frozen=True)
class _Admission:
    """What a request was admitted with: kept on the host while vLLM knows the request."""

    prompt_len: int
    lora_id: int
    sampling: SamplingParams | None


class VllmAdapter:
    """Keeps a `ServingBatch` in step with vLLM's scheduler.

    Per step: ``step = adapter.step(scheduler_output)``, run the model on ``step.inputs``, then
    ``adapter.record_sampled(sampled_token_ids, num_sampled)`` with the sampler's device arrays in
    batch order, and hand vLLM ``adapter.runner_output(step, valid_token_lists)``.

    ``async_scheduling``: vLLM's scheduler is the ``AsyncScheduler`` (``--async-scheduling``). With
    speculative decoding it needs ``FeatureConfig.async_tokens``, and ``record_sampled`` takes the
    drafter's proposals.
    """

    def __init__(self, config: ServingConfig, *, async_scheduling: bool = False):
        if config.prep.features.reorder is not None:
            raise ValueError("VllmAdapter gives the batch in state-row order: FeatureConfig.reorder must be None, "
                             f"got {config.prep.features.reorder!r}")
        if async_scheduling and draft_width(config) and not config.prep.features.async_tokens:
            raise ValueError("VllmAdapter(async_scheduling=True) with num_speculative_tokens > 0 needs "
                             "FeatureConfig.async_tokens: the drafts reach input_ids on the device")
        self.config = config
        self.async_scheduling = async_scheduling
        self.batch = ServingBatch(config)
        self.rows: dict[str, int] = {}  # request id -> state row, for every request holding a row
        self.admitted: dict[str, _Admission] = {}  # every request vLLM has not finished, preempted ones too
        self._free = list(range(config.max_num_reqs))  # kept sorted: the lowest free row is taken first
        self._lora_slots = np.full(config.prep.features.lora.max_loras, -1, np.int64) \
            if config.prep.features.lora is not None else None
        self._last: AdapterStep | None = None
        self._verifying: dict[str, int] = {}  # request id -> drafts the last prepared step verifies

    # --- one step --------------------------------------------------------------------------------

    def step(self, scheduler_output) -> AdapterStep:
        """Applies ``scheduler_output`` as one checked `StepUpdates` and prepares the step. On a bad output
        (``ValueError``, `InvalidUpdateError` naming the field) the adapter and its batch are unchanged.

        A step that schedules nothing (vLLM sends one to report finished requests) is applied and
        prepares nothing: ``inputs`` is ``None`` and ``req_ids`` is empty, as V1's ``execute_model``
        returns ``EMPTY_MODEL_RUNNER_OUTPUT`` after ``_update_states``."""
        kept = (dict(self.rows), dict(self.admitted), list(self._free),
                None if self._lora_slots is None else self._lora_slots.copy())
        try:
            self.batch.apply_updates(self.updates(scheduler_output))
        except Exception:
            self.rows, self.admitted, self._free, self._lora_slots = kept
            raise
        total = int(scheduler_output.total_num_scheduled_tokens)
        self._verifying = {r: len(ids) for r, ids in scheduler_output.scheduled_spec_decode_tokens.items() if ids}
        if total == 0:
            self._last = None
            return AdapterStep(inputs=None, req_ids=[], req_id_to_index={}, num_tokens_padded=0)
        num_tokens_padded = self.config.prep.bucket_for(total)
        req_ids = sorted(scheduler_output.num_scheduled_tokens, key=self.rows.__getitem__)
        self._last = AdapterStep(inputs=self.batch.prepare(num_tokens_padded), req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 num_tokens_padded=num_tokens_padded)
        return self._last

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
        idx_mapping = self._last.inputs.idx_mapping
        if self.async_scheduling and self.config.prep.features.async_tokens:
            self.batch.record_prev_tokens(idx_mapping, sampled_token_ids, num_sampled, draft_token_ids)
        self.batch.record_sampled(idx_mapping, sampled_token_ids, num_sampled)

    @staticmethod
    def runner_output(step: AdapterStep, sampled_token_ids: list[list[int]]):
        """vLLM's ``ModelRunnerOutput`` for ``step``: ``sampled_token_ids[i]`` the valid tokens of batch row i."""
        from vllm.v1.outputs import ModelRunnerOutput

        return ModelRunnerOutput(req_ids=list(step.req_ids), req_id_to_index=dict(step.req_id_to_index),
                                 sampled_token_ids=sampled_token_ids)

    # --- the translation ---------------------------------------------------------------------------

    def updates(self, scheduler_output) -> StepUpdates:
        """The `StepUpdates` of ``scheduler_output``; the request map is updated as a side effect
        (the batch is not: `step` applies the result)."""
        finish = self._finished(scheduler_output)
        add = [self._new_request(new) for new in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        running = []  # indices into cached of the requests that keep their rows
        if not cached.resumed_req_ids:  # the common step: every cached request keeps its row
            running = list(range(len(cached.req_ids)))
        for i, req_id in enumerate(cached.req_ids if cached.resumed_req_ids else ()):
            if req_id in cached.resumed_req_ids:
                add.append(self._resumed_request(cached, i, req_id))
            else:
                running.append(i)
        resume, append = self._running_requests(cached, running)
        return StepUpdates.build(self.config, finish=finish, add=add, resume=resume, append=append,
                                 lora_slots=self._lora_update(scheduler_output),
                                 **self._schedule(scheduler_output))

    def _finished(self, scheduler_output) -> list[int]:
        """Rows of finished and preempted requests (and of V1-resumed ones still holding a row: vLLM's
        forced preemption by ``reset_prefix_cache`` resumes a request in the step that preempts it)."""
        rows = []
        for req_id in scheduler_output.finished_req_ids:
            self.admitted.pop(req_id, None)
            if req_id in self.rows:
                rows.append(self._release(req_id))
        leaving = set(scheduler_output.preempted_req_ids or ()) | set(
            scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        rows += [self._release(req_id) for req_id in sorted(leaving) if req_id in self.rows]
        return rows

    def _new_request(self, new) -> dict:
        tokens = new.prefill_token_ids if new.prefill_token_ids is not None else new.prompt_token_ids
        if tokens is None:
            raise ValueError(f"request {new.req_id}: prompt embeddings without token ids are not supported")
        lora = new.lora_request
        self.admitted[new.req_id] = _Admission(
            prompt_len=len(new.prompt_token_ids), lora_id=lora.lora_int_id if lora is not None else NO_LORA_ID,
            sampling=_sampling_params(new.sampling_params))
        return self._entry(new.req_id, tokens, new.block_ids, new.num_computed_tokens)

    def _resumed_request(self, cached, i: int, req_id: str) -> dict:
        """V1: a preempted request returns with all its tokens and fresh blocks."""
        if req_id not in self.admitted:
            raise ValueError(f"scheduled_cached_reqs: resumed request {req_id} was never admitted")
        if req_id not in cached.all_token_ids:
            raise ValueError(f"scheduled_cached_reqs: resumed request {req_id} comes without all_token_ids "
                             "(vLLM's scheduler sends them to the V1 runner, VLLM_USE_V2_MODEL_RUNNER=0)")
        return self._entry(req_id, cached.all_token_ids[req_id], cached.new_block_ids[i],
                           cached.num_computed_tokens[i])

    def _entry(self, req_id: str, tokens, block_ids, num_computed_tokens: int) -> dict:
        if req_id in self.rows:
            raise ValueError(f"request {req_id} is added but already holds row {self.rows[req_id]}")
        if not self._free:
            raise ValueError(f"request {req_id}: no free row (max_num_reqs={self.config.max_num_reqs})")
        row = self._free.pop(0)
        self.rows[req_id] = row
        admission, features = self.admitted[req_id], self.config.prep.features
        entry = dict(row=row, token_ids=list(tokens), block_ids=_groups(block_ids),
                     num_computed_tokens=int(num_computed_tokens), prefill_len=len(tokens))
        if features.lora is not None:
            entry["lora_id"] = admission.lora_id
        if features.sampling is not None:
            entry.update(sampling=admission.sampling, prompt_len=admission.prompt_len)
        return entry

    def _running_requests(self, cached, running: list[int]) -> tuple[list, dict]:
        """Block appends of the running requests, and a resume entry for each whose computed count the host
        mirror does not know (pending drafts) or knows differently from vLLM."""
        req_ids, row_of = cached.req_ids, self.rows
        try:
            row_list = [row_of[req_ids[i]] for i in running]
        except KeyError:
            row_list = [self._row(req_ids[i]) for i in running]  # raises, naming the request
        rows = np.array(row_list, np.int64)
        computed = np.array(cached.num_computed_tokens, np.int64)[running] if running else np.zeros(0, np.int64)
        mirror = self.batch.rows
        pending = mirror.pending[rows]
        restate = pending | (mirror.num_computed_tokens[rows] != computed)
        resume = []
        for k in np.flatnonzero(restate):
            # async scheduling: the count of a request verifying drafts in the last step takes them as accepted
            unverified = self._verifying.get(req_ids[running[k]], 0) if self.async_scheduling and pending[k] else 0
            resume.append(dict(row=int(rows[k]), num_computed_tokens=int(computed[k]), unverified_drafts=unverified))
        new_block_ids = cached.new_block_ids
        append = {row: _groups(new_block_ids[i]) for row, i in zip(row_list, running)
                  if new_block_ids[i] is not None and any(new_block_ids[i])}
        return resume, append

    def _row(self, req_id: str) -> int:
        row = self.rows.get(req_id)
        if row is None:
            raise ValueError(f"scheduled_cached_reqs: request {req_id} holds no row (never added, or preempted "
                             "and not resumed)")
        return row

    def _schedule(self, scheduler_output) -> dict:
        rows, width = self.config.max_num_reqs, draft_width(self.config)
        scheduled, drafts = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
        draft_ids = np.zeros((rows, width), np.int64)
        counts = scheduler_output.num_scheduled_tokens
        scheduled[np.fromiter(map(self.rows.__getitem__, counts), np.int64, len(counts))] = list(counts.values())
        for req_id, ids in scheduler_output.scheduled_spec_decode_tokens.items():
            if len(ids) > width:
                raise ValueError(f"scheduled_spec_decode_tokens[{req_id!r}] has {len(ids)} drafts, more than "
                                 f"num_speculative_tokens={width}")
            if not self.async_scheduling and -1 in ids:
                raise ValueError(f"scheduled_spec_decode_tokens[{req_id!r}] holds -1 placeholders: vLLM's "
                                 "AsyncScheduler sent them, and its num_computed_tokens counts the drafts still "
                                 "being verified as accepted; build VllmAdapter(config, async_scheduling=True)")
            row = self.rows[req_id]
            drafts[row] = len(ids)
            draft_ids[row, :len(ids)] = ids
        return dict(num_scheduled_tokens=scheduled, num_draft_tokens=drafts,
                    draft_token_ids=draft_ids if width else None)

    def _lora_update(self, scheduler_output) -> np.ndarray | None:
        """The adapter slots when a scheduled request's adapter has none yet (first free slot, else the
        slot of an adapter no scheduled request uses); ``None`` when unchanged."""
        if self._lora_slots is None:
            return None
        wanted = {self.admitted[r].lora_id for r in scheduler_output.num_scheduled_tokens} - {NO_LORA_ID}
        missing = sorted(wanted - set(self._lora_slots.tolist()))
        if not missing:
            return None
        for lora_id in missing:
            free = [s for s, held in enumerate(self._lora_slots) if held < 0 or held not in wanted]
            if not free:
                raise ValueError(f"{len(wanted)} adapters scheduled in one step, more than max_loras="
                                 f"{len(self._lora_slots)}")
            self._lora_slots[free[0]] = lora_id
        return self._lora_slots.copy()

    def _release(self, req_id: str) -> int:
        row = self.rows.pop(req_id)
        self._free.append(row)
        self._free.sort()
        return row


def _groups(block_ids) -> list:
    """vLLM's ``tuple[list[int], ...]`` (one list per KV-cache group) as `StepUpdates` takes it."""
    groups = [list(ids) for ids in block_ids]
    return groups[0] if len(groups) == 1 else groups


def _sampling_params(params) -> SamplingParams | None:
    """vLLM's ``SamplingParams`` as jaxprep's (None: greedy)."""
    if params is None:
        return None
    return SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0),
                          min_p=params.min_p, seed=params.seed, repetition_penalty=params.repetition_penalty,
                          frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
                          stop_token_ids=tuple(params.stop_token_ids or ()))
