"""What `to_torch` refuses before it moves anything: a device it cannot target (named in our own words,
not torch's "Cannot access accelerator device"), a step whose fields come from two buckets or two
configs, or whose num_tokens_padded was relabelled; and a `prepare_to_host` step (NumPy fields) is bridged."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxprep  # noqa: E402
import torch_bridge  # noqa: E402
from jaxprep.reference import pad_reference, prepare_reference  # noqa: E402
from jaxprep.walkthrough.examples import (  # noqa: E402
    example_a_config,
    example_a_step2,
    example_b,
    example_b_config,
)

CORE = ("input_ids", "positions", "logits_indices", "idx_mapping")
METADATA = ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping", "query_start_loc_cpu", "seq_lens_cpu")


def _step(config=None, num_tokens_padded=None):
    """Example A step 2: 5 tokens in the bucket of 8 (larger buckets exist)."""
    config = config or example_a_config()
    return jaxprep.prepare_inputs(jaxprep.BatchState.from_numpy(**example_a_step2()), config,
                                  num_tokens_padded=num_tokens_padded)


BAD_DEVICES = {
    "bogus": "device 'bogus' is not a device torch_bridge can target",
    "CPU": "device 'CPU' is not a device torch_bridge can target (lower case: 'cpu')",
    "meta": "device 'meta' is not one torch_bridge can target: a meta tensor holds no data",
    3: "device 3 is not a device torch_bridge can target (a CUDA ordinal? give 'cuda:3')",
    1.5: "device 1.5 is not a device torch_bridge can target",
}


@pytest.mark.parametrize("device", BAD_DEVICES, ids=str)
def test_a_bad_device_is_named_in_our_words(device):
    with pytest.raises(ValueError, match=re.escape(f"to_torch: {BAD_DEVICES[device]}")):
        torch_bridge.to_torch(_step(), device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a host without CUDA")
def test_cuda_without_a_gpu_is_named():
    with pytest.raises(ValueError, match=re.escape("device 'cuda:0': torch sees no CUDA device")):
        torch_bridge.to_torch(_step(), "cuda:0")


@pytest.mark.parametrize("device", [None, "cpu", "cpu:0", torch.device("cpu")], ids=str)
def test_good_devices_are_taken(device):
    """Control: the check refuses only what it should."""
    inputs = torch_bridge.to_torch(_step(), device)
    assert inputs.input_ids.device.type == "cpu" or device is None


def _mixed(name: str):
    """A step with one field swapped for the same field of a step that does not agree with it."""
    step = _step()
    bigger = next(b for b in example_a_config().token_buckets if b > step.num_tokens_padded)
    other_bucket = _step(num_tokens_padded=bigger)
    wider = jaxprep.prepare_inputs(jaxprep.BatchState.from_numpy(**example_b()), example_b_config())  # 5 rows, not 3
    if name == "relabelled num_tokens_padded":
        return dataclasses.replace(step, num_tokens_padded=bigger), "input_ids has shape"
    if name == "input_ids of another bucket":
        return dataclasses.replace(step, input_ids=other_bucket.input_ids), "input_ids has shape"
    if name == "slot_mapping of another bucket":
        meta = dataclasses.replace(step.attn_metadata, slot_mapping=other_bucket.attn_metadata.slot_mapping)
        return dataclasses.replace(step, attn_metadata=meta), "slot_mapping has shape"
    if name == "seq_lens of another config":
        meta = dataclasses.replace(step.attn_metadata, seq_lens=wider.attn_metadata.seq_lens)
        return dataclasses.replace(step, attn_metadata=meta), "seq_lens has shape"
    raise KeyError(name)


@pytest.mark.parametrize("strategy", ["packed", "per_field"])
@pytest.mark.parametrize("name", ["relabelled num_tokens_padded", "input_ids of another bucket",
                                  "slot_mapping of another bucket", "seq_lens of another config"])
def test_fields_that_disagree_are_refused(name, strategy):
    step, message = _mixed(name)
    with pytest.raises(ValueError, match=re.escape(f"the step's fields disagree: {message}")):
        torch_bridge.to_torch(step, strategy=strategy)


def test_the_refused_fields_really_differ_in_shape():
    """Negative control of the cases above: the swapped field is not the step's own shape."""
    step = _step()
    bigger = next(b for b in example_a_config().token_buckets if b > step.num_tokens_padded)
    assert _step(num_tokens_padded=bigger).input_ids.shape != step.input_ids.shape
    torch_bridge.to_torch(step)  # the step as prepare_inputs returned it bridges


