"""torch_bridge with the optional features on: KV groups, DCP, spec decode, masks, M-RoPE, prompt embeds.

Each case prepares one seeded batch with its features on, bridges it, and compares every torch
field (values and dtype) with the JAX step, and with the NumPy references of jaxprep.reference*.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from numpy.testing import assert_array_equal as assert_equal

torch = pytest.importorskip("torch")

import torch_bridge  # noqa: E402
from jaxprep import DCPConfig, FeatureConfig, KVCacheGroupSpec, LoRAConfig, PrepConfig  # noqa: E402
from jaxprep.config import block_table_width  # noqa: E402
from jaxprep.reference import prepare_reference  # noqa: E402
from jaxprep.reference.kv_cache import (  # noqa: E402
    dcp_local_seq_lens_reference,
    dcp_slot_mapping_reference,
    kernel_block_table_reference,
    sliding_window_reference,
)
from jaxprep.reference.logits import logits_indirection_reference  # noqa: E402
from jaxprep.reference.lora import lora_reference  # noqa: E402
from jaxprep.reference.requests import (  # noqa: E402
    discard_request_mask_reference,
    request_distribution_reference,
    spec_decode_reference,
)
from jaxprep.reference.tokens import mrope_reference, prompt_embeds_reference  # noqa: E402
from support.bridge_checks import assert_views_of  # noqa: E402
from support.feature_batches import batch_rows, block_table, build_feature_batch, pad, run_step  # noqa: E402
from support.mrv2_examples import with_random_adapters  # noqa: E402

K = 2
BASE = PrepConfig(max_num_reqs=5, max_model_len=40, max_num_batched_tokens=32, block_size=4)
GROUPS = (KVCacheGroupSpec(4, kernel_block_size=2), KVCacheGroupSpec(8), KVCacheGroupSpec(2, sliding_window=5))
DCP = DCPConfig(world_size=2, rank=1, interleave=2)
CASES = {
    "kv_groups": FeatureConfig(kv_groups=GROUPS),
    "dcp": FeatureConfig(kv_groups=GROUPS[:2], dcp=DCP),
    "spec_decode": FeatureConfig(num_speculative_tokens=K, discard_request_mask=True, request_distribution=True),
    "mrope_prompt_embeds": FeatureConfig(mrope=True, prompt_embeds=True),
    "mrv2_lora": FeatureConfig(runner="v2", num_speculative_tokens=K, lora=LoRAConfig(max_loras=3, vocab_size=100)),
}
STRATEGIES = ("packed", "per_field")
FEATURES = ("spec_decode", "discard_request_mask", "kv_groups", "mrope_positions", "prompt_embeds",
            "request_distribution", "lora", "logits_indirection")
BOOL_FIELDS = ("discard_request_mask", "prompt_embeds.is_token_ids", "logits_indirection.is_padding")
INT64_NAMES = ("positions", "mrope_positions", "lora.token_lora_indices", "lora.sampler_indices",
               "lora.sampler_indices_padded", "lora.embeddings_indices", "logits_indirection.logits_indices",
               "logits_indirection.expanded_idx_mapping", "logits_indirection.logits_pos")


def expected_dtype(name: str, slot_dtype=torch.int64) -> torch.dtype:
    """vLLM's dtypes: int64 positions (M-RoPE and the sampler's too), slots (int32 on the NPU) and the
    LoRA and V2 index tensors vLLM builds as torch.long; bool masks; else int32."""
    if name in INT64_NAMES:
        return torch.int64
    if name.endswith("slot_mapping"):
        return slot_dtype
    return torch.bool if name in BOOL_FIELDS else torch.int32


@functools.cache
def prepared(case: str):
    """(config, arrays, step) of one seeded batch with the case's features and every input they read."""
    features = CASES[case]
    config = dataclasses.replace(BASE, features=features)
    rng = np.random.default_rng(0)  # 3+ requests, padded; drafts, decodes and discards
    arrays = build_feature_batch(config, lambda lo, hi: int(rng.integers(lo, hi + 1)),
                                 max_drafts=K if features.spec_decode else 0)
    rows, seq_lens = config.max_num_reqs, arrays["num_computed_tokens"] + arrays["num_scheduled_tokens"]
    if features.kv_groups:
        arrays["extra_block_tables"] = [
            block_table(rows, block_table_width(config.max_model_len, g.block_size), seq_lens, g.block_size, 10 + i)
            for i, g in enumerate(features.kv_groups[1:])]
    if features.mrope:
        table = np.full((rows, 3, config.max_model_len), -1, np.int32)
        for row, prompt in enumerate(arrays["prefill_len"]):
            table[row, :, :prompt] = rng.integers(0, 60, (3, prompt))
        arrays.update(mrope_positions=table, mrope_position_delta=rng.integers(-5, 6, rows).astype(np.int32))
    if features.prompt_embeds:
        arrays.update(is_token_ids=rng.random((rows, config.max_model_len)) < 0.5,
                      prompt_embeds_start=rng.integers(0, 1000, rows).astype(np.int32))
    if features.lora is not None:
        arrays = with_random_adapters(arrays, features.lora.max_loras, rng)
    step = run_step(arrays, config, "jit")
    assert int(step.attn_metadata.num_reqs) >= 3 and step.num_tokens_padded > int(step.attn_metadata.num_actual_tokens)
    return config, arrays, step


