"""Single arrays across the JAX/PyTorch boundary through DLPack, in both directions.

JAX -> torch: `jax_to_torch` is zero-copy on the array's own device (CPU or CUDA). On CUDA,
``torch.from_dlpack`` hands torch's current stream to ``jax.Array.__dlpack__``, and JAX makes that
stream wait for the computation that produces the array: no host sync, no race.

torch -> JAX: `from_torch` (sampled token ids back into the batch state) is zero-copy when the
tensor is int32, contiguous and 64-byte aligned, and makes an explicit, checked copy otherwise.
"""

from __future__ import annotations

import jax

from jaxprep._constants import INT32_MAX, INT32_MIN
from jaxprep.bounds import expect
from torch_bridge._torch import device_type, torch

JAX_ALIGNMENT = 64
"""Bytes: XLA adopts an external buffer only at this alignment (it copies a buffer at 32)."""

_DLPACK_DEVICES = ("cpu", "cuda")


def jax_to_torch(array: jax.Array, name: str = "array") -> torch.Tensor:
    """A torch tensor sharing ``array``'s memory. The tensor keeps the buffer alive.

    While torch holds it, PJRT sees an external reference and will not reuse the buffer for a
    donated argument (see `torch_bridge.inputs`, *Lifetime*).
    """
    expect("jax_to_torch", name, array, jax.Array, "a jax.Array", "jax.numpy.asarray(x) makes one")
    if array.is_deleted():
        raise ValueError(f"{name} was deleted (donated to a jitted update?) before it reached torch")
    if next(iter(array.devices())).platform == "cpu":
        # host memory has no stream to order: the bare capsule skips torch.from_dlpack's device
        # probing (half the cost of the call); JAX still waits until the array is computed
        return torch.utils.dlpack.from_dlpack(array.__dlpack__())
    return torch.from_dlpack(array)  # passes torch's current stream to array.__dlpack__


def from_torch(tensor: torch.Tensor, *, name: str = "tensor", copy: bool | None = None) -> jax.Array:
    """An int32 `jax.Array` holding ``tensor``'s values, e.g. sampled token ids for the state update.

    Args:
      tensor: an integer tensor on CPU or CUDA (other devices are staged through host memory).
      name: used in error messages.
      copy: ``None`` shares memory where it can and copies explicitly otherwise; ``False`` raises
        `BufferError` instead of copying; ``True`` always copies.

    int64 (and other integer) tensors are range-checked and cast, which is a copy: a value outside
    int32 raises `ValueError` naming the tensor and the bound, never wraps. On CUDA the check
    reads two scalars back to the host.
    """
    expect("from_torch", name, tensor, torch.Tensor, "a torch.Tensor",
           "torch.from_numpy(array) wraps a NumPy array; jax.numpy.asarray(array) takes one without torch")
    if tensor.dtype in (torch.bool,) or tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        raise TypeError(f"{name} must hold integers, got dtype {tensor.dtype}")
    reason = _copy_reason(tensor)
    if reason is not None and copy is False:
        raise BufferError(f"{name} cannot be shared with JAX without a copy: {reason}")
    if reason is None and not copy:
        return _share(tensor, name)
    return _share(_int32_copy(tensor, name), name)


def _copy_reason(tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` cannot be handed to JAX as it is, or None if it can."""
    if device_type(tensor.device) not in _DLPACK_DEVICES:
        return f"it lives on {tensor.device}, which JAX cannot address"
    if tensor.dtype != torch.int32:
        return f"dtype {tensor.dtype} is not int32"
    if not tensor.is_contiguous():
        return "it is not contiguous"
    if tensor.data_ptr() % JAX_ALIGNMENT:
        return f"its data pointer is not {JAX_ALIGNMENT}-byte aligned"
    return None


def _int32_copy(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """A fresh, contiguous int32 copy on a device JAX can address (host for anything else)."""
    if device_type(tensor.device) not in _DLPACK_DEVICES:
        tensor = tensor.cpu()
    if tensor.dtype != torch.int32 and tensor.numel():
        low, high = int(tensor.min()), int(tensor.max())
        if low < INT32_MIN or high > INT32_MAX:
            bad = low if low < INT32_MIN else high
            raise ValueError(f"{name} holds {bad}, outside int32 [{INT32_MIN}, {INT32_MAX}]: "
                             "it cannot be cast without wrapping")
    # a new allocation: torch aligns it to at least 64 bytes on CPU and CUDA
    return tensor.to(torch.int32, copy=True, memory_format=torch.contiguous_format)


def _share(tensor: torch.Tensor, name: str) -> jax.Array:
    array = jax.dlpack.from_dlpack(tensor)
    if tensor.numel() and array.unsafe_buffer_pointer() != tensor.data_ptr():
        raise BufferError(f"JAX copied {name} although it was expected to share its memory")
    return array
