"""Moving a step's named int32 arrays to torch: one packed buffer, or one DLPack capsule per field.

Both strategies give the same tensors; `benchmarks/bench_bridge.py` measures which is faster.
Values needed as Python ints (``num_reqs`` ...) and the host mirrors vLLM keeps
(``query_start_loc_cpu``, ``seq_lens_cpu``) come from the buffer's tail: free when JAX runs on
the CPU, one small device-to-host copy when it runs on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxprep.array_packing import INT32, INT64, FieldSpec, Span, layout_of, pack
from torch_bridge._torch import device_type, torch
from torch_bridge.array_views import unpack
from torch_bridge.dlpack import jax_to_torch


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """Which arrays a bridge carries, in buffer order.

    The host region (scalars, then host-mirrored arrays) is last, so one copy of the buffer's tail
    brings every host value.
    """

    device_only: FieldSpec  # (name, kind): views on the target device only
    scalars: tuple[str, ...]  # 0-d arrays, read back as Python ints
    host_mirrored: tuple[str, ...]  # views on the target device and on the host

    @property
    def spec(self) -> FieldSpec:
        return self.device_only + tuple((name, INT32) for name in self.scalars + self.host_mirrored)

    @functools.cached_property
    def slot_kind(self) -> str:
        """How ``slot_mapping`` is carried (the KV-cache groups' slot mappings follow it)."""
        return dict(self.device_only)["slot_mapping"]


@functools.lru_cache(maxsize=64)
def with_fields(pack_spec: PackSpec, extra: FieldSpec) -> PackSpec:
    """``pack_spec`` with ``extra`` device-only fields (a step's optional features) after its own."""
    return dataclasses.replace(pack_spec, device_only=pack_spec.device_only + extra) if extra else pack_spec


@dataclasses.dataclass(frozen=True)
class Bridged:
    """What a strategy hands to the step assembler."""

    device: dict[str, torch.Tensor]  # every array field on the target device
    host: dict[str, torch.Tensor]  # the host-mirrored fields on the CPU
    scalars: dict[str, int]
    jax_buffers: tuple[jax.Array, ...]  # the JAX arrays whose memory the tensors share


def transfer(tensor: torch.Tensor, device) -> torch.Tensor:
    """``tensor`` on ``device``: itself when it is there already, else one explicit copy.

    Host to accelerator goes through pinned memory with ``non_blocking=True``; the caching host
    allocator keeps the pinned block alive until the copy has run.
    """
    if device is None or _same_device(tensor.device, device):
        return tensor
    if tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def convert_leaf(value, device):
    """A JAX array as a (zero-copy) tensor on ``device``; a tensor moved there; anything else as is."""
    if isinstance(value, jax.Array):
        value = jax_to_torch(value)
    return transfer(value, device) if isinstance(value, torch.Tensor) else value


def check_live(arrays: dict[str, jax.Array]) -> None:
    """Raises if a step's array was donated (deleted) before it reached torch."""
    for name, array in arrays.items():
        if array.is_deleted():
            raise ValueError(f"StepInputs field {name} was deleted (donated to a jitted update?) before "
                             "it reached torch: never donate a step that is still to be bridged")


def host_tensor(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The CPU one of (source, target), or a blocking copy of ``source`` when neither is on the CPU."""
    for tensor in (source, target):
        if tensor.device.type == "cpu":
            return tensor
    return source.cpu()


def bridge_packed(arrays: dict[str, jax.Array], pack_spec: PackSpec, device) -> Bridged:
    """One jitted pack, one DLPack capsule, then views (int64 fields are views too)."""
    spec = pack_spec.spec
    packed = pack(arrays, spec)
    spans = layout_of(arrays, spec)
    return bridge_words(packed, spans, len(pack_spec.device_only), pack_spec.scalars, device)


def bridge_words(packed: jax.Array, spans: tuple[Span, ...], num_device_only: int, scalars: tuple[str, ...],
                 device, name: str = "packed step") -> Bridged:
    """Torch views of a packed buffer laid out as ``spans`` (device fields, then ``scalars``, then the
    host-mirrored fields): one DLPack capsule, at most one transfer of the whole buffer and, when both
    sides are accelerators, one device-to-host copy of its tail."""
    source = jax_to_torch(packed, name)
    target = transfer(source, device)
    start, host_region = _host_region(spans, num_device_only, len(scalars))
    views = unpack(target, spans[:num_device_only] + host_region)
    if source.device.type == "cpu":  # JAX's own host buffer, shared
        host = views if target is source else unpack(source, host_region)
    elif target.device.type == "cpu":
        host = views
    else:  # one device-to-host copy of the buffer's tail
        host = unpack(source[start:].cpu(), host_region, base=start)
    return Bridged(device=views, host=host, scalars=dict(zip(scalars, host["scalars"].tolist())),
                   jax_buffers=(packed,))


def bridge_per_field(arrays: dict[str, jax.Array], pack_spec: PackSpec, device) -> Bridged:
    """One DLPack capsule per field; INT64 fields are cast to int64 by torch (a copy each)."""
    fields = pack_spec.device_only + tuple((name, INT32) for name in pack_spec.host_mirrored)
    source = {name: jax_to_torch(arrays[name], name) for name, _ in fields}
    target = {name: transfer(source[name].to(torch.int64) if kind == INT64 else source[name], device)
              for name, kind in fields}
    # a blocking read each (free on the CPU); the packed strategy reads them in one copy
    scalar_values = [np.asarray(arrays[name]) for name in pack_spec.scalars]
    return Bridged(device=target,
                   host={name: host_tensor(source[name], target[name]) for name in pack_spec.host_mirrored},
                   scalars={name: int(value) for name, value in zip(pack_spec.scalars, scalar_values)},
                   jax_buffers=tuple(arrays[name] for name, _ in fields))


@functools.lru_cache(maxsize=512)
def _host_region(spans: tuple[Span, ...], num_device_only: int, num_scalars: int) -> tuple[int, tuple[Span, ...]]:
    """First word of the host region, and its spans: the scalars as one chunk, then the mirrored arrays."""
    start = spans[num_device_only].offset
    scalars = Span("scalars", start, (num_scalars,), INT32, num_scalars)
    return start, (scalars,) + spans[num_device_only + num_scalars:]


def _same_device(current: torch.device, device) -> bool:
    if device_type(device) != current.type:
        return False
    index = torch.device(device).index
    return current.type == "cpu" or index is None or index == current.index
