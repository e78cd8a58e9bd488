"""vLLM's model runner V2 preparation with its real Triton kernels: the fused step's on-device anchor.

`vllm/v1/worker/gpu/model_runner.py::GPUModelRunner.prepare_inputs` (one KV group, no context
parallelism; with or without draft tokens) as V2 runs it, its kernels loaded from vLLM's own files
(`vllm_sources.load_mrv2_kernels`) and launched with the arguments V2's wrappers pass:

1. host: with drafts, V2's batch order (`v2_batch_order`, ``sort_batch_req_ids``) and
   ``cu_num_logits = [0, cumsum(D + 1)]`` (copied asynchronously), else ``cu_num_logits = arange``;
   ``idx_mapping`` to the device (``async_tensor_h2d``, int64); ``query_start_loc`` by ``np.cumsum``
   on the host (tail = the total), copied asynchronously;
2. with drafts, ``_expand_idx_mapping_kernel``: ``expanded_idx_mapping``, ``expanded_local_pos``;
3. ``_prepare_prefill_inputs_kernel`` (if a row prefills): prompt tokens from ``all_token_ids``;
4. ``_prepare_pos_seq_lens_kernel``: positions, ``seq_lens`` (tail 0);
5. ``_combine_sampled_and_draft_tokens_kernel``: a decode row's input id from
   ``last_sampled_tokens``, its drafts' from ``draft_tokens``, and ``logits_indices``;
6. ``_gather_block_tables_kernel`` (`BlockTables.gather_block_tables`): the batch's block-table
   rows, padded rows zeroed;
7. ``_compute_slot_mappings_kernel`` (`BlockTables.compute_slot_mappings`): slots, tail PAD.

The state is set up so that V2's outputs are jaxprep's: ``prefill_len`` is the prompt end of a row
that prefills (``num_scheduled > 1 + D``) and the computed count of a decoding row, whose input id
V2 reads from ``last_sampled_tokens`` (here the token table's entry at its position) and whose
drafts from ``draft_tokens`` (the table's entries after it). V2 leaves the padded tails of
``input_ids`` and ``positions`` as they were; `prepare` returns them as views of the real part and
the padding V2 writes (``query_start_loc``, ``seq_lens``, slots, block-table rows).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from mrv2_torch_baseline import async_h2d


class Mrv2TritonPrep:
    """V2's device state (`vllm/v1/worker/gpu/states.py::RequestState`, `block_table.py::BlockTables`,
    one KV group) and buffers (`input_batch.py::InputBuffers`), on ``device``; ``kernels`` from
    `vllm_sources.load_mrv2_kernels`.

    State: ``all_token_ids`` [R, M] int32, ``num_computed_tokens`` / ``prefill_len`` /
    ``last_sampled_tokens`` [R] int32, ``block_table`` [R, W] int32, ``num_blocks`` [1, R] int32
    (here W: the whole row is gathered, as jaxprep gathers it). Buffers: ``input_ids`` [N] int32,
    ``positions`` [N] int64, ``query_start_loc`` [R + 1] int32, ``seq_lens`` [R] int32,
    ``input_block_table`` [R, W] int32, ``slot_mappings`` [1, N] int64.
    """

    def __init__(self, kernels, arrays: dict, block_size: int, max_num_batched_tokens: int, device="cpu",
                 num_speculative_tokens: int = 0):
        self.k, self.device, self.block_size = kernels, torch.device(device), block_size
        computed, scheduled = arrays["num_computed_tokens"], arrays["num_scheduled_tokens"]
        drafts = arrays.get("num_draft_tokens", np.zeros_like(scheduled))
        rows = np.arange(len(computed))
        self.max_num_reqs, self.num_speculative_tokens = len(computed), num_speculative_tokens
        decoding = scheduled == 1 + drafts
        self.has_prefill = bool((scheduled > 0)[~decoding].any())

        def on_device(values, dtype=torch.int32):
            return torch.as_tensor(np.ascontiguousarray(values)).to(device=self.device, dtype=dtype)

        self.all_token_ids = on_device(arrays["token_ids"])
        self.num_computed_tokens = on_device(computed)
        self.prefill_len = on_device(np.where(decoding, computed, computed + scheduled))
        last = arrays["token_ids"].shape[1] - 1
        self.last_sampled_tokens = on_device(arrays["token_ids"][rows, np.clip(computed, 0, last)])
        draft_columns = np.clip(computed[:, None] + 1 + np.arange(max(num_speculative_tokens, 1))[None, :], 0, last)
        self.draft_tokens = on_device(np.take_along_axis(arrays["token_ids"], draft_columns, axis=1))
        self.block_table = on_device(arrays["block_table"])
        width = self.block_table.shape[1]
        self.num_blocks = on_device(np.full((1, self.max_num_reqs), width))
        self.next_prefill_tokens = on_device(np.zeros((1, self.max_num_reqs)))
        self.input_ids = on_device(np.zeros(max_num_batched_tokens))
        self.positions = on_device(np.zeros(max_num_batched_tokens), torch.int64)
        self.query_start_loc = on_device(np.zeros(self.max_num_reqs + 1))
        self.seq_lens = on_device(np.zeros(self.max_num_reqs))
        self.input_block_table = torch.zeros_like(self.block_table)
        self.slot_mappings = on_device(np.zeros((1, max_num_batched_tokens)), torch.int64)
        self._layout_tensors()
        self.num_dirty_rows = 0

    def _layout_tensors(self) -> None:
        """`BlockTables.init_block_table_layout_tensors` for one group."""
        def pointers(tensor):
            return torch.tensor([tensor.data_ptr()], dtype=torch.uint64, device=self.device)

        self.block_table_ptrs = pointers(self.block_table)
        self.input_block_table_ptrs = pointers(self.input_block_table)
        self.block_table_strides = torch.tensor([self.block_table.stride(0)], dtype=torch.int64, device=self.device)
        self.block_sizes = torch.tensor([self.block_size], dtype=torch.int32, device=self.device)
        self.slot_mapping_enabled = torch.tensor([True], device=self.device)
        self.dcp_sharded = torch.tensor([True], device=self.device)
        self.sliding_window_reach = torch.zeros(1, dtype=torch.int32, device=self.device)

    def prepare(self, idx_mapping_np: np.ndarray, num_scheduled_tokens: np.ndarray, num_tokens_padded: int,
                num_reqs_padded: int, num_draft_tokens: np.ndarray | None = None) -> dict:
        """One step (steps 1-7 of the module docstring) over the batch rows ``idx_mapping_np`` (in V2's order
        when there are drafts, `v2_batch_order`) and their counts; returns the device views and host counts."""
        num_reqs = len(idx_mapping_np)
        idx_mapping = async_h2d(idx_mapping_np.astype(np.int64), torch.empty(num_reqs, dtype=torch.int64,
                                                                             device=self.device))
        expanded = {}
        if num_draft_tokens is None:
            cu_num_logits = torch.arange(num_reqs + 1, device=self.device, dtype=torch.int32)
            num_logits = num_reqs
        else:
            cu_num_logits_np = np.zeros(num_reqs + 1, np.int32)
            np.cumsum(num_draft_tokens + 1, out=cu_num_logits_np[1:])
            num_logits = int(cu_num_logits_np[-1])
            cu_num_logits = async_h2d(cu_num_logits_np, torch.empty(num_reqs + 1, dtype=torch.int32,
                                                                    device=self.device))
            expanded = self._expand(idx_mapping, cu_num_logits, num_logits)
        qsl_np = np.empty(self.max_num_reqs + 1, np.int32)
        qsl_np[0] = 0
        np.cumsum(num_scheduled_tokens, out=qsl_np[1:num_reqs + 1])
        num_tokens = int(qsl_np[num_reqs])
        qsl_np[num_reqs + 1:] = num_tokens
        qsl = async_h2d(qsl_np, self.query_start_loc)[:num_reqs_padded + 1]
        self._token_kernels(idx_mapping, qsl, cu_num_logits, num_reqs)
        logits_indices = self._logits(idx_mapping, qsl, cu_num_logits, num_reqs, num_logits)
        self._block_kernels(idx_mapping, qsl, num_reqs, num_reqs_padded)
        return dict(input_ids=self.input_ids[:num_tokens], positions=self.positions[:num_tokens],
                    slot_mapping=self.slot_mappings[0, :num_tokens_padded], query_start_loc=qsl,
                    seq_lens=self.seq_lens[:num_reqs_padded], block_table=self.input_block_table[:num_reqs_padded],
                    logits_indices=logits_indices, idx_mapping=idx_mapping, num_actual_tokens=num_tokens,
                    num_reqs=num_reqs, **expanded)

    def _expand(self, idx_mapping, cu_num_logits, num_logits: int) -> dict:
        """`expand_idx_mapping`: every logits row's slot and place in its request (V2 launches it with drafts)."""
        out = dict(expanded_idx_mapping=idx_mapping.new_empty(num_logits),
                   expanded_local_pos=torch.empty(num_logits, dtype=torch.int32, device=self.device),
                   cu_num_logits=cu_num_logits)
        self.k._expand_idx_mapping_kernel[(len(idx_mapping),)](
            idx_mapping, out["expanded_idx_mapping"], out["expanded_local_pos"], cu_num_logits,
            BLOCK_SIZE=_next_pow2(1 + self.num_speculative_tokens))
        return out

    def _token_kernels(self, idx_mapping, qsl, cu_num_logits, num_reqs: int) -> None:
        """`prepare_prefill_inputs` (if any row prefills) and `prepare_pos_seq_lens`, as V2 launches them."""
        if self.has_prefill:
            self.k._prepare_prefill_inputs_kernel[(num_reqs,)](
                self.input_ids, self.next_prefill_tokens, self.next_prefill_tokens.stride(0), 1, idx_mapping, qsl,
                self.all_token_ids, self.all_token_ids.stride(0), self.prefill_len, self.num_computed_tokens,
                BLOCK_SIZE=1024, LOOKAHEAD_BLOCK=1)
        self.k._prepare_pos_seq_lens_kernel[(num_reqs + 1,)](
            self.positions, self.seq_lens, idx_mapping, qsl, self.num_computed_tokens, self.seq_lens.shape[0],
            BLOCK_SIZE=1024)

    def _logits(self, idx_mapping, qsl, cu_num_logits, num_reqs: int, num_logits: int):
        """`combine_sampled_and_draft_tokens`: decode input ids (last sampled, drafts) and ``logits_indices``."""
        logits_indices = torch.empty(num_logits, dtype=torch.int64, device=self.device)
        self.k._combine_sampled_and_draft_tokens_kernel[(num_reqs,)](
            self.input_ids, idx_mapping, self.last_sampled_tokens, qsl, self.seq_lens, self.prefill_len,
            self.draft_tokens, self.draft_tokens.stride(0), cu_num_logits, logits_indices,
            NUM_NEW_SAMPLED_TOKENS=1, BLOCK_SIZE=_next_pow2(self.num_speculative_tokens + 1))
        return logits_indices

    def _block_kernels(self, idx_mapping, qsl, num_reqs: int, num_reqs_padded: int) -> None:
        """`BlockTables.gather_block_tables` and `BlockTables.compute_slot_mappings` for one group."""
        num_rows = max(num_reqs_padded, self.num_dirty_rows)
        self.num_dirty_rows = num_reqs
        self.k._gather_block_tables_kernel[(1, num_rows)](
            idx_mapping, self.block_table_ptrs, self.input_block_table_ptrs, self.block_table_strides,
            self.num_blocks, self.num_blocks.stride(0), num_reqs, self.sliding_window_reach,
            self.sliding_window_reach, self.block_sizes, MASK_SLIDING_WINDOW=False, BLOCK_SIZE=1024)
        self.k._compute_slot_mappings_kernel[(1, num_reqs + 1)](
            self.slot_mappings.shape[1], idx_mapping, qsl, self.positions, self.block_table_ptrs,
            self.block_table_strides, self.block_sizes, self.slot_mapping_enabled, self.dcp_sharded,
            self.slot_mappings, self.slot_mappings.stride(0), 0, CP_SIZE=1, CP_INTERLEAVE=1, PAD_ID=-1,
            TRITON_BLOCK_SIZE=1024)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def v2_batch_order(num_scheduled_tokens: np.ndarray, num_draft_tokens: np.ndarray, num_speculative_tokens: int):
    """V2's batch on the host (`vllm/v1/worker/gpu/model_runner.py::sort_batch_req_ids`): the slots with work,
    in arrival order (V2 hands slots out from the top: descending slot), sorted by ``(not has_drafts,
    S != 1 + K, S)``; returns ``(idx_mapping, S, D)`` in that order."""
    arrivals = [slot for slot in range(len(num_scheduled_tokens) - 1, -1, -1) if num_scheduled_tokens[slot] > 0]
    decode_query_len = 1 + num_speculative_tokens
    order = np.array(sorted(arrivals, key=lambda slot: (not num_draft_tokens[slot],
                                                        num_scheduled_tokens[slot] != decode_query_len,
                                                        num_scheduled_tokens[slot])), np.int64)
    return order, num_scheduled_tokens[order], num_draft_tokens[order]


