"""`prepare_inputs`: one jitted function from a `BatchState` to padded `StepInputs`.

Semantics follow vLLM V1 ``_prepare_inputs`` (docs/semantics.md#core-outputs) over the condensed batch.
`prepare_body` is the traced step and the one place that picks its path (``PrepConfig.kernel``: the
jnp step `xla_body`, or the fused Pallas kernels of `jaxprep.kernels.prepare_pallas`), `prepare_padded`
its jit, `prepare_inputs` picks the bucket, and `prepare_to_host` fetches the step to NumPy in one
transfer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import PAD_INPUT_ID, PAD_LOGITS_INDEX, PAD_POSITION, PAD_STATE_ROW
from jaxprep._ragged import batch_layout, stack, token_blocks
from jaxprep._ragged import slot_mapping as _slot_mapping
from jaxprep._typing import Array, Int32
from jaxprep.array_packing import INT32, Span, layout, pack_body
from jaxprep.bounds import BLOCK_ID_OUT_OF_RANGE, NULL_BLOCK, expect_bucket, safe_block_table, token_flags
from jaxprep.config import PrepConfig, triton_backend_available, uncovered_features
from jaxprep.features import with_features
from jaxprep.features.masks import compressed_causal_mask
from jaxprep.features.reorder import reordered_rows
from jaxprep.metadata import (
    STEP_FIELDS,
    AttentionMetadata,
    StepInputs,
    step_field_shapes,
    step_fields,
    step_from_fields,
)
from jaxprep.state import BatchState
from jaxprep.validate import (
    check_row_count,
    check_static,
    expect_state_and_config,
    flag_rows,
    raise_for_errors,
    validate,
)


def prepare_inputs(state: BatchState, config: PrepConfig, num_tokens_padded: int | None = None, *,
                   check: bool = False) -> StepInputs:
    """Prepares one step's model inputs and attention metadata.

    Args:
      state: the batch tables; rows with ``num_scheduled_tokens > 0`` form the batch.
      config: static configuration (hashable).
      num_tokens_padded: the step's padded token count. ``None`` reads the scheduled total back
        from the device and picks the smallest bucket of ``config.token_buckets`` that holds it;
        a serving loop that knows its total passes ``config.bucket_for(total)`` and stays
        asynchronous (and may call this inside its own ``jax.jit``).
      check: validate the state on the host first (`jaxprep.validate`), and read the step's
        error word after it (`jaxprep.validate`); raises `InvalidBatchError` naming the field
        and the bound. Without it nothing is read back: a loop reads ``step.errors`` when it likes.
    """
    expect_state_and_config("prepare_inputs", state, config)
    expect_bucket("prepare_inputs", num_tokens_padded)
    if num_tokens_padded is None:
        check_row_count(state, config)  # before the total: 5 rows of a 3-row config are a row-count error
        total = int(np.asarray(state.num_scheduled_tokens, dtype=np.int64).sum())
        if check:
            validate(state, config)
        num_tokens_padded = config.bucket_for(total) if total > 0 else config.token_buckets[0]
    elif check:
        validate(state, config, num_tokens_padded=num_tokens_padded)
    step = prepare_padded(state, config, int(num_tokens_padded))
    if check:
        raise_for_errors(step, config)
    if config.features.attn_mask == "compressed":  # one constant, not a per-step jit output
        step = dataclasses.replace(step, attn_mask=compressed_causal_mask())
    return step


def prepare_body(state: BatchState, config: PrepConfig, num_tokens_padded: int) -> StepInputs:
    """The traced body of `prepare_padded` (no jit of its own), for callers that fuse it further.

    Raises at trace time (no cost per call) if the state's shapes do not match ``config`` or
    ``num_tokens_padded`` is not a rung of ``config.token_buckets``. The one place that picks the
    XLA step (`xla_body`) or the fused Pallas step (`jaxprep.kernels.prepare_pallas.fused_step`).
    """
    check_static(state, config, num_tokens_padded)
    if uses_kernels(config):  # PrepConfig.kernel: the fused Pallas step (docs/guides/gpu.md)
        return _kernel_body(state, config, num_tokens_padded)  # the kernels flag and drop rows
    return xla_body(state, config, num_tokens_padded)


def xla_body(state: BatchState, config: PrepConfig, num_tokens_padded: int) -> StepInputs:
    """The step in jnp ops (``PrepConfig.kernel="xla"``, any backend): the fused kernels' twin."""
    state, row_errors = flag_rows(state, config, num_tokens_padded)  # flagged rows leave the batch
    num_reqs_padded = config.num_reqs_padded(num_tokens_padded)
    features = config.features
    order = reordered_rows(state, num_reqs_padded, features) if features.batch_order else None
    layout = batch_layout(state, num_reqs_padded, num_tokens_padded, config.max_num_batched_tokens, order)
    # ends [3,5,5,5] -> query_start_loc [0,3,5,5,5]; the padded tail repeats the total
    query_start_loc = jnp.pad(layout.ends, (1, 0))
    is_real_token = layout.is_real_token
    # position = t + shift[owner]: shift = computed - first token index of the owning request
    positions = jnp.where(is_real_token, jnp.arange(num_tokens_padded, dtype=jnp.int32) + layout.token_shift,
                          PAD_POSITION)
    # 2-D gathers: no flattened row * max_model_len index that could overflow int32; the clip only
    # matters for bad input on the unchecked path (a position past the table), see jaxprep.validate
    read_positions = jnp.clip(positions, 0, config.max_model_len - 1)
    input_ids = jnp.where(is_real_token, state.token_ids[layout.token_rows, read_positions], PAD_INPUT_ID)
    slot_mapping = _slot_mapping(state.block_table, layout.token_rows, positions, is_real_token, config.block_size,
                                 config.max_block_id)
    blocks = token_blocks(state.block_table, layout.token_rows, positions,
                          config.block_size * config.features.dcp_world_size)
    seq_lens = layout.computed + layout.scheduled  # padded rows: 0 + 0 = PAD_SEQ_LEN
    block_table, table_errors = safe_block_table(state.block_table, layout.rows, layout.row_seq_lens,
                                                 config.block_size * features.dcp_world_size,
                                                 config.max_block_id, BLOCK_ID_OUT_OF_RANGE)
    maxima = _maxima(state.num_scheduled_tokens, layout.row_seq_lens)
    attn_metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        slot_mapping=slot_mapping,
        block_table=block_table,
        num_actual_tokens=layout.num_actual_tokens,
        num_reqs=layout.num_reqs,
        max_query_len=maxima[0],
        max_seq_len=maxima[1],
    )
    step = StepInputs(
        input_ids=input_ids,
        positions=positions,
        logits_indices=jnp.where(layout.is_real_req, layout.ends - 1, PAD_LOGITS_INDEX),
        idx_mapping=jnp.where(layout.is_real_req, layout.rows, PAD_STATE_ROW),
        attn_metadata=attn_metadata,
        errors=row_errors | table_errors | token_flags(blocks, is_real_token, NULL_BLOCK),
        num_tokens_padded=num_tokens_padded,
    )
    if not features.any_on:
        return step
    return with_features(step, state, config, layout)


