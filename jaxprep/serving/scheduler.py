"""A host-side scheduler in vLLM V1's manner, sending the device only small per-step updates.

Each step: running requests first (in arrival order), each given its remaining prompt (chunked to
the token budget) or one decode token; then waiting requests in FCFS order while budget, free rows
and free blocks last. When a running request needs a block and none is free, the most recently
admitted running request is preempted by recompute: its blocks are freed and it waits at the front
of the queue to be re-added with prompt + outputs as its new prefill.
"""

from __future__ import annotations

import collections
import dataclasses
import enum

import numpy as np

from jaxprep._constants import NULL_BLOCK_ID
from jaxprep.config import cdiv
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.step import AppendedTokens

NO_ROW = -1
"""`Request.row` of a request that holds no state row (waiting, preempted or finished)."""


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

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def stop_len(self, max_model_len: int) -> int:
        """``num_tokens`` (prompt + outputs) at which the request stops: ``max_tokens`` outputs, or
        ``max_model_len`` (vLLM's two length stops)."""
        return min(len(self.prompt_token_ids) + self.max_tokens, max_model_len)


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

    @property
    def total_num_scheduled_tokens(self) -> int:
        return int(self.num_scheduled_tokens.sum())


class Scheduler:
    """Admits, schedules, preempts and finishes requests; the host half of the serving loop."""

    def __init__(self, config: ServingConfig):
        self.config = config
        self.allocator = BlockAllocator(config.num_blocks)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self._free_rows = list(range(config.max_num_reqs))
        self._rows_to_free: list[int] = []

    def add_request(self, request: Request) -> None:
        prep = self.config.prep
        length = len(request.prompt_token_ids)
        if not 0 < length < prep.max_model_len or request.max_tokens < 1:
            raise ValueError(f"request {request.request_id}: prompt of {length} tokens must lie in "
                             f"[1, max_model_len={prep.max_model_len}) and max_tokens={request.max_tokens} >= 1")
        blocks = cdiv(request.stop_len(prep.max_model_len), prep.block_size)
        if blocks > self.config.num_blocks - 1:
            raise ValueError(f"request {request.request_id} may need {blocks} blocks; the cache has "
                             f"{self.config.num_blocks - 1} allocatable")
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        rows, k = self.config.max_num_reqs, self.config.num_speculative_tokens
        out = SchedulerOutput(finished_rows=self._rows_to_free, new_requests=[], new_block_ids={},
                              num_scheduled_tokens=np.zeros(rows, np.int32),
                              num_draft_tokens=np.zeros(rows, np.int32), draft_token_ids=np.zeros((rows, k), np.int32))
        self._rows_to_free = []
        budget = self._schedule_running(out, self.config.prep.max_num_batched_tokens)
        if not out.num_preempted:
            self._schedule_waiting(out, budget)
        self._maybe_multi_step(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_known = request.num_tokens - request.num_computed_tokens
            num_new = min(num_known + len(request.spec_token_ids), budget)
            if not self._grow(request, request.num_computed_tokens + num_new, out):
                break  # the request preempted itself
            out.num_scheduled_tokens[request.row] = num_new
            # the budget may cut the drafts (vLLM: scheduled_spec_decode_tokens)
            drafts, request.spec_token_ids = request.spec_token_ids[: max(num_new - num_known, 0)], []
            out.num_draft_tokens[request.row] = len(drafts)
            out.draft_token_ids[request.row, : len(drafts)] = drafts
            budget -= num_new
            index += 1
        return budget

    def _grow(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Allocates blocks for ``num_tokens`` of a running request, preempting from the tail if needed."""
        needed = cdiv(num_tokens, self.config.block_size) - len(request.block_ids)
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
        request.spec_token_ids = []
        self._free_rows.append(request.row)
        request.block_ids, request.row, request.num_computed_tokens = [], NO_ROW, 0
        request.status = Status.WAITING
        request.num_preemptions += 1
        out.num_preempted += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        block_size = self.config.block_size
        while self.waiting and budget > 0 and self._free_rows:
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
                                         stop_len=request.stop_len(self.config.max_model_len),
                                         block_ids=list(request.block_ids)))
            out.num_scheduled_tokens[request.row] = num_new
            budget -= num_new

    def _maybe_multi_step(self, out: SchedulerOutput) -> None:
        """Every running request decoding and none waiting: give each the blocks of up to K tokens
        (as many as are free) and let the device run the K decode steps."""
        steps, max_model_len = self.config.decode_steps, self.config.max_model_len
        if steps == 1 or self.waiting or not self.running:
            return
        if any(r.num_computed_tokens != r.num_tokens - 1 or out.num_scheduled_tokens[r.row] != 1 for r in self.running):
            return
        for request in self.running:
            # K decodes compute positions C .. C+K-1; the last token worth computing is stop_len - 2
            num_positions = min(request.num_computed_tokens + steps, request.stop_len(max_model_len) - 1)
            needed = cdiv(num_positions, self.config.block_size) - len(request.block_ids)
            needed = min(needed, self.allocator.num_free)
            if needed > 0:
                blocks = self.allocator.allocate(needed)
                request.block_ids += blocks
                out.new_block_ids.setdefault(request.row, []).extend(blocks)
        out.decode_steps = steps

    def update(self, out: SchedulerOutput, tokens: np.ndarray, eos_token_id: int) -> list[Request]:
        """Takes the tokens the device appended ([iterations, max_num_reqs], NO_TOKEN = none) and finishes
        requests at EOS, at max_tokens or at max_model_len. Returns the newly finished requests.

        Iteration 0 computed the scheduled tokens and appended a token only if they reached the end
        of the known tokens; every later iteration computed and appended one decode token
        (`AppendedTokens`).
        """
        step, done = AppendedTokens(tokens, self.config.num_speculative_tokens), []
        rejected = step.num_rejected(out.num_draft_tokens)
        for request in list(self.running):
            row = request.row
            scheduled = int(out.num_scheduled_tokens[row])
            if scheduled == 0:
                continue
            computed = request.num_computed_tokens + scheduled - int(out.num_draft_tokens[row])
            if bool(step.num_first[row]) != (computed >= request.num_tokens):
                raise RuntimeError(f"request {request.request_id}: the device and the host disagree on whether "
                                   f"computing {computed} of {request.num_tokens} tokens samples")
            request.num_computed_tokens += scheduled - int(rejected[row]) + int(step.num_decoded[row])
            appended = step.row_tokens(row)
            for i, token in enumerate(appended):
                request.output_token_ids.append(token)
                if self._stops(request, token, eos_token_id):
                    if i != len(appended) - 1:
                        raise RuntimeError(f"request {request.request_id}: the device decoded past its stop")
                    self._finish(request)
                    done.append(request)
            if request.status is Status.RUNNING:
                self._keep_drafts(request, step.draft_token_ids[row, : step.num_draft_tokens[row]])
        return done

    def _keep_drafts(self, request: Request, drafts: np.ndarray) -> None:
        """The device's drafts for the request's next step, cut so that its accepted tokens and the
        token after them stay within the request's stop (``stop_len``): no block is ever needed
        past it."""
        room = request.stop_len(self.config.max_model_len) - request.num_tokens - 1
        request.spec_token_ids = [int(t) for t in drafts[: max(room, 0)]]

    def _stops(self, request: Request, token: int, eos_token_id: int) -> bool:
        return (token == eos_token_id or len(request.output_token_ids) >= request.max_tokens
                or request.num_tokens >= self.config.max_model_len)

    def _finish(self, request: Request) -> None:
        self.running.remove(request)
        self.allocator.free(request.block_ids)
        self._rows_to_free.append(request.row)
        self._free_rows.append(request.row)
        request.status, request.block_ids = Status.FINISHED, []
        self.finished.append(request)
