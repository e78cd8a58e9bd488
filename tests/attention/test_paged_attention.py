"""The XLA paged attention against the NumPy oracle and the former gather-all path, on random mixed steps."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprep.attention import gather_all_attention, paged_attention, token_kv_lens
from jaxprep.attention.paged import query_tiles
from support.attention_batches import CONFIG, attention_cases, longer_row, shifted_block, with_metadata

ATOL = 2e-5


@functools.partial(jax.jit, static_argnames=("blocks_per_chunk", "query_tile"))
def xla_attention(q, k_cache, v_cache, inputs, blocks_per_chunk=1, query_tile=None):
    return paged_attention(q, k_cache, v_cache, inputs, block_size=CONFIG.block_size,
                           blocks_per_chunk=blocks_per_chunk, query_tile=query_tile)


@jax.jit
def old_attention(q, k_cache, v_cache, inputs):
    return gather_all_attention(q, k_cache, v_cache, inputs, block_size=CONFIG.block_size,
                                max_model_len=CONFIG.max_model_len)


def real_tokens(inputs) -> int:
    return int(inputs.attn_metadata.num_actual_tokens)


@pytest.mark.parametrize(("blocks_per_chunk", "query_tile"), [(1, None), (3, 1), (2, 3)])
def test_paged_attention_matches_reference_and_gather_all(blocks_per_chunk, query_tile):
    """Random mixed steps (decodes, prefill chunks, holes, sequences ending at max_model_len), GQA 4 over 2,
    query tiles of one token, of 3 (tiles cut inside requests) and the bucket's default: every token equals
    the NumPy oracle (padded tokens: zeros) and the former gather-all path."""
    for case in attention_cases(seed=11, count=4):
        out = np.asarray(xla_attention(case.q, case.k_cache, case.v_cache, case.inputs, blocks_per_chunk,
                                       query_tile))
        np.testing.assert_allclose(out, case.reference(), atol=ATOL)
        n = real_tokens(case.inputs)
        old = np.asarray(old_attention(case.q, case.k_cache, case.v_cache, case.inputs))
        np.testing.assert_allclose(out[:n], old[:n], atol=ATOL)
        assert not out[n:].any()


def test_a_shifted_slot_or_length_changes_the_output():
    """Negative controls: attention of the step with row 0's first block moved, or row 0 one token
    longer, differs from the oracle of the true step at row 0's tokens."""
    case = next(attention_cases(seed=12, count=1))
    start, end = (int(x) for x in np.asarray(case.inputs.attn_metadata.query_start_loc)[:2])
    expected = case.reference()[start:end]
    for shifted in (shifted_block(case.inputs), longer_row(case.inputs)):
        out = np.asarray(xla_attention(case.q, case.k_cache, case.v_cache, shifted))[start:end]
        assert np.abs(out - expected).max() > 1e-3


def test_padded_tokens_read_nothing_and_give_zeros():
    """Padded tokens have kv_lens 0; poisoning the null block (which padded rows point at) and every slot no
    real token reads changes no output."""
    case = next(attention_cases(seed=13, count=1))
    _, kv_lens = token_kv_lens(case.inputs)
    n = real_tokens(case.inputs)
    assert (np.asarray(kv_lens)[n:] == 0).all() and (np.asarray(kv_lens)[:n] > 0).all()
    meta = case.inputs.attn_metadata
    read = np.zeros(case.k_cache.shape[0], bool)
    table, qsl, pos, lens = (np.asarray(x) for x in (meta.block_table, meta.query_start_loc, case.inputs.positions,
                                                     meta.seq_lens))
    for row in range(len(lens)):
        for t in range(qsl[row], min(qsl[row + 1], n)):
            context = np.arange(min(pos[t] + 1, lens[row]))
            read[table[row, context // CONFIG.block_size] * CONFIG.block_size + context % CONFIG.block_size] = True
    poison = jnp.asarray(~read)[:, None, None]
    k_poisoned, v_poisoned = (jnp.where(poison, jnp.float32(1e4), c) for c in (case.k_cache, case.v_cache))
    out = np.asarray(xla_attention(case.q, k_poisoned, v_poisoned, case.inputs))
    np.testing.assert_allclose(out, case.reference(), atol=ATOL)


def test_bad_metadata_stays_in_bounds():
    """Block ids past the cache and negative ones are clamped: finite output, no out-of-bounds read."""
    case = next(attention_cases(seed=14, count=1))
    table = np.asarray(case.inputs.attn_metadata.block_table).copy()
    table[0, 0], table[-1, -1] = 10_000, -7
    bad = with_metadata(case.inputs, block_table=jnp.asarray(table))
    assert np.isfinite(np.asarray(xla_attention(case.q, case.k_cache, case.v_cache, bad))).all()


def test_query_tiles_worked_example():
    """query_start_loc [0, 5, 6, 6], 6 real tokens, tile 4: rows get 2, 1, 0 tiles; the rest are empty."""
    case = next(attention_cases(seed=15, count=1))
    padded = np.full(case.inputs.attn_metadata.query_start_loc.shape, 6, np.int32)
    padded[:2] = [0, 5]
    inputs = with_metadata(case.inputs, query_start_loc=jnp.asarray(padded), num_actual_tokens=jnp.int32(6))
    tile_row, tile_start, tile_len = (np.asarray(x) for x in query_tiles(inputs, 4))
    assert tile_row[:3].tolist() == [0, 0, 1] and tile_start[:3].tolist() == [0, 4, 5]
    assert tile_len.tolist() == [4, 1, 1] + [0] * (len(tile_len) - 3)
