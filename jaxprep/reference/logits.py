"""NumPy reference of V2's logits indirection (`jaxprep.features.logits_indirection`), for reading.

One loop per vLLM kernel, over the real batch rows in batch order, unpadded: the oracle of the
logits-indirection tests.
"""

from __future__ import annotations

import numpy as np


def logits_indirection_reference(idx_mapping, num_scheduled, num_draft, positions, input_ids,
                                 num_tokens_padded: int) -> dict[str, np.ndarray]:
    """`vllm/v1/worker/gpu/model_runner.py::GPUModelRunner.prepare_inputs`'s logits rows.

    ``idx_mapping``, ``num_scheduled``, ``num_draft``: per batch row; ``positions`` and
    ``input_ids``: the step's tokens (at least the real ones).
    """
    idx_mapping = np.asarray(idx_mapping, np.int64)
    num_reqs = len(idx_mapping)
    num_draft = np.asarray(num_draft, np.int64)
    query_start_loc = np.concatenate([[0], np.cumsum(num_scheduled)])
    if num_draft.sum() == 0:  # no draft scheduled: V2's common-case branch
        cu_num_logits = np.arange(num_reqs + 1)
        expanded_idx_mapping, expanded_local_pos = idx_mapping, np.zeros(num_reqs, np.int64)
    else:
        num_logits = num_draft + 1
        assert (np.asarray(num_scheduled) >= num_logits).all()
        cu_num_logits = np.concatenate([[0], np.cumsum(num_logits)])
        expanded_idx_mapping = np.zeros(cu_num_logits[-1], np.int64)
        expanded_local_pos = np.zeros(cu_num_logits[-1], np.int64)
        for b in range(num_reqs):  # _expand_idx_mapping_kernel, one program per request
            for j in range(num_logits[b]):
                expanded_idx_mapping[cu_num_logits[b] + j] = idx_mapping[b]
                expanded_local_pos[cu_num_logits[b] + j] = j
    logits_indices = np.zeros(cu_num_logits[-1], np.int64)
    for b in range(num_reqs):  # _combine_sampled_and_draft_tokens_kernel
        n = cu_num_logits[b + 1] - cu_num_logits[b]
        for j in range(n):
            logits_indices[cu_num_logits[b] + j] = query_start_loc[b + 1] - n + j
    num_tokens = int(query_start_loc[-1])
    return {
        "cu_num_logits": cu_num_logits,
        "logits_indices": logits_indices,
        "expanded_idx_mapping": expanded_idx_mapping,
        "expanded_local_pos": expanded_local_pos,
        "logits_pos": np.asarray(positions)[logits_indices],  # sample/sampler.py: Sampler.__call__
        "logits_input_ids": np.asarray(input_ids)[logits_indices],
        "is_padding": np.arange(num_tokens_padded) >= num_tokens,
        "num_draft_tokens_per_req": num_draft,
    }
