"""torch_bridge.to_torch: names, dtypes and values against the NumPy reference; zero copy by pointer."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxprep  # noqa: E402
import torch_bridge  # noqa: E402
from jaxprep.metadata import SCALAR_FIELDS  # noqa: E402
from jaxprep.reference import pad_reference, prepare_reference  # noqa: E402
from jaxprep.walkthrough.examples import example_a_config, example_a_step1, example_a_step2, example_b, example_b_config  # noqa: E402
from support.bridge_checks import JAX_TORCH_DEVICE, assert_views_of  # noqa: E402

STRATEGIES = ("packed", "per_field")
EXAMPLES = {
    "A1": (example_a_config, example_a_step1),
    "A2": (example_a_config, example_a_step2),
    "B": (example_b_config, example_b),
}
TORCH_DTYPES = {  # vLLM's dtypes on the CUDA/CPU path
    "input_ids": torch.int32, "positions": torch.int64, "logits_indices": torch.int32, "idx_mapping": torch.int32,
    "query_start_loc": torch.int32, "seq_lens": torch.int32, "block_table_tensor": torch.int32,
    "slot_mapping": torch.int64,
}


def prepared(example: str):
    config_fn, arrays_fn = EXAMPLES[example]
    config, arrays = config_fn(), arrays_fn()
    step = jaxprep.prepare_inputs(jaxprep.BatchState.from_numpy(**arrays), config)
    ref = prepare_reference(**arrays, block_size=config.block_size)
    num_tokens_padded = config.bucket_for(ref["num_actual_tokens"])
    return step, pad_reference(ref, num_tokens_padded, config.num_reqs_padded(num_tokens_padded))


def torch_fields(inputs) -> dict:
    meta = inputs.attn_metadata
    fields = {name: getattr(inputs, name) for name in ("input_ids", "positions", "logits_indices", "idx_mapping")}
    fields.update({name: getattr(meta, name) for name in
                   ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping")})
    return fields


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_to_torch_matches_reference(example, strategy):
    step, expected = prepared(example)
    inputs = torch_bridge.to_torch(step, strategy=strategy)
    expected["block_table_tensor"] = expected.pop("block_table")
    for name, tensor in torch_fields(inputs).items():
        assert tensor.dtype == TORCH_DTYPES[name], name
        assert tensor.device.type == JAX_TORCH_DEVICE
        np.testing.assert_array_equal(tensor.cpu().numpy(), expected[name], err_msg=name)
    meta = inputs.attn_metadata
    for name in SCALAR_FIELDS:
        assert type(getattr(meta, name)) is int and getattr(meta, name) == expected[name], name
    np.testing.assert_array_equal(meta.query_start_loc_cpu.cpu().numpy(), expected["query_start_loc"])
    np.testing.assert_array_equal(meta.seq_lens_cpu.cpu().numpy(), expected["seq_lens"])
    assert meta.query_start_loc_cpu.device.type == "cpu" and meta.seq_lens_cpu.dtype == torch.int32
    assert inputs.num_tokens_padded == step.num_tokens_padded and meta.causal is True


def test_spec_example_a_step2_literal():
    """docs/semantics.md#example-a-step-2-padded: example A step 2 padded to 8 tokens (3 request rows here: max_num_reqs
    = 3)."""
    step, _ = prepared("A2")
    inputs = torch_bridge.to_torch(step)
    meta = inputs.attn_metadata
    assert inputs.positions.tolist() == [3, 2, 5, 6, 7, 0, 0, 0]
    assert meta.slot_mapping.tolist() == [5, 14, 13, 16, 17, -1, -1, -1]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 5]
    assert meta.seq_lens.tolist() == [4, 3, 8]
    assert (meta.num_reqs, meta.num_actual_tokens, meta.max_query_len, meta.max_seq_len) == (3, 5, 3, 8)


def test_per_field_int32_fields_share_memory_with_the_step():
    step, _ = prepared("B")
    inputs = torch_bridge.to_torch(step, strategy="per_field")
    arrays = torch_bridge.step_arrays(step)
    fields = torch_fields(inputs)
    for name in ("input_ids", "logits_indices", "idx_mapping", "query_start_loc", "seq_lens", "block_table_tensor"):
        assert fields[name].data_ptr() == arrays[name].unsafe_buffer_pointer(), name
    host_mirror = inputs.attn_metadata.query_start_loc_cpu
    if JAX_TORCH_DEVICE == "cpu":  # the host mirror is JAX's own host buffer
        assert host_mirror.data_ptr() == arrays["query_start_loc"].unsafe_buffer_pointer()
    else:  # one device-to-host copy
        assert host_mirror.device.type == "cpu"
        assert host_mirror.tolist() == inputs.attn_metadata.query_start_loc.tolist()
    for name in ("positions", "slot_mapping"):  # int64 casts copy
        assert fields[name].data_ptr() != arrays[name].unsafe_buffer_pointer(), name


def test_packed_fields_are_views_of_one_jax_buffer():
    step, _ = prepared("B")
    inputs = torch_bridge.to_torch(step, strategy="packed")
    (buffer,) = inputs.jax_buffers
    assert_views_of(buffer, torch_fields(inputs))  # the int64 fields too: no cast, no copy
    meta = inputs.attn_metadata
    if JAX_TORCH_DEVICE == "cpu":  # the host mirrors are views too; on a GPU they are one copy of the buffer's tail
        assert_views_of(buffer, dict(qsl_cpu=meta.query_start_loc_cpu, seq_lens_cpu=meta.seq_lens_cpu), disjoint=False)
    assert meta.query_start_loc_cpu.device.type == "cpu" and meta.seq_lens_cpu.device.type == "cpu"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FakeSpecDecode:
    """Stands in for the features branch's spec-decode pytree: arrays plus a static field."""

    draft_token_ids: jax.Array
    cu_num_draft_tokens: jax.Array
    max_spec_len: int = dataclasses.field(metadata=dict(static=True))


