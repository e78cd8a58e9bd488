"""A prepared step in a peer's layout, computed on the device from jaxprep's step.

- `tpu_inference`: tpu-inference 0.32.0's runner inputs and its RPA v3 kernel's arrays and KV cache.
"""

from jaxprep.layouts.tpu_inference import (
    TpuInferenceInputs,
    rpa_v3_cache_shape,
    to_rpa_v3_cache,
    tpu_inference_layout,
    tpu_inference_sizes,
)

__all__ = ["TpuInferenceInputs", "rpa_v3_cache_shape", "to_rpa_v3_cache", "tpu_inference_layout",
           "tpu_inference_sizes"]
