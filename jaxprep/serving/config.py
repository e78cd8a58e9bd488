"""`ServingConfig`: the static sizes of the serving loop's per-step updates, on top of a `PrepConfig`."""

from __future__ import annotations

import dataclasses
import functools

from jaxprep._constants import INT32_MAX
from jaxprep.bounds import check_positive_int
from jaxprep.config import PrepConfig


def _from_prep(name: str) -> property:
    """A read-only attribute that reads ``self.prep.<name>``."""
    return property(lambda self: getattr(self.prep, name), doc=f"``prep.{name}``")


def last_config(lookup):
    """``lookup(config)`` (a configuration's constants, `functools.lru_cache`d) with the answer for the last
    configuration asked kept by identity: a serving loop asks each step for the same configuration's constants,
    and an lru lookup hashes the whole frozen configuration (every field, nested) first.

    ```
    # @last_config @functools.lru_cache(maxsize=64) def _bounds(config): ...
    #   _bounds(c); _bounds(c) -> the second call compares c by identity, no hash
    ```
    """
    last = (None, None)  # (configuration, answer), read and replaced as one tuple: thread-safe

    @functools.wraps(lookup)
    def cached(config):
        nonlocal last
        held, answer = last
        if held is not config:
            answer = lookup(config)
            last = (config, answer)
        return answer

    return cached


NO_EOS = -1
"""`ServingConfig.eos_token_id` that disables the EOS stop (no token id is negative)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class NgramConfig:
    """Static sizes of the n-gram drafter (vLLM ``SpeculativeConfig.prompt_lookup_min``/``max``;
    vLLM's default, when neither is set, is 5 and 5)."""

    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5

    def __post_init__(self):
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
            raise ValueError(f"NgramConfig: need 1 <= prompt_lookup_min={low} <= prompt_lookup_max={high}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingConfig:
    """Static configuration of the serving state and its updates; hashable, a static jit argument.

    Attributes:
      prep: the input-preparation configuration; ``prep.num_blocks`` (the KV-cache size) is required.
      num_speculative_tokens: draft tokens a row may schedule (vLLM ``num_speculative_tokens``);
        the width of `Schedule.draft_token_ids`.
      ngram: the n-gram drafter (`jaxprep.serving.spec_decode.ngram`): every step proposes up to
        ``num_speculative_tokens`` drafts per decoding row for the next step; ``None``: no drafter
        (drafts only come from the host's `Schedule`). Drafts are verified whenever
        ``num_speculative_tokens > 0``.
      eos_token_id: a sampled token equal to it finishes the request; `NO_EOS` disables the check.
      decode_steps: decode steps one multi-step dispatch runs when every request is decoding (K).
      vocab_size: token ids in requests and payloads must lie in [0, vocab_size); ``None`` accepts
        any int32 id (`Engine` fills it in from its model).
    """

    prep: PrepConfig
    num_speculative_tokens: int = 0
    ngram: NgramConfig | None = None
    eos_token_id: int = NO_EOS
    decode_steps: int = 8
    vocab_size: int | None = None

    def __post_init__(self):
        if self.prep.num_blocks is None:
            raise ValueError("ServingConfig.prep.num_blocks must be set: it is the KV-cache size in blocks")
        check_positive_int("ServingConfig.decode_steps", self.decode_steps)
        if self.vocab_size is not None:
            check_positive_int("ServingConfig.vocab_size", self.vocab_size)
        if self.num_speculative_tokens < 0:
            raise ValueError(f"ServingConfig.num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.ngram is not None and self.num_speculative_tokens < 1:
            raise ValueError("ServingConfig.ngram needs num_speculative_tokens >= 1 (the drafts it may propose)")

    @property
    def token_id_bound(self) -> int:
        """Token ids lie in [0, token_id_bound): ``vocab_size``, or 2**31 (int32) if it is not set."""
        return INT32_MAX + 1 if self.vocab_size is None else self.vocab_size

    # the PrepConfig sizes the serving code reads most, as attributes of the ServingConfig
    max_num_reqs = _from_prep("max_num_reqs")
    max_model_len = _from_prep("max_model_len")
    block_size = _from_prep("block_size")
    max_blocks_per_req = _from_prep("max_blocks_per_req")
    num_blocks = _from_prep("num_blocks")
