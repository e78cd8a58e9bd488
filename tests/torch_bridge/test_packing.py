"""torch_bridge.array_views: the packed layout, int64 word pairs, and views that round-trip any field mix."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from jaxprep.array_packing import BOOL, FLOAT32, INT32, INT64, layout, num_packed_words, pack  # noqa: E402
from torch_bridge.array_views import unpack  # noqa: E402

KINDS = (INT32, INT64, BOOL)


def test_layout_aligns_wide_fields_to_even_words():
    a, b, c = layout((("a", (3,), INT32), ("b", (2,), INT64), ("c", (2, 2), INT32)))
    assert (a.offset, a.num_words) == (0, 3)
    assert (b.offset, b.num_words) == (4, 4)  # one pad word after a
    assert (c.offset, c.num_words, c.shape) == (8, 4, (2, 2))
    assert num_packed_words((a, b, c)) == 12


def test_wide_fields_are_int64_sign_extensions():
    arrays = {"odd": jnp.array([1, 2, 3], jnp.int32), "slots": jnp.array([9, -1, 2**31 - 1, -(2**31)], jnp.int32)}
    spec = (("odd", INT32), ("slots", INT64))
    words = np.asarray(pack(arrays, spec))
    assert words[:3].tolist() == [1, 2, 3] and words[3] == 0
    assert words[4:12].tolist() == [9, 0, -1, -1, 2**31 - 1, 0, -(2**31), -1]
    views = unpack(torch.from_dlpack(pack(arrays, spec)), layout((("odd", (3,), INT32), ("slots", (4,), INT64))))
    assert views["slots"].dtype == torch.int64
    assert views["slots"].tolist() == [9, -1, 2**31 - 1, -(2**31)]


def test_bool_fields_are_bytes_four_to_a_word():
    """[T, F, T, T, F] -> bytes 1,0,1,1 | 0,0,0,0 (two words); the view is bool without a copy."""
    arrays = {"mask": jnp.array([True, False, True, True, False]), "after": jnp.array([7], jnp.int32)}
    spec = (("mask", BOOL), ("after", INT32))
    buffer = torch.from_dlpack(pack(arrays, spec))
    assert buffer.view(torch.uint8)[:8].tolist() == [1, 0, 1, 1, 0, 0, 0, 0] and buffer[2] == 7
    views = unpack(buffer, layout((("mask", (5,), BOOL), ("after", (1,), INT32))))
    assert views["mask"].dtype == torch.bool and views["mask"].tolist() == [True, False, True, True, False]
    assert views["mask"].data_ptr() == buffer.data_ptr()


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="kind must be"):
        layout((("a", (3,), "float16"),))


def test_float32_field_is_a_view_of_its_bit_patterns():
    """A FLOAT32 field travels as its values' bit patterns ([1.0, -0.5] -> words 0x3F800000, 0xBF000000)
    and comes back as a float32 view of the same memory, bit for bit (NaN included)."""
    values = np.array([1.0, -0.5, np.nan, 3.25e-7], np.float32)
    arrays = {"ids": jnp.array([4, 5], jnp.int32), "temperature": jnp.asarray(values)}
    buffer = torch.from_dlpack(pack(arrays, (("ids", INT32), ("temperature", FLOAT32))))
    assert buffer[2:4].tolist() == [0x3F800000, np.int32(np.uint32(0xBF000000))]
    views = unpack(buffer, layout((("ids", (2,), INT32), ("temperature", (4,), FLOAT32))))
    got = views["temperature"]
    assert got.dtype == torch.float32 and got.data_ptr() == buffer.data_ptr() + 8
    assert got.numpy().view(np.int32).tolist() == values.view(np.int32).tolist()
    assert views["ids"].tolist() == [4, 5]


field = st.tuples(st.lists(st.integers(0, 4), min_size=0, max_size=2), st.sampled_from(KINDS))


@settings(max_examples=30, deadline=None)
@given(fields=st.lists(field, min_size=1, max_size=5), seed=st.integers(0, 2**16), tail_from=st.integers(0, 4))
def test_unpack_round_trips_matches_numpy(fields, seed, tail_from):
    rng = np.random.default_rng(seed)
    arrays, spec = {}, []
    for index, (shape, kind) in enumerate(fields):
        name = f"f{index}"
        values = rng.integers(-(2**31), 2**31, size=tuple(shape), dtype=np.int64).astype(np.int32)
        arrays[name] = values % 2 == 0 if kind == BOOL else values
        spec.append((name, kind))
    spec = tuple(spec)
    spans = layout(tuple((name, arrays[name].shape, kind) for name, kind in spec))
    buffer = torch.from_dlpack(pack({k: jnp.asarray(v) for k, v in arrays.items()}, spec))
    assert buffer.numel() == num_packed_words(spans) and buffer.numel() % 2 == 0
    for name, view in unpack(buffer, spans).items():
        assert view.dtype == {INT32: torch.int32, INT64: torch.int64, BOOL: torch.bool}[dict(spec)[name]]
        assert view.shape == arrays[name].shape
        np.testing.assert_array_equal(view.cpu().numpy(), arrays[name], err_msg=name)
    # a copy of the buffer's tail, as on CUDA hosts: views of the int32 and bool spans past a cut
    tail = tuple(span for span in spans[tail_from:] if span.kind != INT64)
    if tail:
        start = tail[0].offset
        for name, view in unpack(buffer[start:].clone(), tail, base=start).items():
            np.testing.assert_array_equal(view.cpu().numpy(), arrays[name], err_msg=name)
