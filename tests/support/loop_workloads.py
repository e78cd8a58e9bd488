"""The serving loop's random workloads, shared by the synchronous and the async loop tests."""

from __future__ import annotations

from jaxprep import PrepConfig
from jaxprep.serving import ModelConfig, ServingConfig

MODEL = ModelConfig(vocab_size=64, num_layers=2, d_model=32, num_heads=2, d_ff=64)
EOS = 1


def make_config(*, budget, block_size, num_blocks, max_num_reqs, max_model_len, decode_steps, eos=EOS):
    prep = PrepConfig(max_num_reqs=max_num_reqs, max_model_len=max_model_len, max_num_batched_tokens=budget,
                      block_size=block_size, num_blocks=num_blocks)
    return ServingConfig(prep=prep, eos_token_id=eos, decode_steps=decode_steps)


WORKLOADS = {
    # small budget: long prompts are prefilled in chunks; few blocks: requests are preempted
    "chunked+preempt": (dict(budget=8, block_size=2, num_blocks=24, max_num_reqs=4, max_model_len=32,
                             decode_steps=4), dict(prompt_len=(1, 20), max_tokens=(1, 12))),
    "tight cache": (dict(budget=16, block_size=4, num_blocks=12, max_num_reqs=4, max_model_len=40,
                         decode_steps=3), dict(prompt_len=(2, 24), max_tokens=(4, 16))),
    "multi-step": (dict(budget=24, block_size=8, num_blocks=40, max_num_reqs=8, max_model_len=48,
                        decode_steps=8), dict(prompt_len=(1, 16), max_tokens=(8, 30))),
    "odd sizes, max_model_len, K=1": (dict(budget=5, block_size=3, num_blocks=30, max_num_reqs=3, max_model_len=20,
                                           decode_steps=1), dict(prompt_len=(1, 15), max_tokens=(1, 12))),
}
