"""Sampling settings on the host: `SamplingConfig` (the static switch) and `SamplingParams` (one request's).

`SamplingParams` carries vLLM's names (`vllm/sampling_params.py::SamplingParams`) and its admission
normalisation (`SamplingParams.__post_init__`, ``_verify_args``, ``_verify_greedy_sampling``):

- ``0 < temperature < 0.01`` becomes 0.01 (vLLM's ``_MAX_TEMP``);
- ``temperature < 1e-5`` is greedy, and forces ``top_p = 1``, ``top_k = 0`` (the whole vocabulary)
  and ``min_p = 0`` whatever the user set;
- ``seed = -1`` means no seed.

`state_row` turns them into one state row of the sampling tables (`jaxprep.features.sampling`) as
vLLM V2 stores them (`vllm/v1/worker/gpu/sample/states.py::SamplingStates.add_request`): ``top_k``
``<= 0`` or ``> V`` becomes ``V``, and a request without a seed gets one drawn on the host
(``np.random.randint(INT64_MIN, INT64_MAX)``), kept as two int32 words.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

MIN_TEMPERATURE = 0.01
"""vLLM ``_MAX_TEMP``: a temperature in (0, 0.01) is raised to this."""
GREEDY_TEMPERATURE = 1e-5
"""vLLM ``_SAMPLING_EPS``: a temperature below it is greedy (stored as 0)."""
MAX_ABS_PENALTY = 2.0
"""vLLM's bound on ``frequency_penalty`` and ``presence_penalty``: [-2, 2]."""
INT64_MIN, INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """The sampling switch (`FeatureConfig.sampling`): per-request sampling state rows and
    `StepInputs.sampling`, the parameters of every logits row.

    Attributes:
      vocab_size: ``V``, the model's vocabulary: the width of ``output_bin_counts`` and the
        ``top_k`` that means "all tokens".
    """

    vocab_size: int

    def __post_init__(self):
        if not isinstance(self.vocab_size, int) or isinstance(self.vocab_size, bool) or self.vocab_size <= 0:
            raise ValueError(f"SamplingConfig.vocab_size must be a positive int, got {self.vocab_size!r}")

    @property
    def num_bin_words(self) -> int:
        """Words of ``prompt_bin_mask``: ``ceil(V / 32)``."""
        return -(-self.vocab_size // 32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """One request's sampling parameters, normalised as vLLM does at construction (module docstring).

    ``stop_token_ids``: sampling one of them finishes the request (the token is kept), as vLLM.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        _check(self)
        def set_(name, value):
            object.__setattr__(self, name, value)

        set_("stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.seed == -1:
            set_("seed", None)
        if 0 < self.temperature < MIN_TEMPERATURE:
            set_("temperature", MIN_TEMPERATURE)
        if self.temperature < GREEDY_TEMPERATURE:
            set_("temperature", 0.0)
            set_("top_p", 1.0)
            set_("top_k", 0)
            set_("min_p", 0.0)

    @classmethod
    def greedy(cls, **kwargs) -> SamplingParams:
        """Temperature 0: the argmax after penalties."""
        return cls(temperature=0.0, **kwargs)

    @property
    def use_penalty(self) -> bool:
        """vLLM ``use_penalty``: some penalty differs from its neutral value."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _check(params: SamplingParams) -> None:
    """vLLM ``_verify_args``: raises ValueError naming the field and its bound."""
    bounds = (
        ("temperature", math.isfinite(params.temperature) and params.temperature >= 0, "must be finite and >= 0"),
        ("top_p", 0 < params.top_p <= 1, "must be in (0, 1]"),
        ("top_k", _is_int(params.top_k) and params.top_k >= -1, "must be an int >= -1 (-1 or 0: all tokens)"),
        ("min_p", 0 <= params.min_p <= 1, "must be in [0, 1]"),
        ("repetition_penalty", math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0,
         "must be finite and > 0"),
        ("frequency_penalty", -MAX_ABS_PENALTY <= params.frequency_penalty <= MAX_ABS_PENALTY, "must be in [-2, 2]"),
        ("presence_penalty", -MAX_ABS_PENALTY <= params.presence_penalty <= MAX_ABS_PENALTY, "must be in [-2, 2]"),
        ("seed", params.seed is None or (_is_int(params.seed) and INT64_MIN <= params.seed <= INT64_MAX),
         "must be None or an int64"),
        ("stop_token_ids", all(_is_int(t) and t >= 0 for t in params.stop_token_ids), "must be ints >= 0"),
    )
    for name, ok, bound in bounds:
        if not ok:
            raise ValueError(f"SamplingParams.{name}={getattr(params, name)!r} {bound}")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def seed_words(seed: int) -> tuple[int, int]:
    """An int64 seed as its (high, low) 32-bit words, each an int32 bit pattern.

    ```
    # -1 -> (-1, -1);  2**32 + 5 -> (1, 5);  7 -> (0, 7)
    ```
    """
    bits = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    return tuple(int(np.uint32(word).view(np.int32)) for word in (bits >> 32, bits & 0xFFFF_FFFF))


def state_row(params: SamplingParams | None, vocab_size: int, rng: np.random.Generator | None = None) -> dict:
    """The values one request writes into the sampling state rows (None: greedy, no penalty).

    ``rng`` draws the seed of a request without one (default: NumPy's global generator, as vLLM).
    """
    params = SamplingParams.greedy() if params is None else params
    if params.seed is None:
        draw = np.random.randint if rng is None else rng.integers
        seed, seeds_set = int(draw(INT64_MIN, INT64_MAX, dtype=np.int64)), False
    else:
        seed, seeds_set = params.seed, True
    top_k = vocab_size if params.top_k <= 0 or params.top_k > vocab_size else params.top_k
    return dict(temperature=params.temperature, top_k=top_k, top_p=params.top_p, min_p=params.min_p,
                seeds=seed_words(seed), seeds_set=seeds_set, repetition_penalty=params.repetition_penalty,
                frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty)
