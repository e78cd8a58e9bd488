"""NumPy reference of the LoRA metadata (`jaxprep.features.lora`), written the way vLLM 0.33.0 writes it.

Host loops and ``np.repeat`` / ``np.unique`` / a stable ``np.argsort`` over the real (unpadded)
rows, one function per vLLM function; the oracle of the LoRA tests. The graph-key rules are
written from the dispatchers' code (bisect over the capture cases), not from `LoRAConfig`'s tables.
"""

from __future__ import annotations

import bisect

import numpy as np


def make_lora_inputs_v1(request_lora_mapping, num_scheduled, num_sampled) -> tuple[np.ndarray, np.ndarray, set]:
    """`vllm/v1/worker/gpu_input_batch.py::InputBatch.make_lora_inputs` over rows in batch order:
    (prompt mapping, token mapping, active adapter ids)."""
    ids = np.asarray(request_lora_mapping, np.int64)
    return (np.repeat(ids, num_sampled), np.repeat(ids, num_scheduled), {int(i) for i in ids if i > 0})


def make_lora_inputs_v2(lora_ids, idx_mapping, num_scheduled) -> tuple[np.ndarray, np.ndarray, set]:
    """`vllm/v1/worker/gpu/lora_utils.py::LoraState.make_lora_inputs`: one prompt entry per request."""
    ids = np.asarray(lora_ids, np.int64)[np.asarray(idx_mapping)]
    return ids, np.repeat(ids, num_scheduled), {int(i) for i in ids if i > 0}


def convert_mapping_reference(token_mapping, prompt_mapping, lora_index_to_id, max_loras: int,
                              vocab_size: int) -> dict[str, np.ndarray]:
    """`vllm/lora/punica_wrapper/utils.py::convert_mapping` (its ``max_loras`` argument is slots + 1)."""
    id_to_index = {lora_id: index for index, lora_id in enumerate(lora_index_to_id) if lora_id is not None}
    token_indices = [id_to_index[x] if x > 0 else -1 for x in token_mapping]
    sampler = np.array([id_to_index[x] if x > 0 else -1 for x in prompt_mapping], np.int64)
    length = len(sampler)
    padded = np.where(sampler == -1, max_loras, sampler)  # vLLM: -1 -> its argument (slots + 1) minus 1
    return {
        "token_lora_indices": np.array(token_indices, np.int64),
        "sampler_indices": sampler,
        "sampler_indices_padded": np.arange(length) + padded * length,
        "embeddings_indices": np.array([i if i >= 0 else 0 for i in token_indices], np.int64) * vocab_size,
        "indices_len": np.array([len(token_indices), length, length, len(token_indices)]),
    }


def captured_lora_counts(max_loras: int, specialize: bool) -> list[int]:
    """`vllm/lora/utils.py::get_captured_lora_counts`."""
    if not specialize:
        return [max_loras + 1]
    return [n for n in range(1, max_loras + 2) if (n & (n - 1)) == 0 or n == max_loras + 1]


def kernel_meta_reference(x, max_loras: int, specialize_active_lora: bool) -> dict:
    """`vllm/lora/ops/triton_ops/lora_kernel_metadata.py::LoRAKernelMeta.prepare_tensors` on ``x``.

    ``token_indices_sorted_by_lora_ids`` is None when vLLM leaves the buffer as it was (no LoRA).
    """
    x = np.asarray(x, np.int64)
    out = {"token_indices_sorted_by_lora_ids": None, "active_lora_ids": np.full(max_loras + 1, -1),
           "num_tokens_per_lora": np.zeros(max_loras + 1, np.int64),
           "lora_token_start_loc": np.zeros(max_loras + 2, np.int64), "num_active_loras": 0}
    if np.all(x == -1):
        return out
    out["token_indices_sorted_by_lora_ids"] = np.argsort(x, kind="stable")
    ids, counts = np.unique(x, return_counts=True)
    out["active_lora_ids"][: len(ids)] = ids
    out["num_tokens_per_lora"][: len(counts)] = counts
    out["lora_token_start_loc"][1: 1 + len(counts)] = np.cumsum(counts)
    captured = sorted(captured_lora_counts(max_loras, specialize_active_lora))
    num_active = len(ids)
    place = bisect.bisect_left(captured, num_active)
    out["num_active_loras"] = captured[place] if place < len(captured) else num_active
    return out


def graph_key_v1(num_active: int, max_loras: int, specialize_active_lora: bool,
                 cudagraph_specialize_lora: bool) -> int:
    """`vllm/v1/cudagraph_dispatcher.py::CudagraphDispatcher.dispatch`'s effective ``num_active_loras``."""
    if num_active == 0:
        return 0
    if not specialize_active_lora:
        return max_loras + 1
    cases = [0, *captured_lora_counts(max_loras, True)] if cudagraph_specialize_lora else [max_loras + 1]
    captured = [c for c in cases if c]
    place = bisect.bisect_left(captured, num_active)
    return captured[place] if place < len(captured) else num_active


def graph_key_v2(num_active: int, max_loras: int, specialize_active_lora: bool,
                 cudagraph_specialize_lora: bool) -> int:
    """`vllm/v1/worker/gpu/cudagraph_utils.py::CudaGraphManager._resolve_effective_loras`."""
    if cudagraph_specialize_lora:
        cases = [0] + [c for c in captured_lora_counts(max_loras, specialize_active_lora) if c > 0]
    else:
        cases = [0, max_loras + 1]
    with_lora = sorted(c for c in cases if c > 0)
    if num_active <= 0:
        return num_active
    for case in with_lora:
        if case >= num_active:
            return case
    return with_lora[-1]


def lora_reference(lora_ids, lora_slots, rows, num_scheduled, num_draft, lora, runner: str,
                   spec_decode: bool) -> dict:
    """Every `LoRAMetadata` field, unpadded, for the batch of state rows ``rows`` (in batch order).

    ``lora``: a `jaxprep.LoRAConfig` (only its options are read); ``spec_decode``: a speculative
    config exists (V1 then samples ``D + 1`` logits rows per request).
    """
    rows = np.asarray(rows, np.int64)
    scheduled = np.asarray(num_scheduled, np.int64)[rows]
    drafts = np.asarray(num_draft, np.int64)[rows]
    per_logits_row = runner == "v1" if lora.prompt_mapping == "runner" else lora.prompt_mapping == "logits_rows"
    num_sampled = drafts + 1 if (spec_decode and per_logits_row) else np.ones_like(drafts)
    if runner == "v1" or per_logits_row:
        prompt, token, active = make_lora_inputs_v1(np.asarray(lora_ids)[rows], scheduled, num_sampled)
    else:
        prompt, token, active = make_lora_inputs_v2(lora_ids, rows, scheduled)
    slot_layout = [None if s == -1 else int(s) for s in lora_slots]
    out = convert_mapping_reference(token, prompt, slot_layout, lora.max_loras, lora.vocab_size or 1)
    out.update(token_lora_mapping=token, prompt_lora_mapping=prompt, num_active_loras=len(active))
    args = (lora.max_loras, lora.specialize_active_lora, lora.cudagraph_specialize_lora)
    out["cudagraph_num_active_loras"] = (graph_key_v1 if runner == "v1" else graph_key_v2)(len(active), *args)
    out["token_mapping_meta"] = kernel_meta_reference(out["token_lora_indices"], *args[:2])
    out["prompt_mapping_meta"] = kernel_meta_reference(out["sampler_indices"], *args[:2])
    return out