def with_features(step, **features):
    """A step-like object: the step's attributes plus the given optional features."""
    names = ("input_ids", "positions", "logits_indices", "idx_mapping", "attn_metadata", "num_tokens_padded")
    return types.SimpleNamespace(**{name: getattr(step, name) for name in names}, **features)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_spec_decode_arrays_are_converted_generically(strategy):
    step, _ = prepared("A2")
    spec = FakeSpecDecode(draft_token_ids=jnp.array([37, 38], jnp.int32),
                          cu_num_draft_tokens=jnp.array([0, 0, 2], jnp.int32), max_spec_len=2)
    inputs = torch_bridge.to_torch(with_features(step, spec_decode=spec), strategy=strategy)
    assert isinstance(inputs.spec_decode, FakeSpecDecode) and inputs.spec_decode.max_spec_len == 2
    assert inputs.spec_decode.draft_token_ids.tolist() == [37, 38]
    assert inputs.spec_decode.cu_num_draft_tokens.dtype == torch.int32
    shared = inputs.spec_decode.draft_token_ids.untyped_storage().data_ptr()
    source = spec.draft_token_ids if strategy == "per_field" else inputs.jax_buffers[0]  # packed: in the buffer
    assert shared == source.unsafe_buffer_pointer()
    assert torch_bridge.to_torch(step).spec_decode is None


def test_leaves_that_are_not_int32_or_bool_are_converted_on_their_own():
    step, _ = prepared("A2")
    spec = FakeSpecDecode(draft_token_ids=jnp.array([0.5, 1.5], jnp.float32),
                          cu_num_draft_tokens=jnp.array([0, 0, 2], jnp.int32), max_spec_len=2)
    inputs = torch_bridge.to_torch(with_features(step, spec_decode=spec))
    assert inputs.spec_decode.draft_token_ids.dtype == torch.float32
    assert inputs.spec_decode.draft_token_ids.data_ptr() == spec.draft_token_ids.unsafe_buffer_pointer()
    assert inputs.spec_decode.cu_num_draft_tokens.tolist() == [0, 0, 2]


def test_attn_state_and_mask_pass_through_and_keyword_overrides():
    step, _ = prepared("A2")
    mask = jnp.triu(jnp.ones((4, 4), jnp.int8), k=1)
    inputs = torch_bridge.to_torch(with_features(step, attn_state=jnp.int32(3), attn_mask=mask))
    assert inputs.attn_metadata.attn_state == 3 and type(inputs.attn_metadata.attn_state) is int
    assert inputs.attn_metadata.attn_mask.dtype == torch.int8
    np.testing.assert_array_equal(inputs.attn_metadata.attn_mask.cpu().numpy(), np.triu(np.ones((4, 4)), 1))
    overridden = torch_bridge.to_torch(with_features(step, attn_state=jnp.int32(3)), attn_state=2)
    assert overridden.attn_metadata.attn_state == 2 and overridden.attn_metadata.attn_mask is None


def test_unknown_strategy_is_rejected():
    step, _ = prepared("A2")
    with pytest.raises(ValueError, match="strategy must be one of"):
        torch_bridge.to_torch(step, strategy="fastest")


def test_missing_torch_names_the_extra():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None
        try:
            import torch_bridge
        except ImportError as error:
            print(error)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install jaxprep[torch]" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available() or jax.default_backend() != "gpu", reason="needs CUDA torch and JAX")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_handoff_is_zero_copy_and_matches_reference(strategy):  # pragma: no cover - no GPU in CI
    step, expected = prepared("B")
    inputs = torch_bridge.to_torch(step, strategy=strategy)
    torch.cuda.current_stream().synchronize()
    assert inputs.input_ids.device.type == "cuda"
    assert inputs.attn_metadata.seq_lens_cpu.device.type == "cpu"
    np.testing.assert_array_equal(inputs.positions.cpu().numpy(), expected["positions"])
    np.testing.assert_array_equal(inputs.attn_metadata.slot_mapping.cpu().numpy(), expected["slot_mapping"])
    if strategy == "per_field":
        assert inputs.input_ids.data_ptr() == step.input_ids.unsafe_buffer_pointer()
    else:
        assert inputs.input_ids.untyped_storage().data_ptr() == inputs.jax_buffers[0].unsafe_buffer_pointer()
