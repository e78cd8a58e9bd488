"""torch_bridge: hands jaxprep's prepared steps to PyTorch (CPU, CUDA, Ascend NPU) and back.

```python
import torch_bridge
step = jaxprep.prepare_inputs(state, config)
inputs = torch_bridge.to_torch(step)               # zero-copy on the arrays' own device
meta = inputs.attn_metadata                        # vLLM CommonAttentionMetadata names and dtypes
inputs_npu = torch_bridge.to_npu(step)             # host-staged, FIA-padded (needs jaxprep[npu])
sampled = torch_bridge.from_torch(sampled_ids, name="sampled_token_ids")   # back to an int32 jax.Array
```

Needs the ``torch`` extra (``pip install jaxprep[torch]``); the NPU path needs ``jaxprep[npu]``.
"""

from torch_bridge._torch import torch  # noqa: F401  (fails first, with the extra to install)
from torch_bridge.dlpack import from_torch, jax_to_torch
from torch_bridge.features import TorchGroupMetadata
from torch_bridge.inputs import TorchAttentionMetadata, TorchStepInputs, step_arrays
from torch_bridge.npu import FIA_PAD_SEQ_LEN, NpuAttentionMetadata, fia_layout, to_npu
from torch_bridge.step import to_torch

__all__ = [
    "FIA_PAD_SEQ_LEN", "NpuAttentionMetadata", "TorchAttentionMetadata", "TorchGroupMetadata", "TorchStepInputs",
    "fia_layout", "from_torch", "jax_to_torch", "step_arrays", "to_npu", "to_torch",
]
