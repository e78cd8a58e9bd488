"""A fake torch_npu for the NPU tests on CPU (as vllm-ascend's unit tests fake it,
docs/semantics.md#ascend-without-npu).

The fake maps ``tensor.to("npu", ...)`` onto a CPU copy and records every pin and copy, so tests
check the staging path (pinned, non_blocking, one copy) and which tensors live "on the NPU". The
fixture that installs it is ``fake_npu`` in tests/torch_bridge/conftest.py.
"""

from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")


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


def install(npu: FakeNpu, monkeypatch) -> FakeNpu:
    """Puts ``npu`` in place of torch_npu until ``monkeypatch`` undoes it."""
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        device = args[0] if args else kwargs.get("device")
        if isinstance(device, str) and device.split(":")[0] == "npu":
            return npu.to(self, device, non_blocking=kwargs.get("non_blocking", False))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: npu.pin_memory(self))
    return npu
