"""Optional vLLM features, each a static switch of `FeatureConfig` (``PrepConfig.features``).

One module per feature; each holds the traced function that computes the feature's outputs and
the host check of its `BatchState` inputs (module, feature, vLLM source):

- `spec_decode`: spec-decode metadata;
  `vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._calc_spec_decode_metadata`
- `discard`: the discard mask of partial prefills;
  `vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._prepare_inputs`
- `kv_groups`: a block table and slot mapping per KV-cache group;
  `vllm/v1/worker/gpu/block_table.py::BlockTables.gather_block_tables`,
  `vllm/v1/worker/utils.py::AttentionGroup.map_to_kernel_block_table`
- `dcp`: decode context parallelism; `vllm/v1/worker/block_table.py`,
  `vllm/v1/attention/backends/utils.py::get_dcp_local_seq_lens`
- `mrope`: M-RoPE positions; `vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._calc_mrope_positions`
- `prompt_embeds`: prompt embeddings;
  `vllm/v1/worker/gpu/model_states/prompt_embeds.py::_apply_prompt_embeds_kernel`
- `async_tokens`: last step's sampled tokens into ``input_ids``;
  `vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._prepare_input_ids`
- `attn_state`: the attention state;
  vllm-ascend `vllm_ascend/worker/model_runner_v1.py::NPUModelRunner._build_attn_state`
- `masks`: Ascend attention masks;
  vllm-ascend `vllm_ascend/attention/attention_mask.py::AttentionMaskBuilder`
- `reorder`: batch order and ``request_distribution``;
  `vllm/v1/worker/gpu/model_runner.py::sort_batch_req_ids`, tpu-inference `PersistentBatchManager._reorder_batch`
- `drafter`: the inputs of an EAGLE / MTP drafter after verification;
  `vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py` (its three input kernels)
- `hybrid`, `hybrid_chunks`: Mamba / linear-attention metadata and the SSD chunks;
  `vllm/v1/attention/backends/mamba_attn.py::BaseMambaAttentionMetadataBuilder`,
  `vllm/v1/worker/gpu/model_states/mamba_hybrid.py`
- `grammar`: structured outputs, the grammar-bitmask row of each logits row;
  `vllm/v1/worker/gpu/structured_outputs.py`
- `ubatch`: micro-batches (dual-batch overlap); `vllm/v1/worker/ubatch_utils.py::maybe_create_ubatch_slices`
- `lora` (settings in `lora_config`): LoRA mappings, slot indices, punica kernel metadata, CUDA-graph key;
  `vllm/v1/worker/gpu_input_batch.py::InputBatch.make_lora_inputs`,
  `vllm/v1/worker/gpu/lora_utils.py::LoraState.make_lora_inputs`,
  `vllm/lora/punica_wrapper/utils.py::convert_mapping`,
  `vllm/lora/ops/triton_ops/lora_kernel_metadata.py::LoRAKernelMeta.prepare_tensors`
- `logits_indirection`: V2's logits rows (``cu_num_logits``, ``expanded_idx_mapping``, ...), also read by `grammar`;
  `vllm/v1/worker/gpu/model_runner.py::GPUModelRunner.prepare_inputs`,
  `vllm/v1/worker/gpu/input_batch.py::_expand_idx_mapping_kernel`
- `sampling` (settings and request parameters in `sampling_params`): every logits row's sampling
  parameters and vLLM's flags; `vllm/v1/worker/gpu/sample/states.py::SamplingStates`,
  `vllm/v1/worker/gpu/sample/sampler.py::Sampler.__call__`, `vllm/sampling_params.py::SamplingParams`

``FeatureConfig(runner="v2")`` switches every output to vLLM's model runner V2 where V1 and V2
differ (the batch order, LoRA's prompt mapping and graph key, the logits indirection).

Each module exports its record, ``FEATURE`` (`record.Feature`: its inputs and their empty values,
its host check, its row flags, its bits' messages, its metadata function), and `registry.FEATURES`
lists them: the central code (`jaxprep.validate`, `jaxprep.state`, `inputs`, `dispatch`) loops over
that list. `with_features` (`dispatch`) adds the outputs of the features that are on to a prepared
step, inside `prepare_padded`'s jit, in `registry.STEP_ORDER`; `check_feature_shapes` /
`check_feature_values` / `check_group_blocks` (`inputs`) are the host checks `jaxprep.validate`
calls, `check_traced_shapes` their trace-time twin, and `flags` numbers the feature bits of the
step's error word.
"""

from jaxprep.features.config import (ATTN_MASK_DTYPES, ATTN_MASK_MODES, HYBRID_MODES, MROPE_NUM_DIMS, REORDER_MODES,
                                     RUNNERS, AttnState, DCPConfig, DrafterConfig, FeatureConfig, HybridConfig,
                                     KVCacheGroupSpec)
from jaxprep.features.dispatch import with_features
from jaxprep.features.inputs import (
    check_feature_shapes,
    check_feature_values,
    check_group_blocks,
    check_traced_shapes,
    required_fields,
)
from jaxprep.features.lora_config import LoRAConfig
from jaxprep.features.sampling_params import SamplingConfig, SamplingParams

__all__ = [
    "ATTN_MASK_DTYPES", "ATTN_MASK_MODES", "HYBRID_MODES", "MROPE_NUM_DIMS", "REORDER_MODES", "RUNNERS", "AttnState",
    "DCPConfig", "DrafterConfig", "FeatureConfig", "HybridConfig", "KVCacheGroupSpec", "LoRAConfig",
    "check_feature_shapes", "check_feature_values", "check_group_blocks", "check_traced_shapes", "required_fields",
    "with_features",
    "SamplingConfig", "SamplingParams",
]
