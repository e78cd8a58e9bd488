"""`ALL`: a `FeatureConfig` with every optional feature on (small sizes), shared by the tests that need one."""

from jaxprep import DCPConfig, FeatureConfig, KVCacheGroupSpec, LoRAConfig, SamplingConfig
from jaxprep.features import DrafterConfig, HybridConfig

ALL = FeatureConfig(num_speculative_tokens=2, speculative_method="mtp", discard_request_mask=True,
                    kv_groups=(KVCacheGroupSpec(4, kernel_block_size=2), KVCacheGroupSpec(8)),
                    dcp=DCPConfig(2, 1, 2), mrope=True, prompt_embeds=True, async_tokens=True, attn_state=True,
                    attn_mask="rows_bool", request_distribution=True, lora=LoRAConfig(max_loras=3, vocab_size=100),
                    logits_indirection=True, sampling=SamplingConfig(vocab_size=100), drafter=DrafterConfig(),
                    hybrid=HybridConfig(num_speculative_blocks=2, chunk_size=4, checkpoints=True),
                    structured_outputs=True, num_ubatches=2)
