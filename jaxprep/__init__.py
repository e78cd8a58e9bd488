"""jaxprep: jit-compiled input preparation for paged-attention LLM serving.

```python
config = jaxprep.PrepConfig(max_num_reqs=8, max_model_len=4096, max_num_batched_tokens=512, block_size=16)
state = jaxprep.BatchState.from_numpy(token_ids=..., block_table=..., num_computed_tokens=...,
                                      num_scheduled_tokens=...)
step = jaxprep.prepare_inputs(state, config)
```
"""

from jaxprep._constants import (NULL_BLOCK_ID, PAD_INPUT_ID, PAD_LOGITS_INDEX, PAD_POSITION, PAD_SEQ_LEN,
                                PAD_SLOT_ID, PAD_STATE_ROW)
from jaxprep.compilation import CompileCount, count_compiles, use_compile_cache, warmup
from jaxprep.config import PrepConfig, default_token_buckets
from jaxprep.metadata import AttentionMetadata, StepInputs
from jaxprep.prepare import prepare_inputs, prepare_padded, prepare_to_host
from jaxprep.sharding import data_mesh, prepare_data_parallel, stack_ranks
from jaxprep.state import BatchState
from jaxprep.validate import InvalidBatchError, validate

# optional features (FeatureConfig switches)
from jaxprep.features import AttnState, DCPConfig, DrafterConfig, FeatureConfig, HybridConfig, KVCacheGroupSpec
from jaxprep.features.async_tokens import prev_batch_rows_from_step
from jaxprep.features.kv_groups import KVGroupMetadata
from jaxprep.features.logits_indirection import LogitsIndirection
from jaxprep.features.lora import LoRAKernelMeta, LoRAMetadata
from jaxprep.features.lora_config import LoRAConfig
from jaxprep.features.mrope import qwen2vl_prompt_positions
from jaxprep.features.prompt_embeds import PromptEmbedsMetadata
from jaxprep.features.sampling import SamplingMetadata
from jaxprep.features.sampling_params import SamplingConfig, SamplingParams
from jaxprep.features.spec_decode import SpecDecodeMetadata

__version__ = "0.1.0"
"""The package's version (pyproject.toml reads it from here)."""
VLLM_VERSION = "0.33.0"
"""The vLLM release whose values jaxprep reproduces and whose code the tests compare against."""

__all__ = [
    "AttentionMetadata", "BatchState", "CompileCount", "InvalidBatchError", "NULL_BLOCK_ID", "PAD_INPUT_ID",
    "PAD_LOGITS_INDEX", "PAD_POSITION", "PAD_SEQ_LEN", "PAD_SLOT_ID", "PAD_STATE_ROW", "PrepConfig",
    "StepInputs", "count_compiles", "data_mesh", "default_token_buckets", "prepare_data_parallel", "prepare_inputs",
    "prepare_padded", "prepare_to_host", "stack_ranks", "use_compile_cache", "validate", "warmup",
    "AttnState", "DCPConfig", "FeatureConfig", "KVCacheGroupSpec", "KVGroupMetadata", "PromptEmbedsMetadata",
    "SpecDecodeMetadata", "prev_batch_rows_from_step", "qwen2vl_prompt_positions", "DrafterConfig", "HybridConfig",
    "LoRAConfig", "LoRAKernelMeta", "LoRAMetadata", "LogitsIndirection", "SamplingConfig", "SamplingMetadata",
    "SamplingParams",
]
