"""vLLM's model runner V2 preparation with its real Triton kernels: the fused step's on-device anchor.

`vllm/v1/worker/gpu/model_runner.py::GPUModelRunner.prepare_inputs` (plain step: no drafts, one KV
group, no context parallelism) as V2 runs it, its kernels loaded from vLLM's own files
(`vllm_sources.load_mrv2_kernels`) and launched with the arguments V2's wrappers pass:

1. host: ``idx_mapping`` to the device (``async_tensor_h2d``, int64), ``cu_num_logits = arange``;
   ``query_start_loc`` by ``np.cumsum`` on the host (tail = the total), copied asynchronously;
2. ``_prepare_prefill_inputs_kernel`` (if a row prefills): prompt tokens from ``all_token_ids``;
3. ``_prepare_pos_seq_lens_kernel``: positions, ``seq_lens`` (tail 0);
4. ``_combine_sampled_and_draft_tokens_kernel``: a decode row's input id from
   ``last_sampled_tokens``, and ``logits_indices``;
5. ``_gather_block_tables_kernel`` (`BlockTables.gather_block_tables`): the batch's block-table
   rows, padded rows zeroed;
6. ``_compute_slot_mappings_kernel`` (`BlockTables.compute_slot_mappings`): slots, tail PAD.

The state is set up so that V2's outputs are jaxprep's: ``prefill_len`` is the prompt end of a row
that prefills (``num_scheduled > 1``) and the computed count of a decoding row, whose input id V2
reads from ``last_sampled_tokens`` (here the token table's entry at its position). V2 leaves the
padded tails of ``input_ids`` and ``positions`` as they were; `prepare` returns them as views of the
real part and the padding V2 writes (``query_start_loc``, ``seq_lens``, slots, block-table rows).
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

    def __init__(self, kernels, arrays: dict, block_size: int, max_num_batched_tokens: int, device="cpu"):
        self.k, self.device, self.block_size = kernels, torch.device(device), block_size
        computed, scheduled = arrays["num_computed_tokens"], arrays["num_scheduled_tokens"]
        rows = np.arange(len(computed))
        self.max_num_reqs = len(computed)
        self.has_prefill = bool((scheduled > 1).any())

        def on_device(values, dtype=torch.int32):
            return torch.as_tensor(np.ascontiguousarray(values)).to(device=self.device, dtype=dtype)

        self.all_token_ids = on_device(arrays["token_ids"])
        self.num_computed_tokens = on_device(computed)
        self.prefill_len = on_device(np.where(scheduled > 1, computed + scheduled, computed))
        position = np.clip(computed, 0, arrays["token_ids"].shape[1] - 1)
        self.last_sampled_tokens = on_device(arrays["token_ids"][rows, position])
        self.block_table = on_device(arrays["block_table"])
        width = self.block_table.shape[1]
        self.num_blocks = on_device(np.full((1, self.max_num_reqs), width))
        self.next_prefill_tokens = on_device(np.zeros((1, self.max_num_reqs)))
        self.draft_tokens = on_device(np.zeros((self.max_num_reqs, 1)))
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
                num_reqs_padded: int) -> dict:
        """One step (steps 1-6 of the module docstring); returns the device views and host counts."""
        num_reqs = len(idx_mapping_np)
        idx_mapping = async_h2d(idx_mapping_np.astype(np.int64), torch.empty(num_reqs, dtype=torch.int64,
                                                                             device=self.device))
        cu_num_logits = torch.arange(num_reqs + 1, device=self.device, dtype=torch.int32)
        qsl_np = np.empty(self.max_num_reqs + 1, np.int32)
        qsl_np[0] = 0
        np.cumsum(num_scheduled_tokens, out=qsl_np[1:num_reqs + 1])
        num_tokens = int(qsl_np[num_reqs])
        qsl_np[num_reqs + 1:] = num_tokens
        qsl = async_h2d(qsl_np, self.query_start_loc)[:num_reqs_padded + 1]
        self._token_kernels(idx_mapping, qsl, cu_num_logits, num_reqs)
        logits_indices = self._logits(idx_mapping, qsl, cu_num_logits, num_reqs)
        self._block_kernels(idx_mapping, qsl, num_reqs, num_reqs_padded)
        return dict(input_ids=self.input_ids[:num_tokens], positions=self.positions[:num_tokens],
                    slot_mapping=self.slot_mappings[0, :num_tokens_padded], query_start_loc=qsl,
                    seq_lens=self.seq_lens[:num_reqs_padded], block_table=self.input_block_table[:num_reqs_padded],
                    logits_indices=logits_indices, idx_mapping=idx_mapping, num_actual_tokens=num_tokens,
                    num_reqs=num_reqs)

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

    def _logits(self, idx_mapping, qsl, cu_num_logits, num_reqs: int):
        """`combine_sampled_and_draft_tokens` with no drafts: decode input ids and ``logits_indices``."""
        logits_indices = torch.empty(num_reqs, dtype=torch.int64, device=self.device)
        self.k._combine_sampled_and_draft_tokens_kernel[(num_reqs,)](
            self.input_ids, idx_mapping, self.last_sampled_tokens, qsl, self.seq_lens, self.prefill_len,
            self.draft_tokens, self.draft_tokens.stride(0), cu_num_logits, logits_indices,
            NUM_NEW_SAMPLED_TOKENS=1, BLOCK_SIZE=1)
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


def mismatches(step, mrv2: dict) -> list[str]:
    """Fields where V2's output differs from a jaxprep step (real part, and the padding V2 writes)."""
    meta = step.attn_metadata
    num_tokens, num_reqs = mrv2["num_actual_tokens"], mrv2["num_reqs"]
    ours = {"input_ids": step.input_ids[:num_tokens], "positions": step.positions[:num_tokens],
            "slot_mapping": meta.slot_mapping, "query_start_loc": meta.query_start_loc, "seq_lens": meta.seq_lens,
            "block_table": meta.block_table, "logits_indices": step.logits_indices[:num_reqs],
            "idx_mapping": step.idx_mapping[:num_reqs]}
    wrong = [name for name, value in ours.items()
             if not np.array_equal(np.asarray(value), mrv2[name].cpu().numpy().astype(np.int64))]
    counts = (int(meta.num_actual_tokens), int(meta.num_reqs))
    return wrong + (["counts"] if counts != (num_tokens, num_reqs) else [])


