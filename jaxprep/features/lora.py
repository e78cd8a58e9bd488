"""LoRA metadata of a step (`FeatureConfig.lora`): request, slot and kernel level, all inside the jit.

vLLM builds it on the host, then in torch: per-request ids (V1
`vllm/v1/worker/gpu_input_batch.py::InputBatch.make_lora_inputs`, V2
`vllm/v1/worker/gpu/lora_utils.py::LoraState.make_lora_inputs`), slot indices
(`vllm/lora/punica_wrapper/utils.py::convert_mapping`), the punica kernels' sort
(`vllm/lora/ops/triton_ops/lora_kernel_metadata.py::LoRAKernelMeta.prepare_tensors`) and the CUDA-graph
key (`jaxprep.features.lora_config`). Here everything is integer ops on static shapes.

The adapter swap (loading weights into slots) is the caller's: `BatchState.lora_slots` says which
adapter id each GPU slot holds (-1: empty), `BatchState.lora_ids` which adapter each request uses
(0: none). Slot-level "none" is -1 (`NO_LORA_SLOT`), as in vLLM.

Sizes: ``T_pad`` tokens; the prompt mapping has ``P_pad`` rows: ``min(T_pad, R_pad * (K + 1))``
logits rows (V1) or ``R_pad`` requests (V2). Real counts are in ``indices_len``; pads are the
constants of `jaxprep._constants`.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import (
    EMPTY_LORA_SLOT,
    NO_LORA_ID,
    NO_LORA_SLOT,
    PAD_ACTIVE_LORA_ID,
    PAD_LORA_TOKEN_START_LOC,
    PAD_NUM_TOKENS_PER_LORA,
    PAD_SAMPLER_INDEX_PADDED,
)
from jaxprep._ragged import prefix_sum, stack, take_rows, token_request_index
from jaxprep._typing import Array, Bool, Int32, StepArray
from jaxprep.bounds import InvalidBatchError
from jaxprep.features.flags import LORA_ID_NOT_LOADED, LORA_SLOTS_INVALID
from jaxprep.features.record import Feature
from jaxprep.features.spec_decode import padded_sizes


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class LoRAKernelMeta:
    """vLLM ``LoRAKernelMeta`` for one mapping (tokens or logits rows); ``n`` = its padded length."""

    token_indices_sorted_by_lora_ids: Int32[StepArray, " n"]  # stable sort by slot; tail [count, n): identity
    active_lora_ids: Int32[StepArray, " max_loras_plus_1"]  # distinct slots ascending (-1 first); pad -1
    num_tokens_per_lora: Int32[StepArray, " max_loras_plus_1"]  # entries per active id; pad 0
    lora_token_start_loc: Int32[StepArray, " max_loras_plus_2"]  # [0, cumsum(counts)]; pad 0
    num_active_loras: Int32[StepArray, ""]  # distinct ids (-1 counted), rounded to a captured count; 0: no LoRA

    @property
    def sorted_token_indices(self) -> Int32[StepArray, " n"]:
        """Short name of ``token_indices_sorted_by_lora_ids``."""
        return self.token_indices_sorted_by_lora_ids


@jax.tree_util.register_dataclass
@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class LoRAMetadata:
    """A step's LoRA inputs under vLLM's names (`jaxprep.features.lora`)."""

    token_lora_mapping: Int32[StepArray, " num_tokens_padded"]  # adapter id per token; pad 0
    prompt_lora_mapping: Int32[StepArray, " num_prompt_padded"]  # adapter id per logits row (V1) / request (V2); pad 0
    token_lora_indices: Int32[StepArray, " num_tokens_padded"]  # slot per token, -1: none; pad -1
    sampler_indices: Int32[StepArray, " num_prompt_padded"]  # slot per prompt-mapping row, -1: none; pad -1
    sampler_indices_padded: Int32[StepArray, " num_prompt_padded"]  # j + L * (slot, -1 -> max_loras); pad -1
    embeddings_indices: Int32[StepArray, " num_tokens_padded"] | None  # slot * vocab_size (none: 0); pad 0
    indices_len: Int32[StepArray, " 4"]  # real lengths [N, L, L, N] of the four arrays above
    token_mapping_meta: LoRAKernelMeta  # over token_lora_indices
    prompt_mapping_meta: LoRAKernelMeta  # over sampler_indices
    num_active_loras: Int32[StepArray, ""]  # distinct adapters of the scheduled requests
    cudagraph_num_active_loras: Int32[StepArray, ""]  # the CUDA-graph key's value (V1 / V2 rule)


def adapter_slots(lora_ids: Int32[Array, " n"], lora_slots: Int32[Array, " max_loras"]) -> Int32[Array, " n"]:
    """The GPU slot holding each adapter id; -1 for no adapter (and, on unchecked input, an unloaded one).

    ```
    # lora_slots [3, -1, 7, -1], lora_ids [7, 0, 3, 9] -> [2, -1, 0, -1]
    ```
    """
    match = (lora_ids[:, None] == lora_slots[None, :]) & (lora_ids[:, None] > NO_LORA_ID)
    return jnp.where(jnp.any(match, axis=1), jnp.argmax(match, axis=1).astype(jnp.int32), NO_LORA_SLOT)


def lora_metadata(lora_ids, lora_slots, rows, is_real_req, drafts, token_rows, is_real_token, query_start_loc,
                  features) -> LoRAMetadata:
    """The step's `LoRAMetadata`; batch-row inputs as `jaxprep._ragged.Layout` holds them."""
    lora = features.lora
    if tuple(lora_slots.shape) != (lora.max_loras,):
        raise ValueError(f"BatchState.lora_slots has shape {tuple(lora_slots.shape)}, config expects "
                         f"({lora.max_loras},) (LoRAConfig.max_loras)")
    state_slots = adapter_slots(lora_ids, lora_slots)
    req_ids = jnp.where(is_real_req, take_rows(lora_ids, rows, fill_value=NO_LORA_ID), NO_LORA_ID)
    req_slots = jnp.where(is_real_req, take_rows(state_slots, rows, fill_value=NO_LORA_SLOT), NO_LORA_SLOT)
    token_slots = jnp.where(is_real_token, state_slots[token_rows], NO_LORA_SLOT)
    prompt_ends, prompt_owner, prompt_ids, prompt_slots = _prompt_mapping(req_ids, req_slots, is_real_req, drafts,
                                                                          token_rows.shape[0], features)
    # state row -> batch row, so each token knows its batch row:
    # rows [5, 1, 2, 3], token rows [5,5,5, 1,1, ...] -> token batch rows [0,0,0, 1,1, ...]
    max_num_reqs = lora_ids.shape[0]  # padded rows (max_num_reqs) write a spare entry, cut off after
    batch_of_state = jnp.zeros((max_num_reqs + 1,), jnp.int32).at[jnp.clip(rows, 0, max_num_reqs)].set(
        jnp.arange(rows.shape[0], dtype=jnp.int32), mode="promise_in_bounds")[:max_num_reqs]
    num_tokens, num_prompt = query_start_loc[-1], prompt_ends[-1]
    row = jnp.arange(prompt_slots.shape[0], dtype=jnp.int32)
    # sampler_indices [2,2,2,-1,0,2,2], L 7, max_loras 4 -> row + 7 * [2,2,2,4,0,2,2] = [14,15,16,31,4,19,20]
    padded = row + num_prompt * jnp.where(prompt_slots == NO_LORA_SLOT, lora.max_loras, prompt_slots)
    token_meta, prompt_meta, num_adapters = kernel_metas(
        req_slots, is_real_req, (query_start_loc[1:], batch_of_state[token_rows]), (prompt_ends, prompt_owner),
        not lora.prompt_per_logits_row(features.runner), lora)
    return LoRAMetadata(
        token_lora_mapping=jnp.where(is_real_token, lora_ids[token_rows], NO_LORA_ID),
        prompt_lora_mapping=prompt_ids,
        token_lora_indices=token_slots,
        sampler_indices=prompt_slots,
        sampler_indices_padded=jnp.where(row < num_prompt, padded, PAD_SAMPLER_INDEX_PADDED),
        embeddings_indices=(None if lora.vocab_size is None
                            else jnp.maximum(token_slots, 0) * jnp.int32(lora.vocab_size)),
        indices_len=jnp.stack([num_tokens, num_prompt, num_prompt, num_tokens]),
        token_mapping_meta=token_meta,
        prompt_mapping_meta=prompt_meta,
        num_active_loras=num_adapters,
        cudagraph_num_active_loras=_lookup(lora.graph_key_table(features.runner), num_adapters),
    )


