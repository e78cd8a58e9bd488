"""`BatchState`: the persistent per-request tables one step is prepared from.

Rows are request slots (vLLM's persistent batch rows). A row with ``num_scheduled_tokens == 0``
takes no part in the step; the step's batch is the rows with work, in row order.

The fields after the four core tables are inputs of optional features (`jaxprep.FeatureConfig`):
``None`` (an empty pytree node) when not given; a feature that is on needs its fields.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import (
    NULL_BLOCK_ID,
)
from jaxprep._typing import Array, Bool, Float32, Int32
from jaxprep.config import PrepConfig
from jaxprep.features import registry

INT32 = np.dtype(np.int32)


@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class BatchState:
    """Immutable pytree of the batch tables; every field is a device array (registered below the class:
    `_rebuild`)."""

    token_ids: Int32[Array, "max_num_reqs max_model_len"]  # prompt, then outputs, then drafts
    block_table: Int32[Array, "max_num_reqs max_blocks_per_req"]  # 0 = null block past num_blocks
    num_computed_tokens: Int32[Array, " max_num_reqs"]  # tokens whose KV is already cached
    num_scheduled_tokens: Int32[Array, " max_num_reqs"]  # tokens to run this step; 0 = not in the batch
    # spec decode (docs/semantics.md#spec-decode): the last num_draft_tokens scheduled tokens of a row are drafts
    num_draft_tokens: Int32[Array, " max_num_reqs"] | None = None
    # prefill length: the prompt plus the outputs a resumed request recomputes (vLLM V2 prefill_len,
    # >= the prompt length); read by the discard mask (docs/semantics.md#logits-indices) and M-RoPE
    # (docs/semantics.md#m-rope)
    prefill_len: Int32[Array, " max_num_reqs"] | None = None
    # KV-cache groups 1..G-1 (docs/semantics.md#kv-groups); group 0 is block_table
    extra_block_tables: tuple[Int32[Array, "max_num_reqs _"], ...] | None = None
    # M-RoPE (docs/semantics.md#m-rope): prompt positions per request (-1 = missing) and the completion delta
    mrope_positions: Int32[Array, "max_num_reqs 3 max_model_len"] | None = None
    mrope_position_delta: Int32[Array, " max_num_reqs"] | None = None
    # prompt embeddings (docs/semantics.md#prompt-embeddings): False where a prompt position is an embedding; its pool
    # row is start + position
    is_token_ids: Bool[Array, "max_num_reqs max_model_len"] | None = None
    prompt_embeds_start: Int32[Array, " max_num_reqs"] | None = None
    # async scheduling (docs/semantics.md#async-scheduling): last step's outputs per last-step batch row, and each state
    # row's last-step row
    prev_sampled_token_ids: Int32[Array, " max_num_reqs"] | None = None
    prev_draft_token_ids: Int32[Array, "max_num_reqs num_speculative_tokens"] | None = None
    prev_batch_rows: Int32[Array, " max_num_reqs"] | None = None  # -1: not sampled last step
    # hybrid models (jaxprep.features.hybrid): the Mamba group's state blocks, accepted counts (spec decode),
    # prefill checkpoint offsets (0: none)
    mamba_block_table: Int32[Array, "max_num_reqs mamba_width"] | None = None
    num_accepted_tokens: Int32[Array, " max_num_reqs"] | None = None
    mamba_checkpoint_offsets: Int32[Array, " max_num_reqs"] | None = None
    # structured outputs (jaxprep.features.grammar): the request's block of rows in this step's bitmask; -1: none
    grammar_index: Int32[Array, " max_num_reqs"] | None = None
    # LoRA (jaxprep.features.lora): adapter id per state row (0: none), adapter id per GPU slot (-1: empty)
    lora_ids: Int32[Array, " max_num_reqs"] | None = None
    lora_slots: Int32[Array, " max_loras"] | None = None
    # sampling (jaxprep.features.sampling): vLLM V2's per-slot sampling rows, written at admission and never
    # reset at finish; seeds are int64 seeds as (high, low) int32 words
    temperature: Float32[Array, " max_num_reqs"] | None = None
    top_k: Int32[Array, " max_num_reqs"] | None = None
    top_p: Float32[Array, " max_num_reqs"] | None = None
    min_p: Float32[Array, " max_num_reqs"] | None = None
    seeds: Int32[Array, "max_num_reqs 2"] | None = None
    seeds_set: Bool[Array, " max_num_reqs"] | None = None
    repetition_penalty: Float32[Array, " max_num_reqs"] | None = None
    frequency_penalty: Float32[Array, " max_num_reqs"] | None = None
    presence_penalty: Float32[Array, " max_num_reqs"] | None = None
    prompt_bin_mask: Int32[Array, "max_num_reqs num_bin_words"] | None = None  # bit t%32 of word t//32: t in prompt
    output_bin_counts: Int32[Array, "max_num_reqs vocab_size"] | None = None  # times each token was output

    def __post_init__(self):
        check_leaves(self)

    @classmethod
    def empty(cls, config: PrepConfig) -> BatchState:
        """All-zero tables: no tokens, null blocks, nothing computed or scheduled.

        The inputs of every feature that ``config.features`` turns on are filled too: no drafts,
        prefill length 0, null blocks, M-RoPE positions missing (-1), all token ids, no last step,
        no adapter and empty adapter slots.
        """
        rows = config.max_num_reqs
        return cls(
            token_ids=jnp.zeros((rows, config.max_model_len), jnp.int32),
            block_table=jnp.full((rows, config.max_blocks_per_req), NULL_BLOCK_ID, jnp.int32),
            num_computed_tokens=jnp.zeros((rows,), jnp.int32),
            num_scheduled_tokens=jnp.zeros((rows,), jnp.int32),
            **jax.device_put(registry.empty_inputs(config)),
        )

    @classmethod
    def from_numpy(cls, *, token_ids, block_table, num_computed_tokens, num_scheduled_tokens,
                   **feature_inputs) -> BatchState:
        """Builds a state from host arrays (any integer dtype whose values fit int32).

        ``feature_inputs`` are the optional fields by name (``num_draft_tokens=...``, ...);
        ``extra_block_tables`` is a sequence of 2-D tables and ``is_token_ids`` a bool table.
        Shapes are checked for consistency with each other; `jaxprep.validate` checks them
        against a `PrepConfig`.
        """
        host = {
            "token_ids": _as_int32(token_ids, "token_ids", ndim=2),
            "block_table": _as_int32(block_table, "block_table", ndim=2),
            "num_computed_tokens": _as_int32(num_computed_tokens, "num_computed_tokens", ndim=1),
            "num_scheduled_tokens": _as_int32(num_scheduled_tokens, "num_scheduled_tokens", ndim=1),
        }
        host.update(_feature_inputs_as_host(feature_inputs))
        rows = host["token_ids"].shape[0]
        for name, value in host.items():
            if name in NOT_PER_ROW:
                continue
            for array in value if isinstance(value, tuple) else (value,):
                if array.shape[0] != rows:
                    raise ValueError(f"BatchState.{name} has {array.shape[0]} rows, but token_ids has {rows}")
        return cls(**jax.device_put(host))

    def to_numpy(self) -> dict[str, np.ndarray]:
        """Host copies of every field that is set, by name (a tuple field gives a tuple of arrays)."""
        host = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                host[f.name] = tuple(np.asarray(v) for v in value)
            elif value is not None:
                host[f.name] = np.asarray(value)
        return host


_OPTIONAL_NDIM = {
    "num_draft_tokens": 1, "prefill_len": 1, "mrope_positions": 3, "mrope_position_delta": 1,
    "prompt_embeds_start": 1, "prev_sampled_token_ids": 1, "prev_draft_token_ids": 2, "prev_batch_rows": 1,
    "mamba_block_table": 2, "num_accepted_tokens": 1, "mamba_checkpoint_offsets": 1, "grammar_index": 1,
    "lora_ids": 1, "lora_slots": 1, "top_k": 1, "seeds": 2, "prompt_bin_mask": 2, "output_bin_counts": 2,
}
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
"""Optional fields of float32 values (each 1-D)."""
OPTIONAL_FIELDS = (*_OPTIONAL_NDIM, *_FLOAT_FIELDS, "extra_block_tables", "is_token_ids", "seeds_set")
"""`BatchState` fields that only optional features read."""
NOT_PER_ROW = frozenset({"lora_slots"})
"""Optional fields not indexed by state row (``lora_slots`` has ``max_loras`` entries)."""


_BOOL_FIELDS = ("is_token_ids", "seeds_set")
_NDIM = {"token_ids": 2, "block_table": 2, "num_computed_tokens": 1, "num_scheduled_tokens": 1, **_OPTIONAL_NDIM,
         "is_token_ids": 2, "seeds_set": 1, **dict.fromkeys(_FLOAT_FIELDS, 1), "extra_block_tables": 2}


def _is_concrete_array(value) -> bool:
    """A host array or a device array with its values (not a tracer, a ShapeDtypeStruct or another leaf
    JAX puts in a pytree it rebuilds)."""
    return isinstance(value, np.ndarray) or (isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer))


def check_leaves(state: BatchState) -> None:
    """The dtype and rank of every field that holds an array, and one row count for the per-row fields.

    Runs whichever constructor built ``state`` (`from_numpy` converts first; a direct ``BatchState(...)``
    gets no conversion, so a float, bool or int64 table is rejected here instead of being cast or
    wrapped inside the step). Leaves that are not concrete arrays are skipped: JAX rebuilds the pytree
    with tracers and other leaves while tracing. JAX also rebuilds it from every jitted call's outputs,
    so the walk is kept short: the per-field expectations are computed once (`_field_checks`), the walk
    goes over the state's ``__dict__``, and an absent (None) feature costs one comparison.
    """
    token_ids = state.token_ids
    rows = token_ids.shape[0] if _is_concrete_array(token_ids) and token_ids.ndim else None
    checks = _field_checks()
    for name, value in vars(state).items():
        if value is None:
            continue
        expected, ndim, per_row = checks[name]
        for i, array in enumerate(value if type(value) is tuple else (value,)):
            if isinstance(array, jax.core.Tracer) or not isinstance(array, (np.ndarray, jax.Array)):
                continue  # not a concrete array (`_is_concrete_array`, inlined: this runs per leaf per call)
            shape = array.shape
            if array.dtype != expected or len(shape) != ndim or (per_row and rows is not None and shape[0] != rows):
                _raise_bad_leaf(f"{name}[{i}]" if type(value) is tuple else name, array, expected, ndim,
                                per_row, rows)


@functools.cache
def _field_checks() -> dict[str, tuple[np.dtype, int, bool]]:
    """field name -> (expected dtype, rank, indexed by state row), for every `BatchState` field."""
    return {f.name: (np.dtype(bool if f.name in _BOOL_FIELDS else np.float32 if f.name in _FLOAT_FIELDS else INT32),
                     _NDIM[f.name], f.name not in NOT_PER_ROW)
            for f in dataclasses.fields(BatchState)}


def _raise_bad_leaf(name: str, array, expected: np.dtype, ndim: int, per_row: bool, rows: int | None) -> None:
    if array.dtype != expected:
        raise TypeError(f"BatchState.{name} has dtype {array.dtype}, expected {expected} (build the state "
                        f"with BatchState.from_numpy, which converts integer tables whose values fit int32)")
    if array.ndim != ndim:
        raise ValueError(f"BatchState.{name} must be {ndim}-D, got shape {tuple(array.shape)}")
    raise ValueError(f"BatchState.{name} has {array.shape[0]} rows, but token_ids has {rows}")


_FIELDS = tuple(f.name for f in dataclasses.fields(BatchState))
_field_values = operator.attrgetter(*_FIELDS)  # a state's fields as a tuple, in field order
_FIELD_KEYS = tuple(jax.tree_util.GetAttrKey(name) for name in _FIELDS)


def _rebuild(_, leaves) -> BatchState:
    """A `BatchState` from its pytree children, as JAX rebuilds one from every jitted call's outputs: the
    fields written into a new object's ``__dict__`` at once, then `check_leaves`, as ``__init__`` and
    ``__post_init__`` do. The pytree registration a dataclass gets (`jax.tree_util.register_dataclass`)
    calls ``BatchState(**fields)`` instead, whose frozen ``__init__`` sets the 31 fields one
    ``object.__setattr__`` at a time: that cost ~2.5x this, ~10 µs per serving step on a loaded 2-core host
    (docs/benchmarks-history.md, "The XLA step (TPU's path)")."""
    state = object.__new__(BatchState)
    state.__dict__.update(zip(_FIELDS, leaves))
    check_leaves(state)
    return state


# data fields only (every field), keyed by attribute as register_dataclass keys them
jax.tree_util.register_pytree_with_keys(
    BatchState, lambda state: (tuple(zip(_FIELD_KEYS, _field_values(state))), None), _rebuild,
    flatten_func=lambda state: (_field_values(state), None))


def _feature_inputs_as_host(feature_inputs: dict) -> dict:
    host = {}
    for name, value in feature_inputs.items():
        if name not in OPTIONAL_FIELDS:
            raise TypeError(f"BatchState.from_numpy got an unexpected field {name!r}")
        if value is None:
            continue
        if name == "extra_block_tables":
            host[name] = tuple(_as_int32(t, f"{name}[{g}]", ndim=2) for g, t in enumerate(value))
        elif name in ("is_token_ids", "seeds_set"):
            host[name] = _as_bool(value, name, ndim=2 if name == "is_token_ids" else 1)
        elif name in _FLOAT_FIELDS:
            host[name] = _as_float32(value, name)
        else:
            host[name] = _as_int32(value, name, ndim=_OPTIONAL_NDIM[name])
    return host


def _as_float32(value, name: str) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != 1:
        raise ValueError(f"BatchState.{name} must be 1-D, got shape {array.shape}")
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise TypeError(f"BatchState.{name} must hold numbers, got dtype {array.dtype}")
    return array.astype(np.float32)


def _as_bool(value, name: str, *, ndim: int) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != ndim:
        raise ValueError(f"BatchState.{name} must be {ndim}-D, got shape {array.shape}")
    if array.dtype != np.bool_:
        raise TypeError(f"BatchState.{name} must hold bools, got dtype {array.dtype}")
    return array


def _as_int32(value, name: str, *, ndim: int) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != ndim:
        raise ValueError(f"BatchState.{name} must be {ndim}-D, got shape {array.shape}")
    if array.dtype == INT32:
        return array
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"BatchState.{name} must hold integers, got dtype {array.dtype}")
    info = np.iinfo(INT32)
    if array.size and (array.min() < info.min or array.max() > info.max):
        raise ValueError(f"BatchState.{name} has values outside int32 [{info.min}, {info.max}]")
    return array.astype(INT32)
