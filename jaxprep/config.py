"""`PrepConfig`: the static, hashable description of a serving batch and its bucket ladder."""

from __future__ import annotations

import bisect
import dataclasses
import math

from jaxprep._checks import cdiv, check_positive_int, max_block_id
from jaxprep._constants import INT32_MAX
from jaxprep.features import FeatureConfig
from jaxprep.kernels import KERNEL_CHOICES, TRITON_BACKEND, triton_backend_available, uncovered_features

MIN_TOKEN_BUCKET = 8
SPLIT_OCTAVES_FROM = 64
STEPS_PER_OCTAVE = 2
"""From 64 tokens every power of two is split into 2 rungs (x1, x1.5): a step is padded by at most
50% (100% below 64 tokens, where a step costs little either way), with 18 rungs for an 8192-token
budget. The measured waste of this ladder and its alternatives is in BENCHMARKS.md, "Padding waste"."""


def block_table_width(max_model_len: int, block_size: int) -> int:
    """vLLM's block-table width: cdiv(max_model_len, B) aligned to 128 tokens.

    ```
    # B=2, M=12 -> 6 blocks, alignment 64 -> 64 columns; B=16, M=240 -> 15 blocks, alignment 8 -> 16
    ```
    """
    num_blocks = cdiv(max_model_len, block_size)
    alignment = 128 // math.gcd(128, block_size)
    return cdiv(num_blocks, alignment) * alignment


