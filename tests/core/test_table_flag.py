"""The block-table bit (``BLOCK_ID_OUT_OF_RANGE``) as one pass over the state's table.

`jaxprep.bounds.max_of_blocks` folds column blocks, then row blocks, into a small array before its
one reduction; `jaxprep.features.flags` takes the maximum of the used ids as uint32 (a negative id
above every bound): on CPU after the maximum of every id, elsewhere in one masked pass. Both are
compared with NumPy written out per element; every fold is shown to see every element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprep.bounds import _used_ids_outside, max_of_blocks, used_ids_outside_masked

SHAPES = [(1, 1), (1, 7), (3, 8), (5, 37), (8, 256), (33, 700), (64, 2048)]


def _max_of(array: np.ndarray):
    values = jnp.asarray(array)
    return jax.jit(lambda v: max_of_blocks(lambda start, stop: v[:, start:stop], v.shape[1]))(values)


@pytest.mark.parametrize("shape", SHAPES)
def test_max_of_blocks_matches_numpy(shape):
    array = np.random.default_rng(sum(shape)).integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
    assert int(_max_of(array)) == int(array.max())


@pytest.mark.parametrize("shape", [(5, 37), (33, 70), (40, 9)])
def test_max_of_blocks_sees_every_element(shape):
    """The maximum placed at each position in turn is found (negative control: the zeros around it
    give 0): no column block and no row block leaves an element out, the overlapping last ones included."""
    rows, width = shape
    values = jnp.zeros(shape, jnp.uint32)
    fold = jax.jit(lambda v: max_of_blocks(lambda start, stop: v[:, start:stop], width))
    assert int(fold(values)) == 0
    found = jax.jit(jax.vmap(lambda i: fold(values.reshape(-1).at[i].set(7).reshape(shape))))(
        jnp.arange(rows * width))
    np.testing.assert_array_equal(found, np.full(rows * width, 7))


def _reference(table: np.ndarray, seq_lens: np.ndarray, tokens_per_column: int, max_block_id: int) -> bool:
    """Column by column, as written: column c of row r is used when c * B < seq_len[r]."""
    for r in range(table.shape[0]):
        for c in range(table.shape[1]):
            if c * tokens_per_column < seq_lens[r] and not 0 <= table[r, c] <= max_block_id:
                return True
    return False


FLAGS = {"cpu path": _used_ids_outside, "masked pass": used_ids_outside_masked}


def _flag(name: str, table, seq_lens, tokens_per_column: int, max_block_id: int) -> bool:
    fn = jax.jit(FLAGS[name], static_argnums=(2, 3))
    return bool(fn(jnp.asarray(table, jnp.int32), jnp.asarray(seq_lens, jnp.int32), tokens_per_column, max_block_id))


@pytest.mark.parametrize("name", FLAGS)
def test_the_flag_matches_the_reference_on_random_tables(name):
    rng = np.random.default_rng(5)
    seen = set()
    for trial in range(40):  # few distinct shapes and bounds: few compiles
        rows, width = [(3, 5), (8, 37)][trial % 2]
        block, max_block_id = [(1, 9), (4, 40)][trial // 2 % 2]
        table = rng.integers(0, max_block_id + 1, (rows, width)).astype(np.int32)
        for _ in range(int(rng.integers(0, 3))):  # a few ids outside the pool, anywhere
            table[rng.integers(rows), rng.integers(width)] = rng.choice([-1, -(2**31), max_block_id + 1, 2**31 - 1])
        seq_lens = np.where(rng.random(rows) < 0.3, 0, rng.integers(0, width * block + 1, rows)).astype(np.int32)
        want = _reference(table, seq_lens, block, max_block_id)
        seen.add(want)
        assert _flag(name, table, seq_lens, block, max_block_id) == want, (trial, table, seq_lens, block)
    assert seen == {True, False}  # both answers were asked for


@pytest.mark.parametrize("name", FLAGS)
def test_an_id_past_the_used_columns_is_not_flagged(name):
    """B 4, seq_len 9: columns 0..2 are used. 77 in column 2 is flagged; in column 3 (negative
    control: the first column past the request) it is not, nor in a row outside the batch."""
    table = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32)
    seq_lens = np.array([9, 0], np.int32)
    for column, want in [(2, True), (3, False)]:
        bad = table.copy()
        bad[0, column] = 77
        assert _flag(name, bad, seq_lens, 4, 39) == want, column
    outside_batch = table.copy()
    outside_batch[1, 0] = -1
    assert not _flag(name, outside_batch, seq_lens, 4, 39)
    assert _flag(name, outside_batch, np.array([9, 1], np.int32), 4, 39)  # once row 1 is in the batch


def test_only_the_cpu_lowering_holds_the_conditional():
    """The maximum of every id, then the masked pass under a conditional, is CPU's: on a GPU a
    conditional syncs with the host, so CUDA and TPU lower the masked pass alone. Each lowering
    holds the platform switch's own case; the CPU one holds one more (the conditional)."""
    args = (jax.ShapeDtypeStruct((8, 16), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.int32))
    fn = jax.jit(_used_ids_outside, static_argnums=(2, 3))
    cases = {platform: jax.export.export(fn, platforms=(platform,))(*args, 4, 39).mlir_module().count(
        "stablehlo.case") for platform in ("cpu", "cuda", "tpu")}
    assert cases["cuda"] == cases["tpu"] >= 1 and cases["cpu"] == cases["cuda"] + 1, cases
