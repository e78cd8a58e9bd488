"""`BatchState` as a pytree: registered with its own rebuild (`jaxprep.state._rebuild`), not
`jax.tree_util.register_dataclass`, so that JAX's rebuild from a jitted call's outputs skips the frozen
``__init__``'s per-field setattrs. These tests pin what the dataclass registration gave: every field a
child in field order, keyed ``.name``, a rebuild holding the very leaves, and the leaf checks on rebuild.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprep import BatchState

CORE = dict(token_ids=np.zeros((3, 8), np.int32), block_table=np.zeros((3, 2), np.int32),
            num_computed_tokens=np.zeros(3, np.int32), num_scheduled_tokens=np.ones(3, np.int32))
FIELDS = [f.name for f in dataclasses.fields(BatchState)]


def test_children_are_every_field_in_order_keyed_by_name():
    state = BatchState.from_numpy(**CORE, num_draft_tokens=np.zeros(3, np.int32))
    children, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: x is None)
    assert [jax.tree_util.keystr(path) for path, _ in children] == [f".{name}" for name in FIELDS]
    assert all(value is getattr(state, name) for (_, value), name in zip(children, FIELDS))


def test_a_rebuild_holds_the_same_leaves_and_compares_equal_in_structure():
    state = BatchState.from_numpy(**CORE, lora_ids=np.zeros(3, np.int32))
    leaves, tree = jax.tree.flatten(state)
    rebuilt = jax.tree.unflatten(tree, leaves)
    assert type(rebuilt) is BatchState and list(vars(rebuilt)) == FIELDS
    assert all(getattr(rebuilt, name) is getattr(state, name) for name in FIELDS)
    assert jax.tree.structure(rebuilt) == tree == jax.tree.structure(BatchState.from_numpy(
        **CORE, lora_ids=np.ones(3, np.int32)))
    assert jax.tree.structure(BatchState.from_numpy(**CORE)) != tree  # another feature set: another tree
    with pytest.raises(dataclasses.FrozenInstanceError):
        rebuilt.token_ids = None


def test_a_rebuilt_state_is_checked_like_a_constructed_one():
    """The outputs of a jit are rebuilt through `_rebuild`, which checks the leaves as ``__post_init__``
    does. Negative control: the same program keeping the int32 table returns a state."""
    state = BatchState.from_numpy(**CORE)
    kept = jax.jit(lambda s: dataclasses.replace(s, num_computed_tokens=s.num_computed_tokens + 1))(state)
    np.testing.assert_array_equal(kept.num_computed_tokens, 1)
    with pytest.raises(TypeError, match="num_computed_tokens has dtype float32, expected int32"):
        jax.jit(lambda s: dataclasses.replace(s, num_computed_tokens=s.num_computed_tokens.astype(jnp.float32)))(
            state)
    leaves, tree = jax.tree.flatten(state)
    with pytest.raises(ValueError, match="num_scheduled_tokens has 2 rows, but token_ids has 3"):
        jax.tree.unflatten(tree, leaves[:3] + [jnp.ones(2, jnp.int32)])


def test_tracers_and_shape_structs_rebuild_unchecked():
    state = BatchState.from_numpy(**CORE)
    shapes = jax.eval_shape(lambda s: s, state)
    assert isinstance(shapes, BatchState) and shapes.token_ids.shape == (3, 8)
    assert jax.jit(lambda s: s.num_scheduled_tokens.sum())(state) == 3
