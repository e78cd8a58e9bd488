"""Sampling on the device, as vLLM's model runner V2 keeps it (`vllm/v1/worker/gpu/sample/`): the sampler and
the admission of its per-row state."""
