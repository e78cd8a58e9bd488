"""The tiny model's paged forward against its dense recomputation, and the padded-slot contract."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep import PrepConfig, prepare_padded
from jaxprep.serving import (
    AddRequests,
    AppendBlocks,
    KVCache,
    ModelConfig,
    Schedule,
    ServingBatch,
    ServingConfig,
    dense_forward,
    init_params,
    paged_forward,
)

MODEL = ModelConfig(vocab_size=64, num_layers=2, d_model=32, num_heads=2, d_ff=64)
CONFIG = ServingConfig(prep=PrepConfig(max_num_reqs=3, max_model_len=24, max_num_batched_tokens=16, block_size=4,
                                       num_blocks=24))
PREP = CONFIG.prep


@functools.partial(jax.jit, static_argnames=("num_tokens_padded",))
def paged_step(params, kv_cache, state, num_tokens_padded):
    inputs = prepare_padded(state.batch, PREP, num_tokens_padded)
    kv_cache, logits = paged_forward(params, kv_cache, inputs, model=MODEL, block_size=PREP.block_size,
                                     max_model_len=PREP.max_model_len)
    return kv_cache, logits, inputs


@jax.jit
def dense_logits(params, token_ids):
    return dense_forward(params, token_ids, model=MODEL)


def test_chunked_paged_prefill_matches_dense_logits():
    """Three prompts prefilled in chunks of at most 5 tokens, in scattered blocks: the logits of every
    chunk's last token equal the dense logits at that position."""
    rng = np.random.default_rng(0)
    params = init_params(MODEL, seed=1)
    kv_cache = KVCache.zeros(MODEL, PREP.num_blocks, PREP.block_size)
    batch = ServingBatch(CONFIG)
    prompts = [rng.integers(2, 64, n) for n in (13, 6, 20)]
    blocks = rng.permutation(np.arange(1, PREP.num_blocks))  # scattered, never block 0
    blocks_of = [blocks[0:4], blocks[4:6], blocks[6:11]]
    batch.add_requests(AddRequests.build(CONFIG, [
        dict(row=r, token_ids=p, stop_len=24, block_ids=blocks_of[r][:1]) for r, p in enumerate(prompts[:2])]))
    batch.add_requests(AddRequests.build(CONFIG, [dict(row=2, token_ids=prompts[2], stop_len=24,
                                                       block_ids=blocks_of[2][:1])]))
    compared = 0
    while (batch.rows.num_computed_tokens < batch.rows.num_tokens - 1).any():
        computed = batch.rows.num_computed_tokens
        scheduled = np.minimum(batch.rows.num_tokens - computed, 5)
        needed = -(-(computed + scheduled) // PREP.block_size) - batch.rows.num_blocks
        batch.append_block_ids(AppendBlocks.build(CONFIG, {
            r: blocks_of[r][batch.rows.num_blocks[r]: batch.rows.num_blocks[r] + needed[r]].tolist()
            for r in range(3) if needed[r] > 0}))
        batch.schedule(Schedule.build(CONFIG, scheduled))
        kv_cache, logits, inputs = paged_step(params, kv_cache, batch.state, PREP.bucket_for(int(scheduled.sum())))
        for b, row in enumerate(np.asarray(inputs.idx_mapping)):
            if row < 0:
                continue
            end = int(computed[row] + scheduled[row])
            tokens = np.zeros(PREP.max_model_len, np.int32)
            tokens[: len(prompts[row])] = prompts[row]
            np.testing.assert_allclose(np.asarray(logits[b]), np.asarray(dense_logits(params, tokens))[end - 1],
                                       atol=2e-4, rtol=2e-4)
            compared += 1
        batch.record_sampled(np.asarray(inputs.idx_mapping), np.zeros((PREP.max_num_reqs, 1), np.int32),
                             np.ones(PREP.max_num_reqs, np.int32))
    assert compared >= 9


def test_padded_tokens_write_no_slot():
    """A step of 3 real tokens padded to 8: exactly the 3 slots of slot_mapping change; the last slot
    (where an unmapped -1 would wrap) and every other slot keep their values."""
    params = init_params(MODEL, seed=2)
    shape = (MODEL.num_layers, PREP.num_blocks * PREP.block_size, MODEL.num_heads, MODEL.head_dim)
    kv_cache = KVCache(k=jnp.full(shape, 123.0), v=jnp.full(shape, 123.0))
    batch = ServingBatch(CONFIG)
    batch.add_requests(AddRequests.build(CONFIG, [dict(row=0, token_ids=[5, 6, 7], stop_len=8, block_ids=[2])]))
    batch.schedule(Schedule.build(CONFIG, [3, 0, 0]))
    kv_cache, _, inputs = paged_step(params, kv_cache, batch.state, 8)
    slots = np.asarray(inputs.attn_metadata.slot_mapping)
    assert slots.tolist() == [8, 9, 10, -1, -1, -1, -1, -1]
    for cache in (np.asarray(kv_cache.k), np.asarray(kv_cache.v)):
        changed = np.flatnonzero((cache != 123.0).any(axis=(0, 2, 3)))
        assert changed.tolist() == [8, 9, 10]
