"""vLLM 0.33.0's real scheduler through `VllmAdapter`, each step read both ways (tests/support/column_paths.py):
the common path (vLLM's lists straight into the buffer's columns) against the general path (`StepUpdates`), on
the adapter's state before the step; then the step taken, the fake model's tokens recorded, vLLM updated.

Started by tests/serving/test_vllm_columns.py in a subprocess (as the other vLLM workers). Workloads from
tests/support/vllm_scheduler.py in a configuration the common path covers (no LoRA), both runner modes
(V1: a preempted request resumes in ``resumed_req_ids``, the general path's; V2: it is re-sent as new, a common
step): chunked prefill with preemption, prefix caching, six admissions at once, a second KV-cache group with a
sliding window, async scheduling, n-gram drafts (their steps are the general path's). Every step also tries the
door's corruptions of vLLM's output (tests/support/vllm_door_worker.py's `CORRUPTIONS`) on deep copies: a
corruption the general path refuses must not be taken by the common path. Negative control, every common
step: its step buffer with its last counted word changed must be seen as a difference.

Prints ``REPORT {json}``: per run the steps each path took, the corruptions refused, the controls caught; and
every difference found.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the support package

from support.vllm_scheduler import no_pinned_memory

no_pinned_memory()

import numpy as np  # noqa: E402

import jaxprep  # noqa: E402
from jaxprep.serving import ServingConfig  # noqa: E402
from jaxprep.serving.host.vllm import VllmAdapter  # noqa: E402
from support.column_paths import both_paths, differences, try_corruptions  # noqa: E402
from support.vllm_door_worker import CORRUPTIONS  # noqa: E402
from support.vllm_scheduler import WORKLOADS, Requests, Workload, fake_token, make_scheduler  # noqa: E402

RUNS = tuple(dataclasses.replace(work, num_loras=0) for work in WORKLOADS
             if not (work.async_scheduling and work.num_speculative_tokens))
"""The workloads without LoRA (the common path's configurations have no per-request feature values); async
scheduling with drafts is left out (its every step has drafts: the general path's, tested by the parity worker)."""
NUM_BLOCKS = max(work.num_blocks for work in RUNS)
"""Every run's adapter holds the largest run's KV pool (vLLM's block ids fit it; the corruptions' ids do not): the
runs share their configurations, and so their executables, where their features are the same."""


def columns_config(work: Workload) -> ServingConfig:
    groups = ()
    if work.sliding_window:
        groups = (jaxprep.KVCacheGroupSpec(block_size=work.block_size),
                  jaxprep.KVCacheGroupSpec(block_size=work.block_size, sliding_window=work.sliding_window))
    features = jaxprep.FeatureConfig(num_speculative_tokens=work.num_speculative_tokens, kv_groups=groups,
                                     discard_request_mask=True)
    prep = jaxprep.PrepConfig(max_num_reqs=work.max_num_seqs, max_model_len=work.max_model_len,
                              max_num_batched_tokens=64, block_size=work.block_size, num_blocks=NUM_BLOCKS,
                              features=features, token_buckets=(16, 64))
    return ServingConfig(prep=prep, vocab_size=1000)


def control_caught(paths) -> bool:
    """The common step's buffer with its last counted word changed: the comparison must see it."""
    checked = paths.common.checked
    step = checked.packed.step.copy()
    last = int(np.flatnonzero(step)[-1])
    step[last] += 1
    changed = dataclasses.replace(checked, packed=dataclasses.replace(checked.packed, step=step))
    return bool(differences(dataclasses.replace(paths, common=dataclasses.replace(paths.common, checked=changed))))


def run(work: Workload, v2_mode: bool, report: dict) -> None:
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if v2_mode else "0"
    scheduler, requests = make_scheduler(work), Requests(work)
    adapter, rng = VllmAdapter(columns_config(work), async_scheduling=work.async_scheduling), \
        np.random.default_rng(37)
    label = f"{work.name} [{'V2' if v2_mode else 'V1'}]"
    seen = dict(common=0, general=0, refused=0, corrupt_refused=0, corrupt_common=0, controls_caught=0)
    pending = None  # async scheduling: step N's output reaches the scheduler after step N + 1 is scheduled
    for number in range(work.num_steps):
        for request in requests.arrivals(number):
            scheduler.add_request(request)
        so = scheduler.schedule()
        paths = both_paths(adapter, so)
        seen[paths.kind] += 1
        report["problems"] += [f"[{label}] step {number}: {d}" for d in differences(paths)]
        if paths.kind == "common":
            seen["controls_caught"] += control_caught(paths)
        report["problems"] += try_corruptions(adapter, so, CORRUPTIONS, rng, seen, f"[{label}] step {number}")
        step = adapter.step(so)
        sampled = sampled_tokens(so, adapter)
        if step.buffer is not None:
            record(adapter, step, sampled, 1 + work.num_speculative_tokens)
        req_ids = list(so.num_scheduled_tokens)
        output = (so, ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                        sampled_token_ids=[sampled[r] for r in req_ids]))
        if work.async_scheduling:
            if pending:
                scheduler.update_from_output(*pending)
            pending = output
            continue
        scheduler.update_from_output(*output)
        if work.num_speculative_tokens:  # the fake model's next tokens as drafts (all rejected: one sample kept)
            drafting = [r for r in req_ids if sampled[r] and r in scheduler.requests]
            scheduler.update_draft_token_ids(DraftTokenIds(drafting, [
                [fake_token(r, scheduler.requests[r].num_tokens + i) for i in range(work.num_speculative_tokens)]
                for r in drafting]))
    report["runs"][label] = seen


def sampled_tokens(so, adapter: VllmAdapter) -> dict:
    """The fake model's token for every scheduled request whose step reaches its last known token, read from
    the adapter's mirror once it took the step (drafts all rejected: one token kept)."""
    mirror, out = adapter.batch.rows, {}
    for req_id in so.num_scheduled_tokens:
        row = adapter.rows[req_id]
        tokens = int(mirror.num_tokens[row])
        reaches = mirror.num_computed_tokens[row] + mirror.num_scheduled_tokens[row] >= tokens
        out[req_id] = [fake_token(req_id, tokens)] if reaches else []
    return out


def record(adapter: VllmAdapter, step, sampled: dict, width: int) -> None:
    import jax.numpy as jnp

    rows = step.inputs.idx_mapping.shape[0]
    tokens, counts = np.zeros((rows, width), np.int32), np.zeros(rows, np.int32)
    for req_id, values in sampled.items():
        b = step.req_id_to_index[req_id]
        tokens[b, :len(values)], counts[b] = values, len(values)
    adapter.record_sampled(jnp.asarray(tokens), jnp.asarray(counts))


def main() -> int:
    report = {"runs": {}, "problems": []}
    for work in RUNS:
        for v2_mode in (False, True):
            run(work, v2_mode, report)
    report["problems"] = report["problems"][:40]
    print("REPORT " + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
