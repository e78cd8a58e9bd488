"""vLLM's model runner V2 device path, written with plain torch ops: the on-device baseline.

V2 (`vllm/v1/worker/gpu/`) keeps the per-request state on the device, indexed by state row, and
builds each step there from two small host arrays: ``idx_mapping`` (batch row -> state row) and
``query_start_loc`` (a host ``np.cumsum`` of the scheduled counts). Its Triton kernels loop over
each request's ``[query_start_loc[b], query_start_loc[b + 1])``; `Mrv2TorchPrep` computes the same
values with torch ops over all tokens at once (a ``searchsorted`` maps each token to its batch
row), so it runs on CPU torch (the tests) and on CUDA (`bench_gpu.py`) without Triton.

Simplification: input ids are gathered from the token table for every token. V2 gathers only the
prefill rows there (`vllm/v1/worker/gpu/input_batch.py::_prepare_prefill_inputs_kernel`) and writes
decode rows from ``last_sampled_tokens``
(`vllm/v1/worker/gpu/input_batch.py::_combine_sampled_and_draft_tokens_kernel`); the values are the
same when the table holds the sampled tokens, as jaxprep's `BatchState` does.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm_v1_baseline import padded_views

from jaxprep._constants import (
    NULL_BLOCK_ID,
    PAD_INPUT_ID,
    PAD_LOGITS_INDEX,
    PAD_POSITION,
    PAD_SEQ_LEN,
    PAD_SLOT_ID,
)


def async_h2d(array: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """`vllm/utils/torch_utils.py::async_tensor_h2d` into ``out``: staged in pinned memory on CUDA,
    then a non-blocking copy."""
    host = torch.from_numpy(array)
    if out.is_cuda:
        host = torch.empty(host.shape, dtype=out.dtype, pin_memory=True).copy_(host)
    return out.copy_(host, non_blocking=True)


class Mrv2TorchPrep:
    """Device state (`vllm/v1/worker/gpu/states.py::RequestState`,
    `vllm/v1/worker/gpu/block_table.py::BlockTables`) and the per-step buffers
    (`vllm/v1/worker/gpu/input_batch.py::InputBuffers`), all torch tensors on ``device``.

    State: ``all_token_ids`` [max_num_reqs, max_model_len] int32, ``block_tables``
    [max_num_reqs, max_blocks_per_req] int32, ``num_computed_tokens`` [max_num_reqs] int32 and its
    host mirror ``num_computed_tokens_np`` (V2 keeps one for ``seq_lens_cpu_upper_bound``).
    Buffers: ``input_ids`` [max_num_tokens] int32, ``positions`` [max_num_tokens] int64,
    ``query_start_loc`` [max_num_reqs + 1] int32, ``seq_lens`` [max_num_reqs] int32,
    ``input_block_tables`` [max_num_reqs, max_blocks_per_req] int32, ``slot_mappings``
    [max_num_tokens] int64, ``logits_indices`` [max_num_reqs] int64.
    """

    def __init__(self, token_ids: np.ndarray, block_table: np.ndarray, num_computed_tokens: np.ndarray,
                 block_size: int, max_num_batched_tokens: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_num_reqs, self.max_model_len = token_ids.shape
        self.all_token_ids = torch.from_numpy(token_ids).to(self.device)
        self.block_tables = torch.from_numpy(block_table).to(self.device)
        self.num_computed_tokens = torch.from_numpy(num_computed_tokens).to(self.device)
        self.num_computed_tokens_np = num_computed_tokens.copy()

        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(shape, dtype=dtype, device=self.device)

        self.input_ids = zeros(max_num_batched_tokens)
        self.positions = zeros(max_num_batched_tokens, dtype=torch.int64)
        self.query_start_loc = zeros(self.max_num_reqs + 1)
        self.seq_lens = zeros(self.max_num_reqs)
        self.input_block_tables = zeros(*block_table.shape)
        self.slot_mappings = zeros(max_num_batched_tokens, dtype=torch.int64)
        self.logits_indices = zeros(self.max_num_reqs, dtype=torch.int64)
        self.idx_mapping = zeros(self.max_num_reqs, dtype=torch.int64)
        self.token_arange = torch.arange(max_num_batched_tokens, dtype=torch.int32, device=self.device)

    def load(self, token_ids: np.ndarray, block_table: np.ndarray, num_computed_tokens: np.ndarray) -> None:
        """Overwrites the whole device state in place (V2 writes it request by request:
        `vllm/v1/worker/gpu/states.py::RequestState.add_request`,
        `vllm/v1/worker/gpu/block_table.py::BlockTables.append_block_ids`)."""
        self.all_token_ids.copy_(torch.from_numpy(token_ids))
        self.block_tables.copy_(torch.from_numpy(block_table))
        self.num_computed_tokens.copy_(torch.from_numpy(num_computed_tokens))
        self.num_computed_tokens_np[:] = num_computed_tokens

    def prepare(self, idx_mapping_np: np.ndarray, num_scheduled_tokens: np.ndarray, num_tokens_padded: int,
                num_reqs_padded: int) -> dict:
        """`vllm/v1/worker/gpu/model_runner.py::GPUModelRunner.prepare_inputs` without spec decode.

        ``idx_mapping_np`` [num_reqs] int64 (batch row -> state row), ``num_scheduled_tokens``
        [num_reqs] int32 (every one >= 1). Returns the padded device views (valid until the next
        call) and the step's host counts.

        1. ``idx_mapping`` and ``query_start_loc`` (host cumsum, tail = total) to the device;
        2. each token's batch row and state row, positions and input ids
           (`vllm/v1/worker/gpu/input_batch.py::_prepare_pos_seq_lens_kernel`, ``_prepare_prefill_inputs_kernel``);
        3. ``seq_lens`` = computed + query length, tail 0 (the same ``_prepare_pos_seq_lens_kernel``);
        4. slot mapping, tail PAD_SLOT_ID (`vllm/v1/worker/gpu/block_table.py::_compute_slot_mappings_kernel`);
        5. block-table rows gathered by ``idx_mapping``, padded rows null
           (`vllm/v1/worker/gpu/block_table.py::_gather_block_tables_kernel`);
        6. ``logits_indices = query_start_loc[1:] - 1``
           (`vllm/v1/worker/gpu/input_batch.py::_combine_sampled_and_draft_tokens_kernel`).
        """
        num_reqs = len(idx_mapping_np)
        idx_mapping = async_h2d(idx_mapping_np, self.idx_mapping[:num_reqs])
        qsl_np = np.empty(self.max_num_reqs + 1, np.int32)
        qsl_np[0] = 0
        np.cumsum(num_scheduled_tokens, out=qsl_np[1:num_reqs + 1])
        num_tokens = int(qsl_np[num_reqs])
        qsl_np[num_reqs + 1:] = num_tokens
        qsl = async_h2d(qsl_np, self.query_start_loc)
        state_rows, positions = self._positions_and_input_ids(idx_mapping, qsl, num_reqs, num_tokens)
        query_lens = qsl[1:num_reqs + 1] - qsl[:num_reqs]
        torch.add(self.num_computed_tokens[idx_mapping], query_lens, out=self.seq_lens[:num_reqs])
        self.seq_lens[num_reqs:].fill_(PAD_SEQ_LEN)
        self._slot_mapping(state_rows, positions, num_tokens)
        torch.index_select(self.block_tables, 0, idx_mapping, out=self.input_block_tables[:num_reqs])
        self.input_block_tables[num_reqs:num_reqs_padded].fill_(NULL_BLOCK_ID)
        torch.sub(qsl[1:num_reqs + 1], 1, out=self.logits_indices[:num_reqs])
        self.logits_indices[num_reqs:num_reqs_padded].fill_(PAD_LOGITS_INDEX)
        seq_lens_upper = self.num_computed_tokens_np[idx_mapping_np] + num_scheduled_tokens
        return self._padded(num_reqs, num_tokens, num_tokens_padded, num_reqs_padded,
                            int(num_scheduled_tokens.max()), int(seq_lens_upper.max()))

    def _positions_and_input_ids(self, idx_mapping, qsl, num_reqs: int, num_tokens: int):
        """qsl [0, 2, 5], idx_mapping [7, 3], computed[7] = 10, computed[3] = 0 ->
        batch rows [0, 0, 1, 1, 1], state rows [7, 7, 3, 3, 3], positions [10, 11, 0, 1, 2]."""
        tokens = self.token_arange[:num_tokens]
        batch_rows = torch.searchsorted(qsl[1:num_reqs + 1], tokens, right=True)
        state_rows = idx_mapping[batch_rows]
        positions = self.positions[:num_tokens]
        torch.add(self.num_computed_tokens[state_rows], tokens - qsl[batch_rows], out=positions)
        token_indices = state_rows * self.max_model_len + positions
        torch.index_select(self.all_token_ids.view(-1), 0, token_indices, out=self.input_ids[:num_tokens])
        return state_rows, positions

    def _slot_mapping(self, state_rows, positions, num_tokens: int) -> None:
        """Block size 2, blocks of state row 7 = [4, 9]: positions [0, 1, 2] -> slots [8, 9, 18]."""
        block_numbers = self.block_tables[state_rows, positions // self.block_size]
        torch.add(block_numbers * self.block_size, positions % self.block_size, out=self.slot_mappings[:num_tokens])
        self.slot_mappings[num_tokens:].fill_(PAD_SLOT_ID)

    def _padded(self, num_reqs, num_tokens, num_tokens_padded, num_reqs_padded, max_query_len, max_seq_len) -> dict:
        self.positions[num_tokens:num_tokens_padded].fill_(PAD_POSITION)
        self.input_ids[num_tokens:num_tokens_padded].fill_(PAD_INPUT_ID)
        buffers = {"input_ids": self.input_ids, "positions": self.positions, "slot_mapping": self.slot_mappings,
                   "query_start_loc": self.query_start_loc, "seq_lens": self.seq_lens,
                   "block_table": self.input_block_tables, "logits_indices": self.logits_indices}
        return padded_views(buffers, num_tokens_padded, num_reqs_padded, num_actual_tokens=num_tokens,
                            num_reqs=num_reqs, max_query_len=max_query_len, max_seq_len=max_seq_len)
