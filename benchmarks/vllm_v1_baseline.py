"""vLLM V1's host-side input preparation, written the way vLLM writes it: the benchmarks' baseline.

`jaxprep.reference` is written for reading (int64 casts, concatenates, a fresh array per step) and
is the tests' oracle; it is not what a serving engine runs. `VllmV1HostPrep` follows vLLM 0.33.0's
V1 runner step for step instead: persistent, preallocated NumPy buffers (the NumPy views of
vLLM's ``CpuGpuBuffer``s, `vllm/v1/utils.py::CpuGpuBuffer`), ``out=`` arguments, one batched
arange kept from start-up, a condensed batch (rows ``[0, num_reqs)``, as
`vllm/v1/worker/gpu_input_batch.py::InputBatch.condense` keeps it) and the per-step copy of the
batch's block-table rows (`vllm/v1/worker/block_table.py::BlockTable.commit_block_table`).

Where vLLM 0.33.0 runs a step on the GPU (positions, ``seq_lens`` and the slot mapping, from the
GPU copies of ``req_indices``/``query_pos``/``num_computed_tokens``), the same formula is written
here with NumPy on the host buffers, so a CPU-only machine times the whole preparation on one side.
"""

from __future__ import annotations

import numpy as np

from jaxprep._constants import (
    NULL_BLOCK_ID,
    PAD_INPUT_ID,
    PAD_LOGITS_INDEX,
    PAD_POSITION,
    PAD_SEQ_LEN,
    PAD_SLOT_ID,
)

try:  # vLLM gathers input ids with torch.index_select ("much faster than np.take for large tensors")
    import torch
except ImportError:  # pragma: no cover - torch is an optional extra
    torch = None


