"""LoRA metadata against vLLM 0.33.0's own functions, run on CPU torch (skipped without vllm).

For random batches, vLLM's code builds the mappings (V1 ``InputBatch.make_lora_inputs``, V2
``LoraState.make_lora_inputs``), converts them to slot indices (``convert_mapping``), prepares the
punica kernels' metadata (``LoRAKernelMeta.prepare_tensors``) and resolves the V2 graph key
(``CudaGraphManager``'s dispatch map); jaxprep's jitted step must give the same values.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import FeatureConfig, LoRAConfig
from support.feature_batches import feature_batches, run_step
from support.mrv2_examples import BASE, lora_fields, with_random_adapters

torch = pytest.importorskip("torch")
punica_utils = pytest.importorskip("vllm.lora.punica_wrapper.utils")

from vllm.lora.layers import LoRAMapping  # noqa: E402
from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.lora.utils import get_captured_lora_counts  # noqa: E402
from vllm.utils import torch_utils  # noqa: E402
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager  # noqa: E402
from vllm.v1.worker.gpu.lora_utils import LoraState, get_lora_capture_cases  # noqa: E402
from vllm.v1.worker.gpu_input_batch import InputBatch  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def no_pinned_memory():
    """vLLM stages host-to-device copies in pinned memory when it believes CUDA is there; here it is not."""
    saved, torch_utils.PIN_MEMORY = torch_utils.PIN_MEMORY, False
    yield
    torch_utils.PIN_MEMORY = saved


def vllm_mappings(arrays: dict, rows, runner: str, spec_decode: bool):
    """(prompt mapping, token mapping, active adapters) from vLLM's runner code for batch ``rows``."""
    ids, scheduled = arrays["lora_ids"], arrays["num_scheduled_tokens"][rows]
    requests = {int(i): LoRARequest(lora_name=f"adapter-{i}", lora_int_id=int(i), lora_path="/none")
                for i in ids if i > 0}
    if runner == "v1":  # the persistent batch holds exactly the scheduled rows, in batch order
        batch = types.SimpleNamespace(request_lora_mapping=ids[rows].astype(np.int64), num_reqs=len(rows),
                                      lora_id_to_lora_request={int(i): requests[int(i)] for i in ids[rows] if i > 0})
        sampled = arrays["num_draft_tokens"][rows] + 1 if spec_decode else np.ones(len(rows), np.int32)
        return InputBatch.make_lora_inputs(batch, scheduled, sampled)
    state = LoraState(len(ids))
    for slot, i in enumerate(ids):
        state.add_request(f"req-{slot}", slot, requests.get(int(i)))
    return state.make_lora_inputs([f"req-{slot}" for slot in rows], np.asarray(rows), scheduled)


def vllm_kernel_meta(indices: torch.Tensor, lora: LoRAConfig) -> dict:
    meta = LoRAKernelMeta.make(lora.max_loras, 64, "cpu",
                               captured_lora_counts=get_captured_lora_counts(lora.max_loras,
                                                                             lora.specialize_active_lora))
    meta.prepare_tensors(indices)
    no_lora = bool(meta.no_lora_flag_cpu[0])
    return {"token_indices_sorted_by_lora_ids": None if no_lora else meta.token_indices_sorted_by_lora_ids[
                :len(indices)].numpy(),
            "active_lora_ids": meta.active_lora_ids.numpy(), "num_tokens_per_lora": meta.num_tokens_per_lora.numpy(),
            "lora_token_start_loc": meta.lora_token_start_loc.numpy(),
            "num_active_loras": int(meta.num_active_loras_cpu[0])}


def vllm_v2_key(num_active: int, lora: LoRAConfig) -> int:
    compilation = types.SimpleNamespace(cudagraph_specialize_lora=lora.cudagraph_specialize_lora)
    lora_config = types.SimpleNamespace(max_loras=lora.max_loras, specialize_active_lora=lora.specialize_active_lora)
    manager = types.SimpleNamespace(lora_capture_cases=get_lora_capture_cases(lora_config, compilation))
    manager._lora_dispatch_map, manager._max_lora_case = CudaGraphManager._build_lora_dispatch_map(manager)
    return CudaGraphManager._resolve_effective_loras(manager, num_active)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), runner=st.sampled_from(["v1", "v2"]), k=st.sampled_from([0, 2]),
       max_loras=st.integers(1, 5), specialize=st.booleans(), cudagraph_specialize=st.booleans())
def test_random_batches_match_vllm(data, runner, k, max_loras, specialize, cudagraph_specialize):
    lora = LoRAConfig(max_loras=max_loras, vocab_size=512, specialize_active_lora=specialize,
                      cudagraph_specialize_lora=cudagraph_specialize)
    config = dataclasses.replace(BASE, features=FeatureConfig(num_speculative_tokens=k, runner=runner, lora=lora))
    arrays = data.draw(feature_batches(config, max_drafts=k))
    arrays = with_random_adapters(arrays, max_loras, np.random.default_rng(data.draw(st.integers(0, 2**20))))
    step = run_step(arrays, config, "jit")
    rows = np.asarray(step.idx_mapping)[: int(step.attn_metadata.num_reqs)]
    prompt, token, active = vllm_mappings(arrays, rows, runner, k > 0)
    slot_layout = [None if s < 0 else int(s) for s in arrays["lora_slots"]]
    base, sampler, padded, embeddings, lengths = punica_utils.convert_mapping(
        LoRAMapping(token, prompt, is_prefill=True), slot_layout, max_loras + 1, 512, "cpu")
    got = lora_fields(step)
    want = {"token_lora_mapping": np.array(token), "prompt_lora_mapping": np.array(prompt),
            "token_lora_indices": base.numpy(), "sampler_indices": sampler.numpy(),
            "sampler_indices_padded": padded.numpy(), "embeddings_indices": embeddings.numpy()}
    for name, value in want.items():
        np.testing.assert_array_equal(got[name][: len(value)], value, err_msg=name)
    assert got["indices_len"].tolist() == list(lengths)
    for prefix, indices in (("token", base), ("prompt", sampler)):
        for name, value in vllm_kernel_meta(indices, lora).items():
            mine = got[f"{prefix}.{name}"]
            if name == "token_indices_sorted_by_lora_ids":
                value = np.arange(len(indices)) if value is None else value  # vLLM: stale buffer
                mine = mine[: len(indices)]
            np.testing.assert_array_equal(mine, value, err_msg=f"{prefix}.{name}")
    assert int(got["num_active_loras"]) == len(active)
    if runner == "v2":
        assert int(got["cudagraph_num_active_loras"]) == vllm_v2_key(len(active), lora)
