"""Checks shared by the torch_bridge tests."""

from __future__ import annotations

import jax

JAX_TORCH_DEVICE = "cuda" if jax.default_backend() == "gpu" else "cpu"
"""torch device type of a tensor bridged from JAX's default device, without a copy."""


def assert_views_of(buffer, tensors: dict, *, disjoint: bool = True) -> None:
    """Every tensor lies inside the JAX ``buffer``'s memory (no copy); with ``disjoint``, none overlap."""
    start = buffer.unsafe_buffer_pointer()
    end = start + buffer.size * buffer.dtype.itemsize
    ranges = []
    for name, tensor in tensors.items():
        first, last = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
        assert start <= first and last <= end, f"{name} is not a view of the buffer"
        ranges.append((first, last, name))
    ranges.sort()
    if disjoint:
        for (_, a_end, a_name), (b_start, _, b_name) in zip(ranges, ranges[1:]):
            assert a_end <= b_start, f"{a_name} and {b_name} overlap"
