"""The ``fake_npu`` fixture of the NPU tests (`support.fake_npu`)."""

from __future__ import annotations

import sys
import types

import pytest


@pytest.fixture
def fake_npu(monkeypatch):
    """A fake ``torch_npu``: ``tensor.to("npu", ...)`` becomes a recorded CPU copy."""
    torch = pytest.importorskip("torch")
    from support.fake_npu import FakeNpu

    npu = FakeNpu()
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