def mismatches(step, mrv2: dict) -> list[str]:
    """Fields where V2's output differs from a jaxprep step (real part, and the padding V2 writes); with
    drafts, the logits rows are jaxprep's ``logits_indirection`` (``FeatureConfig(runner="v2")``)."""
    meta = step.attn_metadata
    num_tokens, num_reqs = mrv2["num_actual_tokens"], mrv2["num_reqs"]
    num_logits = len(mrv2["logits_indices"])
    logits = step.logits_indirection
    ours = {"input_ids": step.input_ids[:num_tokens], "positions": step.positions[:num_tokens],
            "slot_mapping": meta.slot_mapping, "query_start_loc": meta.query_start_loc, "seq_lens": meta.seq_lens,
            "block_table": meta.block_table, "idx_mapping": step.idx_mapping[:num_reqs],
            "logits_indices": (step.logits_indices if logits is None else logits.logits_indices)[:num_logits]}
    if "expanded_idx_mapping" in mrv2:
        ours.update(expanded_idx_mapping=logits.expanded_idx_mapping[:num_logits],
                    expanded_local_pos=logits.expanded_local_pos[:num_logits],
                    cu_num_logits=logits.cu_num_logits[:num_reqs + 1])
    wrong = [name for name, value in ours.items()
             if not np.array_equal(np.asarray(value), mrv2[name].cpu().numpy().astype(np.int64))]
    counts = (int(meta.num_actual_tokens), int(meta.num_reqs))
    return wrong + (["counts"] if counts != (num_tokens, num_reqs) else [])


