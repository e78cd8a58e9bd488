"""Drives vLLM 0.33.0's real scheduler through `jaxprep.serving.host.vllm.VllmAdapter` and vLLM's own V1 runner at once;
prints a JSON report of every field where the two prepared steps differ.

Started by tests/serving/test_vllm_adapter.py in a subprocess whose environment sets ``TRITON_INTERPRET=1`` and
``CUDA_VISIBLE_DEVICES=""`` before Python starts (the runner's slot-mapping kernel is a Triton kernel). Each
workload runs in both scheduler modes: ``VLLM_USE_V2_MODEL_RUNNER`` is set before each scheduler's
`VllmConfig` is built (vLLM reads it there, lazily): 0, the scheduler speaks to V1 (a preempted request
comes back in ``resumed_req_ids`` with ``all_token_ids``); 1, to V2 (it is re-sent as a new request).

Every step: ``scheduler.schedule()`` -> the adapter (one `StepUpdates`, prepare) and the runner
(``_update_states`` + ``_prepare_inputs``), and under V2 also MRV2's input kernels in V2's batch order
(`v2_kernels`) -> per request, every field compared -> the fake model's
tokens recorded on both sides (the adapter's on the device, no host read) -> ``update_from_output``
with the adapter's ``ModelRunnerOutput``, and under n-gram spec decode vLLM's n-gram drafts back to the
scheduler. Under async scheduling the output of step N reaches the scheduler after step N + 1 is
scheduled, as ``EngineCore.step_with_batch_queue`` does; with drafts there (an EAGLE drafter: V1 refuses
n-gram with async scheduling) the scheduler schedules -1 placeholders and never sees the drafts: the
fake drafter's proposals (`fake_drafts`) go to both runners on the device side (V1's ``_draft_token_ids``,
the adapter's ``record_sampled(draft_token_ids=...)``), as ``EngineCore`` skips ``take_draft_token_ids``.

Negative controls, every step: each compared field is compared again with jaxprep's value shifted by one;
the report counts, per field, the steps where the shift was caught (`Comparison.caught`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("CUDA_VISIBLE_DEVICES") != "":
    sys.exit("run with TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES='' set before Python starts")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the support package

from support.vllm_scheduler import no_pinned_memory

no_pinned_memory()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxprep  # noqa: E402
from jaxprep.serving import ServingConfig  # noqa: E402
from jaxprep.serving.host import batch as batch_module  # noqa: E402
from jaxprep.serving.host.vllm import VllmAdapter  # noqa: E402
from support.run_keys import recording_run  # noqa: E402
from support.vllm_scheduler import (  # noqa: E402
    WORKLOADS,
    Requests,
    Workload,
    fake_drafts,
    fake_token,
    make_scheduler,
)
from support.vllm_v1_runner import V1Runner  # noqa: E402

MAX_NUM_BATCHED_TOKENS = max(w.max_num_batched_tokens for w in WORKLOADS)
NUM_BLOCKS = max(w.num_blocks for w in WORKLOADS)
NUM_SPECULATIVE_TOKENS = max(w.num_speculative_tokens for w in WORKLOADS)
MAX_LORAS = max(w.num_loras for w in WORKLOADS)


def serving_config(work: Workload) -> ServingConfig:
    """jaxprep's configuration of ``work``: vLLM's sizes, and the features of all workloads at once (drafts,
    LoRA, the discard mask), so that only the KV-cache groups tell two configurations apart (each one
    compiles): one token budget, KV-cache size and two-bucket ladder for all workloads."""
    groups = ()
    if work.sliding_window:
        groups = (jaxprep.KVCacheGroupSpec(block_size=work.block_size, num_blocks=NUM_BLOCKS),
                  jaxprep.KVCacheGroupSpec(block_size=work.block_size, sliding_window=work.sliding_window,
                                           num_blocks=NUM_BLOCKS))
    features = jaxprep.FeatureConfig(num_speculative_tokens=NUM_SPECULATIVE_TOKENS, discard_request_mask=True,
                                     kv_groups=groups, lora=jaxprep.LoRAConfig(max_loras=MAX_LORAS),
                                     async_tokens=True)
    prep = jaxprep.PrepConfig(max_num_reqs=work.max_num_seqs, max_model_len=work.max_model_len,
                              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, block_size=work.block_size,
                              num_blocks=NUM_BLOCKS, features=features, token_buckets=(16, MAX_NUM_BATCHED_TOKENS))
    return ServingConfig(prep=prep, vocab_size=1000)


class Comparison:
    """Mismatches of one workload; with ``corrupt`` set, only whether that field's shifted value was caught."""

    def __init__(self, name: str, corrupt: str | None = None):
        self.name, self.corrupt, self.mismatches, self.compared = name, corrupt, [], set()

    def check(self, step: int, req_id: str, field: str, ours, vllm) -> None:
        ours, vllm = np.asarray(ours).astype(np.int64), np.asarray(vllm).astype(np.int64)
        if self.corrupt is not None:
            if field != self.corrupt:
                return
            ours = ours + 1
        self.compared.add(field)
        if ours.shape != vllm.shape or not np.array_equal(ours, vllm):
            where = np.flatnonzero(ours.ravel() != vllm.ravel())[:1] if ours.shape == vllm.shape else [0]
            first = int(where[0]) if len(where) else 0
            shown = slice(first, first + 12)
            self.mismatches.append(f"[{self.name}] step {step} {req_id} {field} from index {first}: jaxprep "
                                   f"{ours.ravel()[shown].tolist()} vLLM {vllm.ravel()[shown].tolist()}")


