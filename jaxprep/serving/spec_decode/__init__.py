"""Speculative decoding on the device, as vLLM's model runner V2 keeps it (`vllm/v1/worker/gpu/spec_decode/`):
the n-gram drafter, draft verification and the step's speculative path."""