def make_draft_batch(num_reqs: int, num_tokens: int, num_speculative_tokens: int, decode_only: bool,
                     max_model_len: int, block_size: int, seed: int = 0) -> tuple[dict, int]:
    """``(arrays, token budget)`` of a step with drafts: a decode schedules its last sampled token and
    ``D`` drafts (uniform in [0, K]); decode-only: every row (budget R (K + 1)), else half the rows, the
    others prefill chunks sharing the rest of ``num_tokens`` (the budget). Blocks as `bench_prepare.make_batch`."""
    rng = np.random.default_rng(seed)
    decodes = np.ones(num_reqs, bool) if decode_only else rng.random(num_reqs) < 0.5
    drafts = np.where(decodes, rng.integers(0, num_speculative_tokens + 1, num_reqs), 0)
    scheduled = np.where(decodes, 1 + drafts, 0)
    budget = num_reqs * (num_speculative_tokens + 1) if decode_only else num_tokens
    if not decode_only:  # the chunks share what the decodes leave, each at least 1 token
        weights = np.where(decodes, 0.0, rng.random(num_reqs) + 0.05)
        rest = budget - int(scheduled.sum()) - int((~decodes).sum())
        scheduled = scheduled + np.where(decodes, 0, 1 + np.floor(weights / weights.sum() * rest)).astype(np.int64)
    computed = np.array([rng.integers(0, max_model_len - s + 1) for s in scheduled], np.int64)
    width = -(-max_model_len // block_size)
    block_table = np.zeros((num_reqs, width), np.int32)
    ids = rng.permutation(num_reqs * width) + 1
    for row in range(num_reqs):
        count = -(-int(computed[row] + scheduled[row]) // block_size)
        block_table[row, :count] = ids[row * width:][:count]
    arrays = dict(token_ids=rng.integers(0, 32000, (num_reqs, max_model_len), dtype=np.int32), block_table=block_table,
                  num_computed_tokens=computed.astype(np.int32), num_scheduled_tokens=scheduled.astype(np.int32),
                  num_draft_tokens=drafts.astype(np.int32))
    return arrays, budget


def check_against_jaxprep(num_reqs: int, num_tokens: int, decode_only: bool, device: str = "cpu",
                          src: str | None = None, num_speculative_tokens: int = 0) -> dict:
    """V2's real kernels against `jaxprep.prepare_padded` on one step (`bench_prepare.make_batch`; with K > 0
    `make_draft_batch` and ``FeatureConfig(runner="v2")``), and the same comparison with one of V2's slots
    shifted (the negative control: it must see the shift)."""
    import jax
    from bench_prepare import make_batch
    from vllm_sources import VENDOR_DIR, load_mrv2_kernels

    from jaxprep import BatchState, FeatureConfig, PrepConfig, prepare_padded

    k = num_speculative_tokens
    if k:
        arrays, budget = make_draft_batch(num_reqs, num_tokens, k, decode_only, 64, 4)
        config = PrepConfig(max_num_reqs=num_reqs, max_model_len=64, max_num_batched_tokens=budget, block_size=4,
                            features=FeatureConfig(num_speculative_tokens=k, runner="v2"))
    else:
        config, arrays = make_batch(num_reqs, num_tokens, 64, 4, decode_only)
    bucket = config.bucket_for(int(arrays["num_scheduled_tokens"].sum()))
    step = jax.device_get(prepare_padded(BatchState.from_numpy(**arrays), config, bucket))
    kernels = load_mrv2_kernels(src or VENDOR_DIR)
    prep = Mrv2TritonPrep(kernels, arrays, config.block_size, config.max_num_batched_tokens, device, k)
    scheduled = arrays["num_scheduled_tokens"]
    if k:
        idx_mapping, batch_scheduled, batch_drafts = v2_batch_order(scheduled, arrays["num_draft_tokens"], k)
    else:
        idx_mapping, batch_drafts = np.flatnonzero(scheduled > 0), None
        batch_scheduled = scheduled[idx_mapping]
    out = prep.prepare(idx_mapping, batch_scheduled, bucket, config.num_reqs_padded(bucket), batch_drafts)
    found = mismatches(step, out)
    out["slot_mapping"] = out["slot_mapping"].clone()
    out["slot_mapping"][0] += 1
    return dict(vllm=kernels.version, mismatches=found, shifted=mismatches(step, out), num_tokens=bucket,
                vllm_imported="vllm" in sys.modules)


if __name__ == "__main__":  # the CPU check: TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" python ... [--src DIR]
    import json
    import os

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    source = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else None
    print(json.dumps([check_against_jaxprep(n, t, decode, src=source, num_speculative_tokens=k)
                      for n, t, decode, k in ((6, 6, True, 0), (6, 40, False, 0), (6, 40, False, 2))]))