def _tree_pairs(prefix: str, torch_tree, jax_tree) -> dict[str, tuple]:
    """{"lora.token_mapping_meta.active_lora_ids": (tensor, array), ...} over a feature's nested dataclasses."""
    pairs = {}
    for field in dataclasses.fields(jax_tree):
        got, want = getattr(torch_tree, field.name), getattr(jax_tree, field.name)
        if dataclasses.is_dataclass(want):
            pairs.update(_tree_pairs(f"{prefix}.{field.name}", got, want))
        elif want is not None:
            pairs[f"{prefix}.{field.name}"] = (got, want)
    return pairs


def paired_fields(inputs, step) -> dict[str, tuple]:
    """{name: (torch tensor, JAX array)} for the core arrays and every feature array of the step."""
    meta, jax_meta = inputs.attn_metadata, step.attn_metadata
    pairs = {name: (getattr(inputs, name), getattr(step, name)) for name in ("input_ids", "positions")}
    pairs.update(slot_mapping=(meta.slot_mapping, jax_meta.slot_mapping),
                 block_table_tensor=(meta.block_table_tensor, jax_meta.block_table))
    for g, (got, want) in enumerate(zip(inputs.kv_groups or (), step.kv_groups or (), strict=True)):
        pairs[f"kv_groups.{g}.block_table_tensor"] = (got.block_table_tensor, want.block_table)
        pairs[f"kv_groups.{g}.slot_mapping"] = (got.slot_mapping, want.slot_mapping)
    for tree in ("spec_decode", "prompt_embeds", "lora", "logits_indirection"):
        if getattr(step, tree) is not None:
            pairs.update(_tree_pairs(tree, getattr(inputs, tree), getattr(step, tree)))
    for name in ("discard_request_mask", "mrope_positions", "request_distribution"):
        if getattr(step, name) is not None:
            pairs[name] = (getattr(inputs, name), getattr(step, name))
    if jax_meta.dcp_local_seq_lens is not None:
        pairs["dcp_local_seq_lens"] = (meta.dcp_local_seq_lens, jax_meta.dcp_local_seq_lens)
    return pairs


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_feature_field_matches_the_step(case, strategy):
    config, _, step = prepared(case)
    inputs = torch_bridge.to_torch(step, strategy=strategy)
    for name in FEATURES:
        assert (getattr(inputs, name) is None) == (getattr(step, name) is None), name
    assert (inputs.attn_metadata.dcp_local_seq_lens is None) == (config.features.dcp is None)
    for name, (tensor, array) in paired_fields(inputs, step).items():
        assert tensor.dtype == expected_dtype(name), name
        assert tuple(tensor.shape) == array.shape, name
        assert_equal(tensor.cpu().numpy(), np.asarray(array), err_msg=name)
    for got, spec in zip(inputs.kv_groups or (), config.features.kv_groups, strict=True):
        assert (got.block_size, got.kernel_block_size) == (spec.block_size, spec.kernel_block_size or spec.block_size)
        assert type(got.block_size) is int and type(got.kernel_block_size) is int


def reference(arrays: dict, block_size: int, table=None) -> dict:
    ref = prepare_reference(arrays["token_ids"], arrays["block_table"] if table is None else table,
                            arrays["num_computed_tokens"], arrays["num_scheduled_tokens"], block_size)
    rows = batch_rows(arrays)
    return dict(ref, rows=rows, token_rows=np.repeat(rows, arrays["num_scheduled_tokens"][rows]))


