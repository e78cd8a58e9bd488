"""Real decoder architectures from local Hugging Face checkpoints, for the serving loop.

```python
config, params = load_model("path/to/checkpoint", dtype="bfloat16")  # config.json + *.safetensors
engine = Engine(serving_config, config, params=params)
```

The Llama family (``model_type`` llama, qwen2, qwen3) with RMSNorm, RoPE (default, linear and llama3
scaling), grouped-query attention, SwiGLU and tied or untied embeddings; computed in float32 (the
default, exact) or bfloat16 (`jaxprep.models.llama`). Loading streams the safetensors files
(`jaxprep.models.load`, `jaxprep.models.safetensors_file`); docs/guides/real_models.md.
"""

from jaxprep._typing import as_compute, storage_dtype
from jaxprep.models.config import SUPPORTED_MODEL_TYPES, DecoderConfig, parse_config, read_config
from jaxprep.models.errors import CheckpointError, UnsupportedConfigError
from jaxprep.models.llama import dense_forward, paged_forward
from jaxprep.models.load import build_params, load_model, read_safetensors
from jaxprep.models.rope import ROPE_TYPES, RopeConfig

__all__ = [
    "ROPE_TYPES", "SUPPORTED_MODEL_TYPES", "CheckpointError", "DecoderConfig", "RopeConfig",
    "UnsupportedConfigError", "build_params", "dense_forward", "load_model", "paged_forward", "parse_config",
    "read_config", "read_safetensors", "as_compute", "storage_dtype",
]
