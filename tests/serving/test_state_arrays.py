"""The serving state as three arrays (`jaxprep.serving.state_layout`, `jaxprep.serving.device_state`): every field
placed once and apart, read back as written, written only inside itself; the jitted transitions update the
arrays in place (no copy of a state array in their compiled programs) and the door's call passes 8 arrays."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprep import FeatureConfig, PrepConfig, SamplingConfig
from jaxprep.models.tiny import KVCache, ModelConfig, init_params
from jaxprep.serving import ServingConfig
from jaxprep.serving.config import NgramConfig
from jaxprep.serving.device_state import Cells, ServingState
from jaxprep.serving.state_layout import ARRAYS, empty_fields, extra_table_name, layout_of
from jaxprep.serving.step import serve_step, update_and_prepare_buffer
from jaxprep.serving.transitions import apply_packed, record_sampled
from jaxprep.serving.update_packing import step_payload_buckets
from jaxprep.state import BatchState
from support.all_features import ALL

PLAIN = ServingConfig(prep=PrepConfig(max_num_reqs=5, max_model_len=40, max_num_batched_tokens=32, block_size=4,
                                      num_blocks=60), vocab_size=100)
EVERY = ServingConfig(prep=dataclasses.replace(PLAIN.prep, features=ALL), num_speculative_tokens=2, vocab_size=100)
SPEC = ServingConfig(prep=dataclasses.replace(PLAIN.prep, features=FeatureConfig(num_speculative_tokens=2)),
                     num_speculative_tokens=2, vocab_size=100)
CONFIGS = {"plain": PLAIN, "every feature": EVERY, "spec decode": SPEC}


def random_fields(config: ServingConfig, seed: int) -> dict[str, np.ndarray]:
    """Every field of ``config``'s state filled with random values of its dtype (floats of every sign and size)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, value in empty_fields(config).items():
        if value.dtype == np.bool_:
            out[name] = rng.random(value.shape) < 0.5
        elif value.dtype == np.float32:
            out[name] = (rng.standard_normal(value.shape) * 10.0 ** rng.integers(-30, 30, value.shape)).astype(
                np.float32)
        else:
            out[name] = rng.integers(-2**31, 2**31, value.shape, dtype=np.int64).astype(np.int32)
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_every_field_is_placed_once_and_apart(name):
    layout = layout_of(CONFIGS[name])
    fields = empty_fields(CONFIGS[name])
    assert set(layout.by_name) == set(fields)
    taken = {array: np.zeros(layout.width(array), int) for array in ARRAYS}
    for field, place in layout.placements:
        taken[place.array][place.start:place.stop] += 1
        expected = fields[field].shape if place.shared else fields[field].shape[1:]
        assert place.shape == tuple(expected), field
    for array in ARRAYS:  # every column holds exactly one field (an empty array keeps one unused column)
        assert set(np.unique(taken[array])) <= {1} or layout.width(array) == 1, array
    assert len(jax.tree.leaves(ServingState.empty(CONFIGS[name]))) == 3


@pytest.mark.parametrize("name", CONFIGS)
def test_fields_read_back_as_written(name):
    config = CONFIGS[name]
    fields = random_fields(config, seed=1)
    state = ServingState.from_fields(layout_of(config), fields)
    host = state.to_numpy()
    for field, value in fields.items():
        if field.startswith("extra_block_tables["):
            got = host["extra_block_tables"][int(field[len("extra_block_tables["):-1])]
        elif field == "errors":
            got = host["errors"]
        else:
            got = host[field]
        np.testing.assert_array_equal(got.view(np.int32) if got.dtype == np.float32 else got,
                                      value.view(np.int32) if value.dtype == np.float32 else value, err_msg=field)
    # the batch view is the `BatchState` of the same values, field by field
    batch = state.batch
    assert isinstance(batch, BatchState)
    for f in dataclasses.fields(BatchState):
        value = getattr(batch, f.name)
        if f.name == "extra_block_tables" and value is not None:
            for g, table in enumerate(value):
                np.testing.assert_array_equal(np.asarray(table), fields[extra_table_name(g)])
        elif value is not None:
            np.testing.assert_array_equal(np.asarray(value), fields[f.name], err_msg=f.name)


def test_a_changed_word_is_seen():
    """Negative control of the round trip: one word of one array changed shows in exactly one field."""
    fields = random_fields(EVERY, seed=2)
    state = ServingState.from_fields(layout_of(EVERY), fields)
    place = state.layout["num_tokens"]
    changed = dataclasses.replace(state, rows=state.rows.at[3, place.start].add(1))
    before, after = state.to_numpy(), changed.to_numpy()
    differ = [name for name in before if not _same(before[name], after[name])]
    assert differ == ["num_tokens"]


def _same(a, b) -> bool:
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b))
    return np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("name", ["token_ids", "block_table", "num_blocks", "mrope_positions", "seeds",
                                  "prev_draft_token_ids", "lora_slots"])
def test_writes_outside_a_field_land_nowhere(name):
    """Rows and columns outside the field (or the state) are dropped, never written into a neighbour."""
    state = ServingState.from_fields(layout_of(EVERY), random_fields(EVERY, seed=3))
    place = state.layout[name]
    rows = 1 if place.shared else state.num_rows
    outside = [(-1, 0), (rows, 0), (0, -1), (0, place.width), (0, place.width + 7), (-5, place.width)]
    before = state.to_numpy()
    for row, col in outside:
        after = state.write_cells([Cells(name, jnp.int32(row), 7, jnp.int32(col))]).to_numpy()
        assert all(_same(before[k], after[k]) for k in before), (row, col)
    # control: a write inside the field changes that field, and only it
    after = state.write_cells([Cells(name, jnp.int32(0), 7, jnp.int32(place.width - 1))]).to_numpy()
    assert [k for k in before if not _same(before[k], after[k])] == [name]



