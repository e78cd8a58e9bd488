"""torch_bridge.to_npu on CPU, against a fake torch_npu (as vllm-ascend's unit tests fake it,
docs/semantics.md#ascend-without-npu).

The fake maps ``tensor.to("npu", ...)`` onto a CPU copy and records every pin and copy, so the
tests check FIA's layout (docs/semantics.md#fia-layout) and the staging path (pinned, non_blocking, one copy).
"""

from __future__ import annotations

import importlib.abc
import sys

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxprep  # noqa: E402
import torch_bridge  # noqa: E402
from jaxprep.reference import pad_reference, prepare_reference  # noqa: E402
from jaxprep.walkthrough.examples import (  # noqa: E402
    example_a_config,
    example_a_step1,
    example_a_step2,
    example_b,
    example_b_config,
    sequential_block_table,
)

pytestmark = pytest.mark.cpu_only("the Ascend path stages from JAX on the host CPU; the fake NPU copies host tensors")


def prepare(config, arrays):
    step = jaxprep.prepare_inputs(jaxprep.BatchState.from_numpy(**arrays), config)
    ref = prepare_reference(**arrays, block_size=config.block_size)
    num_tokens_padded = config.bucket_for(ref["num_actual_tokens"])
    return step, pad_reference(ref, num_tokens_padded, config.num_reqs_padded(num_tokens_padded))


def fia_expected(padded: dict, num_tokens_padded: int) -> dict:
    """FIA's layout written from docs/semantics.md#fia-layout on the padded reference: a dummy request closes qsl."""
    num_reqs, num_tokens = padded["num_reqs"], padded["num_actual_tokens"]
    rows = len(padded["seq_lens"]) + 1
    qsl = np.full(rows + 1, num_tokens_padded)
    qsl[:num_reqs + 1] = padded["query_start_loc"][:num_reqs + 1]
    seq_lens = np.ones(rows, np.int64)
    seq_lens[:num_reqs] = padded["seq_lens"][:num_reqs]
    block_table = np.zeros((rows, padded["block_table"].shape[1]), np.int64)
    block_table[:num_reqs] = padded["block_table"][:num_reqs]
    fia_batch = num_reqs + (num_tokens < num_tokens_padded)
    return dict(query_start_loc=qsl, seq_lens=seq_lens, block_table_tensor=block_table,
                actual_seq_lengths_q=qsl[1:fia_batch + 1].tolist(), seq_lens_list=seq_lens[:fia_batch].tolist())


