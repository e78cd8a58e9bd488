"""What each dispatch of the serving loop ran: tokens per forward pass, the bucket, prefill vs decode.

`LoopStats.dispatches_log` holds one `DispatchRecord` per dispatch; ``jaxprep simulate --plot``
draws it (`jaxprep.cli.chart`). A request counts as decoding in a pass when it runs one token,
vLLM's rule (``vllm/v1/attention/backends/utils.py::split_decodes_and_prefills``, decode threshold 1).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class DispatchRecord:
    """One dispatch (one jitted call); its first forward pass runs what the scheduler scheduled,
    each later pass of a multi-step decode one token per row still decoding."""

    prefill_tokens: int  # first pass: tokens of requests running more than one token
    decode_tokens: int  # first pass: requests running exactly one token
    later_tokens: tuple[int, ...]  # real tokens of each later pass (all decodes)
    padded_tokens: int  # bucket x ranks: token slots of every pass

    @property
    def tokens_per_pass(self) -> tuple[int, ...]:
        return (self.prefill_tokens + self.decode_tokens, *self.later_tokens)


def dispatch_record(scheduled: list[np.ndarray], tokens: list[np.ndarray], bucket: int) -> DispatchRecord:
    """``scheduled``: each rank's ``num_scheduled_tokens`` [max_num_reqs]; ``tokens``: each rank's
    appended tokens [iterations, max_num_reqs] (-1: none).

    ```
    # one rank, scheduled [5, 1, 0, 1], tokens [[x, x, -1, x], [-1, x, -1, x]] -> prefill 5, decode 2, later (2,)
    ```
    """
    counts = np.asarray(scheduled[0]) if len(scheduled) == 1 else np.stack([np.asarray(s) for s in scheduled])
    later = sum((np.asarray(t)[1:] >= 0).sum(axis=1) for t in tokens)  # [iterations - 1]
    return DispatchRecord(prefill_tokens=int(counts[counts > 1].sum()), decode_tokens=int((counts == 1).sum()),
                          later_tokens=tuple(later[later > 0].tolist()), padded_tokens=bucket * len(scheduled))
