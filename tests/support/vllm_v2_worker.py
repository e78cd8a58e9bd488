"""Runs vLLM 0.33.0's model runner V2 input kernels on batches read from stdin; prints JSON results.

Started by tests/features/test_runner_v2_matches_vllm.py in a subprocess with ``TRITON_INTERPRET=1`` (the Triton
kernels run on the CPU) and ``CUDA_VISIBLE_DEVICES=""``, both set before triton is imported.

Each batch gives V2's per-slot state: the token table (prompt and outputs: ``all_token_ids``),
``num_computed_tokens``, ``prefill_len``, and per scheduled slot (in scheduler order) its scheduled
count and draft tokens. The worker does what `vllm/v1/worker/gpu/model_runner.py::GPUModelRunner`
does for them: ``sort_batch_req_ids``, the host part of ``prepare_inputs`` (query_start_loc and
cu_num_logits, both branches), then V2's kernels: ``prepare_prefill_inputs``,
``prepare_pos_seq_lens``, ``combine_sampled_and_draft_tokens`` and ``expand_idx_mapping``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("CUDA_VISIBLE_DEVICES") != "":
    sys.exit("run with TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES='' set before Python starts")

import torch
from vllm.v1.worker.gpu.input_batch import (
    combine_sampled_and_draft_tokens,
    expand_idx_mapping,
    prepare_pos_seq_lens,
    prepare_prefill_inputs,
)
from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids


def run(batch: dict) -> dict:
    k, num_tokens_padded = batch["num_speculative_tokens"], batch["num_tokens_padded"]
    table = torch.tensor(batch["token_ids"], dtype=torch.int32)
    max_num_reqs = table.shape[0]
    computed = torch.tensor(batch["num_computed_tokens"], dtype=torch.int32)
    prefill_len = torch.tensor(batch["prefill_len"], dtype=torch.int32)
    scheduled = {str(s): n for s, n in batch["scheduled"]}  # scheduler order
    drafts = {str(s): d for s, d in batch["drafts"] if d}
    order = [int(s) for s in sort_batch_req_ids(scheduled, drafts, 1 + k)]
    idx_mapping = torch.tensor(order, dtype=torch.int64)
    num_scheduled = np.array([scheduled[str(s)] for s in order], np.int32)
    num_reqs, num_tokens = len(order), int(num_scheduled.sum())
    query_start_loc = torch.full((max_num_reqs + 1,), num_tokens, dtype=torch.int32)
    query_start_loc[0] = 0
    query_start_loc[1:num_reqs + 1] = torch.from_numpy(np.cumsum(num_scheduled))
    if not drafts:  # prepare_inputs: no draft scheduled
        cu_num_logits = torch.arange(num_reqs + 1, dtype=torch.int32)
        expanded_idx_mapping, expanded_local_pos = idx_mapping, torch.zeros(num_reqs, dtype=torch.int32)
    else:
        num_logits = np.array([len(drafts.get(str(s), ())) + 1 for s in order], np.int32)
        assert (num_scheduled >= num_logits).all()
        cu_num_logits = torch.from_numpy(np.concatenate([[0], np.cumsum(num_logits)]).astype(np.int32))
        expanded_idx_mapping, expanded_local_pos = expand_idx_mapping(idx_mapping, int(cu_num_logits[-1]),
                                                                      cu_num_logits, 1 + k)
    input_ids = torch.zeros(num_tokens_padded, dtype=torch.int32)
    positions = torch.zeros(num_tokens_padded, dtype=torch.int64)
    seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32)
    prepare_prefill_inputs(input_ids, torch.zeros((1, max_num_reqs), dtype=torch.int32), idx_mapping,
                           query_start_loc, table, prefill_len, computed)
    prepare_pos_seq_lens(idx_mapping, query_start_loc, computed, positions, seq_lens)
    last_sampled = torch.zeros((max_num_reqs, 1), dtype=torch.int64)
    draft_tokens = torch.zeros((max_num_reqs, max(k, 1)), dtype=torch.int64)
    for s, n in scheduled.items():  # the state V2 keeps: last sampled token, drafts (not in all_token_ids)
        d = drafts.get(s, [])
        end = int(computed[int(s)]) + n - len(d)
        last_sampled[int(s), 0] = table[int(s), end - 1]
        draft_tokens[int(s), :len(d)] = torch.tensor(d, dtype=torch.int64)
    logits_indices = combine_sampled_and_draft_tokens(input_ids, idx_mapping, last_sampled, query_start_loc,
                                                      seq_lens, prefill_len, draft_tokens, cu_num_logits,
                                                      int(cu_num_logits[-1]))
    return {"idx_mapping": order, "query_start_loc": query_start_loc[:num_reqs + 1].tolist(),
            "seq_lens": seq_lens[:num_reqs].tolist(), "positions": positions[:num_tokens].tolist(),
            "input_ids": input_ids[:num_tokens].tolist(), "cu_num_logits": cu_num_logits.tolist(),
            "logits_indices": logits_indices.tolist(), "expanded_idx_mapping": expanded_idx_mapping.tolist(),
            "expanded_local_pos": expanded_local_pos.tolist()}


if __name__ == "__main__":
    print(json.dumps([run(batch) for batch in json.load(sys.stdin)]))
