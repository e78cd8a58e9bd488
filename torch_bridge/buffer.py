"""`to_torch` of a `jaxprep.step_buffer.StepBuffer`: ONE DLPack handoff of its words, every field a view.

A step that left its jitted call as one buffer (`jaxprep.serving.step.update_and_prepare_buffer`, the
``buffer`` of `jaxprep.serving.host.vllm.AdapterStep`) reaches torch without a pack of its own and without a
capsule per field: the words go through one ``torch.from_dlpack`` and the buffer's static `StepLayout` cuts
the views (`torch_bridge.array_views.unpack`), so every tensor shares the buffer's one storage. The layout
already follows vLLM's dtypes (``positions`` and the slot mappings int64, masks bool, sampling parameters
float32; `jaxprep.step_buffer.field_kind`); the host scalars and mirrors come from the buffer's tail, as in
the packed strategy (`torch_bridge.transfer.bridge_words`).
"""

from __future__ import annotations

import jax

from jaxprep.step_buffer import StepBuffer
from torch_bridge.inputs import TORCH_NAMES
from torch_bridge.transfer import Bridged, bridge_words


def bridge_buffer(buffer: StepBuffer, device):
    """``(step, bridged)``: the step's pytree with torch views (host scalars as Python ints) in place of
    its leaves, and the `Bridged` tensors `torch_bridge.inputs.assemble` builds `TorchStepInputs` from."""
    lay = buffer.layout
    if buffer.words.is_deleted():
        raise ValueError("StepBuffer.words was deleted (donated to a jitted update?) before it reached torch: "
                         "never donate a step that is still to be bridged")
    scalars = tuple(span.name for span in lay.spans[lay.num_device:lay.num_device + lay.num_scalars])
    bridged = bridge_words(buffer.words, lay.spans, lay.num_device, scalars, device, name="StepBuffer.words")
    views, values = bridged.device, bridged.scalars
    extras = tuple(buffer.extras)
    leaves = [values[name] if name in values else views[name] if index >= 0 else extras[-1 - index]
              for name, index in lay.leaves]
    step = jax.tree.unflatten(lay.treedef, leaves)
    device_views = {TORCH_NAMES.get(name, name): view for name, view in views.items()}
    bridged = Bridged(device=device_views, host=bridged.host,
                      scalars={name: value for name, value in values.items() if name != "attn_state"},
                      jax_buffers=(buffer.words, *extras))
    return step, bridged