def _prompt_mapping(req_ids, req_slots, is_real_req, drafts, num_tokens_padded: int, features):
    """(row ends per request, each row's batch row, adapter id and slot per row) in the runner's layout.

    ```
    # V1, D [2, 1, 0, 0] -> n = D + 1 [3, 2, 1, 1], ends [3, 5, 6, 7], rows of [0,0,0, 1,1, 2, 3]:
    #   ids [7, 7, 3, 0] -> [7,7,7, 7,7, 3, 0]
    # V2 -> one row per request: ends [1, 2, 3, 4], ids [7, 7, 3, 0]
    ```
    """
    num_reqs_padded = is_real_req.shape[0]
    if not features.lora.prompt_per_logits_row(features.runner):
        batch_row = jnp.arange(num_reqs_padded, dtype=jnp.int32)
        ends = jnp.minimum(batch_row + 1, jnp.sum(is_real_req, dtype=jnp.int32))  # real rows come first
        return ends, batch_row, req_ids, req_slots
    num_logits_padded, _ = padded_sizes(num_tokens_padded, num_reqs_padded, features.num_speculative_tokens)
    ends = prefix_sum(jnp.where(is_real_req, drafts + 1, 0), num_tokens_padded)
    owner = token_request_index(ends, num_logits_padded)
    is_real_row = jnp.arange(num_logits_padded, dtype=jnp.int32) < ends[-1]
    return (ends, owner, jnp.where(is_real_row, req_ids[owner], NO_LORA_ID),
            jnp.where(is_real_row, req_slots[owner], NO_LORA_SLOT))


