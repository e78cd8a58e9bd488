"""A host-side scheduler in vLLM V1's manner, sending the device only small per-step updates.

Each step: running requests first (in arrival order), each given its remaining prompt (chunked to
the token budget) or one decode token; then waiting requests in FCFS order while budget, free rows
and free blocks last. When a running request needs a block and none is free, the most recently
admitted running request is preempted by recompute: its blocks are freed and it waits at the front
of the queue to be re-added with prompt + outputs as its new prefill.

A step's tokens reach the scheduler in two moves (vLLM's ``_update_after_schedule`` and
``update_from_output``): `after_schedule` advances each scheduled request by what the step appends,
as output placeholders, and `resolve` replaces them with the sampled ids and finishes requests that
stop. The synchronous loop makes both moves with the step's tokens (`update`); under async
scheduling the host makes the first with the tokens it predicts and schedules the next step before
the real ones arrive (`jaxprep.serving.host.overlap`).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools

import numpy as np

from jaxprep._constants import NULL_BLOCK_ID
from jaxprep.config import cdiv
from jaxprep.features.sampling_params import SamplingParams
from jaxprep.serving._values import check_request_fields
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.state import check_token_ids
from jaxprep.serving.step import AppendedTokens

NO_ROW = -1
"""`Request.row` of a request that holds no state row (waiting, preempted or finished)."""


class StepTokens(AppendedTokens):
    """`AppendedTokens` whose arrays are computed once: the loop reads one step's tokens several times (its
    counters, `Scheduler.after_schedule`, `Scheduler.resolve`), each property more than once."""

    appended = functools.cached_property(AppendedTokens.appended.fget)
    num_appended = functools.cached_property(AppendedTokens.num_appended.fget)
    num_first = functools.cached_property(AppendedTokens.num_first.fget)
    num_decoded = functools.cached_property(AppendedTokens.num_decoded.fget)
    num_iterations = functools.cached_property(AppendedTokens.num_iterations.fget)
    draft_token_ids = functools.cached_property(AppendedTokens.draft_token_ids.fget)
    num_draft_tokens = functools.cached_property(AppendedTokens.num_draft_tokens.fget)


def step_tokens(tokens, num_speculative_tokens: int) -> StepTokens:
    """``tokens`` (a step's [slots, max_num_reqs] array, or its `StepTokens` already) as `StepTokens`."""
    return tokens if isinstance(tokens, StepTokens) else StepTokens(np.asarray(tokens), num_speculative_tokens)


class BlockAllocator:
    """A free list of KV-cache block ids 1..num_blocks-1; the null block 0 is never handed out."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = collections.deque(range(NULL_BLOCK_ID + 1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(count)]

    def free(self, block_ids) -> None:
        self._free.extend(block_ids)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Request:
    """One request as the host scheduler tracks it: its prompt, the tokens it has produced, its
    blocks, its batch row and its status (vLLM's ``vllm/v1/request.py::Request``, the fields the
    loop uses)."""

    request_id: int
    prompt_token_ids: list[int]
    max_tokens: int
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = dataclasses.field(default_factory=list)
    row: int = NO_ROW
    status: Status = Status.WAITING
    num_preemptions: int = 0
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)  # drafts for the next step
    num_output_placeholders: int = 0  # tokens a step in flight appends, not yet seen by the host
    # None: greedy. With FeatureConfig.sampling the device samples with these; stop_token_ids work either way
    sampling_params: SamplingParams | None = None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return () if self.sampling_params is None else self.sampling_params.stop_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens the host knows (placeholders not included, as in vLLM)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """The tokens the device holds once the steps in flight are done: what scheduling reads."""
        return self.num_tokens + self.num_output_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def stop_len(self, max_model_len: int) -> int:
        """``num_tokens`` (prompt + outputs) at which the request stops: ``max_tokens`` outputs, or
        ``max_model_len`` (vLLM's two length stops)."""
        return min(len(self.prompt_token_ids) + self.max_tokens, max_model_len)


def _check_sampling(request: Request, sampling) -> None:
    """Sampling parameters other than greedy without penalties need `FeatureConfig.sampling`."""
    params = request.sampling_params
    if params is None or sampling is not None:
        return
    if params.temperature != 0 or params.use_penalty:
        raise ValueError(f"request {request.request_id}: sampling with {params} needs FeatureConfig.sampling "
                         f"(the loop without it samples greedily)")


@dataclasses.dataclass
class SchedulerOutput:
    """One step's decisions, by state row."""

    finished_rows: list[int]  # rows to free first (finished last step, or preempted now)
    new_requests: list[dict]  # AddRequests entries: row, token_ids, stop_len, block_ids
    new_block_ids: dict[int, list[int]]  # row -> blocks appended to a running request
    num_scheduled_tokens: np.ndarray  # [max_num_reqs]
    decode_steps: int = 1  # > 1: every scheduled row decodes, up to this many tokens on the device
    num_preempted: int = 0
    num_draft_tokens: np.ndarray | None = None  # [max_num_reqs] drafts among the scheduled tokens
    draft_token_ids: np.ndarray | None = None  # [max_num_reqs, num_speculative_tokens]
    requests: dict[int, Request] = dataclasses.field(default_factory=dict)  # row -> request, in schedule order
    num_appended: np.ndarray | None = None  # [max_num_reqs] tokens `after_schedule` counted per row

    @property
    def total_num_scheduled_tokens(self) -> int:
        return int(self.num_scheduled_tokens.sum())


class Scheduler:
    """Admits, schedules, preempts and finishes requests; the host half of the serving loop."""

    def __init__(self, config: ServingConfig):
        self.config = config
        self.max_model_len, self.block_size = config.max_model_len, config.block_size  # read per request
        self.allocator = BlockAllocator(config.num_blocks)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []  # until `drain_finished` hands them out
        self._free_rows = list(range(config.max_num_reqs))
        self._rows_to_free: list[int] = []

    def check_request(self, request: Request) -> None:
        """Raises ValueError naming ``request`` if it can never run: a prompt outside [1, max_model_len),
        max_tokens < 1, a token id outside [0, vocab_size), or more blocks than the cache holds; or
        a field of the wrong type or state (`check_request_fields`: max_tokens 2.5, an unhashable id)."""
        check_request_fields(request, Request, SamplingParams)
        prep = self.config.prep
        length = len(request.prompt_token_ids)
        if not 0 < length < prep.max_model_len or request.max_tokens < 1:
            raise ValueError(f"request {request.request_id}: prompt of {length} tokens must lie in "
                             f"[1, max_model_len={prep.max_model_len}) and max_tokens={request.max_tokens} >= 1")
        check_token_ids(f"request {request.request_id}: prompt_token_ids", request.prompt_token_ids,
                        self.config.token_id_bound)
        _check_sampling(request, prep.features.sampling)
        blocks = cdiv(request.stop_len(prep.max_model_len), prep.block_size)
        if blocks > self.config.num_blocks - 1:
            raise ValueError(f"request {request.request_id} may need {blocks} blocks; the cache has "
                             f"{self.config.num_blocks - 1} allocatable")

    def add_request(self, request: Request) -> None:
        self.check_request(request)
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def demand(self) -> int:
        """Tokens this rank still has to compute before its requests sample again: the routing load."""
        running = sum(r.num_tokens_with_placeholders - r.num_computed_tokens for r in self.running)
        return running + sum(r.num_tokens for r in self.waiting)

    def drain_finished(self) -> list[Request]:
        """The finished requests, handed out and forgotten (a long-running loop keeps flat memory)."""
        done, self.finished = self.finished, []
        return done

    def schedule(self) -> SchedulerOutput:
        rows, k = self.config.max_num_reqs, self.config.num_speculative_tokens
        out = SchedulerOutput(finished_rows=self._rows_to_free, new_requests=[], new_block_ids={},
                              num_scheduled_tokens=np.zeros(rows, np.int64),  # int64: `Schedule`'s own dtype
                              num_draft_tokens=np.zeros(rows, np.int64), draft_token_ids=np.zeros((rows, k), np.int64))
        self._rows_to_free = []
        budget = self._schedule_running(out, self.config.prep.max_num_batched_tokens)
        if not out.num_preempted:
            self._schedule_waiting(out, budget)
        self._maybe_multi_step(out)
        return out

    def _awaiting_stop(self, request: Request) -> bool:
        """A step in flight reaches the request's length stop: nothing is left to schedule (vLLM
        async scheduling skips it too); it finishes when that step's tokens arrive."""
        return request.num_tokens_with_placeholders >= request.stop_len(self.max_model_len)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            index += 1
            if self._awaiting_stop(request):
                continue
            num_known = request.num_tokens_with_placeholders - request.num_computed_tokens
            num_new = min(num_known + len(request.spec_token_ids), budget)
            if not self._grow(request, request.num_computed_tokens + num_new, out):
                break  # the request preempted itself
            out.num_scheduled_tokens[request.row] = num_new
            out.requests[request.row] = request
            # the budget may cut the drafts (vLLM: scheduled_spec_decode_tokens)
            drafts, request.spec_token_ids = request.spec_token_ids[: max(num_new - num_known, 0)], []
            if drafts:
                out.num_draft_tokens[request.row] = len(drafts)
                out.draft_token_ids[request.row, : len(drafts)] = drafts
            budget -= num_new
        return budget

    def _grow(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Allocates blocks for ``num_tokens`` of a running request, preempting from the tail if needed."""
        needed = cdiv(num_tokens, self.block_size) - len(request.block_ids)
        while needed > self.allocator.num_free:
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is request:
                return False
        if needed > 0:
            blocks = self.allocator.allocate(needed)
            request.block_ids += blocks
            out.new_block_ids.setdefault(request.row, []).extend(blocks)
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.allocator.free(request.block_ids)
        out.finished_rows.append(request.row)
        out.new_block_ids.pop(request.row, None)
        out.num_scheduled_tokens[request.row] = out.num_draft_tokens[request.row] = 0
        out.requests.pop(request.row, None)
        request.spec_token_ids = []
        self._free_rows.append(request.row)
        request.block_ids, request.row, request.num_computed_tokens = [], NO_ROW, 0
        request.status = Status.WAITING
        request.num_preemptions += 1
        out.num_preempted += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        block_size = self.block_size
        # a request preempted with a step in flight waits for that step's tokens: its prefill needs them
        while self.waiting and budget > 0 and self._free_rows and not self.waiting[0].num_output_placeholders:
            request = self.waiting[0]
            num_new = min(request.num_tokens, budget)
            needed = cdiv(num_new, block_size)
            if needed > self.allocator.num_free:
                break
            self.waiting.popleft()
            self._free_rows.sort()
            request.row = self._free_rows.pop(0)
            request.block_ids = self.allocator.allocate(needed)
            request.status = Status.RUNNING
            self.running.append(request)
            out.new_requests.append(dict(row=request.row, token_ids=request.all_token_ids,
                                         stop_len=request.stop_len(self.max_model_len),
                                         block_ids=list(request.block_ids), sampling=request.sampling_params,
                                         prompt_len=len(request.prompt_token_ids)))
            out.num_scheduled_tokens[request.row] = num_new
            out.requests[request.row] = request
            budget -= num_new

    def _maybe_multi_step(self, out: SchedulerOutput) -> None:
        """Every running request decoding and none waiting: give each the blocks of up to K tokens
        (as many as are free) and let the device run the K decode steps."""
        steps, max_model_len = self.config.decode_steps, self.max_model_len
        running = [r for r in self.running if not self._awaiting_stop(r)]
        if steps == 1 or self.waiting or not running or any(r.stop_token_ids for r in running):
            return  # the device stops only at EOS and stop_len: a stop token ends multi-step decoding
        if any(r.num_computed_tokens != r.num_tokens_with_placeholders - 1 or out.num_scheduled_tokens[r.row] != 1
               for r in running):
            return
        for request in running:
            # K decodes compute positions C .. C+K-1; the last token worth computing is stop_len - 2
            num_positions = min(request.num_computed_tokens + steps, request.stop_len(max_model_len) - 1)
            needed = cdiv(num_positions, self.block_size) - len(request.block_ids)
            needed = min(needed, self.allocator.num_free)
            if needed > 0:
                blocks = self.allocator.allocate(needed)
                request.block_ids += blocks
                out.new_block_ids.setdefault(request.row, []).extend(blocks)
        out.decode_steps = steps

    def cap(self, out: SchedulerOutput, budget: int) -> None:
        """Cuts ``out`` to ``budget`` tokens, taking prefill tokens from the last scheduled request
        backwards; decodes are kept (the caller's budget holds them). A request cut to nothing keeps
        its row and blocks and is scheduled again next step.

        ```
        # scheduled in order {row 2: 1 (decode), row 0: 12, row 3: 9}, budget 16 -> {2: 1, 0: 12, 3: 3}
        ```
        """
        excess = out.total_num_scheduled_tokens - budget
        for row in reversed(list(out.requests)):
            if excess <= 0:
                break
            scheduled = int(out.num_scheduled_tokens[row])
            cut = min(excess, scheduled) if scheduled > 1 else 0
            out.num_scheduled_tokens[row] = scheduled - cut
            self._cut_drafts(out, row, cut)
            excess -= cut
            if scheduled == cut:
                del out.requests[row]
        if excess > 0:
            raise ValueError(f"cannot cap a step to {budget} tokens: it decodes more rows than that")

    def update(self, out: SchedulerOutput, tokens: np.ndarray | StepTokens, eos_token_id: int) -> list[Request]:
        """`after_schedule` and `resolve` with the tokens the device appended ([iterations,
        max_num_reqs], NO_TOKEN = none, or their `StepTokens`): the synchronous loop. Returns the newly
        finished requests."""
        tokens = step_tokens(tokens, self.config.num_speculative_tokens)
        self.after_schedule(out, tokens)
        return self.resolve(out, tokens, eos_token_id)

    def after_schedule(self, out: SchedulerOutput, tokens: np.ndarray | StepTokens) -> None:
        """Advances every request ``out`` scheduled by what ``tokens`` says the step appends (the
        step's own tokens, or the prediction of `jaxprep.serving.host.overlap.predicted_tokens`): its
        computed tokens, and one output placeholder per appended token.

        Iteration 0 computes the scheduled tokens and appends a token only if they reach the end of
        the known tokens; every later iteration computes and appends one decode token (`AppendedTokens`).
        """
        step = step_tokens(tokens, self.config.num_speculative_tokens)
        # each per-row array read once, as lists (the loop below reads them row by row)
        advance = step.computed_advance(out.num_scheduled_tokens, out.num_draft_tokens).tolist()
        num_appended = step.num_appended
        samples, appended = (step.num_first > 0).tolist(), num_appended.tolist()
        computed = (out.num_scheduled_tokens - out.num_draft_tokens).tolist()  # the scheduled tokens, drafts not
        for row, request in out.requests.items():
            reached = request.num_computed_tokens + computed[row]
            if samples[row] != (reached >= request.num_tokens_with_placeholders):
                raise RuntimeError(f"request {request.request_id}: the device and the host disagree on whether "
                                   f"computing {reached} of {request.num_tokens_with_placeholders} tokens samples")
            # rejected drafts are not computed: the next step computes from the first of them again
            request.num_computed_tokens += advance[row]
            request.num_output_placeholders += appended[row]
        out.num_appended = num_appended

    def resolve(self, out: SchedulerOutput, tokens: np.ndarray | StepTokens, eos_token_id: int) -> list[Request]:
        """Replaces the placeholders of ``out``'s step with the tokens it appended and finishes the
        requests that stop: at EOS, at max_tokens or at max_model_len. A request that stopped in an
        earlier step gets nothing (its token from this step is discarded, vLLM's rule). Returns the
        newly finished requests."""
        step, done = step_tokens(tokens, self.config.num_speculative_tokens), []
        new_tokens, expected = _row_tokens(step), out.num_appended.tolist()
        drafts = _row_drafts(step) if self.config.num_speculative_tokens else None
        for row, request in out.requests.items():
            if request.status is Status.FINISHED:
                continue
            request.num_output_placeholders -= expected[row]
            new = new_tokens[row]
            if self._take(request, new, eos_token_id):
                done.append(request)
                continue
            if len(new) != expected[row]:
                raise RuntimeError(f"request {request.request_id}: the device appended {len(new)} tokens, "
                                   f"the host expected {expected[row]}, and none stops it")
            if request.status is Status.RUNNING:
                self._keep_drafts(request, drafts[row] if drafts is not None else [])
        return done

    def _take(self, request: Request, new: list[int], eos_token_id: int) -> bool:
        """Appends ``new`` to the request's outputs; finishes it (True) at its stop, the last of them."""
        for i, token in enumerate(new):
            request.output_token_ids.append(token)
            if self._stops(request, token, eos_token_id):
                # the device stops at EOS and stop_len; a stop token (seen by the host only) may end a
                # run of accepted drafts early: the tokens after it are dropped, as vLLM's scheduler does
                if i != len(new) - 1 and token not in request.stop_token_ids:
                    raise RuntimeError(f"request {request.request_id}: the device decoded past its stop")
                self._finish(request)
                return True
        return False

    def _keep_drafts(self, request: Request, drafts: list[int]) -> None:
        """The device's drafts for the request's next step, cut so that its accepted tokens and the
        token after them stay within the request's stop (``stop_len``): no block is ever needed
        past it."""
        room = request.stop_len(self.max_model_len) - request.num_tokens - 1
        request.spec_token_ids = drafts[: max(room, 0)]

    @staticmethod
    def _cut_drafts(out: SchedulerOutput, row: int, cut: int) -> None:
        """`cap` took ``cut`` tokens off the end of ``row``'s scheduled tokens: drafts go first.

        ```
        # 1 + 3 drafts [5, 6, 7] scheduled, cut 2 -> 1 + 1 draft [5]
        ```
        """
        kept = max(int(out.num_draft_tokens[row]) - cut, 0)
        out.draft_token_ids[row, kept:] = 0
        out.num_draft_tokens[row] = kept

    def _stops(self, request: Request, token: int, eos_token_id: int) -> bool:
        return (token == eos_token_id or token in request.stop_token_ids
                or len(request.output_token_ids) >= request.max_tokens
                or request.num_tokens >= self.max_model_len)

    def _finish(self, request: Request) -> None:
        """Frees the request's row and blocks (a preempted, waiting request holds none)."""
        if request.status is Status.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
            self.allocator.free(request.block_ids)
            self._rows_to_free.append(request.row)
            self._free_rows.append(request.row)
        request.status, request.block_ids, request.num_output_placeholders = Status.FINISHED, [], 0
        self.finished.append(request)


def _row_tokens(step: AppendedTokens) -> list[list[int]]:
    """The tokens appended to each row, in order (`AppendedTokens.row_tokens` of every row, read at once).

    ```
    # tokens [[7, -1, 9], [8, -1, -1]] -> [[7, 8], [], [9]]
    ```
    """
    appended = step.appended
    tokens, kept = step.tokens[: appended.shape[0]].T.tolist(), appended.T.tolist()
    return [[t for t, k in zip(row, keep) if k] for row, keep in zip(tokens, kept)]


def _row_drafts(step: AppendedTokens) -> list[list[int]]:
    """The drafts each row proposed for its next step (`AppendedTokens.draft_token_ids`, its count per row)."""
    return [ids[:n] for ids, n in zip(step.draft_token_ids.tolist(), step.num_draft_tokens.tolist())]