@pytest.mark.parametrize("strategy", ["packed", "per_field"])
def test_a_prepare_to_host_step_is_bridged_with_the_reference_values(strategy):
    """`prepare_to_host` returns NumPy fields: they used to fail with "'numpy.ndarray' object has no
    attribute 'is_deleted'". Its tensors equal the NumPy reference, as the device step's do."""
    config, arrays = example_b_config(), example_b()
    ref = prepare_reference(**arrays, block_size=config.block_size)
    padded = config.bucket_for(ref["num_actual_tokens"])
    expected = pad_reference(ref, padded, config.num_reqs_padded(padded))
    expected["block_table_tensor"] = expected.pop("block_table")
    expected["query_start_loc_cpu"], expected["seq_lens_cpu"] = expected["query_start_loc"], expected["seq_lens"]
    host = jaxprep.prepare_to_host(jaxprep.BatchState.from_numpy(**arrays), config, padded)
    assert isinstance(host.input_ids, np.ndarray)
    inputs = torch_bridge.to_torch(host, strategy=strategy)
    for name in CORE:
        np.testing.assert_array_equal(getattr(inputs, name).numpy(), expected[name], err_msg=name)
    for name in METADATA:
        np.testing.assert_array_equal(getattr(inputs.attn_metadata, name).numpy(), expected[name], err_msg=name)
    assert inputs.positions.dtype == torch.int64 and inputs.attn_metadata.num_reqs == expected["num_reqs"]
    assert inputs.attn_metadata.num_actual_tokens == ref["num_actual_tokens"] and inputs.errors == 0



def _feature_steps():
    """One serving state prepared at buckets 8 and 16, with spec decode, M-RoPE, the discard mask, V2's logits
    rows and structured outputs on: two rows with four and three tokens, row 0 verifying two drafts."""
    from jaxprep.serving import ServingBatch, ServingConfig, StepUpdates

    features = jaxprep.FeatureConfig(num_speculative_tokens=2, mrope=True, discard_request_mask=True,
                                     logits_indirection=True, structured_outputs=True)
    config = ServingConfig(prep=jaxprep.PrepConfig(max_num_reqs=4, max_model_len=16, max_num_batched_tokens=16,
                                                   block_size=4, num_blocks=16, features=features,
                                                   token_buckets=(8, 16)), vocab_size=50)
    batch = ServingBatch(config)
    add = [dict(row=0, token_ids=[5, 6, 7, 8], num_computed_tokens=3, block_ids=[1, 2],
                mrope_positions=np.tile(np.arange(4), (3, 1))),
           dict(row=1, token_ids=[9, 10, 11], block_ids=[3], mrope_positions=np.tile(np.arange(3), (3, 1)))]
    batch.apply_updates(StepUpdates.build(config, add=add, num_scheduled_tokens=[3, 3, 0, 0],
                                          num_draft_tokens=[2, 0, 0, 0], draft_token_ids=[[20, 21]] + [[0, 0]] * 3))
    return batch.prepare(8), batch.prepare(16)


@pytest.mark.parametrize("strategy", ["packed", "per_field"])
@pytest.mark.parametrize("feature, message", [
    ("spec_decode", "spec_decode.logits_indices has shape (12,)"),  # issue 31: it was bridged
    ("mrope_positions", "mrope_positions has shape (3, 16), but its num_tokens_padded is 8"),
    ("logits_indirection", "logits_indirection.is_padding has shape (16,), but its num_tokens_padded is 8"),
    ("grammar", "grammar.bitmask_rows has shape (12,)"),
])
def test_a_feature_of_another_bucket_is_refused(feature, message, strategy):
    """Issue 31 item 6: a bucket-8 step carrying the bucket-16 step's feature is named, not bridged; the steps as
    prepared bridge (the control)."""
    small, large = _feature_steps()
    with pytest.raises(ValueError, match=re.escape(f"the step's fields disagree: {message}")):
        torch_bridge.to_torch(dataclasses.replace(small, **{feature: getattr(large, feature)}), strategy=strategy)
    for step in (small, large):
        bridged = torch_bridge.to_torch(step, strategy=strategy)
        assert bridged.spec_decode.logits_indices.shape[0] == min(step.num_tokens_padded, 4 * 3)


def test_a_feature_of_another_config_is_refused():
    """The discard mask of a step with more rows (a config with max_num_reqs 8): num_reqs_padded disagrees."""
    small, _ = _feature_steps()
    wider = np.ones(8, bool)
    message = "discard_request_mask has shape (8,), but its num_reqs_padded is 4"
    with pytest.raises(ValueError, match=re.escape(message)):
        torch_bridge.to_torch(dataclasses.replace(small, discard_request_mask=jax_array(wider)))


def jax_array(values):
    import jax.numpy as jnp

    return jnp.asarray(values)