def test_kv_groups_match_reference():
    """Each group: slots from its own table and block size; its kernel's table windowed, then expanded."""
    config, arrays, step = prepared("kv_groups")
    inputs = torch_bridge.to_torch(step)
    rows = batch_rows(arrays)
    tables = (arrays["block_table"], *arrays["extra_block_tables"])
    for g, (spec, table, group) in enumerate(zip(GROUPS, tables, inputs.kv_groups, strict=True)):
        ref = reference(arrays, spec.block_size, table)
        assert_equal(group.slot_mapping.cpu().numpy(), pad(ref["slot_mapping"], step.num_tokens_padded, -1),
                                      err_msg=f"group {g}")
        kernel = ref["block_table"]
        if spec.sliding_window:
            kernel = sliding_window_reference(kernel, arrays["num_computed_tokens"][rows], spec.sliding_window,
                                              spec.block_size)
        kernel = kernel_block_table_reference(kernel, spec.blocks_per_kernel_block)
        assert_equal(group.block_table_tensor.cpu().numpy(), pad(kernel, step.num_reqs_padded, 0),
                                      err_msg=f"group {g}")


def test_dcp_local_seq_lens_and_group_slots_match_reference():
    _, arrays, step = prepared("dcp")
    inputs = torch_bridge.to_torch(step, strategy="per_field")
    ref = reference(arrays, BASE.block_size)
    local = dcp_local_seq_lens_reference(ref["seq_lens"], BASE.block_size, DCP.world_size, DCP.rank, DCP.interleave)
    assert_equal(inputs.attn_metadata.dcp_local_seq_lens.cpu().numpy(), pad(local, step.num_reqs_padded, 0))
    tables = (arrays["block_table"], *arrays["extra_block_tables"])
    for spec, table, group in zip(GROUPS[:2], tables, inputs.kv_groups, strict=True):
        slots = dcp_slot_mapping_reference(ref["positions"], ref["token_rows"], table, spec.block_size,
                                           DCP.world_size, DCP.rank, DCP.interleave)
        assert_equal(group.slot_mapping.cpu().numpy(), pad(slots, step.num_tokens_padded, -1))
    assert_equal(inputs.attn_metadata.slot_mapping.cpu().numpy(), inputs.kv_groups[0].slot_mapping.cpu().numpy())


def test_sampling_features_match_reference():
    """Spec decode, the discard mask and request_distribution; padded entries as their constants say."""
    _, arrays, step = prepared("spec_decode")
    inputs = torch_bridge.to_torch(step)
    ref = reference(arrays, BASE.block_size)
    rows, num_reqs = ref["rows"], ref["num_reqs"]
    scheduled, drafts = arrays["num_scheduled_tokens"][rows], arrays["num_draft_tokens"][rows]
    discard = discard_request_mask_reference(arrays["num_computed_tokens"][rows], scheduled,
                                             arrays["prefill_len"][rows])
    assert_equal(inputs.discard_request_mask.cpu().numpy(), pad(discard, step.num_reqs_padded, True))
    assert_equal(inputs.request_distribution.cpu().numpy(), request_distribution_reference(scheduled, drafts))
    for name, want in spec_decode_reference(scheduled, drafts, ref["input_ids"]).items():
        got = getattr(inputs.spec_decode, name)
        if name == "max_spec_len":
            assert got.shape == () and int(got) == want
        else:
            assert_equal(got[:len(want)].cpu().numpy(), want, err_msg=name)
    assert int(inputs.spec_decode.num_logits) == num_reqs + int(drafts.sum())  # the properties read torch leaves


def test_mrope_and_prompt_embeds_match_reference():
    _, arrays, step = prepared("mrope_prompt_embeds")
    inputs = torch_bridge.to_torch(step)
    ref = reference(arrays, BASE.block_size)
    rows, num_tokens = ref["rows"], ref["num_actual_tokens"]
    want = mrope_reference(arrays["mrope_positions"][rows], arrays["mrope_position_delta"][rows],
                           arrays["prefill_len"][rows], arrays["num_computed_tokens"][rows],
                           arrays["num_scheduled_tokens"][rows])
    mrope = inputs.mrope_positions.cpu().numpy()
    assert mrope.shape == (3, step.num_tokens_padded)
    assert_equal(mrope[:, :num_tokens], want)
    assert (mrope[:, num_tokens:] == 0).all()
    flags, indices = prompt_embeds_reference(arrays["is_token_ids"], arrays["prompt_embeds_start"], ref["token_rows"],
                                             ref["positions"])
    assert_equal(inputs.prompt_embeds.is_token_ids.cpu().numpy(), pad(flags, step.num_tokens_padded, True))
    assert_equal(inputs.prompt_embeds.embeds_indices.cpu().numpy(), pad(indices, step.num_tokens_padded, 0))


