"""NumPy oracles of the tests and baselines of the benchmarks, written for reading, not speed.

- `core`: the plain step, `prepare_reference` and `pad_reference`;
  `vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._prepare_inputs`
- `requests`: per-request features (batch order, spec decode, discard mask, async input ids,
  attention state); `vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._calc_spec_decode_metadata`,
  `::_prepare_input_ids`
- `kv_cache`: KV-cache features (kernel block tables, sliding windows, DCP slots and lengths);
  `vllm/v1/worker/utils.py::AttentionGroup.map_to_kernel_block_table`,
  `vllm/v1/attention/backends/utils.py::get_dcp_local_seq_lens`
- `tokens`: per-token features (M-RoPE and Qwen2-VL positions, prompt embeddings, row masks);
  `vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._calc_mrope_positions`
- `drafter`, `hybrid`, `grammar`, `ubatch`: the runner features, one loop per request as vLLM's
  kernels and builders run; `vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py`,
  `vllm/v1/attention/backends/mamba_attn.py`, `vllm/v1/worker/gpu/structured_outputs.py`,
  `vllm/v1/worker/ubatch_utils.py`
- `lora`: LoRA mappings, slot indices, punica kernel metadata and CUDA-graph keys;
  `vllm/v1/worker/gpu_input_batch.py::InputBatch.make_lora_inputs`,
  `vllm/v1/worker/gpu/lora_utils.py::LoraState.make_lora_inputs`,
  `vllm/lora/punica_wrapper/utils.py::convert_mapping`,
  `vllm/lora/ops/triton_ops/lora_kernel_metadata.py::LoRAKernelMeta.prepare_tensors`
- `logits`: V2's logits indirection; `vllm/v1/worker/gpu/model_runner.py::GPUModelRunner.prepare_inputs`
- `spec_decode`: the serving loop's n-gram drafter and greedy verification;
  `vllm/v1/spec_decode/ngram_proposer.py::_find_longest_matched_ngram_and_propose_tokens`,
  `vllm/v1/sample/rejection_sampler.py::rejection_greedy_sample_kernel`

- `attention`: paged attention token by token (the oracle of `jaxprep.attention`);
  `vllm/v1/attention/backends/flash_attn.py::FlashAttentionImpl.forward`

The serving loop's oracle (state transitions) is `jaxprep.serving.reference`.
"""

from jaxprep.reference.core import pad_reference, prepare_reference

__all__ = ["pad_reference", "prepare_reference"]
