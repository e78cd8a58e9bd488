"""Sampling metadata of a step (`FeatureConfig.sampling`): every logits row's sampling parameters.

vLLM V2 keeps the parameters per state slot (`vllm/v1/worker/gpu/sample/states.py::SamplingStates`,
written at admission by ``add_request`` and never reset when a request finishes) and its sampler
reads them per logits row through ``expanded_idx_mapping``
(`vllm/v1/worker/gpu/sample/sampler.py::Sampler.__call__`). Here the gather happens inside the
step: `SamplingMetadata` holds each logits row's parameters, its state slot, its place among its
request's rows, its position and input id (what the penalties and the seeded noise read), and
vLLM's host flags, computed over the step's requests.

Rows are the logits rows of `jaxprep.features.logits_indirection` (``D + 1`` per request under spec
decode, one otherwise), padded to ``L_pad`` with the neutral values of `jaxprep._constants`
(``PAD_TEMPERATURE`` ...): a padded row is a plain argmax with seed 0, as vLLM's gumbel kernel reads
a row with ``idx < 0``.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import (
    INT32_MAX,
    PAD_FREQUENCY_PENALTY,
    PAD_MIN_P,
    PAD_PRESENCE_PENALTY,
    PAD_REPETITION_PENALTY,
    PAD_SEED,
    PAD_TEMPERATURE,
    PAD_TOP_P,
)
from jaxprep._ragged import take_rows
from jaxprep._typing import Array, Bool, Float32, Int32, StepArray
from jaxprep.bounds import InvalidBatchError
from jaxprep.features.flags import (
    FREQUENCY_PENALTY_NOT_FINITE,
    MIN_P_OUT_OF_RANGE,
    PRESENCE_PENALTY_NOT_FINITE,
    REPETITION_PENALTY_OUT_OF_RANGE,
    TEMPERATURE_OUT_OF_RANGE,
    TOP_K_OUT_OF_RANGE,
    TOP_P_OUT_OF_RANGE,
)
from jaxprep.features.record import Feature

FLOAT_PARAMS = {"temperature": PAD_TEMPERATURE, "top_p": PAD_TOP_P, "min_p": PAD_MIN_P,
                "repetition_penalty": PAD_REPETITION_PENALTY, "frequency_penalty": PAD_FREQUENCY_PENALTY,
                "presence_penalty": PAD_PRESENCE_PENALTY}
"""The float32 sampling parameters and their neutral (pad, never-written) values."""
STATE_FIELDS = (*FLOAT_PARAMS, "top_k", "seeds", "seeds_set", "prompt_bin_mask", "output_bin_counts")
"""The `BatchState` fields of the sampling feature."""


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per logits row (``L_pad`` rows, ``cu_num_logits[-1]`` real) parameters and per-step flags."""

    idx_mapping: Int32[StepArray, " num_logits_padded"]  # state slot (V2 expanded_idx_mapping); pad -1
    expanded_local_pos: Int32[StepArray, " num_logits_padded"]  # row's index inside its request; pad 0
    pos: Int32[StepArray, " num_logits_padded"]  # position of the row's token (logits_pos); pad 0
    input_ids: Int32[StepArray, " num_logits_padded"]  # input id of the row's token (logits_input_ids); pad 0
    cu_num_logits: Int32[StepArray, " num_reqs_padded_plus_1"]  # [0, cumsum(D + 1)]; pad repeats L
    temperature: Float32[StepArray, " num_logits_padded"]  # 0: greedy; pad 0
    top_k: Int32[StepArray, " num_logits_padded"]  # in [1, V], V: off; pad V
    top_p: Float32[StepArray, " num_logits_padded"]  # in (0, 1], 1: off; pad 1
    min_p: Float32[StepArray, " num_logits_padded"]  # in [0, 1], 0: off; pad 0
    seeds: Int32[StepArray, "num_logits_padded 2"]  # int64 seed as (high, low) words; pad 0
    repetition_penalty: Float32[StepArray, " num_logits_padded"]  # pad 1
    frequency_penalty: Float32[StepArray, " num_logits_padded"]  # pad 0
    presence_penalty: Float32[StepArray, " num_logits_padded"]  # pad 0
    # vLLM's flags, over the step's requests
    any_greedy: Bool[StepArray, ""]  # some request has temperature 0
    all_greedy: Bool[StepArray, ""]  # every request has temperature 0
    all_random: Bool[StepArray, ""]  # no request has temperature 0
    any_explicit_seed: Bool[StepArray, ""]  # some request set its seed
    do_top_k: Bool[StepArray, ""]  # some top_k != V
    do_top_p: Bool[StepArray, ""]  # some top_p != 1
    do_min_p: Bool[StepArray, ""]  # some min_p != 0
    do_penalties: Bool[StepArray, ""]  # some request uses a penalty (vLLM use_penalty)
    has_topp_only_rows: Bool[StepArray, ""]  # some request has top_p != 1 and top_k == V

    @property
    def num_logits(self) -> Int32[Array, ""]:
        return self.cu_num_logits[-1]