def kernel_metas(req_slots: Int32[Array, " num_reqs_padded"], is_real_req: Bool[Array, " num_reqs_padded"],
                 tokens: tuple[Array, Array], prompt: tuple[Array, Array], prompt_per_request: bool, lora):
    """(`LoRAKernelMeta` of the tokens, of the prompt-mapping rows, distinct adapters in the step).

    ``tokens`` and ``prompt``: (row ends per request ``[R_pad]``, batch row of each row ``[n]``).

    Request b owns token rows ``[token_ends[b-1], token_ends[b])`` (prompt rows likewise), all in
    slot ``req_slots[b]``, so a stable sort of the rows by slot is a stable sort of the requests by
    slot, each keeping its rows in order. One sort of the requests serves both mappings, and both
    hold the same slot indices (every request has tokens and logits rows).

    ```
    # slots [2, -1, 0, 2], token ends [3, 9, 10, 12] -> requests by slot [1, 2, 0, 3]
    #   -> sorted rows [3,4,5,6,7,8, 9, 0,1,2, 10,11]; ids [-1, 0, 2], counts [6, 1, 5], start [0, 6, 7, 12]
    ```
    """
    order = jnp.argsort(jnp.where(is_real_req, req_slots, lora.max_loras), stable=True).astype(jnp.int32)
    hit, to_front, active, num_ids, num_adapters = _active_slots(req_slots, is_real_req, lora.max_loras)
    (token_ends, token_owner), (prompt_ends, prompt_owner) = tokens, prompt
    ends = stack([token_ends, prompt_ends])
    counts = ends - jnp.pad(ends[:, :-1], ((0, 0), (1, 0)))  # [2, R_pad]: token rows, prompt rows
    per_id = jnp.sum(jnp.where(hit[None], counts[:, :, None], 0), axis=1)  # [2, width]
    moved = jnp.sum(jnp.where(to_front[None], per_id[:, None, :], 0), axis=2)  # [2, width] by front position
    per_lora = jnp.where(jnp.any(to_front, axis=1)[None], moved, PAD_NUM_TOKENS_PER_LORA)
    starts = jnp.where(jnp.arange(lora.max_loras + 1) < num_ids, _small_cumsum(per_lora), PAD_LORA_TOKEN_START_LOC)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32), unique_indices=True)
    num_active = jnp.where(num_adapters > 0, _lookup(lora.kernel_count_table(), num_ids), 0)
    sorted_rows = (_sorted_rows(order, rank, token_ends, token_owner),
                   order if prompt_per_request else _sorted_rows(order, rank, prompt_ends, prompt_owner))
    token_meta, prompt_meta = (
        LoRAKernelMeta(token_indices_sorted_by_lora_ids=sorted_rows[i], active_lora_ids=active,
                       num_tokens_per_lora=per_lora[i], lora_token_start_loc=jnp.pad(starts[i], (1, 0)),
                       num_active_loras=num_active) for i in range(2))
    return token_meta, prompt_meta, num_adapters


