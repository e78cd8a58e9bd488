"""What the bridge checks before it moves anything: a device it can target, named in its own words,
and a step whose fields agree with each other (one bucket, one configuration).

A step is usually `prepare_inputs`' output, whose fields agree by construction. One assembled by
hand (``dataclasses.replace`` of fields from two steps, a relabelled ``num_tokens_padded``) would
otherwise be bridged as it is, and the model would read one bucket's tokens with another's slots.
"""

from __future__ import annotations

import re

import jax
import numpy as np

from jaxprep.metadata import step_field_shapes
from torch_bridge._torch import torch

DEVICE_TYPES = ("cpu", "cuda", "npu")
_DEVICE_STRING = re.compile(r"^(cpu|cuda|npu)(:(\d+))?$")


def check_device(function: str, device) -> None:
    """``device`` is None, ``"cpu"``, ``"cuda[:N]"`` or ``"npu[:N]"`` (or a torch.device of those
    types), and a CUDA device is one torch sees; raises ValueError naming the device otherwise.
    # "bogus", "CPU", "meta", 3 -> ValueError naming it; "cuda:1" on a one-GPU host -> ValueError
    """
    if device is None:
        return
    if isinstance(device, str) and _DEVICE_STRING.match(device):
        match = _DEVICE_STRING.match(device)
        kind, index = match[1], None if match[3] is None else int(match[3])
    elif isinstance(device, (str, torch.device)):
        try:
            parsed = torch.device(device)
        except RuntimeError:
            lower = f" (lower case: {device.lower()!r})" if _DEVICE_STRING.match(device.lower()) else ""
            raise ValueError(f"{function}: device {device!r} is not a device torch_bridge can target{lower}: "
                             "give 'cpu', 'cuda', 'cuda:N', 'npu', 'npu:N' or a torch.device of those types") from None
        kind, index = parsed.type, parsed.index
    else:
        hint = f" (a CUDA ordinal? give 'cuda:{device}')" if isinstance(device, int) else ""
        raise ValueError(f"{function}: device {device!r} is not a device torch_bridge can target{hint}: give "
                         "'cpu', 'cuda', 'cuda:N', 'npu', 'npu:N' or a torch.device of those types")
    if kind not in DEVICE_TYPES:
        raise ValueError(f"{function}: device {device!r} is not one torch_bridge can target: a {kind} tensor "
                         f"{'holds no data' if kind == 'meta' else 'is not supported'}; give cpu, cuda or npu")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{function}: device {device!r}: torch sees no CUDA device "
                             "(torch.cuda.is_available() is False)")
        if index is not None and index >= count:
            raise ValueError(f"{function}: device {device!r}: torch sees {count} CUDA device(s), "
                             f"cuda:0..cuda:{count - 1}")


def check_consistent(function: str, step_inputs, arrays: dict) -> None:
    """The step's core fields have the shapes of one bucket and one configuration: every per-token
    field ``num_tokens_padded`` entries, every per-request field the same ``num_reqs_padded`` (read
    from ``logits_indices``), the block table ``max_blocks_per_req`` columns (read from itself).
    Raises ValueError naming the first field that disagrees.
    # num_tokens_padded 16 but input_ids (8,) -> "input_ids has shape (8,), ... needs (16,)"
    """
    tokens_padded = step_inputs.num_tokens_padded
    if isinstance(tokens_padded, bool) or not isinstance(tokens_padded, (int, np.integer)):
        raise TypeError(f"{function}: num_tokens_padded must be an int, got {type(tokens_padded).__name__}")
    shapes = {name: tuple(np.shape(value)) for name, value in arrays.items()}
    block_table = shapes.get("block_table_tensor", ())
    sizes = dict(num_tokens_padded=int(tokens_padded), num_reqs_padded=(shapes["logits_indices"] or (0,))[0],
                 max_blocks_per_req=block_table[1] if len(block_table) == 2 else -1)
    expected = step_field_shapes(**sizes)
    expected["block_table_tensor"] = expected.pop("block_table")
    for name, shape in expected.items():
        if shapes.get(name) != shape:
            raise ValueError(
                f"{function}: the step's fields disagree: {name} has shape {shapes.get(name)}, but "
                f"num_tokens_padded={sizes['num_tokens_padded']} and num_reqs_padded={sizes['num_reqs_padded']} "
                f"(from logits_indices) need {shape}: fields from two buckets or two configs, or a relabelled "
                "num_tokens_padded? Bridge the step prepare_inputs returned, as it is")


def as_jax(name: str, value) -> jax.Array:
    """A step field as a `jax.Array`: itself, or a NumPy array (a `jaxprep.prepare_to_host` step)
    placed on JAX's CPU device, from where DLPack hands it to torch; anything else raises naming the field."""
    if isinstance(value, jax.Array):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        if value.dtype.kind not in "iub":
            raise TypeError(f"step field {name} holds {value.dtype} values; a step's fields are int32 (or bool)")
        return jax.device_put(value, jax.devices("cpu")[0])
    raise TypeError(f"step field {name} is a {type(value).__name__}; expected a jax.Array (prepare_inputs) or a "
                    "NumPy array (prepare_to_host)")
