"""A fake torch_npu for the NPU tests on CPU (as vllm-ascend's unit tests fake it, PEERS §2.6).

The fake maps ``tensor.to("npu", ...)`` onto a CPU copy and records every pin and copy, so tests
check the staging path (pinned, non_blocking, one copy) and which tensors live "on the NPU". The
fixture that installs it is ``fake_npu`` in tests/torch_bridge/conftest.py.
"""

from __future__ import annotations


class FakeNpu:
    """Records host->NPU staging; 'NPU' tensors are CPU copies kept in ``on_npu``."""

    def __init__(self):
        self.pinned, self.copies, self.on_npu = [], [], []

    def pin_memory(self, tensor, *args, **kwargs):
        pinned = tensor.clone()
        self.pinned.append(pinned.data_ptr())
        return pinned

    def to(self, tensor, device, non_blocking=False):
        self.copies.append(dict(device=str(device), non_blocking=non_blocking,
                                from_pinned=tensor.data_ptr() in self.pinned, numel=tensor.numel()))
        copy = tensor.clone()
        self.on_npu.append(copy)
        return copy

    def is_on_npu(self, tensor) -> bool:
        return any(tensor.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in self.on_npu)