@pytest.mark.parametrize("case", sorted(CASES))
def test_per_field_shares_int32_and_bool_fields_and_copies_int64(case):
    _, _, step = prepared(case)
    for name, (tensor, array) in paired_fields(torch_bridge.to_torch(step, strategy="per_field"), step).items():
        shared = tensor.data_ptr() == array.unsafe_buffer_pointer()
        assert shared == (expected_dtype(name) != torch.int64), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_feature_fields_are_views_of_the_one_buffer(case):
    _, _, step = prepared(case)
    inputs = torch_bridge.to_torch(step, strategy="packed")
    (buffer,) = inputs.jax_buffers
    assert_views_of(buffer, {name: tensor for name, (tensor, _) in paired_fields(inputs, step).items()})


def test_group_attn_metadata_is_the_steps_with_the_groups_tables():
    _, _, step = prepared("kv_groups")
    inputs = torch_bridge.to_torch(step)
    meta = inputs.group_attn_metadata(2)
    assert meta.block_table_tensor is inputs.kv_groups[2].block_table_tensor
    assert meta.slot_mapping is inputs.kv_groups[2].slot_mapping
    assert meta.query_start_loc is inputs.attn_metadata.query_start_loc
    assert meta.num_reqs == inputs.attn_metadata.num_reqs
    plain = torch_bridge.to_torch(prepared("spec_decode")[2])
    with pytest.raises(ValueError, match="no KV-cache groups"):
        plain.group_attn_metadata(0)


@pytest.mark.parametrize("case", ["dcp", "mrope_prompt_embeds", "spec_decode", "mrv2_lora"])
@pytest.mark.cpu_only("the Ascend path stages from JAX on the host CPU")
def test_to_npu_carries_the_features_in_the_one_staged_copy(fake_npu, case):
    """Group slot mappings int32 like the step's; group block tables in FIA's layout (a null dummy row)."""
    _, _, step = prepared(case)
    inputs = torch_bridge.to_npu(step)
    assert len(fake_npu.copies) == 1
    num_reqs = inputs.attn_metadata.num_reqs
    for name, (tensor, array) in paired_fields(inputs, step).items():
        assert tensor.dtype == expected_dtype(name, slot_dtype=torch.int32), name
        assert fake_npu.is_on_npu(tensor), name
        want = np.asarray(array)
        if name.endswith("block_table_tensor"):  # FIA: one more row; rows of no real request are null
            want = np.concatenate([want, np.zeros_like(want[:1])])
            want[num_reqs:] = 0
        assert_equal(tensor.cpu().numpy(), want, err_msg=name)


def test_a_donated_feature_array_is_named():
    config, arrays, _ = prepared("kv_groups")
    step = run_step(arrays, config, "jit")  # a step of its own: this test deletes one of its arrays
    step.kv_groups[1].slot_mapping.delete()
    with pytest.raises(ValueError, match="kv_groups.1.slot_mapping was deleted"):
        torch_bridge.to_torch(step)


