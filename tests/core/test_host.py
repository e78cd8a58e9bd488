"""`prepare_to_host` returns the same step as `prepare_padded`, as NumPy views of one buffer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprep import BatchState, PrepConfig, prepare_padded
from jaxprep._ragged import F32_EXACT_BOUND, prefix_sum
from jaxprep.array_packing import num_packed_words, unpack
from jaxprep.metadata import STEP_FIELDS, AttentionMetadata, StepInputs, step_fields, step_from_fields
from jaxprep.prepare import host_layout, host_views, prepare_to_host
from support.batches import numpy_batches
from support.expect import assert_step_matches_reference

CONFIG = PrepConfig(max_num_reqs=12, max_model_len=96, max_num_batched_tokens=300, block_size=8)


def test_host_step_matches_device_step_and_reference():
    stream = numpy_batches(CONFIG, seed=11)
    for _ in range(200):
        arrays = next(stream)
        bucket = CONFIG.bucket_for(int(arrays["num_scheduled_tokens"].sum()))
        host = prepare_to_host(BatchState.from_numpy(**arrays), CONFIG, bucket)
        device = step_fields(prepare_padded(BatchState.from_numpy(**arrays), CONFIG, bucket))
        for name, value in step_fields(host).items():
            assert isinstance(value, np.ndarray), name
            np.testing.assert_array_equal(value, device[name], err_msg=name)
        assert_step_matches_reference(host, arrays, CONFIG)


def test_host_layout_example():
    """8 tokens, 3 request rows: every field but the block table, end to end, scalars one word each."""
    spans = host_layout(8, 3)
    assert [(s.name, s.offset, s.shape) for s in spans] == [
        ("input_ids", 0, (8,)), ("positions", 8, (8,)), ("logits_indices", 16, (3,)), ("idx_mapping", 19, (3,)),
        ("errors", 22, ()), ("query_start_loc", 23, (4,)), ("seq_lens", 27, (3,)), ("slot_mapping", 30, (8,)),
        ("num_actual_tokens", 38, ()), ("num_reqs", 39, ()), ("max_query_len", 40, ()), ("max_seq_len", 41, ())]


def test_host_views_are_the_layouts_unpacked_fields():
    """`host_views` cuts the same views as `unpack` of `host_layout` (words numbered, so an offset or a length
    off by one reads other values); negative control: the views of another bucket's layout differ."""
    spans = host_layout(8, 3)
    words = np.arange(num_packed_words(spans) + 8, dtype=np.int32)  # room for the control's longer layout
    want = unpack(words, spans)
    got = {name: words[index] for name, index in host_views(8, 3)}
    assert list(got) == list(want)
    for name, view in got.items():
        assert view.shape == want[name].shape and np.shares_memory(view, words), name
        np.testing.assert_array_equal(view, want[name], err_msg=name)
    other = {name: words[index] for name, index in host_views(8, 4)}
    assert not all(np.array_equal(other[name], want[name]) for name in want)


def _dataclass_attributes(obj) -> dict:
    return {name: (_dataclass_attributes(value) if isinstance(value, AttentionMetadata) else value)
            for name, value in vars(obj).items()}


def test_step_from_fields_builds_what_the_constructors_build():
    """`step_from_fields` fills the frozen dataclasses' ``__dict__`` directly; the result has every attribute
    ``__init__`` would give (the same objects, the defaults included) and the same pytree. That holds because
    neither class has a ``__post_init__`` or a default factory (asserted: one would be skipped). Negative
    control: a step whose one default differs is told apart."""
    for cls in (StepInputs, AttentionMetadata):
        assert not hasattr(cls, "__post_init__"), cls
        assert all(f.default_factory is dataclasses.MISSING for f in dataclasses.fields(cls)), cls
    fields = {name: np.full(3, i, np.int32) for i, name in enumerate(STEP_FIELDS)}
    meta_names = [f.name for f in dataclasses.fields(AttentionMetadata) if f.default is dataclasses.MISSING]
    meta = AttentionMetadata(**{name: fields[name] for name in meta_names})
    built = StepInputs(**{name: fields[name] for name in STEP_FIELDS if name not in meta_names},
                       attn_metadata=meta, num_tokens_padded=16)
    fast = step_from_fields(fields, 16)
    want = _dataclass_attributes(built)
    assert _dataclass_attributes(fast).keys() == want.keys()
    for name, value in _dataclass_attributes(fast).items():
        if isinstance(value, dict):
            assert value.keys() == want[name].keys() and all(value[k] is want[name][k] for k in value), name
        else:
            assert value is want[name], name
    assert jax.tree.structure(fast) == jax.tree.structure(built)
    assert dataclasses.replace(fast, num_tokens_padded=32).num_tokens_padded == 32  # still a dataclass
    changed = _dataclass_attributes(dataclasses.replace(built, attn_state=fields["errors"]))
    assert any(changed[name] is not want[name] for name in want if name != "attn_metadata")


@pytest.mark.parametrize("length", [1, 31, 32, 33, 63, 64, 127, 1000, 1024, 1025, 4096, 33000])
def test_prefix_sum_matches_numpy(length):
    values = np.random.default_rng(length).integers(0, 5, (2, length)).astype(np.int32)
    scan = jax.jit(prefix_sum, static_argnums=1)
    total = int(values.sum(axis=1).max())
    np.testing.assert_array_equal(scan(values, total), np.cumsum(values, axis=1))
    np.testing.assert_array_equal(scan(values[0], total), np.cumsum(values[0]))


def test_prefix_sum_exact_near_the_float32_bound():
    """Totals just below 2**24 are still exact; a larger bound falls back to the integer scan."""
    values = np.full(64, (F32_EXACT_BOUND - 1) // 64, np.int32)
    np.testing.assert_array_equal(prefix_sum(jnp.asarray(values), F32_EXACT_BOUND - 1), np.cumsum(values))
    big = np.full(4, 2**28, np.int32)
    np.testing.assert_array_equal(prefix_sum(jnp.asarray(big), 2**30), np.cumsum(big))