def host_step(adapter: VllmAdapter, step) -> dict:
    """jaxprep's prepared step and state as host arrays (a host read for the comparison only)."""
    inputs, meta = step.inputs, step.inputs.attn_metadata
    out = {"input_ids": inputs.input_ids, "positions": inputs.positions, "qsl": meta.query_start_loc,
           "seq_lens": meta.seq_lens, "logits_indices": inputs.logits_indices, "idx_mapping": inputs.idx_mapping,
           "num_computed_tokens": adapter.batch.state.batch.num_computed_tokens}
    groups = inputs.kv_groups or ()
    out["slot_mapping.0"] = groups[0].slot_mapping if groups else meta.slot_mapping
    out["block_table.0"] = groups[0].block_table if groups else meta.block_table
    for g, group in enumerate(groups[1:], start=1):
        out[f"slot_mapping.{g}"], out[f"block_table.{g}"] = group.slot_mapping, group.block_table
    if inputs.discard_request_mask is not None:
        out["discard"] = inputs.discard_request_mask
    if inputs.spec_decode is not None:
        for name in ("draft_token_ids", "logits_indices", "target_logits_indices", "bonus_logits_indices",
                     "num_draft_tokens", "cu_num_draft_tokens", "cu_num_sampled_tokens"):
            out[f"spec.{name}"] = getattr(inputs.spec_decode, name)
    if inputs.lora is not None:
        out["lora.token_lora_mapping"] = inputs.lora.token_lora_mapping
        out["lora_ids"] = adapter.batch.state.batch.lora_ids
    return {k: np.asarray(v) for k, v in out.items()}


def compare_step(cmp: Comparison, number: int, adapter: VllmAdapter, step, ours: dict, vllm: dict,
                 v2: dict | None = None) -> None:
    """Every field, request by request (the two batches may order requests differently); ``v2``: MRV2's
    kernels on the same step (`v2_kernels`), compared too."""
    if v2 is not None:
        compare_v2(cmp, number, step, ours, v2, vllm["req_ids"])
    cmp.check(number, "-", "batch_order", ours["idx_mapping"][:len(step.req_ids)],
              [adapter.rows[r] for r in step.req_ids])
    if sorted(step.req_ids) != sorted(vllm["req_ids"]):
        cmp.mismatches.append(f"[{cmp.name}] step {number}: batch {step.req_ids} vs vLLM {vllm['req_ids']}")
        return
    for i, req_id in enumerate(vllm["req_ids"]):
        b, row = step.req_id_to_index[req_id], adapter.rows[req_id]
        mine, theirs = slice(ours["qsl"][b], ours["qsl"][b + 1]), slice(vllm["query_start_loc"][i],
                                                                          vllm["query_start_loc"][i + 1])
        for field in ("input_ids", "positions"):
            cmp.check(number, req_id, field, ours[field][mine], vllm[field][theirs])
        cmp.check(number, req_id, "query_len", mine.stop - mine.start, theirs.stop - theirs.start)
        cmp.check(number, req_id, "seq_lens", ours["seq_lens"][b], vllm["seq_lens"][i])
        cmp.check(number, req_id, "num_computed_tokens", ours["num_computed_tokens"][row],
                  vllm["num_computed_tokens"][i])
        groups = sum(k.startswith("slot_mapping.") for k in vllm)
        for g in range(groups):
            cmp.check(number, req_id, f"slot_mapping.{g}", ours[f"slot_mapping.{g}"][mine],
                      vllm[f"slot_mapping.{g}"][theirs])
            table, theirs_table = ours[f"block_table.{g}"][b], v2_nulled(adapter, g, vllm, i)
            width = min(len(table), len(theirs_table))
            cmp.check(number, req_id, f"block_table.{g}", table[:width], theirs_table[:width])
        cmp.check(number, req_id, "discard", ours["discard"][b], vllm["discard"][i])
        if "spec" in vllm:
            compare_spec(cmp, number, req_id, ours, vllm, b, i)
        else:
            cmp.check(number, req_id, "logits_indices", ours["logits_indices"][b] - mine.start,
                      vllm["logits_indices"][i] - theirs.start)
        if "lora_ids" in ours:
            cmp.check(number, req_id, "lora_ids", ours["lora_ids"][row], vllm["lora_ids"][i])
            cmp.check(number, req_id, "lora.token_lora_mapping", ours["lora.token_lora_mapping"][mine],
                      vllm["token_lora_mapping"][theirs])


