"""The ``fake_npu`` fixture of the NPU tests (`support.fake_npu`)."""

from __future__ import annotations

import pytest


@pytest.fixture
def fake_npu(monkeypatch):
    """A fake ``torch_npu``: ``tensor.to("npu", ...)`` becomes a recorded CPU copy."""
    pytest.importorskip("torch")
    from support.fake_npu import FakeNpu, install

    return install(FakeNpu(), monkeypatch)