def sampling_metadata(state, idx_mapping: Int32[Array, " num_reqs_padded"],
                      is_real_req: Bool[Array, " num_reqs_padded"], indirection, vocab_size: int) -> SamplingMetadata:
    """The step's `SamplingMetadata`: state slots gathered per logits row (``indirection``: the
    step's `LogitsIndirection`).

    ```
    # expanded_idx_mapping [5,5,5, 1,1, 2, 3, -1], temperature by slot [0, 1.5, 1, 0, 0.5, 0.7]
    #   -> temperature per row [0.7,0.7,0.7, 1.5,1.5, 1, 0, 0 (pad)]
    ```
    """
    check_state_shapes(state, vocab_size)
    rows = indirection.expanded_idx_mapping

    def per_row(name, fill):
        return take_rows(getattr(state, name), rows, fill_value=fill)

    def per_request(name, fill):
        return take_rows(getattr(state, name), idx_mapping, fill_value=fill)

    gathered = {name: per_row(name, fill) for name, fill in FLOAT_PARAMS.items()}
    flags = _flags({name: per_request(name, fill) for name, fill in FLOAT_PARAMS.items()},
                   per_request("top_k", vocab_size), take_rows(state.seeds_set, idx_mapping, fill_value=False),
                   is_real_req, vocab_size)
    return SamplingMetadata(
        idx_mapping=rows, expanded_local_pos=indirection.expanded_local_pos, pos=indirection.logits_pos,
        input_ids=indirection.logits_input_ids, cu_num_logits=indirection.cu_num_logits,
        top_k=per_row("top_k", vocab_size), seeds=per_row("seeds", PAD_SEED), **gathered, **flags)


def _flags(req: dict, top_k, seeds_set, is_real_req, vocab_size: int) -> dict:
    """vLLM's host flags over the requests of the step (padded rows do not count)."""
    def any_(condition):
        return jnp.any(is_real_req & condition)

    greedy = req["temperature"] == 0
    penalty = ((req["repetition_penalty"] != 1) | (req["frequency_penalty"] != 0)
               | (req["presence_penalty"] != 0))
    return dict(any_greedy=any_(greedy), all_greedy=~any_(~greedy), all_random=~any_(greedy),
                any_explicit_seed=any_(seeds_set), do_top_k=any_(top_k != vocab_size), do_top_p=any_(req["top_p"] != 1),
                do_min_p=any_(req["min_p"] != 0), do_penalties=any_(penalty),
                has_topp_only_rows=any_((req["top_p"] != 1) & (top_k == vocab_size)))


def check_state_shapes(state, vocab_size: int) -> None:
    """Trace-time check of the sampling tables' shapes (free per call); raises ValueError."""
    rows = state.num_scheduled_tokens.shape[0]
    for name, shape in expected_shapes(rows, vocab_size).items():
        value = getattr(state, name)
        if value is None:
            raise ValueError(f"BatchState.{name} is missing: FeatureConfig.sampling needs it")
        if tuple(value.shape) != shape:
            raise ValueError(f"BatchState.{name} has shape {tuple(value.shape)}, config expects {shape} "
                             f"(SamplingConfig.vocab_size={vocab_size})")