def v2_kernels(so, vllm: dict, runner: V1Runner, num_speculative_tokens: int,
               device_drafts: dict[str, list[int]] | None = None) -> dict:
    """MRV2's input kernels (tests/support/vllm_v2_worker.py: ``sort_batch_req_ids``, ``prepare_prefill_inputs``,
    ``prepare_pos_seq_lens``, ``combine_sampled_and_draft_tokens``) on V2's per-slot state, a slot per V1 batch
    row: the token table (prompt, outputs, then the drafts), ``num_computed_tokens`` (the device's: V2's
    ``post_update`` counts accepted drafts only) and ``prefill_len`` (the tokens a request was admitted with:
    V2's re-sent requests carry their outputs). ``device_drafts`` (async scheduling): each request's last
    proposals, which V2 keeps in ``req_states.draft_tokens`` in place of the scheduler's placeholders."""
    from support.vllm_v2_worker import run as run_v2_kernels

    batch, slot = runner.runner.input_batch, {r: i for i, r in enumerate(vllm["req_ids"])}
    n = len(slot)
    table = batch.token_ids_cpu[:n].copy()
    # async scheduling: V1 keeps last step's samples on the device (-1 in its host table, which with drafts
    # also lags behind the corrected counts); V2 writes them into its device table. Every token the fake model
    # kept at position p is fake_token(request, p).
    if device_drafts is not None:
        for i, req_id in enumerate(vllm["req_ids"]):
            start, end = int(batch.num_prompt_tokens[i]), int(vllm["num_computed_tokens"][i]) + 1
            table[i, start:end] = [fake_token(req_id, p) for p in range(start, end)]
    for i, p in zip(*np.nonzero(table == -1)):
        table[i, p] = fake_token(vllm["req_ids"][i], int(p))
    return run_v2_kernels(dict(
        num_speculative_tokens=num_speculative_tokens, num_tokens_padded=so.total_num_scheduled_tokens,
        token_ids=table, num_computed_tokens=vllm["num_computed_tokens"],
        prefill_len=batch.num_prompt_tokens[:n],
        scheduled=[(slot[r], count) for r, count in so.num_scheduled_tokens.items()],  # scheduler order
        drafts=[(slot[r], device_drafts[r][:len(ids)] if device_drafts is not None else zeroed(ids))
                for r, ids in so.scheduled_spec_decode_tokens.items()]))


def zeroed(ids: list[int]) -> list[int]:
    """The drafts V2 writes into ``input_ids`` for the sync scheduler's: its own, which equal the scheduler's,
    except the -1 placeholders of a request the scheduler pads as it joins (``pad_spec_decode``): V2 zeroes a
    new request's ``req_states.draft_tokens`` (`vllm/v1/worker/gpu/states.py::RequestState.add_request`)."""
    return [max(t, 0) for t in ids]


