"""The `VllmAdapter`'s request map: which state row each vLLM request holds, what each was admitted with, and
the free rows; copied on a step's first change, so a refused step leaves the adapter's own maps as they were."""

from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np

from jaxprep.features.sampling_params import SamplingParams
from jaxprep.serving.host.vllm_checks import fail


class Admission(NamedTuple):
    """What a request was admitted with: kept on the host while vLLM knows the request (its prompt length,
    adapter, sampling parameters and M-RoPE positions come back with a request resumed after preemption)."""

    prompt_len: int
    lora_id: int
    sampling: SamplingParams | None
    mrope: tuple[np.ndarray, int] | None = None  # a multimodal prompt's M-RoPE positions [3, P] and delta


class RequestMap:
    """The adapter's request map as the step being read leaves it: ``rows`` (request id -> state row),
    ``admitted`` and the sorted free rows, copied on the first change, so the adapter's own maps stay as
    they were until `VllmAdapter.step` keeps the plan."""

    def __init__(self, rows: dict, admitted: dict, free: list):
        self.rows, self.admitted, self.free, self._copied = rows, admitted, free, False

    def _copy(self) -> None:
        if not self._copied:
            self.rows, self.admitted, self.free, self._copied = dict(self.rows), dict(self.admitted), \
                list(self.free), True

    def forget(self, req_id) -> None:
        if req_id in self.admitted:
            self._copy()
            self.admitted.pop(req_id)

    def release(self, req_id) -> int:
        self._copy()
        row = self.rows.pop(req_id)
        bisect.insort(self.free, row)
        return row

    def admit(self, req_id, admission: Admission) -> None:
        self._copy()
        self.admitted[req_id] = admission

    def take_row(self, req_id, max_num_reqs: int) -> int:
        if req_id in self.rows:
            fail(f"request {req_id!r} is added but already holds row {self.rows[req_id]}")
        if not self.free:
            fail(f"request {req_id!r}: no free row (max_num_reqs={max_num_reqs})")
        self._copy()
        row = self.free.pop(0)
        self.rows[req_id] = row
        return row
