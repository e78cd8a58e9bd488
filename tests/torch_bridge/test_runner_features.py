"""torch_bridge with the runner features on: drafter target inputs, hybrid metadata, grammar rows, micro-batches.

The running example with every runner feature on is bridged with each strategy; every feature leaf
becomes a torch tensor (values and dtype checked against the step and against vLLM's worked
example), and with the packed strategy every one is a view of the one buffer.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_bridge  # noqa: E402
from jaxprep.array_packing import path_name  # noqa: E402
from jaxprep.features import DrafterConfig, HybridConfig  # noqa: E402
from support.bridge_checks import assert_views_of  # noqa: E402
from support.feature_batches import run_step  # noqa: E402
from support.runner_examples import running_config, running_example  # noqa: E402

TREES = ("drafter", "hybrid", "grammar", "ubatches")


@functools.cache
def prepared():
    config = running_config(drafter=DrafterConfig(), structured_outputs=True, num_ubatches=2,
                            hybrid=HybridConfig(num_speculative_blocks=2, chunk_size=4, checkpoints=True))
    arrays = running_example(config)
    arrays["grammar_index"] = np.array([-1, 2, 1, -1, -1, 0], np.int32)
    arrays["mamba_block_table"] = np.arange(1, 19, dtype=np.int32).reshape(6, 3)
    arrays["num_accepted_tokens"] = np.ones(6, np.int32)
    arrays["mamba_checkpoint_offsets"] = np.array([0, 0, 0, 3, 0, 0], np.int32)  # r1: 6 tokens, checkpoint at 3
    return config, run_step(arrays, config, "jit")


def leaves(tree) -> dict:
    """{field name: leaf} of a feature tree, named as the bridge names them."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {path_name(path): leaf for path, leaf in flat}


def paired(inputs, step) -> dict:
    pairs = {}
    for name in TREES:
        got, want = leaves({name: getattr(inputs, name)}), leaves({name: getattr(step, name)})
        assert got.keys() == want.keys(), name
        pairs.update({key: (got[key], want[key]) for key in want})
    return pairs


def expected_dtype(name: str):
    if name.startswith("ubatches.") and name.endswith((".positions", ".slot_mapping")):
        return torch.int64
    return torch.bool if name.split(".")[-1] in ("is_prefill_chunk", "is_prefilling", "has_initial_states_p",
                                                 "should_ubatch") else torch.int32


@pytest.mark.parametrize("strategy", ["packed", "per_field"])
def test_every_runner_feature_leaf_matches_the_step(strategy):
    _, step = prepared()
    inputs = torch_bridge.to_torch(step, strategy=strategy)
    pairs = paired(inputs, step)
    assert len(pairs) > 40
    for name, (tensor, array) in pairs.items():
        assert tensor.dtype == expected_dtype(name), name
        np.testing.assert_array_equal(tensor.cpu().numpy(), np.asarray(array), err_msg=name)
    if strategy == "packed":
        (buffer,) = inputs.jax_buffers
        assert_views_of(buffer, {name: tensor for name, (tensor, _) in pairs.items()})


def test_bridged_values_are_vllms_worked_examples():
    """The grammar mapping and the drafter's next prefill token of the running example, on the torch side."""
    _, step = prepared()
    inputs = torch_bridge.to_torch(step)
    assert inputs.grammar.mapping[:9].tolist() == [0, 1, 2, 6, 7, 8, 3, 4, 5]
    assert inputs.drafter.next_prefill_tokens.tolist() == [0, 0, 0, 30, 0, 0]
    assert inputs.hybrid.split.tolist() == [3, 1, 6, 6]
    # r1: C 4, checkpoint 3 tokens in (position 7), chunk 4 -> chunks [4, 7), [7, 8), [8, 10)
    assert inputs.hybrid.chunks.cu_chunk_seqlen[:4].tolist() == [0, 3, 4, 6]
    assert inputs.hybrid.chunks.checkpoint_chunk_indices.tolist() == [0, -1, -1, -1, -1, -1]
    first, second = inputs.ubatches.batches
    assert first.attn_metadata.query_start_loc.tolist() == [0, 3, 5, 6, 8, 8, 8]
    assert second.positions.tolist() == [6, 7, 8, 9, 0, 0, 0, 0] and second.positions.dtype == torch.int64
    assert inputs.ubatches.token_starts == (0, 8)