def compare_v2(cmp: Comparison, number: int, step, ours: dict, v2: dict, req_ids: list[str]) -> None:
    """Per request, in V2's batch order: input ids, positions, seq_lens and logits rows."""
    qsl, cu = v2["query_start_loc"], v2["cu_num_logits"]
    input_ids, positions = np.asarray(v2["input_ids"]), np.asarray(v2["positions"])
    for k, slot in enumerate(v2["idx_mapping"]):
        req_id = req_ids[slot]
        b = step.req_id_to_index[req_id]
        mine, theirs = slice(ours["qsl"][b], ours["qsl"][b + 1]), slice(qsl[k], qsl[k + 1])
        cmp.check(number, req_id, "v2.input_ids", ours["input_ids"][mine], input_ids[theirs])
        cmp.check(number, req_id, "v2.positions", ours["positions"][mine], positions[theirs])
        cmp.check(number, req_id, "v2.seq_lens", ours["seq_lens"][b], v2["seq_lens"][k])
        if "spec.cu_num_sampled_tokens" in ours:
            cu_ours = ours["spec.cu_num_sampled_tokens"]
            logits = ours["spec.logits_indices"][(cu_ours[b - 1] if b else 0):cu_ours[b]]
        else:
            logits = ours["logits_indices"][b:b + 1]
        cmp.check(number, req_id, "v2.logits_indices", np.asarray(logits) - mine.start,
                  np.asarray(v2["logits_indices"][cu[k]:cu[k + 1]]) - theirs.start)


def v2_nulled(adapter: VllmAdapter, g: int, vllm: dict, i: int) -> np.ndarray:
    """V1's block-table row of group ``g``; in a sliding-window group with V2's nulling, which jaxprep applies
    (docs/semantics.md#sliding-window): `vllm/v1/worker/gpu/block_table.py::_gather_block_tables_kernel` nulls
    the first ``max(num_computed_tokens - (window - 1), 0) // block_size`` entries."""
    row = vllm[f"block_table.{g}"][i].copy()
    groups = adapter.config.prep.features.kv_groups
    if groups and groups[g].sliding_window:
        num_null = max(int(vllm["num_computed_tokens"][i]) - (groups[g].sliding_window - 1), 0) // groups[g].block_size
        row[:num_null] = 0
    return row


def compare_spec(cmp: Comparison, number: int, req_id: str, ours: dict, vllm: dict, b: int, i: int) -> None:
    """Spec-decode metadata of one request, each index relative to the request's first token or logit."""
    spec, token_start, their_token_start = vllm["spec"], ours["qsl"][b], vllm["query_start_loc"][i]

    def span(cu, k):  # entries [cu[k-1], cu[k]) of an inclusive cumsum
        return slice(0 if k == 0 else int(cu[k - 1]), int(cu[k]))

    theirs_d, mine_d = span(spec["cu_num_draft_tokens"], i), span(ours["spec.cu_num_draft_tokens"], b)
    theirs_l = span(np.cumsum(spec["num_draft_tokens"] + 1), i)
    mine_l = span(ours["spec.cu_num_sampled_tokens"], b)
    cmp.check(number, req_id, "spec.num_draft_tokens", ours["spec.num_draft_tokens"][b], spec["num_draft_tokens"][i])
    cmp.check(number, req_id, "spec.draft_token_ids", ours["spec.draft_token_ids"][mine_d],
              spec["draft_token_ids"][theirs_d])
    cmp.check(number, req_id, "spec.logits_indices", ours["spec.logits_indices"][mine_l] - token_start,
              spec["logits_indices"][theirs_l] - their_token_start)
    cmp.check(number, req_id, "spec.target_logits_indices", ours["spec.target_logits_indices"][mine_d] - mine_l.start,
              spec["target_logits_indices"][theirs_d] - theirs_l.start)
    cmp.check(number, req_id, "spec.bonus_logits_indices", ours["spec.bonus_logits_indices"][b] - mine_l.start,
              spec["bonus_logits_indices"][i] - theirs_l.start)


def as_v1_output(scheduler_output):
    """Under V2 the scheduler re-sends a preempted request as a new one whose ``prefill_token_ids`` hold its
    prompt and outputs; V1's runner reads ``prompt_token_ids``, so its copy gets those tokens there (V2's
    ``finish_requests`` drops preempted requests first; `V1Runner.forget` does the same)."""
    new = [dataclasses.replace(n, prompt_token_ids=list(n.prefill_token_ids))  # a copy: the scheduler's list grows
           for n in scheduler_output.scheduled_new_reqs]
    return dataclasses.replace(scheduler_output, scheduled_new_reqs=new)