def test_lora_and_logits_indirection_match_reference():
    """V2 runner: the bridged LoRA index tensors (int64) and logits rows against the NumPy references."""
    config, arrays, step = prepared("mrv2_lora")
    inputs = torch_bridge.to_torch(step)
    num_reqs = int(step.attn_metadata.num_reqs)
    rows = np.asarray(step.idx_mapping)[:num_reqs]
    want = lora_reference(arrays["lora_ids"], arrays["lora_slots"], rows, arrays["num_scheduled_tokens"],
                          arrays["num_draft_tokens"], config.features.lora, "v2", True)
    for name in ("token_lora_mapping", "prompt_lora_mapping", "token_lora_indices", "sampler_indices",
                 "sampler_indices_padded", "embeddings_indices"):
        got = getattr(inputs.lora, name)
        np.testing.assert_array_equal(got[: len(want[name])].cpu().numpy(), want[name], err_msg=name)
    meta = inputs.lora.token_mapping_meta
    for name in ("active_lora_ids", "num_tokens_per_lora", "lora_token_start_loc"):
        np.testing.assert_array_equal(getattr(meta, name).cpu().numpy(), want["token_mapping_meta"][name], err_msg=name)
    scheduled, drafts = arrays["num_scheduled_tokens"][rows], arrays["num_draft_tokens"][rows]
    logits = logits_indirection_reference(rows, scheduled, drafts, np.asarray(step.positions),
                                          np.asarray(step.input_ids), step.num_tokens_padded)
    for name, value in logits.items():
        got = getattr(inputs.logits_indirection, name).cpu().numpy()
        np.testing.assert_array_equal(got[: len(value)], value, err_msg=name)


@functools.cache
def prepared_buffer(case: str):
    """The case's step as one `StepBuffer`, prepared by `prepare_buffer` on the same batch."""
    from jaxprep import BatchState
    from jaxprep.step_buffer import prepare_buffer

    config, arrays, step = prepared(case)
    return prepare_buffer(BatchState.from_numpy(**arrays), config, step.num_tokens_padded)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_step_buffer_reaches_torch_in_one_handoff(case):
    """Every torch field of ``to_torch(buffer)`` equals the plain step's (values, vLLM's dtypes, shapes),
    as ``to_torch(step)``'s do, and every tensor is a view of the buffer's one storage."""
    config, _, step = prepared(case)
    buffer = prepared_buffer(case)
    inputs = torch_bridge.to_torch(buffer)
    assert inputs.jax_buffers == (buffer.words,)
    for name in FEATURES:
        assert (getattr(inputs, name) is None) == (getattr(step, name) is None), name
    pairs = paired_fields(inputs, step)
    meta = inputs.attn_metadata
    for name in ("query_start_loc", "seq_lens"):
        pairs[name] = (getattr(meta, name), getattr(step.attn_metadata, name))
    pairs.update(logits_indices=(inputs.logits_indices, step.logits_indices),
                 idx_mapping=(inputs.idx_mapping, step.idx_mapping))
    for name, (tensor, array) in pairs.items():
        assert tensor.dtype == expected_dtype(name), name
        assert tuple(tensor.shape) == array.shape, name
        assert_equal(tensor.cpu().numpy(), np.asarray(array), err_msg=name)
    for name in ("num_actual_tokens", "num_reqs", "max_query_len", "max_seq_len"):
        assert getattr(meta, name) == int(getattr(step.attn_metadata, name)), name
    assert_equal(meta.seq_lens_cpu.numpy(), np.asarray(step.attn_metadata.seq_lens))
    assert_equal(meta.query_start_loc_cpu.numpy(), np.asarray(step.attn_metadata.query_start_loc))
    assert inputs.errors == int(step.errors) and inputs.num_tokens_padded == step.num_tokens_padded
    assert_views_of(buffer.words, {name: tensor for name, (tensor, _) in pairs.items()})
    for got, spec in zip(inputs.kv_groups or (), config.features.kv_groups, strict=True):
        assert (got.block_size, got.kernel_block_size) == (spec.block_size, spec.kernel_block_size or spec.block_size)


def test_a_step_buffer_handoff_check_has_a_negative_control():
    """A perturbed word, or a tensor outside the buffer, is caught by the same checks."""
    _, _, step = prepared("spec_decode")
    buffer = prepared_buffer("spec_decode")
    inputs = torch_bridge.to_torch(buffer)
    inputs.positions[0] += 1  # a view: the buffer's word changes, the plain step's does not
    try:
        with pytest.raises(AssertionError):
            assert_equal(inputs.positions.numpy(), np.asarray(step.positions))
        with pytest.raises(AssertionError, match="not a view"):
            assert_views_of(buffer.words, {"copy": inputs.input_ids.clone()})
    finally:
        inputs.positions[0] -= 1
    with pytest.raises(ValueError, match="deleted"):
        torch_bridge.to_torch(dataclasses.replace(buffer, words=_deleted_copy(buffer.words)))


def _deleted_copy(array):
    import jax.numpy as jnp

    copy = jnp.array(array, copy=True)
    copy.delete()
    return copy
