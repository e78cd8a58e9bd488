"""vLLM 0.33.0's own V1 model runner preparing a step on the CPU: the oracle of the adapter parity test.

`vllm/v1/worker/cpu_model_runner.py::CPUModelRunner` (a `GPUModelRunner` whose device buffers are its host
buffers) is built from the workload's `VllmConfig`, its persistent `InputBatch` re-made for the workload's
`KVCacheConfig` (`GPUModelRunner.may_reinitialize_input_batch`); no model is loaded. Per step it runs what
`GPUModelRunner.execute_model` runs before the forward pass: ``_update_states(scheduler_output)`` and
``_prepare_inputs(scheduler_output, num_scheduled_tokens)``, and after sampling
``_bookkeeping_sync`` with the fake model's tokens (so its token table and, under async scheduling, its
``prev_sampled_token_ids`` hold what a real sampler would have left). Under async scheduling with drafts
(an EAGLE drafter, `support.vllm_scheduler.fake_drafts`) it first does what
``GPUModelRunner.propose_draft_token_ids`` leaves on the device: ``_draft_token_ids`` and, from vLLM's own
``EagleProposer.prepare_next_token_ids_padded`` kernel, ``prev_sampled_token_ids`` and
``valid_sampled_token_count_gpu``, which the next ``_prepare_inputs`` uses to correct the scheduler's
optimistic ``num_computed_tokens`` (`vllm/v1/spec_decode/utils.py::update_num_computed_tokens_for_batch_change`).

`V1Runner.prepare` returns the step per request id, in the runner's batch order: every field the
adapter test compares.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import torch

from support.vllm_ngram import load_vllm_ngram
from support.vllm_scheduler import (
    NoEvent,
    Workload,
    cpu_platform_stubs,
    fake_token,
    kv_cache_config,
    vllm_config,
)


def numba_stand_in() -> None:
    """The runner builds vLLM's ``NgramProposer`` under n-gram spec decode, whose module imports numba only to
    compile the matcher; without numba a module with the same names that compiles nothing stands in (the
    drafts are proposed by `support.vllm_ngram`, the matcher's own body)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("numba")
        stand_in.jit = stand_in.njit = lambda *args, **kwargs: (lambda f: f) if not args or not callable(args[0]) \
            else args[0]
        stand_in.prange = range
        stand_in.get_num_threads = lambda: 1
        stand_in.set_num_threads = lambda n: None
        sys.modules["numba"] = stand_in


class V1Runner:
    def __init__(self, work: Workload):
        self.work = work
        numba_stand_in()
        with cpu_platform_stubs():
            from vllm.v1.worker.cpu_model_runner import CPUModelRunner

            # the runner has no adapters loaded: LoRA ids are read from its InputBatch, not applied
            self.runner = CPUModelRunner(vllm_config(work, lora=False), torch.device("cpu"))
            config = kv_cache_config(work)
            self.runner.kv_cache_config = config
            self.runner.may_reinitialize_input_batch(config)
        self.num_groups = len(config.kv_cache_groups)
        self.ngram = load_vllm_ngram() if work.num_speculative_tokens and work.spec_method == "ngram" else None

    def update_only(self, scheduler_output, v2_mode: bool = False) -> None:
        """A step that schedules nothing: ``execute_model`` runs ``_update_states`` and returns."""
        if v2_mode:
            self.forget(scheduler_output.preempted_req_ids or ())
        with cpu_platform_stubs():
            self.runner._update_states(scheduler_output)

    def prepare(self, scheduler_output, v2_mode: bool = False) -> dict:
        """``_update_states`` + ``_prepare_inputs``; the step's fields, per request in batch order. Under V2
        (``v2_mode``) preempted requests are dropped first (`forget`)."""
        if v2_mode:
            self.forget(scheduler_output.preempted_req_ids or ())
        runner, batch = self.runner, self.runner.input_batch
        with cpu_platform_stubs():
            corrections = runner._update_states(scheduler_output)
            req_ids = list(batch.req_ids)
            scheduled = np.array([scheduler_output.num_scheduled_tokens[r] for r in req_ids], np.int32)
            logits_indices, spec, _ = runner._prepare_inputs(scheduler_output, scheduled)
            if corrections:  # execute_model runs them after the forward pass
                corrections()
        num_reqs, num_tokens = len(req_ids), int(scheduled.sum())
        step = {
            "req_ids": req_ids,
            # as the model gets them: _preprocess clamps the placeholders no step filled (-1) to 0
            "input_ids": runner.input_ids.gpu[:num_tokens].numpy().clip(min=0),
            "positions": runner.positions[:num_tokens].numpy().copy(),
            "query_start_loc": runner.query_start_loc.cpu[:num_reqs + 1].numpy().copy(),
            "seq_lens": runner.seq_lens[:num_reqs].numpy().copy(),
            # the device's count (async spec decode: the scheduler's, corrected for last step's rejections)
            "num_computed_tokens": runner.num_computed_tokens[:num_reqs].numpy().copy(),
            "logits_indices": logits_indices.numpy().copy(),
            "discard": runner.discard_request_mask.np[:num_reqs].copy(),
            "lora_ids": batch.request_lora_mapping[:num_reqs].copy(),
            # InputBatch.make_lora_inputs: the adapter id of every token (what set_active_loras hands on)
            "token_lora_mapping": np.asarray(batch.make_lora_inputs(scheduled, scheduled)[1], np.int64),
        }
        for g in range(self.num_groups):
            table = batch.block_table[g]
            step[f"slot_mapping.{g}"] = table.slot_mapping.gpu[:num_tokens].numpy().copy()
            step[f"block_table.{g}"] = table.get_device_tensor(num_reqs).numpy().copy()
        if spec is not None:
            step["spec"] = {name: getattr(spec, name).numpy().copy() for name in (
                "draft_token_ids", "cu_num_draft_tokens", "target_logits_indices", "bonus_logits_indices",
                "logits_indices")}
            step["spec"]["num_draft_tokens"] = np.asarray(spec.num_draft_tokens, np.int32)
        return step

    def forget(self, req_ids) -> None:
        """Drops requests from the runner, as V2's ``finish_requests`` drops preempted ones (the V2 scheduler
        re-sends them as new requests)."""
        for req_id in req_ids:
            self.runner.requests.pop(req_id, None)
            self.runner.input_batch.remove_request(req_id)

    def sampled(self, step: dict) -> list[list[int]]:
        """The fake model's valid tokens per request of ``step`` (batch order): a discarded partial prefill
        gets none, a request with drafts its accepted drafts and one more (greedy verification)."""
        drafts = step.get("spec", {}).get("num_draft_tokens", np.zeros(len(step["req_ids"]), np.int32))
        out = []
        for i, req_id in enumerate(step["req_ids"]):
            if step["discard"][i]:
                out.append([])
                continue
            seq_len, num_drafts = int(step["seq_lens"][i]), int(drafts[i])
            first = int(step["query_start_loc"][i + 1]) - num_drafts  # the first draft's token index
            tokens = []
            for j in range(num_drafts + 1):
                target = fake_token(req_id, seq_len - num_drafts + j)
                tokens.append(target)
                if j == num_drafts or int(step["input_ids"][first + j]) != target:
                    break
            out.append(tokens)
        return out

    def record(self, scheduler_output, step: dict, sampled: list[list[int]], drafts: list[list[int]] | None = None,
               ) -> None:
        """``_bookkeeping_sync`` with ``sampled`` as the sampler's output ([num_reqs, 1 + K], -1 padded);
        ``drafts``: the drafter's proposals per request (async scheduling), set first as
        ``propose_draft_token_ids`` sets them."""
        from vllm.v1.outputs import SamplerOutput

        width = 1 + self.work.num_speculative_tokens
        table = np.full((len(sampled), width), -1, np.int32)
        for i, tokens in enumerate(sampled):
            table[i, :len(tokens)] = tokens if tokens else [fake_token(step["req_ids"][i], 0)]
        output = SamplerOutput(sampled_token_ids=torch.from_numpy(table[:, :1] if width == 1 else table),
                               logprobs_tensors=None)
        num_tokens = int(step["query_start_loc"][-1])
        # what GPUModelRunner.sample_tokens clears before its bookkeeping
        self.runner._draft_token_ids = None
        self.runner.valid_sampled_token_count_gpu = None
        self.runner.input_batch.prev_sampled_token_ids = None
        if drafts is not None:
            self.keep_drafts(torch.from_numpy(table), drafts)
        self.runner._bookkeeping_sync(scheduler_output, output, None, torch.zeros(num_tokens, 1), num_tokens)

    def keep_drafts(self, sampled: torch.Tensor, drafts: list[list[int]]) -> None:
        """What ``propose_draft_token_ids`` leaves for the next step under async scheduling (EAGLE, padded
        drafter batch): the drafts, and from ``prepare_next_token_ids_padded`` (vLLM's Triton kernel) the last
        valid token and the valid count of each request, as ``_copy_valid_sampled_token_count`` keeps them."""
        runner = self.runner
        next_token_ids, valid_count = runner.drafter.prepare_next_token_ids_padded(
            sampled, runner.requests, runner.input_batch, runner.discard_request_mask.gpu)
        runner.valid_sampled_token_count_event = NoEvent()
        runner.valid_sampled_token_count_cpu = valid_count.clone()
        runner.valid_sampled_token_count_gpu = valid_count
        runner.input_batch.prev_sampled_token_ids = next_token_ids.unsqueeze(1)
        runner._draft_token_ids = torch.tensor(drafts, dtype=torch.int32).reshape(len(drafts),
                                                                                 self.work.num_speculative_tokens)

    def propose_drafts(self, step: dict, sampled: list[list[int]]) -> tuple[list[str], list[list[int]]]:
        """vLLM's n-gram proposer (`vllm/v1/spec_decode/ngram_proposer.py::NgramProposer.propose`) on the
        runner's token table, for the requests that sampled a token."""
        batch, work = self.runner.input_batch, self.work
        drafts = []
        for i, tokens in enumerate(sampled):
            num_tokens = int(batch.num_tokens_no_spec[i])
            if not tokens or num_tokens >= work.max_model_len:
                drafts.append([])
                continue
            found = self.ngram(origin_tokens=batch.token_ids_cpu[i, :num_tokens], min_ngram=2, max_ngram=3,
                               max_model_len=work.max_model_len, k=work.num_speculative_tokens)
            drafts.append([int(t) for t in found])
        return list(step["req_ids"]), drafts