def record(adapter: VllmAdapter, step, sampled: dict[str, list[int]], width: int,
           drafts: dict[str, list[int]] | None = None) -> None:
    """The fake sampler's tokens (and the fake drafter's proposals) as device arrays in the adapter's batch order."""
    rows = step.inputs.idx_mapping.shape[0]
    tokens, counts = np.zeros((rows, width), np.int32), np.zeros(rows, np.int32)
    proposals = np.zeros((rows, width - 1), np.int32)
    for b, req_id in enumerate(step.req_ids):
        tokens[b, :len(sampled[req_id])] = sampled[req_id]
        counts[b] = len(sampled[req_id])
        if drafts is not None:
            proposals[b] = drafts[req_id]
    adapter.record_sampled(jnp.asarray(tokens), jnp.asarray(counts),
                           None if drafts is None else jnp.asarray(proposals))


def propose(vllm: dict, sampled: list[list[int]], k: int) -> list[list[int]]:
    """The fake EAGLE drafter after a step, per request in V1's batch order: proposals for the positions after
    the last kept token (seq_len - D + n, seq_len being the device's); zeros for a discarded prefill chunk."""
    drafts = vllm.get("spec", {}).get("num_draft_tokens", np.zeros(len(vllm["req_ids"]), np.int32))
    return [fake_drafts(req_id, int(vllm["seq_lens"][i]) - int(drafts[i]) + len(tokens), k) if tokens else [0] * k
            for i, (req_id, tokens) in enumerate(zip(vllm["req_ids"], sampled))]


def run_workload(work: Workload, v2_mode: bool, report: dict) -> None:
    from vllm.v1.outputs import DraftTokenIds

    started = time.perf_counter()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if v2_mode else "0"  # read when the scheduler's config is built
    scheduler, requests, runner = make_scheduler(work), Requests(work), V1Runner(work)
    label = f"{work.name} [{'V2' if scheduler.use_v2_model_runner else 'V1'}]"
    adapter, cmp = VllmAdapter(serving_config(work), async_scheduling=work.async_scheduling), Comparison(label)
    adapter.batch.steady_programs = True  # as after `ServingBatch.warmup`; each compiles on first use here
    async_drafts = work.async_scheduling and work.num_speculative_tokens > 0
    device_drafts: dict[str, list[int]] = {}  # V2's req_states.draft_tokens: each request's last proposals
    stats = dict(steps=0, preempted=0, resumed=0, resent=0, drafts=0, rejected=0, prefix_hits=0, max_admissions=0,
                 lora=0)
    RUN_KEYS.clear()
    pending = None
    for number in range(work.num_steps):
        for request in requests.arrivals(number):
            scheduler.add_request(request)
        so = scheduler.schedule()
        if so.total_num_scheduled_tokens == 0:  # finished requests only: both sides update, neither prepares
            adapter.step(so)
            runner.update_only(so, v2_mode)
            if pending:
                scheduler.update_from_output(*pending)
                pending = None
            continue
        count_coverage(stats, so)
        step = adapter.step(so)
        vllm = runner.prepare(as_v1_output(so) if v2_mode else so, v2_mode)
        v2 = v2_kernels(so, vllm, runner, work.num_speculative_tokens,
                        device_drafts if async_drafts else None) if v2_mode else None
        ours = host_step(adapter, step)
        compare_step(cmp, number, adapter, step, ours, vllm, v2)
        negative_controls(report["caught"], label, number, adapter, step, ours, vllm, v2)
        sampled = runner.sampled(vllm)
        count_rejected(stats, vllm, sampled)
        drafts = propose(vllm, sampled, work.num_speculative_tokens) if async_drafts else None
        runner.record(so, vllm, sampled, drafts)
        by_id = dict(zip(vllm["req_ids"], sampled))
        drafts_by_id = None if drafts is None else dict(zip(vllm["req_ids"], drafts))
        record(adapter, step, by_id, 1 + work.num_speculative_tokens, drafts_by_id)
        if drafts_by_id:
            device_drafts.update({r: d for r, d in drafts_by_id.items() if by_id[r]})
        output = adapter.runner_output(step, [by_id[r] for r in step.req_ids])
        if work.async_scheduling:
            if pending:
                scheduler.update_from_output(*pending)
            pending = (so, output)
            continue
        scheduler.update_from_output(so, output)
        if work.num_speculative_tokens:
            scheduler.update_draft_token_ids(DraftTokenIds(*runner.propose_drafts(vllm, sampled)))
    # a finished request must not keep its row once the scheduler has reported it (finished_req_ids: not yet)
    leaked = set(adapter.rows) - set(scheduler.requests) - set(scheduler.finished_req_ids)
    if leaked:
        cmp.mismatches.append(f"[{label}] rows kept by finished requests {sorted(leaked)}")
    errors = adapter.batch.errors()
    if any(errors.values()):
        cmp.mismatches.append(f"[{label}] device error bits {errors}")
    stats["steady"] = sum(key[0] == "door" and key[-1] for key in RUN_KEYS)  # steps the steady program applied
    report["workloads"][label] = dict(stats, v2_mode=scheduler.use_v2_model_runner, compared=sorted(cmp.compared),
                                      h2d_bytes=adapter.batch.h2d_bytes, changed_words=adapter.batch.changed_words,
                                      seconds=round(time.perf_counter() - started, 1))
    report["mismatches"] += cmp.mismatches[:40]


