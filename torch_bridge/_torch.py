"""The one place torch_bridge imports PyTorch (and, lazily, torch_npu), with errors naming the extra."""

from __future__ import annotations

try:
    import torch
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("torch_bridge needs PyTorch, an optional extra of jaxprep: "
                      "pip install jaxprep[torch]") from error

NPU_EXTRA_HINT = "pip install jaxprep[npu]"


def import_torch_npu():
    """Imports torch_npu on first use; a missing or broken install raises one ImportError.

    torch_npu fails in several ways on a host without CANN (ImportError, OSError from a missing
    shared library, RuntimeError from its device probe); all of them name the extra to install.
    """
    try:
        import torch_npu
    except (ImportError, OSError, RuntimeError) as error:
        raise ImportError(f"the Ascend NPU path of torch_bridge needs torch_npu and CANN: {NPU_EXTRA_HINT} "
                          f"(importing torch_npu failed: {error})") from error
    return torch_npu


def device_type(device) -> str:
    """'cuda:1' -> 'cuda'. Works on strings too, since plain torch rejects torch.device('npu')."""
    return device.type if isinstance(device, torch.device) else str(device).split(":")[0]


__all__ = ["NPU_EXTRA_HINT", "device_type", "import_torch_npu", "torch"]