def copies_of_state_arrays(lowered, state: ServingState, arrays=("tokens", "tables", "rows")) -> list[str]:
    """The ``copy`` instructions of a compiled program whose shape is one of the state's ``arrays``."""
    shapes = {f"s32[{getattr(state, a).shape[0]},{getattr(state, a).shape[1]}]" for a in arrays}
    text = lowered.compile().as_text()
    return [shape for shape in re.findall(r"= (s32\[[\d,]+\])\{[\d,]*\} copy\(", text) if shape in shapes]


@pytest.mark.parametrize("name", CONFIGS)
def test_transitions_update_the_arrays_in_place(name):
    """No compiled program of the door, the update or the record copies one of the state's arrays: each write
    is in place in the donated buffers (a copy of the token table each step would cost more than the step)."""
    config = CONFIGS[name]
    state = ServingState.empty(config)
    blob = np.zeros(step_payload_buckets(config)[-1], np.int32)
    rows = config.prep.num_reqs_padded(8)
    programs = {
        "door": update_and_prepare_buffer.lower(state, blob, config=config, num_tokens_padded=8),
        "update": apply_packed.lower(state, blob, config=config),
        "record": record_sampled.lower(state, np.zeros(rows, np.int32), np.zeros((rows, 3), np.int32),
                                       np.zeros(rows, np.int32)),
    }
    assert {program: copies_of_state_arrays(lowered, state) for program, lowered in programs.items()} == \
        dict.fromkeys(programs, [])


MODEL = ModelConfig(vocab_size=100, num_layers=1, d_model=16, num_heads=2, d_ff=32)
SAMPLING = ServingConfig(prep=dataclasses.replace(PLAIN.prep, features=FeatureConfig(
    sampling=SamplingConfig(vocab_size=100))), vocab_size=100)
NGRAM = dataclasses.replace(SPEC, ngram=NgramConfig(prompt_lookup_min=1, prompt_lookup_max=2))


@pytest.mark.parametrize("config", [SAMPLING, NGRAM], ids=["sampling", "spec decode"])
def test_the_serving_step_never_copies_the_wide_tables(config):
    """`serve_step` runs its iterations in a while loop, which carries the state; XLA copies the small ``rows``
    there, never the token table (with the sampler's vocabulary-wide bins) or the block tables."""
    state = ServingState.empty(config)
    lowered = serve_step.lower(state, KVCache.zeros(MODEL, config.prep.num_blocks, config.block_size),
                               init_params(MODEL, 0), np.zeros(step_payload_buckets(config)[-1], np.int32),
                               config=config, model=MODEL, num_tokens_padded=8)
    assert copies_of_state_arrays(lowered, state, ("tokens", "tables")) == []
    assert state.layout.width("rows") < 32  # what a copy of rows costs: a few words per row


def test_the_copy_detector_sees_a_copy():
    """Negative control: a program that reads the old rows after writing them must keep a copy."""
    state = ServingState.empty(PLAIN)

    @jax.jit
    def reads_old_after_write(state):
        new = state.replace(num_tokens=state.field("num_computed_tokens") + 1)
        return new, new.rows + state.rows  # the old rows are still needed after the in-place write

    lowered = jax.jit(reads_old_after_write, donate_argnums=0).lower(state)
    assert copies_of_state_arrays(lowered, state)


def test_the_doors_call_passes_eight_arrays():
    """The state (3 arrays) and the packed update in, the state and the step's one buffer out."""
    config = EVERY
    state = ServingState.empty(config)
    blob = np.zeros(step_payload_buckets(config)[-1], np.int32)
    out = jax.eval_shape(lambda s, b: update_and_prepare_buffer(s, b, config=config, num_tokens_padded=8), state, blob)
    assert len(jax.tree.leaves((state, blob))) + len(jax.tree.leaves(out)) == 8


def test_a_state_of_the_wrong_shape_or_dtype_is_refused_naming_the_array():
    """Built directly, or rebuilt by JAX from arrays a caller changed (`jax.tree.map`), a state whose arrays do
    not match its layout raises, naming the array and the shape it needed; a jitted call's state rebuilds."""
    state = ServingState.empty(PLAIN)
    rows, width = state.tables.shape
    wider = rf"ServingState.tables has shape \({rows}, {width + 1}\).*\[{rows}, {width}\]"
    with pytest.raises(ValueError, match=wider):
        ServingState(tokens=state.tokens, tables=jnp.zeros((rows, width + 1), jnp.int32), rows=state.rows,
                     layout=state.layout)
    with pytest.raises(ValueError, match=r"ServingState.rows has shape .* and dtype int64"):
        ServingState(tokens=state.tokens, tables=state.tables, rows=np.zeros(state.rows.shape, np.int64),
                     layout=state.layout)
    with pytest.raises(ValueError, match=rf"ServingState.tokens has shape \({rows}, 1\)"):
        jax.tree.map(lambda array: array[:, :1], state)  # every array one column wide
    with pytest.raises(ValueError, match=r"ServingState.tokens has shape \(\)"):
        jax.tree.map(lambda array: array[0, 0], state)
    rebuilt = jax.jit(lambda s: s)(state)
    assert rebuilt.layout is state.layout and type(rebuilt) is ServingState
    assert all(np.array_equal(getattr(rebuilt, name), getattr(state, name)) for name in ARRAYS)
    assert [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]] == \
        [f".{name}" for name in ARRAYS]