def expected_shapes(rows: int, vocab_size: int) -> dict[str, tuple[int, ...]]:
    shapes = dict.fromkeys((*FLOAT_PARAMS, "top_k", "seeds_set"), (rows,))
    shapes.update(seeds=(rows, 2), prompt_bin_mask=(rows, -(-vocab_size // 32)), output_bin_counts=(rows, vocab_size))
    return shapes


def empty_sampling_rows(rows: int, sampling) -> dict[str, np.ndarray]:
    """Host arrays of the sampling tables no request has written: the neutral values."""
    out = {name: np.full((rows,), fill, np.float32) for name, fill in FLOAT_PARAMS.items()}
    out.update(top_k=np.full((rows,), sampling.vocab_size, np.int32), seeds=np.full((rows, 2), PAD_SEED, np.int32),
               seeds_set=np.zeros((rows,), bool),
               prompt_bin_mask=np.zeros((rows, sampling.num_bin_words), np.int32),
               output_bin_counts=np.zeros((rows, sampling.vocab_size), np.int32))
    return out


def check_sampling_inputs(host: dict, config) -> None:
    """Host check (`jaxprep.validate`) of the sampling tables: shapes, dtypes and every row's bounds."""
    check_sampling_shapes(host, config)
    check_parameter_bounds(host, config.features.sampling.vocab_size, "BatchState")


def check_sampling_shapes(host: dict, config) -> None:
    """Shapes and dtypes of the sampling tables (host arrays or tracers); raises `InvalidBatchError`."""
    vocab = config.features.sampling.vocab_size
    dtypes = {**dict.fromkeys(FLOAT_PARAMS, np.float32), "seeds_set": np.bool_}
    for name, shape in expected_shapes(config.max_num_reqs, vocab).items():
        if host.get(name) is None:
            raise InvalidBatchError(f"BatchState.{name} is missing: FeatureConfig.sampling needs it")
        if tuple(host[name].shape) != shape:
            raise InvalidBatchError(f"BatchState.{name} has shape {host[name].shape}, config expects {shape}")
        dtype = np.dtype(dtypes.get(name, np.int32))
        if host[name].dtype != dtype:
            raise InvalidBatchError(f"BatchState.{name} has dtype {host[name].dtype}, expected {dtype}")


def check_parameter_bounds(values: dict, vocab_size: int, where: str, rows=None) -> None:
    """Every parameter row inside vLLM's bounds (as stored: top_k already in [1, V]); raises
    `InvalidBatchError` naming the field, the first bad row, its value and the bound."""
    finite = {name: np.isfinite(values[name]) for name in FLOAT_PARAMS}
    bounds = (
        ("temperature", finite["temperature"] & (values["temperature"] >= 0), "finite and >= 0"),
        ("top_k", (values["top_k"] >= 1) & (values["top_k"] <= vocab_size), f"in [1, vocab_size={vocab_size}]"),
        ("top_p", (values["top_p"] > 0) & (values["top_p"] <= 1), "in (0, 1]"),
        ("min_p", (values["min_p"] >= 0) & (values["min_p"] <= 1), "in [0, 1]"),
        ("repetition_penalty", finite["repetition_penalty"] & (values["repetition_penalty"] > 0), "finite and > 0"),
        ("frequency_penalty", finite["frequency_penalty"], "finite"),
        ("presence_penalty", finite["presence_penalty"], "finite"),
    )
    for name, ok, bound in bounds:
        bad = ~ok if rows is None else ~ok & rows
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            value = values[name][row].item()
            raise InvalidBatchError(f"{where}.{name} at row {row} is {value!r}, which is not {bound}")
    if "output_bin_counts" in values and (values["output_bin_counts"] < 0).any():
        row = int(np.nonzero(values["output_bin_counts"] < 0)[0][0])
        raise InvalidBatchError(f"{where}.output_bin_counts at row {row} has a negative count (must be >= 0)")


# --- the record (jaxprep.features.registry) -----------------------------------------------------

FLOAT32_ONE_BITS = int(np.float32(1).view(np.int32))
FLOAT32_INF_BITS = int(np.float32(np.inf).view(np.int32))
FLOAT32_MINUS_ZERO_BITS = int(np.float32(-0.0).view(np.int32))


def _sampling_flags(state, vocab_size: int) -> list:
    """The bounds of `sampling.check_parameter_bounds`, on every row, compared on the float32 bit
    patterns: exact on every backend, subnormals included (XLA:CPU and GPUs may flush them to 0 in
    float compares, NumPy does not). For x >= +0 the int32 patterns order as the floats do; NaN
    patterns lie above the infinity's; -0.0 is the one negative pattern equal to 0.

    ```
    # top_p 1e-45 (bits 1) -> > 0: kept; min_p -1e-45 (bits -2**31 + 1) -> below 0: flagged
    ```
    """
    def bits(name):
        return jax.lax.bitcast_convert_type(getattr(state, name), jnp.int32)

    def non_negative_finite(b):  # [+0, inf) or -0.0
        return ((b >= 0) & (b < FLOAT32_INF_BITS)) | (b == FLOAT32_MINUS_ZERO_BITS)

    def finite(b):
        return (b & INT32_MAX) < FLOAT32_INF_BITS

    top_p, min_p = bits("top_p"), bits("min_p")
    return [
        (TEMPERATURE_OUT_OF_RANGE, ~non_negative_finite(bits("temperature"))),
        (TOP_K_OUT_OF_RANGE, (state.top_k < 1) | (state.top_k > vocab_size)),
        (TOP_P_OUT_OF_RANGE, ~((top_p > 0) & (top_p <= FLOAT32_ONE_BITS))),
        (MIN_P_OUT_OF_RANGE, ~((min_p == FLOAT32_MINUS_ZERO_BITS) | ((min_p >= 0) & (min_p <= FLOAT32_ONE_BITS)))),
        (REPETITION_PENALTY_OUT_OF_RANGE, ~((bits("repetition_penalty") > 0)
                                            & (bits("repetition_penalty") < FLOAT32_INF_BITS))),
        (FREQUENCY_PENALTY_NOT_FINITE, ~finite(bits("frequency_penalty"))),
        (PRESENCE_PENALTY_NOT_FINITE, ~finite(bits("presence_penalty"))),
    ]


def _messages(config) -> dict[int, str]:
    vocab = config.features.sampling.vocab_size if config.features.sampling is not None else "V"
    return {
        TEMPERATURE_OUT_OF_RANGE: "temperature is not finite and >= 0",
        TOP_K_OUT_OF_RANGE: f"top_k is not in [1, vocab_size={vocab}]",
        TOP_P_OUT_OF_RANGE: "top_p is not in (0, 1]",
        MIN_P_OUT_OF_RANGE: "min_p is not in [0, 1]",
        REPETITION_PENALTY_OUT_OF_RANGE: "repetition_penalty is not finite and > 0",
        FREQUENCY_PENALTY_NOT_FINITE: "frequency_penalty is not finite",
        PRESENCE_PENALTY_NOT_FINITE: "presence_penalty is not finite",
    }


def _metadata(build) -> None:
    build.outputs["sampling"] = sampling_metadata(build.state, build.step.idx_mapping, build.layout.is_real_req,
                                                  build.logits, build.config.features.sampling.vocab_size)


FEATURE = Feature(
    name="sampling",
    is_on=lambda features: features.sampling is not None,
    inputs=lambda features: dict.fromkeys(STATE_FIELDS, "sampling"),
    empty_inputs=lambda config: empty_sampling_rows(config.max_num_reqs, config.features.sampling),
    check_values=lambda host, computed, scheduled, config: check_sampling_inputs(host, config),
    row_flags=lambda state, config, in_batch: _sampling_flags(state, config.features.sampling.vocab_size),
    messages=_messages,
    metadata=_metadata,
)