def _active_slots(req_slots: Int32[Array, " num_reqs_padded"], is_real_req: Bool[Array, " num_reqs_padded"],
                  max_loras: int):
    """The slot indices of the step's requests, ascending and compacted to the front (vLLM's ``unique``).

    Returns ``hit [R_pad, W]`` (request b is in slot ``k - 1``; W = max_loras + 1 buckets for -1 ..
    max_loras - 1), ``to_front [W, W]`` (bucket k goes to front position i), ``active_lora_ids [W]``,
    the number of distinct indices and of distinct adapters (-1 not counted). With no adapter at all
    nothing is active (vLLM returns early and leaves its buffers reset).

    ```
    # slots [2, -1, 0, 2], max_loras 4 -> buckets hit [T, T, F, T, F] -> active [-1, 0, 2, -1, -1], 3 ids, 2 adapters
    ```
    """
    ids = jnp.arange(-1, max_loras, dtype=jnp.int32)
    hit = is_real_req[:, None] & (req_slots[:, None] == ids[None, :])
    present = jnp.any(hit, axis=0)
    num_adapters = jnp.sum(present[1:], dtype=jnp.int32)
    present = present & (num_adapters > 0)
    front = _small_cumsum(present.astype(jnp.int32)) - 1  # present [T, T, F, T, F] -> front [0, 1, -, 2, -]
    to_front = present[None, :] & (front[None, :] == jnp.arange(max_loras + 1, dtype=jnp.int32)[:, None])
    active = jnp.where(jnp.any(to_front, axis=1), jnp.sum(jnp.where(to_front, ids[None, :], 0), axis=1),
                       PAD_ACTIVE_LORA_ID)
    return hit, to_front, active, jnp.sum(present, dtype=jnp.int32), num_adapters


def _sorted_rows(order: Int32[Array, " num_reqs_padded"], rank: Int32[Array, " num_reqs_padded"],
                 ends: Int32[Array, " num_reqs_padded"], owner: Int32[Array, " n"]) -> Int32[Array, " n"]:
    """Rows of the requests taken in ``order`` (``rank``: its inverse), each request's rows in place;
    ``owner``: batch row of each row. The padded tail is the identity.

    Every row moves by its request's shift, the request's start in sorted order minus its own start:

    ```
    # order [1, 2, 0, 3], ends [3, 9, 10, 12] -> starts [0, 3, 9, 10], sorted starts [7, 0, 6, 10]
    #   -> shifts [7, -3, -3, 0]; rows 0..11 go to [7,8,9, 0,1,2,3,4,5, 6, 10,11] -> [3,4,5,6,7,8, 9, 0,1,2, 10,11]
    ```
    """
    counts = ends - jnp.pad(ends[:-1], (1, 0))
    sorted_counts = counts[order]
    sorted_starts = prefix_sum(sorted_counts, owner.shape[0]) - sorted_counts
    shift = sorted_starts[rank] - (ends - counts)
    row = jnp.arange(owner.shape[0], dtype=jnp.int32)
    dest = jnp.where(row < ends[-1], row + shift[owner], row)
    return jnp.zeros_like(row).at[dest].set(row, mode="drop", unique_indices=True)


def _small_cumsum(values: Int32[Array, "*k w"]) -> Int32[Array, "*k w"]:
    """Inclusive cumsum along the last (short: max_loras + 1) axis as one masked sum, not a scan.

    ```
    # [6, 1, 5] -> lower triangle [[1,0,0], [1,1,0], [1,1,1]] -> [6, 7, 12]
    ```
    """
    width = values.shape[-1]
    lower = np.tril(np.ones((width, width), bool))
    return jnp.sum(jnp.where(lower, values[..., None, :], 0), axis=-1, dtype=jnp.int32)


def _lookup(table: tuple[int, ...], index: Int32[Array, ""]) -> Int32[Array, ""]:
    """``table[index]`` for a static table, the index clipped into it."""
    return jnp.asarray(np.asarray(table, np.int32))[jnp.clip(index, 0, len(table) - 1)]


# --- host checks (jaxprep.validate) -------------------------------------------------------------