def numpy_buffer(name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zeroed host buffer (vLLM allocates every ``CpuGpuBuffer`` with ``torch.zeros``)."""
    del name
    return np.zeros(shape, dtype)


TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping")
REQUEST_FIELDS = ("seq_lens", "block_table", "logits_indices")


def padded_views(buffers: dict, num_tokens_padded: int, num_reqs_padded: int, **counts) -> dict:
    """The views a forward pass reads: token fields ``[:num_tokens_padded]``, request fields
    ``[:num_reqs_padded]``, ``query_start_loc`` one more; then the step's counts."""
    views = {name: buffers[name][:num_tokens_padded] for name in TOKEN_FIELDS}
    views.update({name: buffers[name][:num_reqs_padded] for name in REQUEST_FIELDS})
    views["query_start_loc"] = buffers["query_start_loc"][:num_reqs_padded + 1]
    return dict(views, **counts)


class VllmV1HostPrep:
    """The persistent state and per-step buffers of vLLM V1's ``GPUModelRunner`` + ``InputBatch``.

    Persistent per-request tables (`vllm/v1/worker/gpu_input_batch.py::InputBatch.__init__`),
    adopted without a copy so that a caller's in-place updates (the scheduler's step,
    `vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._update_states`) are seen:
    ``token_ids_cpu`` [max_num_reqs, max_model_len] int32, ``block_table_np`` [max_num_reqs,
    max_blocks_per_req] int32 (``BlockTable.block_table.np``), ``num_computed_tokens_cpu``
    [max_num_reqs] int32.

    Per-step buffers (`vllm/v1/worker/gpu_model_runner.py::GPUModelRunner.__init__`), from
    ``make_buffer(name, shape, dtype)`` (`numpy_buffer` by default; a caller may hand pinned torch
    memory's NumPy views):
    ``arange_np``, ``query_pos_np`` [max(max_num_reqs + 1, max_num_tokens)] int64,
    ``input_ids_np`` [max_num_tokens] int32, ``positions_np`` [max_num_tokens] int64,
    ``query_start_loc_np`` [max_num_reqs + 1] int32, ``seq_lens_np`` [max_num_reqs] int32
    (``optimistic_seq_lens_cpu``), ``slot_mapping_np`` [max_num_tokens] int64
    (``BlockTable.slot_mapping``), ``logits_indices_np`` [max_num_reqs] int64 and
    ``block_table_committed`` [max_num_reqs, max_blocks_per_req] int32, the destination of
    ``commit_block_table`` (``BlockTable.block_table.gpu``).
    """

    def __init__(self, token_ids: np.ndarray, block_table: np.ndarray, num_computed_tokens: np.ndarray,
                 block_size: int, max_num_batched_tokens: int, make_buffer=numpy_buffer, use_torch_gather=None):
        self.token_ids_cpu = token_ids
        self.block_table_np = block_table
        self.num_computed_tokens_cpu = num_computed_tokens
        self.block_size = block_size
        self.max_num_tokens = max_num_batched_tokens
        max_num_reqs, self.max_model_len = token_ids.shape
        arange_size = max(max_num_reqs + 1, max_num_batched_tokens)
        self.arange_np = np.arange(arange_size, dtype=np.int64)
        self.query_pos_np = make_buffer("query_pos", (arange_size,), np.int64)
        self.input_ids_np = make_buffer("input_ids", (max_num_batched_tokens,), np.int32)
        self.positions_np = make_buffer("positions", (max_num_batched_tokens,), np.int64)
        self.query_start_loc_np = make_buffer("query_start_loc", (max_num_reqs + 1,), np.int32)
        self.seq_lens_np = make_buffer("seq_lens", (max_num_reqs,), np.int32)
        self.slot_mapping_np = make_buffer("slot_mapping", (max_num_batched_tokens,), np.int64)
        self.logits_indices_np = make_buffer("logits_indices", (max_num_reqs,), np.int64)
        self.block_table_committed = make_buffer("block_table_committed", block_table.shape, np.int32)
        self.use_torch_gather = torch is not None if use_torch_gather is None else use_torch_gather
        if self.use_torch_gather:
            self.token_ids_flat_tensor = torch.from_numpy(token_ids).flatten()  # a view: no copy
            self.input_ids_tensor = torch.from_numpy(self.input_ids_np)

    def commit_block_table(self, num_reqs: int) -> None:
        """`vllm/v1/worker/block_table.py::BlockTable.commit_block_table`: the batch's rows
        ``[0, num_reqs)`` to the device copy (``CpuGpuBuffer.copy_to_gpu(num_reqs)``)."""
        np.copyto(self.block_table_committed[:num_reqs], self.block_table_np[:num_reqs])

    def prepare(self, num_scheduled_tokens: np.ndarray, num_tokens_padded: int, num_reqs_padded: int) -> dict:
        """`vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._prepare_inputs` for one step.

        ``num_scheduled_tokens`` [num_reqs] int32: the batch's rows ``[0, num_reqs)``, every one
        scheduled (InputBatch holds exactly the scheduled requests, condensed). Returns the padded
        views of the persistent buffers (valid until the next call) and the step's counts.

        Steps, each as vLLM writes it (line numbers: vLLM 0.33.0's ``gpu_model_runner.py`` unless said):
        1. (l. 1944) ``self.input_batch.block_table.commit_block_table(num_reqs)`` first, "to overlap the
           copy with the following CPU operations";
        2. (l. 1948) ``req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled_tokens)``;
        3. (l. 1952, 1699-1723) ``_get_cumsum_and_arange(num_scheduled_tokens, self.query_pos.np)``: ``np.cumsum``,
           ``np.repeat`` of the offsets, ``np.subtract(arange_np, offsets, out=query_pos)``;
        4. (l. 1957) positions ``num_computed_tokens_cpu[req_indices] + query_pos`` (here with ``out=``);
        5. (l. 1971-1984) ``token_indices = positions + req_indices * max_model_len`` and the input ids
           ``torch.index_select(token_ids_cpu_tensor.flatten(), 0, token_indices, out=input_ids.cpu)``;
        6. (l. 2033-2037) ``query_start_loc.np[0] = 0; [1:num_reqs + 1] = cu_num_tokens``, the tail filled with
           the total (kept non-decreasing for FlashAttention);
        7. (l. 2045-2050) ``torch.add(num_computed_tokens_cpu_tensor[:num_reqs], num_scheduled_tokens,
           out=optimistic_seq_lens_cpu[:num_reqs])``, the tail filled with 0;
        8. (l. 2148; ``block_table.py`` l. 318-376) the slot mapping:
           `vllm/v1/worker/block_table.py::ComputeSlotMappingKernel`'s
           ``block_table[req, pos // block_size] * block_size + pos % block_size`` (the kernel
           reads the committed device copy; the host table holds the same rows), the tail
           ``[num_tokens, max_num_tokens)`` filled with PAD_SLOT_ID;
        9. (l. 2195) ``logits_indices = query_start_loc[1:] - 1`` (no spec decode);
        10. (l. 3375, 2309) padding for the padded shapes: positions ``[N, N_pad)`` zeroed
            (`vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._preprocess`), block-table rows
            ``[num_reqs, num_reqs_padded)`` set to the null block
            (`vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._build_attention_metadata`); vLLM
            leaves the input-id tail stale, zeroed here to match jaxprep's padding contract (at
            most N_pad - N entries).
        """
        num_reqs = len(num_scheduled_tokens)
        self.commit_block_table(num_reqs)  # step 1
        # step 2: num_scheduled [2, 5, 3] -> req_indices [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled_tokens)
        # step 3: cu_num_tokens [2, 7, 10]; query_pos [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]
        cu_num_tokens = self._get_cumsum_and_arange(num_scheduled_tokens)
        num_tokens = int(cu_num_tokens[-1])
        positions = self.positions_np[:num_tokens]
        # step 4: computed [5, 0, 9] -> positions [5, 6, 0, 1, 2, 3, 4, 9, 10, 11]
        np.add(self.num_computed_tokens_cpu[req_indices], self.query_pos_np[:num_tokens], out=positions)
        self._gather_input_ids(req_indices, positions, num_tokens)  # step 5
        self._query_start_loc_and_seq_lens(num_scheduled_tokens, cu_num_tokens)  # steps 6, 7
        self._compute_slot_mapping(req_indices, positions, num_tokens)  # step 8
        np.subtract(self.query_start_loc_np[1:num_reqs + 1], 1, out=self.logits_indices_np[:num_reqs])  # step 9
        return self._padded(num_reqs, num_tokens, num_scheduled_tokens, num_tokens_padded, num_reqs_padded)

    def _get_cumsum_and_arange(self, num_scheduled_tokens: np.ndarray) -> np.ndarray:
        """`vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._get_cumsum_and_arange`: [2, 5, 3] -> cu [2, 7, 10], and
        query_pos[:10] = [0, 1, 0, 1, 2, 3, 4, 0, 1, 2] = arange - [0, 0, 2, 2, 2, 2, 2, 7, 7, 7]."""
        cu_num_tokens = np.cumsum(num_scheduled_tokens)
        total = cu_num_tokens[-1]
        offsets = np.repeat(cu_num_tokens - num_scheduled_tokens, num_scheduled_tokens)
        np.subtract(self.arange_np[:total], offsets, out=self.query_pos_np[:total])
        return cu_num_tokens

    def _gather_input_ids(self, req_indices: np.ndarray, positions: np.ndarray, num_tokens: int) -> None:
        """Step 5: positions [0, 1, 0, 1] of requests [0, 0, 1, 1] -> token_indices [0, 1, M, M + 1]."""
        token_indices = positions + req_indices * self.max_model_len
        if self.use_torch_gather:
            torch.index_select(self.token_ids_flat_tensor, 0, torch.from_numpy(token_indices),
                               out=self.input_ids_tensor[:num_tokens])
        else:
            np.take(self.token_ids_cpu.ravel(), token_indices, out=self.input_ids_np[:num_tokens])

    def _query_start_loc_and_seq_lens(self, num_scheduled_tokens: np.ndarray, cu_num_tokens: np.ndarray) -> None:
        """Steps 6-7: [2, 5, 3] over computed [5, 0, 9], 4 rows -> qsl [0, 2, 7, 10, 10], seq_lens [7, 5, 12, 0]."""
        num_reqs = len(num_scheduled_tokens)
        self.query_start_loc_np[0] = 0
        self.query_start_loc_np[1:num_reqs + 1] = cu_num_tokens
        self.query_start_loc_np[num_reqs + 1:].fill(cu_num_tokens[-1])
        np.add(self.num_computed_tokens_cpu[:num_reqs], num_scheduled_tokens, out=self.seq_lens_np[:num_reqs])
        self.seq_lens_np[num_reqs:].fill(PAD_SEQ_LEN)

    def _compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray, num_tokens: int) -> None:
        """Step 8 (block size 2): positions [0, 1, 2] of request 0, its blocks [4, 9] -> slots [8, 9, 18]."""
        width = self.block_table_np.shape[1]
        block_table_indices = req_indices * width + positions // self.block_size
        block_numbers = self.block_table_np.ravel()[block_table_indices]
        np.add(block_numbers * self.block_size, positions % self.block_size, out=self.slot_mapping_np[:num_tokens])
        self.slot_mapping_np[num_tokens:].fill(PAD_SLOT_ID)

    def _padded(self, num_reqs: int, num_tokens: int, num_scheduled_tokens: np.ndarray, num_tokens_padded: int,
                num_reqs_padded: int) -> dict:
        """Step 10, then `padded_views` of the buffers."""
        self.positions_np[num_tokens:num_tokens_padded] = PAD_POSITION
        self.input_ids_np[num_tokens:num_tokens_padded] = PAD_INPUT_ID
        self.block_table_committed[num_reqs:num_reqs_padded] = NULL_BLOCK_ID
        self.logits_indices_np[num_reqs:num_reqs_padded] = PAD_LOGITS_INDEX
        buffers = {"input_ids": self.input_ids_np, "positions": self.positions_np,
                   "slot_mapping": self.slot_mapping_np, "query_start_loc": self.query_start_loc_np,
                   "seq_lens": self.seq_lens_np, "block_table": self.block_table_committed,
                   "logits_indices": self.logits_indices_np}
        return padded_views(buffers, num_tokens_padded, num_reqs_padded, num_actual_tokens=num_tokens,
                            num_reqs=num_reqs, max_query_len=int(num_scheduled_tokens.max()),
                            max_seq_len=int(self.seq_lens_np[:num_reqs].max()))
