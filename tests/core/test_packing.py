"""`jaxprep.array_packing` on the host side, and the field shapes read from the step's annotations."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import BatchState, PrepConfig, prepare_padded
from jaxprep.array_packing import BOOL, INT32, INT64, layout, pack, pack_host, unpack
from jaxprep.metadata import STEP_FIELDS, step_field_shapes, step_fields

KINDS = (INT32, INT64, BOOL)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_numpy_unpack_round_trips_every_kind(data):
    """A jitted pack, then NumPy views of the fetched words: each field back with its values and shape."""
    fields = data.draw(st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 3), st.integers(1, 3)),
                                min_size=1, max_size=5))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    arrays, spec = {}, []
    for i, (kind, rows, cols) in enumerate(fields):
        shape = (rows, cols) if i % 2 else (rows * cols,)
        values = rng.integers(0, 2, shape).astype(bool) if kind == BOOL else rng.integers(-(2**31), 2**31 - 1, shape)
        arrays[f"f{i}"] = values.astype(bool if kind == BOOL else np.int32)
        spec.append((f"f{i}", kind))
    words = np.asarray(pack(arrays, tuple(spec)))
    views = unpack(words, layout(tuple((name, arrays[name].shape, kind) for name, kind in spec)))
    for name, kind in spec:
        want = arrays[name].astype(np.int64) if kind == INT64 else arrays[name]
        assert views[name].dtype == want.dtype and views[name].shape == want.shape, name
        np.testing.assert_array_equal(views[name], want, err_msg=name)
        assert views[name].size == 0 or np.shares_memory(views[name], words), f"{name} is a copy"


def test_pack_host_equals_the_jitted_pack_for_int32_fields():
    arrays = {"rows": np.array([3, -1, 2, -1], np.int32), "token_ids": np.arange(12, dtype=np.int32).reshape(3, 4),
              "count": np.array(7, np.int32)}
    spec = tuple((name, INT32) for name in arrays)
    spans = layout(tuple((name, value.shape, INT32) for name, value in arrays.items()))
    host = pack_host(arrays, spans)
    np.testing.assert_array_equal(host, np.asarray(pack(arrays, spec)))
    assert host.tolist() == [3, -1, 2, -1, *range(12), 7, 0]  # 17 words, rounded up to 18


def test_step_field_shapes_match_a_prepared_step():
    """The shapes read from the jaxtyping annotations are the shapes `prepare_padded` returns."""
    config = PrepConfig(max_num_reqs=5, max_model_len=24, max_num_batched_tokens=16, block_size=4)
    step = prepare_padded(BatchState.empty(config), config, 8)
    shapes = step_field_shapes(num_tokens_padded=8, num_reqs_padded=5, max_blocks_per_req=config.max_blocks_per_req)
    assert tuple(shapes) == STEP_FIELDS
    assert {name: tuple(value.shape) for name, value in step_fields(step).items()} == shapes
    assert shapes["query_start_loc"] == (6,) and shapes["num_reqs"] == () and shapes["block_table"] == (5, 32)