def default_token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Powers of two from 8, with a rung at 1.5x each power from 64 up, capped at the budget.

    The budget itself is always the top rung, so no step is padded past it.

    ```
    # budget 300 -> (8, 16, 32, 64, 96, 128, 192, 256, 300)
    ```
    """
    rungs = {max_num_batched_tokens}
    power = MIN_TOKEN_BUCKET
    while power < max_num_batched_tokens:
        rungs.add(power)
        if power >= SPLIT_OCTAVES_FROM:
            step = power // STEPS_PER_OCTAVE
            rungs.update(power + k * step for k in range(1, STEPS_PER_OCTAVE))
        power *= 2
    return tuple(sorted(r for r in rungs if r <= max_num_batched_tokens))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrepConfig:
    """Static configuration of the input preparation; passed to jitted functions as a static argument.

    Attributes:
      max_num_reqs: rows of the batch state (vLLM ``max_num_seqs``).
      max_model_len: longest sequence; the token table's row width.
      max_num_batched_tokens: token budget of one step; the top bucket.
      block_size: tokens per KV-cache block.
      token_buckets: ascending padded token counts, the last one equal to the budget.
        ``None`` picks `default_token_buckets`.
      num_blocks: KV-cache size in blocks; block ids must lie in ``[1, num_blocks)``.
        ``None`` bounds them only by the int32 slot range.
      max_blocks_per_req: block-table width of `BatchState.empty`; ``None`` picks vLLM's
        128-token-aligned width.
      features: static switches of the optional features (`jaxprep.FeatureConfig`); all off by default.
      kernel: how the step runs (docs/guides/gpu.md): ``"auto"`` (the default: two fused Pallas
        kernels on CUDA where Pallas' Triton backend is available, XLA elsewhere: CPU, TPU, ROCm),
        ``"xla"`` (jnp ops, every backend) or ``"pallas"`` (the kernels: Triton on CUDA, Pallas'
        interpreter elsewhere). The kernels cover the plain step, spec decode and model runner
        V2's outputs (`jaxprep.kernels.KERNEL_FEATURES`); with any other feature on the step runs
        on XLA under ``"auto"`` and ``"pallas"`` is refused, naming the feature.
    """

    max_num_reqs: int
    max_model_len: int
    max_num_batched_tokens: int
    block_size: int
    token_buckets: tuple[int, ...] | None = None
    num_blocks: int | None = None
    max_blocks_per_req: int | None = None
    features: FeatureConfig = dataclasses.field(default_factory=FeatureConfig)
    kernel: str = "auto"

    def __post_init__(self):
        for name in ("max_num_reqs", "max_model_len", "max_num_batched_tokens", "block_size"):
            check_positive_int(f"PrepConfig.{name}", getattr(self, name))
        if self.token_buckets is None:
            object.__setattr__(self, "token_buckets", default_token_buckets(self.max_num_batched_tokens))
        else:
            object.__setattr__(self, "token_buckets", tuple(int(b) for b in self.token_buckets))
        self._check_buckets()
        if self.max_blocks_per_req is None:
            width = block_table_width(self.max_model_len, self.block_size)
            object.__setattr__(self, "max_blocks_per_req", width)
        if self.max_blocks_per_req < self.min_blocks_per_req:
            raise ValueError(
                f"PrepConfig.max_blocks_per_req={self.max_blocks_per_req} is below "
                f"cdiv(max_model_len, block_size)={self.min_blocks_per_req}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"PrepConfig.num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")
        if self.max_block_id * self.block_size + self.block_size - 1 > INT32_MAX:
            raise ValueError(f"PrepConfig.num_blocks={self.num_blocks} with block_size={self.block_size} "
                             f"overflows int32 slot ids (max {INT32_MAX})")
        self.features.check_against(self)
        self._check_kernel()

    def _check_kernel(self):
        if self.kernel not in KERNEL_CHOICES:
            raise ValueError(f"PrepConfig.kernel must be one of {KERNEL_CHOICES}, got {self.kernel!r}")
        if self.kernel == "pallas" and not triton_backend_available():
            raise ValueError(f"PrepConfig.kernel='pallas' needs Pallas' Triton backend ({TRITON_BACKEND}), which this "
                             "jax does not ship: use kernel='auto' (XLA where the kernels cannot run) or 'xla'")
        uncovered = uncovered_features(self.features) if self.kernel == "pallas" else ()
        if uncovered:
            raise ValueError(f"PrepConfig.kernel='pallas' fuses the plain step, spec decode and model runner V2's "
                             f"outputs only; the kernels do not cover FeatureConfig {', '.join(uncovered)}: turn "
                             f"them off, or use kernel='auto' (the step then runs on XLA)")

    def _check_buckets(self):
        buckets = self.token_buckets
        if not buckets:
            raise ValueError("PrepConfig.token_buckets must not be empty")
        if list(buckets) != sorted(set(buckets)) or buckets[0] <= 0:
            raise ValueError(f"PrepConfig.token_buckets must be strictly increasing positive ints, got {buckets}")
        if buckets[-1] != self.max_num_batched_tokens:
            raise ValueError(f"PrepConfig.token_buckets must end at max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}, got top bucket {buckets[-1]}")

    @property
    def min_blocks_per_req(self) -> int:
        """Blocks a sequence of ``max_model_len`` tokens needs: cdiv(max_model_len, block_size)."""
        return cdiv(self.max_model_len, self.block_size)

    @property
    def max_block_id(self) -> int:
        """Largest valid block id (`jaxprep._checks.max_block_id`)."""
        return max_block_id(self.num_blocks, self.block_size)

    def bucket_for(self, num_tokens: int) -> int:
        """The smallest bucket holding ``num_tokens`` (1 <= num_tokens <= max_num_batched_tokens)."""
        if not 0 < num_tokens <= self.max_num_batched_tokens:
            raise ValueError(f"num_tokens={num_tokens} must lie in [1, max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}]")
        return self.token_buckets[bisect.bisect_left(self.token_buckets, num_tokens)]

    def num_reqs_padded(self, num_tokens_padded: int) -> int:
        """Batch rows of a step padded to ``num_tokens_padded`` tokens: min(tokens, max_num_reqs).

        Every scheduled request has at least one token, so this always holds the batch; it is
        vLLM's FULL-graph rule ``R_pad = min(N_pad, max_num_seqs)``.
        """
        return min(num_tokens_padded, self.max_num_reqs)
