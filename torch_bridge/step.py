"""`to_torch`: a prepared `jaxprep.StepInputs` as torch tensors under vLLM's names and dtypes.

The tensors share memory with the step's JAX arrays (see `torch_bridge.inputs`, *Lifetime*);
``device="npu"`` goes through `torch_bridge.npu.to_npu`.
"""

from __future__ import annotations

from jaxprep.step_buffer import StepBuffer
from torch_bridge._checks import check_device
from torch_bridge._torch import device_type
from torch_bridge.buffer import bridge_buffer
from torch_bridge.features import feature_fields
from torch_bridge.inputs import TorchStepInputs, assemble, bridge_inputs, core_pack_spec, expect_step
from torch_bridge.npu import to_npu
from torch_bridge.transfer import bridge_packed, bridge_per_field

STEP_SPEC = core_pack_spec(int64_fields=("positions", "slot_mapping"))
"""positions and slot_mapping are int64 in vLLM's CUDA/CPU runners."""

STRATEGIES = {"packed": bridge_packed, "per_field": bridge_per_field}
DEFAULT_STRATEGY = "packed"
"""The faster one on a 2-core CPU host (benchmarks/bench_bridge.py): see README, torch_bridge."""


def to_torch(step_inputs, device=None, *, strategy: str = DEFAULT_STRATEGY, attn_state=None,
             attn_mask=None) -> TorchStepInputs:
    """The step as torch tensors on ``device`` (default: where its JAX arrays live).

    On the arrays' own device (CPU or CUDA) every int32 field is shared, not copied. ``device="npu"``
    goes through `torch_bridge.to_npu` (host staging, FIA padding). ``attn_state`` and ``attn_mask``
    override the step's own attributes of those names, if it has any.

    ``step_inputs`` may also be a `jaxprep.step_buffer.StepBuffer` (the step as one buffer, as the serving
    door hands it out): then its words make ONE DLPack handoff and every tensor is a view of that one
    storage, cut by the buffer's layout (`torch_bridge.buffer`; ``strategy`` does not apply).
    """
    if isinstance(step_inputs, StepBuffer):
        check_device("to_torch", device)
        if device_type(device) == "npu":
            return to_npu(step_inputs.inputs(), device, attn_state=attn_state, attn_mask=attn_mask)
        step, bridged = bridge_buffer(step_inputs, device)
        features = feature_fields(step, slot_kind=STEP_SPEC.slot_kind)
        return assemble(step, bridged, features, device, attn_state=attn_state, attn_mask=attn_mask)
    expect_step("to_torch", step_inputs)
    check_device("to_torch", device)
    if device_type(device) == "npu":
        return to_npu(step_inputs, device, attn_state=attn_state, attn_mask=attn_mask)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    arrays, pack_spec, features = bridge_inputs(step_inputs, STEP_SPEC)
    bridged = STRATEGIES[strategy](arrays, pack_spec, device)
    return assemble(step_inputs, bridged, features, device, attn_state=attn_state, attn_mask=attn_mask)
