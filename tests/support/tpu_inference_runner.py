"""tpu-inference 0.32.0's input preparation and its RPA v3 kernel's reference, transcribed to NumPy: the
oracle of `jaxprep.layouts.tpu_inference`.

tpu-inference's runner cannot be imported here (``tpu_inference/runner/tpu_runner.py`` needs flax,
torchax, qwix and a TPU toolchain; its wheel also installs top-level ``tests`` and ``tools`` packages
that would shadow this repository's), so its code is transcribed line for line, in its order, for one
data-parallel rank without speculative decoding, M-RoPE, async scheduling, PCP, LoRA or mamba
layers, one KV-cache group and the default environment (no continue-decode, no bucketed attention
requests). Sources, tpu-inference 0.32.0 (vllm-project/tpu-inference):

- `tpu_inference/runner/utils.py::get_padded_num_reqs_with_upper_limit`, ``get_req_paddings``,
  ``get_token_paddings``, ``build_token_paddings``, ``get_padded_token_len``
- `tpu_inference/runner/tpu_runner.py::TPUModelRunner._init_inputs` (the sizes)
- `tpu_inference/runner/persistent_batch_manager.py::PersistentBatchManager._reorder_batch`
- `tpu_inference/runner/input_batch.py::InputBatch.swap_states` (the rows it swaps)
- `tpu_inference/runner/tpu_runner.py::TPUModelRunner._prepare_input_metadata` and ``_prepare_inputs``
- `tpu_inference/kernels/ragged_paged_attention/v3/kernel.py::get_kv_cache_shape`, ``merge_kv``,
  ``ref_ragged_paged_attention`` (no sliding window, soft cap or quantization scales)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

MIN_NUM_SEQS = 8  # tpu_inference/runner/utils.py
MIN_TOKEN_BUCKET = 16  # tpu_inference/envs.py (default)
VLLM_TPU_BUCKET_PADDING_GAP = 0  # tpu_inference/envs.py (default)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


# --- tpu_inference/runner/utils.py --------------------------------------------------------------

def get_padded_num_reqs_with_upper_limit(x: int, upper_limit: int) -> int:
    res = MIN_NUM_SEQS if x <= MIN_NUM_SEQS else 1 << (x - 1).bit_length()
    return min(res, upper_limit)


def get_req_paddings(min_req_size: int, max_req_size: int) -> list[int]:
    paddings: list = []
    num = max(MIN_NUM_SEQS, min_req_size)
    while num <= max_req_size and (len(paddings) == 0 or paddings[-1] != num):
        paddings.append(num)
        num = get_padded_num_reqs_with_upper_limit(num + 1, max_req_size)
    return paddings


def get_token_paddings(min_token_size: int, max_token_size: int, padding_gap: int) -> list[int]:
    paddings = []
    num = min_token_size
    if padding_gap == 0:
        while True:
            paddings.append(num)
            if num >= max_token_size:
                break
            num *= 2
    else:
        while num <= padding_gap:
            paddings.append(num)
            num *= 2
        num //= 2
        while num < max_token_size:
            num += padding_gap
            paddings.append(num)
    return paddings


def build_token_paddings(min_token_size: int, max_token_size: int, padding_gap: int) -> list[int]:
    budget = -(-max_token_size // min_token_size) * min_token_size
    generated = get_token_paddings(min_token_size, max_token_size, padding_gap)
    sizes = {p for p in generated if p <= budget} | {budget}
    return sorted(sizes)


def get_padded_token_len(paddings: list[int], x: int) -> int:
    index = bisect.bisect_left(paddings, x)
    assert index < len(paddings), f"{paddings=}, {x=}"
    return paddings[index]


# --- the runner and its input batch -------------------------------------------------------------

@dataclass
class TpuRunner:
    """What ``_prepare_inputs`` reads of ``TPUModelRunner`` and its ``InputBatch`` (dp_size 1).

    ``req_ids`` is ``input_batch.req_ids[:num_reqs]``, the persistent batch in its order; row i of
    ``token_ids_cpu``, ``num_computed_tokens_cpu`` and ``block_table_cpu`` belongs to ``req_ids[i]``.
    """

    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    block_size: int
    req_ids: list = field(default_factory=list)

    def __post_init__(self):
        # _init_inputs
        self.max_num_blocks_per_req = cdiv(self.max_model_len, self.block_size)
        self.max_num_reqs = max(1 * self.max_num_seqs, MIN_NUM_SEQS)
        self.attn_max_num_seqs = self.max_num_reqs * 1  # no PCP
        kv_packing = 1  # float32 KV cache (bf16: 2; either way the first bucket stays 16)
        self.num_tokens_paddings = build_token_paddings(
            min_token_size=max(MIN_TOKEN_BUCKET, next_power_of_2(1 * kv_packing)),
            max_token_size=self.max_num_batched_tokens * 1, padding_gap=VLLM_TPU_BUCKET_PADDING_GAP)
        self.num_tokens_paddings_per_dp = list(self.num_tokens_paddings)
        self.max_num_tokens = self.num_tokens_paddings[-1]
        self.positions_cpu = np.zeros(self.max_num_tokens, dtype=np.int32)
        self.arange_cpu = np.arange(self.max_num_tokens, dtype=np.int64)
        min_num_reqs = max(MIN_NUM_SEQS, next_power_of_2(1))
        self.num_reqs_paddings = get_req_paddings(min_req_size=min_num_reqs, max_req_size=self.max_num_reqs)
        self.attn_num_reqs_paddings_per_dp = [self.max_num_seqs]  # get_attn_req_paddings, defaults
        self.num_reqs_paddings_per_dp = list(self.num_reqs_paddings)
        # InputBatch (token_ids_cpu, num_computed_tokens_cpu) and its BlockTable (block_table_cpu)
        self.token_ids_cpu = np.zeros((self.max_num_reqs, self.max_model_len), dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros((self.max_num_reqs,), dtype=np.int32)
        self.block_table_cpu = np.zeros((self.max_num_reqs, self.max_num_blocks_per_req), dtype=np.int32)
        self.request_distribution = [0, 0, 0]

    def add_request(self, req_id, token_ids, num_computed_tokens: int, block_ids) -> None:
        """Appends a request at row ``len(req_ids)`` (``InputBatch.add_request`` without removed rows)."""
        row = len(self.req_ids)
        self.req_ids.append(req_id)
        self.token_ids_cpu[row, :len(token_ids)] = token_ids
        self.num_computed_tokens_cpu[row] = num_computed_tokens
        self.block_table_cpu[row, :len(block_ids)] = block_ids

    def swap_states(self, i1: int, i2: int) -> None:
        """``InputBatch.swap_states``, the arrays ``_prepare_inputs`` reads (whole token rows: it swaps the
        first ``num_tokens``, the rest is never read), and ``BlockTable.swap_row``."""
        self.req_ids[i1], self.req_ids[i2] = self.req_ids[i2], self.req_ids[i1]
        for table in (self.token_ids_cpu, self.num_computed_tokens_cpu, self.block_table_cpu):
            table[[i1, i2]] = table[[i2, i1]]

    # --- tpu_inference/runner/persistent_batch_manager.py::PersistentBatchManager._reorder_batch ---
    def reorder_batch(self, num_scheduled_tokens: dict, total_num_scheduled_tokens: int) -> int:
        num_reqs = len(self.req_ids)
        swap_cnt = 0
        if num_reqs <= 0:
            return swap_cnt
        max_decode_tokens = 1  # InputBatch.max_decode_tokens without spec decode

        if max_decode_tokens == 1 and total_num_scheduled_tokens == num_reqs:
            num_decode = num_reqs
            self.request_distribution = [num_decode, num_decode, num_reqs]
            return swap_cnt

        all_decode = True
        for req_id in self.req_ids[:num_reqs]:
            if num_scheduled_tokens[req_id] > max_decode_tokens:
                all_decode = False
                break
        if all_decode:
            num_decode = num_reqs
            self.request_distribution = [num_decode, num_decode, num_reqs]
            return swap_cnt

        # Use two-pointer approach to reorder the decode requests to front.
        i, j = 0, num_reqs - 1
        while i < j:
            i_req_id = self.req_ids[i]
            j_req_id = self.req_ids[j]
            if num_scheduled_tokens[i_req_id] <= max_decode_tokens:
                i += 1  # i is a decode request, move to the next one.
            elif num_scheduled_tokens[j_req_id] > max_decode_tokens:
                j -= 1  # j is a prefill request, move to the previous one.
            else:
                self.swap_states(i, j)
                i += 1
                j -= 1
                swap_cnt += 1

        num_decode = i + int(num_scheduled_tokens[self.req_ids[i]] <= max_decode_tokens)
        self.request_distribution = [num_decode, num_decode, num_reqs]
        return swap_cnt

    # --- tpu_inference/runner/tpu_runner.py::TPUModelRunner._prepare_input_metadata (dp_size 1) ---
    def prepare_input_metadata(self, num_scheduled_tokens: dict):
        num_reqs = len(self.req_ids)
        req_indices_dp = list(range(num_reqs))  # req_id_to_index: the batch rows, in order
        num_scheduled_tokens_per_dp_rank = sum(num_scheduled_tokens[r] for r in self.req_ids)
        scheduled_tokens_per_dp_rank = [num_scheduled_tokens[r] for r in self.req_ids]
        padded_num_reqs_per_dp_rank = get_padded_token_len(self.num_reqs_paddings_per_dp, num_reqs)
        padded_num_scheduled_tokens_per_dp_rank = get_padded_token_len(self.num_tokens_paddings_per_dp,
                                                                       num_scheduled_tokens_per_dp_rank)
        padded_total_num_scheduled_tokens = padded_num_scheduled_tokens_per_dp_rank * 1
        assert num_scheduled_tokens_per_dp_rank > 0
        padded_num_reqs = padded_num_reqs_per_dp_rank * 1
        attn_padded_num_reqs = get_padded_token_len(self.attn_num_reqs_paddings_per_dp, num_reqs) * 1
        return (req_indices_dp, num_scheduled_tokens_per_dp_rank, scheduled_tokens_per_dp_rank,
                padded_num_scheduled_tokens_per_dp_rank, padded_num_reqs, attn_padded_num_reqs,
                padded_total_num_scheduled_tokens, padded_num_reqs_per_dp_rank)

    # --- tpu_inference/runner/tpu_runner.py::TPUModelRunner._prepare_inputs (dp_size 1) -----------
    def prepare_inputs(self, num_scheduled_tokens: dict) -> dict:
        """The arrays ``_prepare_inputs`` hands the model, by the names of `TpuInferenceInputs`."""
        (req_indices_dp, total_num_scheduled_tokens, num_scheduled_tokens_per_req,
         padded_num_scheduled_tokens_per_dp_rank, padded_num_reqs, attn_padded_num_reqs,
         padded_total_num_scheduled_tokens, padded_num_reqs_per_dp_rank) = self.prepare_input_metadata(
            num_scheduled_tokens)
        num_reqs = len(req_indices_dp)
        # device_buffer views (its buffer is reused dirty: every field below is written whole)
        input_ids_view = np.full((padded_total_num_scheduled_tokens,), -7, np.int32)
        query_start_loc_view = np.full((self.attn_max_num_seqs + 1,), -7, np.int32)
        seq_lens_view = np.full((self.attn_max_num_seqs,), -7, np.int32)
        logits_indices_view = np.full((padded_num_reqs,), -7, np.int32)

        # Populates input_ids and positions
        input_ids_cpu = input_ids_view[:padded_num_scheduled_tokens_per_dp_rank]
        positions_cpu = self.positions_cpu[:padded_num_scheduled_tokens_per_dp_rank]
        req_indices = np.repeat(req_indices_dp, num_scheduled_tokens_per_req)
        arange = np.concatenate([self.arange_cpu[:n] for n in num_scheduled_tokens_per_req])
        positions_np = positions_cpu[:total_num_scheduled_tokens]
        np.add(self.num_computed_tokens_cpu[req_indices], arange, out=positions_np)
        token_indices = positions_np + req_indices * self.token_ids_cpu.shape[1]
        np.take(self.token_ids_cpu.ravel(), token_indices, out=input_ids_cpu[:total_num_scheduled_tokens])
        input_ids_cpu[total_num_scheduled_tokens:] = 0

        # Prepare the attention metadata (query_start_loc_cpu, seq_lens_cpu)
        query_start_loc_cpu = query_start_loc_view[0:self.max_num_reqs + 1]
        seq_lens_cpu = seq_lens_view[0:self.max_num_reqs]
        query_start_loc_cpu[0] = 0
        np.cumsum(num_scheduled_tokens_per_req, out=query_start_loc_cpu[1:num_reqs + 1])
        query_start_loc_cpu[num_reqs + 1:] = query_start_loc_cpu[num_reqs]
        seq_lens_cpu[:num_reqs] = self.num_computed_tokens_cpu[req_indices_dp] + num_scheduled_tokens_per_req
        seq_lens_cpu[num_reqs:] = 0

        # populate logits_indices
        logits_indices_cpu = logits_indices_view[0:padded_num_reqs_per_dp_rank]
        logits_indices_cpu[:num_reqs] = query_start_loc_view[1:num_reqs + 1] - 1
        logits_indices_cpu[num_reqs:] = -1

        positions = self.positions_cpu[:padded_total_num_scheduled_tokens]
        num_decode_in_dp_rank = 0
        for req_id in self.req_ids:  # max_decode_tokens 1
            if num_scheduled_tokens[req_id] <= 1:
                num_decode_in_dp_rank += 1
        request_distribution = np.array([[num_decode_in_dp_rank, num_decode_in_dp_rank, num_reqs]],
                                        dtype=np.int32).ravel()

        # build_block_table_host(0)
        block_tables_view = np.full((self.attn_max_num_seqs, self.max_num_blocks_per_req), -7, np.int32)
        block_tables_view.fill(0)
        np.take(self.block_table_cpu, req_indices_dp, axis=0, out=block_tables_view[0:num_reqs])

        return dict(input_ids=input_ids_view.copy(), positions=positions.copy(),
                    query_start_loc=query_start_loc_view.copy(), seq_lens=seq_lens_view.copy(),
                    block_tables=block_tables_view.reshape(-1).copy(), request_distribution=request_distribution,
                    logits_indices=logits_indices_view.copy(), padded_num_reqs=attn_padded_num_reqs)

    def step(self, num_scheduled_tokens: dict) -> dict:
        """One step: ``_reorder_batch`` (in ``update_states``), then ``_prepare_inputs``; also the batch order."""
        self.reorder_batch(num_scheduled_tokens, sum(num_scheduled_tokens.values()))
        out = self.prepare_inputs(num_scheduled_tokens)
        assert list(out["request_distribution"]) == self.request_distribution  # the runner's two counts agree
        return dict(out, req_ids=list(self.req_ids))


# --- tpu_inference/kernels/ragged_paged_attention/v3/kernel.py ---------------------------------

def get_dtype_packing(dtype) -> int:
    return 32 // (np.dtype(dtype).itemsize * 8)


def align_to(x: int, a: int) -> int:
    return cdiv(x, a) * a


def get_kv_cache_shape(total_num_pages, page_size, actual_num_kv_heads, actual_head_dim, kv_dtype):
    kv_packing = get_dtype_packing(kv_dtype)
    return (total_num_pages, page_size, align_to(actual_num_kv_heads * 2, kv_packing) // kv_packing, kv_packing,
            align_to(actual_head_dim, 128))


def merge_kv(k: np.ndarray, v: np.ndarray) -> np.ndarray:
    max_num_tokens, actual_num_kv_heads, actual_head_dim = k.shape
    kv_packing = get_dtype_packing(k.dtype)
    actual_num_kv_heads_x2 = actual_num_kv_heads * 2
    num_kv_heads_x2 = align_to(actual_num_kv_heads_x2, kv_packing)
    head_dim = align_to(actual_head_dim, 128)
    kv = np.pad(np.concatenate([k, v], axis=-1).reshape(max_num_tokens, actual_num_kv_heads_x2, actual_head_dim),
                ((0, 0), (0, num_kv_heads_x2 - actual_num_kv_heads_x2), (0, head_dim - actual_head_dim)))
    return kv.reshape(max_num_tokens, num_kv_heads_x2 // kv_packing, kv_packing, head_dim)


def ref_ragged_paged_attention(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                               *, sm_scale: float = 1.0):
    """Outputs of the sequences ``[0, distribution[-1])`` (concatenated; the kernel's padded tail is not
    returned) and the cache with their K/V written, in float64. Causal mask, ``finfo.min`` masking."""
    actual_head_dim = queries.shape[2]
    actual_num_q_heads = queries.shape[1]
    actual_num_kv_heads = keys.shape[1]
    merged_kv = merge_kv(keys, values)
    assert merged_kv.shape[-3:] == kv_cache.shape[-3:]
    _, page_size, num_kv_heads_x2_per_kv_packing, kv_packing, head_dim = kv_cache.shape
    num_kv_heads_x2 = num_kv_heads_x2_per_kv_packing * kv_packing
    actual_num_q_heads_per_kv_head = actual_num_q_heads // actual_num_kv_heads
    max_num_seqs = kv_lens.shape[0]
    pages_per_seq = page_indices.shape[0] // max_num_seqs
    kv_cache = kv_cache.copy()
    outputs = []
    for i in range(int(distribution[-1])):
        q_start, q_end = int(cu_q_lens[i]), int(cu_q_lens[i + 1])
        q_len = q_end - q_start
        kv_len = int(kv_lens[i])
        indices_start = i * pages_per_seq
        indices = page_indices[indices_start:indices_start + cdiv(kv_len, page_size)]
        q = queries[q_start:q_end, :, :actual_head_dim]
        assert kv_len - q_len >= 0
        gathered_kv = kv_cache[indices]
        gathered_shape = gathered_kv.shape
        gathered_kv = gathered_kv.reshape(-1, *gathered_shape[-3:])
        gathered_kv[kv_len - q_len:kv_len] = merged_kv[q_start:q_end]
        kv_cache[indices] = gathered_kv.reshape(gathered_shape)
        kv = gathered_kv.reshape(-1, num_kv_heads_x2, head_dim)[:, :actual_num_kv_heads * 2, :].reshape(
            -1, actual_num_kv_heads, head_dim * 2)
        k = kv[:kv_len, :, :head_dim][:, :, :actual_head_dim]
        v = kv[:kv_len, :, head_dim:][:, :, :actual_head_dim]
        k = np.repeat(k, actual_num_q_heads_per_kv_head, axis=1).astype(np.float64)
        v = np.repeat(v, actual_num_q_heads_per_kv_head, axis=1).astype(np.float64)
        attn = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) * sm_scale
        q_span = (kv_len - q_len) + np.arange(q_len)[None, :, None]
        kv_span = np.arange(kv_len)[None, None, :]
        attn = np.where(q_span >= kv_span, attn, np.finfo(np.float32).min)
        attn = np.exp(attn - attn.max(axis=-1, keepdims=True))
        attn /= attn.sum(axis=-1, keepdims=True)
        outputs.append(np.einsum("hqk,khd->qhd", attn, v))
    return np.concatenate(outputs, axis=0), kv_cache
