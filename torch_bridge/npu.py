"""Ascend NPU: staged through host memory, laid out for FIA (``npu_fused_infer_attention_score``).

JAX has no NPU backend and DLPack has no Ascend device type, so the step is packed on JAX's CPU
device, taken zero-copy as a CPU tensor, copied once into pinned memory and sent with one
``.to("npu", non_blocking=True)``; the fields are views of that one NPU buffer.

FIA's rules (docs/semantics.md#fia-layout), applied by `fia_layout` inside a jitted function:
- ``slot_mapping`` stays int32 (``reshape_and_cache`` wants it), padded tokens -1;
  ``positions`` int64, ``input_ids`` int32;
- in TND layout the last cumulative query length must equal the padded token count: when the step
  is padded, a dummy request after the real ones holds the padded tokens (``qsl[-1] == T_pad``);
- ``seq_lens`` rows past the real requests hold `FIA_PAD_SEQ_LEN` and block-table rows hold the
  null block, so every row of the FIA batch is well formed;
- FIA takes host lists: ``actual_seq_lengths_q`` (cumulative) and ``seq_lens_list`` (per request),
  one entry per request of the FIA batch (the real requests plus the dummy, if any).

The optional features ride in the same buffer: each KV-cache group's block table gets the FIA
rows too, and its slot mapping stays int32 like the step's; the other features are as on CPU/CUDA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import Array

from jaxprep import NULL_BLOCK_ID
from torch_bridge._torch import device_type, import_torch_npu
from torch_bridge.inputs import (
    TorchAttentionMetadata,
    TorchStepInputs,
    assemble,
    bridge_inputs,
    core_pack_spec,
    expect_step,
)
from torch_bridge.transfer import bridge_packed

FIA_PAD_SEQ_LEN = 1
"""``seq_lens`` of the dummy request and of padded rows on the NPU (jaxprep pads with 0 elsewhere)."""

NPU_SPEC = core_pack_spec(int64_fields=("positions",))
"""slot_mapping stays int32 here: Ascend's reshape_and_cache takes int32 slots."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class NpuAttentionMetadata(TorchAttentionMetadata):
    """`TorchAttentionMetadata` in FIA's layout (one extra batch row), plus FIA's host lists.

    ``query_start_loc`` is [num_reqs_padded + 2], ``seq_lens`` [num_reqs_padded + 1] and
    ``block_table_tensor`` [num_reqs_padded + 1, W]; the FIA batch is their first
    ``len(actual_seq_lengths_q)`` rows.
    """

    actual_seq_lengths_q: list[int]  # query_start_loc[1 : fia_batch + 1], ends with num_tokens_padded
    seq_lens_list: list[int]  # seq_lens[:fia_batch], FIA_PAD_SEQ_LEN for the dummy request


@functools.partial(jax.jit, static_argnames=("group_block_tables",))
def fia_layout(arrays: dict[str, Array], group_block_tables: tuple[str, ...] = ()) -> dict[str, Array]:
    """`step_arrays` with query_start_loc, seq_lens and the block tables in FIA's layout.

    Row ``num_reqs`` becomes the dummy request, holding the padded tokens; later rows are empty.
    ``group_block_tables`` names the KV-cache groups' block tables, laid out like block_table_tensor.

    ```
    # T_pad 8, num_reqs 2 of 3 rows: qsl [0,3,5,5] -> [0,3,5,8,8]  (the dummy holds tokens 5..7)
    #   seq_lens [7,2,0] -> [7,2,1,1];  block_table rows [b0,b1,0] -> [b0,b1,0,0]
    ```
    """
    num_tokens_padded = arrays["input_ids"].shape[0]
    num_reqs = arrays["num_reqs"]
    query_start_loc = jnp.append(arrays["query_start_loc"], num_tokens_padded)
    query_start_loc = jnp.where(jnp.arange(query_start_loc.shape[0]) <= num_reqs, query_start_loc,
                                num_tokens_padded)
    rows = jnp.arange(arrays["seq_lens"].shape[0] + 1)
    seq_lens = jnp.where(rows < num_reqs, jnp.append(arrays["seq_lens"], FIA_PAD_SEQ_LEN), FIA_PAD_SEQ_LEN)
    block_tables = {name: _fia_block_table(arrays[name], rows < num_reqs)
                    for name in ("block_table_tensor",) + group_block_tables}
    return {**arrays, "query_start_loc": query_start_loc.astype(jnp.int32), "seq_lens": seq_lens.astype(jnp.int32),
            **block_tables}


def _fia_block_table(block_table: Array, is_real_row: Array) -> Array:
    """One more row; rows of no real request hold the null block. [R_pad, W] -> [R_pad + 1, W]"""
    padded = jnp.pad(block_table, ((0, 1), (0, 0)))
    return jnp.where(is_real_row[:, None], padded, NULL_BLOCK_ID).astype(jnp.int32)


def to_npu(step_inputs, device="npu", *, attn_state=None, attn_mask=None) -> TorchStepInputs:
    """The step on an Ascend NPU in FIA's layout, with `NpuAttentionMetadata`.

    ``attn_state`` / ``attn_mask`` override the step's own attributes of those names (jaxprep's
    attention-state function). A mask that is not already on the NPU is copied there on every
    call: create the constant mask on the NPU once and pass that tensor.
    """
    expect_step("to_npu", step_inputs)
    import_torch_npu()
    if device_type(device) != "npu":
        raise ValueError(f"to_npu needs an npu device, got {device!r}")
    arrays, pack_spec, features = bridge_inputs(step_inputs, NPU_SPEC)
    bridged = bridge_packed(fia_layout(arrays, features.group_block_tables), pack_spec, device)
    scalars, host = bridged.scalars, bridged.host
    fia_batch = scalars["num_reqs"] + int(scalars["num_actual_tokens"] < step_inputs.num_tokens_padded)
    return assemble(step_inputs, bridged, features, device, attn_state=attn_state, attn_mask=attn_mask,
                    metadata_cls=NpuAttentionMetadata,
                    actual_seq_lengths_q=host["query_start_loc"][1:fia_batch + 1].tolist(),
                    seq_lens_list=host["seq_lens"][:fia_batch].tolist())