RUN_KEYS: list[tuple] = []
"""The executable keys `ServingBatch` ran in the running workload (`support.run_keys.recording_run`)."""


def negative_controls(caught: dict, label: str, number: int, adapter, step, ours: dict, vllm: dict, v2) -> None:
    """Each field compared again with jaxprep's value shifted by one: counts the steps that catch it."""
    for field in FIELDS:
        shifted = Comparison(label, corrupt=field)
        compare_step(shifted, number, adapter, step, ours, vllm, v2)
        if shifted.compared:
            seen = caught.setdefault(field, [0, 0])
            seen[0] += 1
            seen[1] += bool(shifted.mismatches)


def count_rejected(stats: dict, vllm: dict, sampled: list[list[int]]) -> None:
    """Drafts the fake model rejected this step (D - (n - 1) per request that verified D drafts)."""
    for num_drafts, tokens in zip(vllm.get("spec", {}).get("num_draft_tokens", ()), sampled):
        if num_drafts and tokens:
            stats["rejected"] += int(num_drafts) - (len(tokens) - 1)


def count_coverage(stats: dict, so) -> None:
    cached = so.scheduled_cached_reqs
    stats["steps"] += 1
    stats["preempted"] += len(so.preempted_req_ids or ())
    stats["resumed"] += len(cached.resumed_req_ids)
    stats["resent"] += sum(n.prefill_token_ids is not None and len(n.prefill_token_ids) > len(n.prompt_token_ids)
                           for n in so.scheduled_new_reqs)
    stats["drafts"] += sum(len(d) for d in so.scheduled_spec_decode_tokens.values())
    stats["prefix_hits"] += sum(n.num_computed_tokens > 0 for n in so.scheduled_new_reqs)
    stats["max_admissions"] = max(stats["max_admissions"], len(so.scheduled_new_reqs))
    stats["lora"] += sum(n.lora_request is not None for n in so.scheduled_new_reqs)


FIELDS = ("batch_order", "input_ids", "positions", "query_len", "seq_lens", "num_computed_tokens", "slot_mapping.0",
          "slot_mapping.1", "block_table.0", "block_table.1", "discard", "logits_indices", "spec.num_draft_tokens",
          "spec.draft_token_ids", "spec.logits_indices", "spec.target_logits_indices", "spec.bonus_logits_indices",
          "lora_ids", "lora.token_lora_mapping", "v2.input_ids", "v2.positions", "v2.seq_lens", "v2.logits_indices")
"""Every field `compare_step` compares."""


def main() -> int:
    """Arguments: ``--modes 0,1`` (default both) and workload names (default all)."""
    args, modes = sys.argv[1:], ["0", "1"]
    if args[:1] == ["--modes"]:
        modes, args = args[1].split(","), args[2:]
    report = {"workloads": {}, "mismatches": [], "caught": {}}
    batch_module.run = recording_run(RUN_KEYS)
    for mode in modes:
        for work in WORKLOADS:
            if not args or work.name in args:
                run_workload(work, mode == "1", report)
    print("REPORT " + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