CASES = {
    "A2-padded": (example_a_config, example_a_step2),
    "A1-exact": (example_a_config, example_a_step1),  # 10 tokens fill bucket 10: no dummy request
    "B": (example_b_config, example_b),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_to_npu_matches_fia_reference(fake_npu, case):
    config_fn, arrays_fn = CASES[case]
    step, padded = prepare(config_fn(), arrays_fn())
    inputs = torch_bridge.to_npu(step)
    meta = inputs.attn_metadata
    expected = fia_expected(padded, len(padded["input_ids"]))
    assert isinstance(meta, torch_bridge.NpuAttentionMetadata)
    for name in ("query_start_loc", "seq_lens", "block_table_tensor"):
        np.testing.assert_array_equal(getattr(meta, name).cpu().numpy(), expected[name], err_msg=name)
        assert getattr(meta, name).dtype == torch.int32, name
    assert meta.actual_seq_lengths_q == expected["actual_seq_lengths_q"]
    assert meta.actual_seq_lengths_q[-1] == len(padded["input_ids"])
    assert meta.seq_lens_list == expected["seq_lens_list"]
    assert meta.slot_mapping.dtype == torch.int32 and inputs.positions.dtype == torch.int64
    assert inputs.input_ids.dtype == torch.int32
    np.testing.assert_array_equal(meta.slot_mapping.cpu().numpy(), padded["slot_mapping"])
    np.testing.assert_array_equal(inputs.positions.cpu().numpy(), padded["positions"])
    np.testing.assert_array_equal(inputs.input_ids.cpu().numpy(), padded["input_ids"])
    np.testing.assert_array_equal(meta.query_start_loc_cpu.cpu().numpy(), expected["query_start_loc"])
    assert (meta.num_reqs, meta.num_actual_tokens) == (padded["num_reqs"], padded["num_actual_tokens"])


def test_spec_example_a_step2_fia_literal(fake_npu):
    """Example A step 2: 5 tokens padded to 8, so a dummy request holds tokens 5..7 (qsl[-1] == 8)."""
    step, _ = prepare(example_a_config(), example_a_step2())
    meta = torch_bridge.to_npu(step).attn_metadata
    assert meta.query_start_loc.tolist() == [0, 1, 2, 5, 8]
    assert meta.seq_lens.tolist() == [4, 3, 8, 1]
    assert meta.block_table_tensor[3].eq(0).all()
    assert meta.actual_seq_lengths_q == [1, 2, 5, 8] and meta.seq_lens_list == [4, 3, 8, 1]
    assert meta.slot_mapping.tolist() == [5, 14, 13, 16, 17, -1, -1, -1]


def test_padded_rows_after_the_dummy_are_empty(fake_npu):
    """2 requests in 8 request rows: the dummy is row 2; rows 3..8 are empty, seq_len 1, null blocks."""
    config = jaxprep.PrepConfig(max_num_reqs=8, max_model_len=32, max_num_batched_tokens=16, block_size=4)
    arrays = dict(token_ids=np.arange(8 * 32, dtype=np.int32).reshape(8, 32),
                  block_table=sequential_block_table([2, 1, 0, 0, 0, 0, 0, 0], config.max_blocks_per_req),
                  num_computed_tokens=np.array([4, 0, 0, 0, 0, 0, 0, 0], np.int32),
                  num_scheduled_tokens=np.array([3, 2, 0, 0, 0, 0, 0, 0], np.int32))
    step, _ = prepare(config, arrays)
    meta = torch_bridge.to_npu(step).attn_metadata
    assert step.num_tokens_padded == 8
    assert meta.query_start_loc.tolist() == [0, 3, 5] + [8] * 7
    assert meta.seq_lens.tolist() == [7, 2] + [1] * 7
    assert meta.actual_seq_lengths_q == [3, 5, 8] and meta.seq_lens_list == [7, 2, 1]
    assert meta.block_table_tensor[:2, :2].tolist() == [[1, 2], [3, 0]] and meta.block_table_tensor[2:].eq(0).all()


def test_one_pinned_non_blocking_copy_and_views_on_the_npu(fake_npu):
    step, _ = prepare(example_b_config(), example_b())
    inputs = torch_bridge.to_npu(step)
    assert len(fake_npu.copies) == 1, "the whole step goes to the NPU in one copy"
    (copy,) = fake_npu.copies
    assert copy["device"] == "npu" and copy["non_blocking"] and copy["from_pinned"]
    meta = inputs.attn_metadata
    for tensor in (inputs.input_ids, inputs.positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                   meta.block_table_tensor):
        assert fake_npu.is_on_npu(tensor)
    (buffer,) = inputs.jax_buffers  # the host side: JAX's own buffer, shared with torch
    assert meta.query_start_loc_cpu.untyped_storage().data_ptr() == buffer.unsafe_buffer_pointer()
    assert not fake_npu.is_on_npu(meta.seq_lens_cpu)


def test_attn_state_and_mask_keywords_and_device_routing(fake_npu):
    step, _ = prepare(example_a_config(), example_a_step2())
    mask = jnp.triu(jnp.ones((8, 8), jnp.int8), k=1)
    inputs = torch_bridge.to_torch(step, device="npu", attn_state=3, attn_mask=mask)  # routed to to_npu
    meta = inputs.attn_metadata
    assert isinstance(meta, torch_bridge.NpuAttentionMetadata) and meta.attn_state == 3
    assert fake_npu.is_on_npu(meta.attn_mask) and meta.attn_mask.dtype == torch.int8
    assert len(fake_npu.copies) == 2 and all(c["non_blocking"] and c["from_pinned"] for c in fake_npu.copies)


def test_to_npu_rejects_other_devices(fake_npu):
    step, _ = prepare(example_a_config(), example_a_step2())
    with pytest.raises(ValueError, match="needs an npu device"):
        torch_bridge.to_npu(step, device="cpu")


class RaisingFinder(importlib.abc.MetaPathFinder):
    """Makes ``import torch_npu`` fail the way a broken CANN install does."""

    def __init__(self, error: Exception):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        if name == "torch_npu":
            raise self.error
        return None


@pytest.mark.parametrize("error", [ImportError("No module named 'torch_npu'"),
                                   OSError("libascendcl.so: cannot open shared object file"),
                                   RuntimeError("NPU device probe failed")])
def test_missing_torch_npu_names_the_extra(monkeypatch, error):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [RaisingFinder(error)] + sys.meta_path)
    step, _ = prepare(example_a_config(), example_a_step2())
    with pytest.raises(ImportError, match=r"pip install jaxprep\[npu\]"):
        torch_bridge.to_npu(step)