# --- the choice of path (PrepConfig.kernel) -----------------------------------------------------

@functools.cache
def cuda_devices_present() -> bool:
    """Whether this process has CUDA devices (jax's CUDA plugin, a GPU): only then may a step be lowered
    for CUDA here, so only then does ``"auto"`` trace the kernels."""
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:  # "Unknown backend cuda": no CUDA plugin or no GPU
        return False


def lowering_for_cuda() -> bool:
    """Whether a trace now may be lowered for CUDA: this process has CUDA devices, or the abstract mesh
    in force names a CUDA device (`jax.sharding.use_abstract_mesh`: lowering for a GPU without one)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return cuda_devices_present() or getattr(device, "platform", None) in ("cuda", "gpu")


def uses_kernels(config) -> bool:
    """Whether `PrepConfig.kernel` routes ``config``'s step to the kernels (decided when the step is traced):

    - ``"xla"``, or a feature the kernels do not cover: no;
    - ``"pallas"``: yes (Triton on CUDA, Pallas' interpreter elsewhere);
    - ``"auto"``: where this jax has the Triton backend and the trace may be lowered for CUDA
      (`lowering_for_cuda`); on a machine without a GPU the XLA step is traced alone, no kernel.
    """
    if config.kernel == "xla" or uncovered_features(config.features):
        return False
    return config.kernel == "pallas" or (triton_backend_available() and lowering_for_cuda())


def _kernel_body(state, config, num_tokens_padded: int) -> StepInputs:
    """The step as ``config.kernel`` picks it, resolved when lowering (`jax.lax.platform_dependent`):

    - ``"pallas"``: the Triton kernels on CUDA, the same kernels in Pallas' interpreter elsewhere;
    - ``"auto"``: the Triton kernels on CUDA, `xla_body` elsewhere (ROCm, CPU, TPU). A process that
      cannot lower for CUDA never gets here (`uses_kernels`).
    """
    from jaxprep.kernels.prepare_pallas import fused_step  # imported here: jax 0.11 deprecates its Triton backend

    compiled = functools.partial(fused_step, config=config, num_tokens_padded=num_tokens_padded, interpret=False)
    if config.kernel == "pallas":
        other = functools.partial(fused_step, config=config, num_tokens_padded=num_tokens_padded, interpret=True)
    else:
        other = functools.partial(xla_body, config=dataclasses.replace(config, kernel="xla"),
                                  num_tokens_padded=num_tokens_padded)
    return jax.lax.platform_dependent(state, cuda=compiled, default=other)


def _maxima(scheduled: Int32[Array, " max_num_reqs"],
            row_seq_lens: Int32[Array, " max_num_reqs"]) -> Int32[Array, " 2"]:
    """[max_query_len, max_seq_len] over the rows with work, read from the state rows directly.

    Equal to the maxima over the batch rows (every row with work is in the batch), but ready as
    soon as the step starts: on XLA:CPU fewer kernels then wait on the batch gather together, and
    more than 8 ready at once would hand work to the thread pool (a costly hand-off on a small host:
    docs/benchmarks-history.md, "Thread-pool hand-offs").
    """
    return jnp.max(stack([scheduled, row_seq_lens]), axis=1)  # one reduction for both


@functools.partial(jax.jit, static_argnames=("config", "num_tokens_padded"))
def prepare_padded(state: BatchState, config: PrepConfig, num_tokens_padded: int) -> StepInputs:
    """The compiled core of `prepare_inputs`: `prepare_body`, one executable per (config, num_tokens_padded).

    No host check and no bucket choice: ``num_tokens_padded`` is a rung of ``config.token_buckets``
    (a trace-time error otherwise); rows that do not fit set bits of ``step.errors``.
    """
    return prepare_body(state, config, num_tokens_padded)


# --- the step on the host, in one transfer ------------------------------------------------------
# prepare_padded returns a dozen device arrays; fetching them one by one costs more than the
# preparation itself at small batches on the CPU backend (docs/benchmarks-history.md, "Prepare alone").

HOST_PACKED = tuple((name, INT32) for name in STEP_FIELDS if name != "block_table")
"""The fields `prepare_packed` packs (all but the block table, which comes back as it is)."""


@functools.partial(jax.jit, static_argnames=("config", "num_tokens_padded"))
def prepare_packed(state: BatchState, config: PrepConfig, num_tokens_padded: int):
    """`prepare_body` with its fields packed (`host_layout`): returns (packed words, gathered block table)."""
    fields = step_fields(prepare_body(state, config, num_tokens_padded))
    return pack_body(fields, HOST_PACKED), fields["block_table"]


@functools.cache
def host_layout(num_tokens_padded: int, num_reqs_padded: int) -> tuple[Span, ...]:
    """Where `prepare_packed` puts each field: the `jaxprep.array_packing` layout of `HOST_PACKED`."""
    shapes = step_field_shapes(num_tokens_padded=num_tokens_padded, num_reqs_padded=num_reqs_padded)
    return layout(tuple((name, shapes[name], kind) for name, kind in HOST_PACKED))


def prepare_to_host(state: BatchState, config: PrepConfig, num_tokens_padded: int) -> StepInputs:
    """`prepare_padded`'s step as host NumPy arrays (scalars 0-d), views of one fetched buffer:
    two transfers instead of twelve."""
    expect_state_and_config("prepare_to_host", state, config)
    expect_bucket("prepare_to_host", num_tokens_padded, optional=False)
    words, block_table = prepare_packed(state, config, num_tokens_padded)
    return unpack_to_host(words, block_table, config, num_tokens_padded)


@functools.cache
def host_views(num_tokens_padded: int, num_reqs_padded: int) -> tuple[tuple[str, slice | tuple], ...]:
    """``(field, index)`` per field of `host_layout`: ``words[index]`` is the field's view, a slice or (a scalar)
    a 0-d view; `jaxprep.array_packing.unpack` of the layout, resolved once per bucket.

    ```
    # host_views(8, 3)[:2] -> (("input_ids", slice(0, 8)), ("positions", slice(8, 16))); errors -> (22, Ellipsis)
    ```
    """
    return tuple((span.name, slice(span.offset, span.offset + span.num_words) if span.shape else (span.offset, ...))
                 for span in host_layout(num_tokens_padded, num_reqs_padded))


def unpack_to_host(words, block_table, config: PrepConfig, num_tokens_padded: int) -> StepInputs:
    """Fetches `prepare_packed`'s outputs and hands out a `StepInputs` of NumPy views into them."""
    words = np.asarray(words)
    fields = {name: words[index] for name, index in host_views(num_tokens_padded,
                                                                config.num_reqs_padded(num_tokens_padded))}
    fields["block_table"] = np.asarray(block_table)
    return step_from_fields(fields, num_tokens_padded)

