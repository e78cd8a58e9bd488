"""How data-parallel ranks share a step: where a new request goes and the one bucket they all pad to.

vLLM's rule stays: every rank runs each step padded to one shared bucket
(``vllm/v1/worker/dp_utils.py::coordinate_batch_across_dp``), and an idle rank runs a padding-only
batch. What the coordinator picks is jaxprep's policy, chosen to keep padding low:

- routing balances tokens, not requests: a new request goes to the rank with the fewest tokens
  still to compute (`Scheduler.demand`), ties to the fewest unfinished requests, then the lowest rank;
- a multi-step decode dispatch runs only when every busy rank can run one: a dispatch has one
  bucket, so one rank's prefill would otherwise pad K decode iterations of the others to it;
- the shared bucket is the rung that wastes the smallest share of the step's slots (holding every
  rank's decodes); a rank over it gives back prefill tokens (`Scheduler.cap`), which it schedules
  in the next step as any chunked prefill. On `jaxprep simulate --devices 4` this costs few extra
  steps (BENCHMARKS.md): the tokens given back fill later steps whose ranks would pad anyway.

With one rank all three are no-ops: the plain loop is unchanged.
"""

from __future__ import annotations

import numpy as np

from jaxprep.config import PrepConfig
from jaxprep.serving.host.scheduler import Scheduler, SchedulerOutput
from jaxprep.sharding import dp_bucket


def route(schedulers: list[Scheduler]) -> int:
    """The rank a new request joins: least demand, then fewest unfinished requests, then lowest rank.

    ```
    # demands [40, 3, 3, 0], requests [2, 1, 1, 0] -> rank 3
    ```
    """
    keys = [(s.demand, len(s.waiting) + len(s.running), rank) for rank, s in enumerate(schedulers)]
    return min(keys)[2]


def coordinate(prep: PrepConfig, schedulers: list[Scheduler], outs: list[SchedulerOutput]) -> int:
    """Makes the ranks' schedules (``outs``, changed in place) fit one bucket; returns it."""
    totals = [out.total_num_scheduled_tokens for out in outs]
    if any(out.decode_steps == 1 and total for out, total in zip(outs, totals)):
        for out in outs:
            out.decode_steps = 1  # the lookahead blocks stay allocated: the request needs them soon anyway
    if len(outs) == 1:
        return dp_bucket(prep, totals)  # one rank: its own bucket, nothing given back
    bucket = shared_bucket(prep, totals, [_num_decodes(out) for out in outs])
    for scheduler, out in zip(schedulers, outs):
        if out.total_num_scheduled_tokens > bucket:
            scheduler.cap(out, bucket)
    return bucket


def shared_bucket(prep: PrepConfig, totals, decodes) -> int:
    """The rung, among those holding every rank's decodes (tokens a rank cannot give back), whose
    step wastes the smallest share of its slots once each rank is cut to it; ties: the larger rung.

    ```
    # ladder (8, 16, 32, 64), totals [64, 12, 64, 64], decodes [0, 12, 0, 0]
    #   -> waste 16: 1 - 60/64, 32: 1 - 108/128, 64: 1 - 204/256 -> 16 (the prefills give back 48 each)
    ```
    """
    floor = max(int(np.max(decodes)), 1)
    rungs = [b for b in prep.token_buckets if b >= floor]
    waste = [1.0 - sum(min(int(t), b) for t in totals) / (b * len(totals)) for b in rungs]
    return -min(zip(waste, (-b for b in rungs)))[1]


def _num_decodes(out: SchedulerOutput) -> int:
    """Rows scheduled one token: what `Scheduler.cap` keeps."""
    return int(np.count_nonzero(out.num_scheduled_tokens == 1))
