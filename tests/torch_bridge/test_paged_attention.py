"""A torch consumer of the bridged metadata: paged attention over a chunked-prefill workload.

Several steps are prepared with jaxprep from a host-driven schedule (chunked prefills under a token
budget, then decodes, blocks allocated as needed from a shuffled pool). Each step writes its
tokens' K/V by ``slot_mapping`` and reads by ``block_table_tensor`` and ``seq_lens``; every real
token's output must equal torch's dense causal attention over its whole sequence at that position.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = pytest.importorskip("torch.nn.functional")

import jaxprep  # noqa: E402
import torch_bridge  # noqa: E402
from jaxprep.config import cdiv  # noqa: E402
from support.bridge_checks import JAX_TORCH_DEVICE  # noqa: E402
from torch_bridge.paged_attention import paged_attention, write_kv_cache  # noqa: E402

CONFIG = jaxprep.PrepConfig(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=16, block_size=4,
                            num_blocks=48)
PROMPT_LENS = (23, 9, 14)
NUM_DECODES = 3
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 8


@dataclasses.dataclass
class Request:
    row: int
    prompt_len: int
    total_len: int  # prompt plus decoded tokens: their q/k/v are fixed up front
    num_computed: int = 0

    def next_chunk(self, budget: int) -> int:
        if self.num_computed < self.prompt_len:  # chunked prefill
            return min(self.prompt_len - self.num_computed, budget)
        return min(1, self.total_len - self.num_computed, budget)  # decode


def schedule(requests, budget: int) -> np.ndarray:
    """Tokens per state row for one step: rows in order, each takes what fits in the budget."""
    scheduled = np.zeros(CONFIG.max_num_reqs, np.int32)
    for request in requests:
        scheduled[request.row] = request.next_chunk(budget - int(scheduled.sum()))
    return scheduled


def dense_causal(q, k, v):
    """torch's own causal attention over a whole sequence ([L, heads, head_size] each), as the oracle."""
    group = NUM_HEADS // NUM_KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)


def run_workload(strategy: str):
    rng = np.random.default_rng(7)
    gen = torch.Generator().manual_seed(7)
    requests = [Request(row, n, n + NUM_DECODES) for row, n in enumerate(PROMPT_LENS)]
    qkv = [tuple(torch.randn(r.total_len, heads, HEAD_SIZE, generator=gen, dtype=torch.float64)
                 for heads in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)) for r in requests]
    expected = [dense_causal(*tensors) for tensors in qkv]
    free_blocks = list(rng.permutation(np.arange(1, CONFIG.num_blocks)))
    block_table = np.zeros((CONFIG.max_num_reqs, CONFIG.max_blocks_per_req), np.int32)
    token_ids = rng.integers(1, 1000, (CONFIG.max_num_reqs, CONFIG.max_model_len), dtype=np.int32)
    cache_shape = (CONFIG.num_blocks, CONFIG.block_size, NUM_KV_HEADS, HEAD_SIZE)
    key_cache, value_cache = (torch.zeros(cache_shape, dtype=torch.float64, device=JAX_TORCH_DEVICE) for _ in range(2))
    schedules = []
    while any(r.num_computed < r.total_len for r in requests):
        scheduled = schedule(requests, CONFIG.max_num_batched_tokens)
        for r in requests:  # allocate the blocks this step's tokens land in
            for column in range(cdiv(r.num_computed, CONFIG.block_size), cdiv(r.num_computed + int(scheduled[r.row]),
                                                                               CONFIG.block_size)):
                if block_table[r.row, column] == 0:
                    block_table[r.row, column] = free_blocks.pop()
        computed = np.zeros(CONFIG.max_num_reqs, np.int32)
        computed[[r.row for r in requests]] = [r.num_computed for r in requests]
        state = jaxprep.BatchState.from_numpy(token_ids=token_ids, block_table=block_table,
                                              num_computed_tokens=computed, num_scheduled_tokens=scheduled)
        inputs = torch_bridge.to_torch(jaxprep.prepare_inputs(state, CONFIG, check=True), strategy=strategy)
        check_step(inputs, requests, scheduled, qkv, expected, key_cache, value_cache)
        schedules.append(scheduled[:len(requests)].tolist())
        for r in requests:
            r.num_computed += int(scheduled[r.row])
    return schedules


def check_step(inputs, requests, scheduled, qkv, expected, key_cache, value_cache):
    """Runs one step's paged attention and compares every real token with the dense oracle."""
    num_tokens_padded = inputs.num_tokens_padded
    # padded tokens carry garbage: they must neither be written nor disturb real outputs
    query = torch.full((num_tokens_padded, NUM_HEADS, HEAD_SIZE), 1e6, dtype=torch.float64, device=JAX_TORCH_DEVICE)
    key = torch.full((num_tokens_padded, NUM_KV_HEADS, HEAD_SIZE), 1e6, dtype=torch.float64, device=JAX_TORCH_DEVICE)
    value = key.clone()
    token, owners = 0, []  # the batch: rows with work, in row order (our own bookkeeping, not the bridge's)
    for r in requests:
        for position in range(r.num_computed, r.num_computed + int(scheduled[r.row])):
            query[token], key[token], value[token] = (t[position] for t in qkv[r.row])
            owners.append((r.row, position))
            token += 1
    write_kv_cache(key, value, key_cache, value_cache, inputs.attn_metadata.slot_mapping)
    output = paged_attention(query, key_cache, value_cache, inputs.attn_metadata)
    for token, (row, position) in enumerate(owners):
        torch.testing.assert_close(output[token].cpu(), expected[row][position], rtol=1e-9, atol=1e-9)
    assert output[len(owners):].eq(0).all()


@pytest.mark.parametrize("strategy", ["packed", "per_field"])
def test_paged_attention_over_chunked_prefill_matches_dense_causal(strategy):
    schedules = run_workload(strategy)
    # the workload really chunks a prefill across steps and mixes decodes with prefill chunks
    assert schedules[0] == [16, 0, 0]
    assert any(steps[0] == 1 and steps[2] > 1 for steps in schedules)
    assert len(schedules) >= 5
