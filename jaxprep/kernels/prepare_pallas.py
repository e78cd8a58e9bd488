"""The step as two Pallas (Triton) launches: `jaxprep.prepare.xla_step` with every feature off, or
with the features the kernels cover (`jaxprep.config.KERNEL_FEATURES`: spec decode, model runner
V2's batch order and logits indirection).

On an NVIDIA GPU a step's host time is its launch count (~6.5 µs per kernel launch, BENCHMARKS.md);
XLA's plain step is 16-20 kernels there, 19-25 with spec decode and V2's outputs. Two Triton kernels
compute the same outputs with the same padding: the work vLLM's model runner V2 spreads over five to
six kernels (`vllm/v1/worker/gpu/input_batch.py`, `vllm/v1/worker/gpu/block_table.py`) and a host
prefix sum and sort:

- launch 1, `jaxprep.kernels.rows.rows_kernel`: the batch rows (in state-row order by one scan, or
  in a batch order by ranking every row), every per-request output, the 0-d counts and the error
  bits of the counts, bad rows dropped;
- launch 2, `jaxprep.kernels.tokens.tokens_kernel`: per program one token block, one logits-row
  block, one draft-row block and one block-table row.

Its XLA twin is `jaxprep.prepare.xla_step` (the jnp step, ``PrepConfig.kernel="xla"``), and
`jaxprep.prepare` alone picks between them: this module never imports it. The tests run both on the
same batches, the kernels in Pallas' interpreter on CPU. Every read index is clamped into its
array before the read, so bad input on the unchecked path reads in bounds, and every output equals
the XLA path's bit for bit, bad input included (tests/core/test_fast_path_errors.py,
tests/features/test_kernel_features.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxprep._constants import INT32_MAX
from jaxprep.features.logits_indirection import LogitsIndirection
from jaxprep.features.spec_decode import SpecDecodeMetadata
from jaxprep.kernels import rows, tokens
from jaxprep.kernels.common import COMPILER_PARAMS, Sizes, named
from jaxprep.metadata import AttentionMetadata, StepInputs


def _varying_like(shapes: dict, array) -> tuple[jax.ShapeDtypeStruct, ...]:
    """``shapes`` varying over the mesh axes ``array`` varies over: inside ``jax.shard_map`` (which checks
    what varies, `jaxprep.sharding.prepare_sharded`) a kernel's outputs vary as the state rows do; outside
    it there are no such axes. A jax without the attribute gets the shapes as they are."""
    axes = getattr(jax.typeof(array), "manual_axis_type", None)
    if axes is None:
        return tuple(shapes.values())
    return tuple(jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=axes) for s in shapes.values())


def _launch(body, sizes: Sizes, in_names, out_shapes: dict, args: dict, *, interpret: bool, name: str, grid: int,
            aliases: dict | None = None) -> dict:
    """One ``pallas_call`` of ``body`` with named inputs and outputs; returns its outputs by name."""
    out_names = tuple(out_shapes)
    aliases = {in_names.index(i): out_names.index(o) for i, o in (aliases or {}).items()}
    outs = pl.pallas_call(named(body, in_names + out_names, sizes=sizes), name=name, grid=(grid,),
                          out_shape=_varying_like(out_shapes, args["num_scheduled_tokens"]),
                          input_output_aliases=aliases, interpret=interpret,
                          compiler_params=COMPILER_PARAMS)(*[args[n] for n in in_names])
    return dict(zip(out_names, outs, strict=True))


def fused_step(state, config, num_tokens_padded: int, *, interpret: bool) -> StepInputs:
    """The step as the two kernels (``interpret``: Pallas' interpreter, any backend)."""
    sizes = Sizes.of(state, config, num_tokens_padded)
    if sizes.order == "v2" and 8 * (num_tokens_padded + 1) > INT32_MAX:  # rows._sort_key's bound
        raise ValueError(f"num_tokens_padded={num_tokens_padded}: V2's sort key overflows int32 in the kernels")
    args = dict(num_computed_tokens=state.num_computed_tokens, num_scheduled_tokens=state.num_scheduled_tokens,
                num_draft_tokens=state.num_draft_tokens, token_ids=state.token_ids, block_table=state.block_table)
    row = _launch(rows.rows_kernel, sizes, rows.inputs(sizes), rows.outputs(sizes), args, interpret=interpret,
                  name="jaxprep_prepare_rows", grid=sizes.num_row_programs)
    if sizes.logits_rows:
        row["logits_ends"] = row["cu_num_logits" if tokens.logits_ends_first(sizes) else "cu_num_sampled_tokens"]
    token = _launch(tokens.tokens_kernel, sizes, tokens.inputs(sizes), tokens.outputs(sizes),
                    dict(args, **row, errors_in=row["errors"], seen_in=row["seen"]), interpret=interpret,
                    name="jaxprep_prepare_tokens", grid=max(sizes.num_token_blocks, sizes.num_reqs_padded),
                    aliases=tokens.ERROR_ALIASES)
    return _step(row, token, sizes)


def _step(row: dict, token: dict, sizes: Sizes) -> StepInputs:
    """The kernels' outputs as the `StepInputs` of the XLA path ((1,) scalars reshaped to 0-d)."""
    scalar = functools.partial(jnp.reshape, shape=())
    features = {}
    if sizes.spec_decode:
        features["spec_decode"] = SpecDecodeMetadata(
            num_draft_tokens=row["num_draft_tokens_out"], cu_num_draft_tokens=row["cu_num_draft_tokens"],
            cu_num_sampled_tokens=row["cu_num_sampled_tokens"], logits_indices=token["spec_logits_indices"],
            target_logits_indices=token["target_logits_indices"], bonus_logits_indices=row["bonus_logits_indices"],
            draft_token_ids=token["draft_token_ids"], max_spec_len=scalar(row["max_spec_len"]))
    if sizes.indirection:
        features["logits_indirection"] = LogitsIndirection(
            cu_num_logits=row["cu_num_logits"], logits_indices=token["indirection_logits_indices"],
            expanded_idx_mapping=token["expanded_idx_mapping"], expanded_local_pos=token["expanded_local_pos"],
            logits_pos=token["logits_pos"], logits_input_ids=token["logits_input_ids"],
            is_padding=token["is_padding"], num_draft_tokens_per_req=row["num_draft_tokens_per_req"])
    return StepInputs(
        input_ids=token["input_ids"], positions=token["positions"], logits_indices=row["logits_indices"],
        idx_mapping=row["idx_mapping"],
        attn_metadata=AttentionMetadata(
            query_start_loc=row["query_start_loc"], seq_lens=row["seq_lens"], slot_mapping=token["slot_mapping"],
            block_table=token["tables"], num_actual_tokens=scalar(row["num_actual_tokens"]),
            num_reqs=scalar(row["num_reqs"]), max_query_len=scalar(row["max_query_len"]),
            max_seq_len=scalar(row["max_seq_len"])),
        errors=scalar(token["errors"]), num_tokens_padded=sizes.num_tokens_padded, **features)