def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Shapes of the LoRA fields of `BatchState` under ``config`` ({} with LoRA off)."""
    lora = config.features.lora
    return {} if lora is None else {"lora_ids": (config.max_num_reqs,), "lora_slots": (lora.max_loras,)}


def check_lora_inputs(lora_ids: np.ndarray, lora_slots: np.ndarray, in_batch: np.ndarray) -> None:
    """Slots hold -1 or distinct ids >= 1; each scheduled request's id is 0 or a loaded adapter."""
    bad = np.flatnonzero((lora_slots < EMPTY_LORA_SLOT) | (lora_slots == NO_LORA_ID))
    if len(bad):
        raise InvalidBatchError(f"lora_slots[{bad[0]}] is {int(lora_slots[bad[0]])}: a slot holds "
                                f"{EMPTY_LORA_SLOT} (empty) or an adapter id >= 1")
    loaded = lora_slots[lora_slots > NO_LORA_ID]
    values, first = np.unique(loaded, return_index=True)
    if len(values) != len(loaded):
        twice = int(loaded[np.setdiff1d(np.arange(len(loaded)), first)[0]])
        raise InvalidBatchError(f"lora_slots holds adapter {twice} in two slots: {lora_slots.tolist()}")
    negative = np.flatnonzero(in_batch & (lora_ids < NO_LORA_ID))
    if len(negative):
        row = int(negative[0])
        raise InvalidBatchError(f"lora_ids at row {row} is {int(lora_ids[row])}, which is below {NO_LORA_ID} "
                                f"(0: no LoRA; adapter ids are >= 1)")
    missing = np.flatnonzero(in_batch & (lora_ids > NO_LORA_ID) & ~np.isin(lora_ids, loaded))
    if len(missing):
        row = int(missing[0])
        raise InvalidBatchError(f"lora_ids at row {row} is {int(lora_ids[row])}, which no slot of lora_slots "
                                f"{lora_slots.tolist()} holds: load the adapter into a slot first")


# --- the record (jaxprep.features.registry) -----------------------------------------------------

def _unloaded_adapters(lora_ids, lora_slots, in_batch):
    """Scheduled rows whose adapter id is negative, or held by no slot or by two (`lora.check_lora_inputs`).

    ```
    # slots [3, -1, 7, 3], ids [7, 0, 3, 9, -2] -> matches [1, -, 2, 0, -] -> bad [F, F, T, T, T]
    ```
    """
    matches = jnp.sum(lora_ids[:, None] == lora_slots[None, :], axis=1, dtype=jnp.int32)
    return in_batch & ((lora_ids < NO_LORA_ID) | ((lora_ids > NO_LORA_ID) & (matches != 1)))


def _state_flags(state, config) -> list[tuple[int, Bool[Array, ""]]]:
    """``(bit, flag)`` for the bound that belongs to no state row: the LoRA slots."""
    slots = state.lora_slots
    # one adapter in two slots: a pair (i < j) of equal ids >= 1
    pairs = (slots[:, None] == slots[None, :]) & (slots[:, None] > NO_LORA_ID) & np.triu(
        np.ones((slots.shape[0],) * 2, bool), 1)
    return [(LORA_SLOTS_INVALID, jnp.any((slots < EMPTY_LORA_SLOT) | (slots == NO_LORA_ID)) | jnp.any(pairs))]


def _empty_inputs(config) -> dict[str, np.ndarray]:
    return {"lora_ids": np.full((config.max_num_reqs,), NO_LORA_ID, np.int32),
            "lora_slots": np.full((config.features.lora.max_loras,), EMPTY_LORA_SLOT, np.int32)}


def _metadata(build) -> None:
    state, layout = build.state, build.layout
    build.outputs["lora"] = lora_metadata(state.lora_ids, state.lora_slots, layout.rows, layout.is_real_req,
                                          build.drafts, layout.token_rows, layout.is_real_token,
                                          build.step.attn_metadata.query_start_loc, build.config.features)


FEATURE = Feature(
    name="lora",
    is_on=lambda features: features.lora is not None,
    inputs=lambda features: {"lora_ids": "lora", "lora_slots": "lora"},
    empty_inputs=_empty_inputs,
    check_values=lambda host, computed, scheduled, config: check_lora_inputs(
        host["lora_ids"].astype(np.int64), host["lora_slots"].astype(np.int64), scheduled > 0),
    row_flags=lambda state, config, in_batch: [
        (LORA_ID_NOT_LOADED, _unloaded_adapters(state.lora_ids, state.lora_slots, in_batch))],
    state_flags=_state_flags,
    messages=lambda config: {
        LORA_ID_NOT_LOADED: f"lora_ids of a scheduled row is below {NO_LORA_ID}, or no slot (or two slots) of "
                            f"lora_slots holds it",
        LORA_SLOTS_INVALID: f"lora_slots holds a value that is neither {EMPTY_LORA_SLOT} (empty) nor an adapter "
                            f"id >= 1, or one adapter in two slots"},
    metadata=_metadata,
)