def check_against_jaxprep(num_reqs: int, num_tokens: int, decode_only: bool, device: str = "cpu",
                          src: str | None = None) -> dict:
    """V2's real kernels against `jaxprep.prepare_padded` on one `bench_prepare.make_batch` step, and the
    same comparison with one of V2's slots shifted (the negative control: it must see the shift)."""
    import jax
    from bench_prepare import make_batch
    from vllm_sources import VENDOR_DIR, load_mrv2_kernels

    from jaxprep import BatchState, prepare_padded

    config, arrays = make_batch(num_reqs, num_tokens, 64, 4, decode_only)
    bucket = config.bucket_for(int(arrays["num_scheduled_tokens"].sum()))
    step = jax.device_get(prepare_padded(BatchState.from_numpy(**arrays), config, bucket))
    kernels = load_mrv2_kernels(src or VENDOR_DIR)
    prep = Mrv2TritonPrep(kernels, arrays, config.block_size, config.max_num_batched_tokens, device)
    scheduled = arrays["num_scheduled_tokens"]
    idx_mapping = np.flatnonzero(scheduled > 0)
    out = prep.prepare(idx_mapping, scheduled[idx_mapping], bucket, config.num_reqs_padded(bucket))
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
    print(json.dumps([check_against_jaxprep(n, t, decode, src=source) for n, t, decode in ((6, 6, True),
                                                                                             (6, 40, False))]))
