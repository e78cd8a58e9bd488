"""`PrepConfig`: the static, hashable description of a serving batch and its bucket ladder, and the
kernel choices it may name (``PrepConfig.kernel``) with the check that Pallas' Triton backend is there."""

from __future__ import annotations

import bisect
import dataclasses

from jaxprep._constants import INT32_MAX
from jaxprep.bounds import block_table_width, cdiv, check_positive_int, max_block_id, module_available
from jaxprep.features import FeatureConfig

MIN_TOKEN_BUCKET = 8
SPLIT_OCTAVES_FROM = 64
STEPS_PER_OCTAVE = 2
"""From 64 tokens every power of two is split into 2 rungs (x1, x1.5): a step is padded by at most
50% (100% below 64 tokens, where a step costs little either way), with 18 rungs for an 8192-token
budget. The measured waste of this ladder and its alternatives is in docs/benchmarks-history.md, "Padding waste"."""


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


# --- the kernel choice (`PrepConfig.kernel`; `jaxprep.prepare` picks the path per step) ---------

KERNEL_CHOICES = ("xla", "pallas", "auto")
"""Values of `PrepConfig.kernel` (``"auto"`` is the default)."""
TRITON_BACKEND = "jax.experimental.pallas.triton"
"""Pallas' Triton backend, which the kernels are written for. jax 0.11 deprecates it: `prepare_pallas`
is imported only when a step is traced onto the kernels, so ``import jaxprep`` never needs it."""
KERNEL_FEATURES = ("num_speculative_tokens", "speculative_method", "reorder", "runner", "logits_indirection")
"""`FeatureConfig` fields the kernels cover: spec decode (`StepInputs.spec_decode`; the method is a
label the attention state alone reads), the batch orders ("v2", "decode_first") and model runner V2's
outputs (its order and `StepInputs.logits_indirection`)."""
SETTINGS = ("enable_chunked_prefill", "attn_mask_dtype", "mask_kv_len")
"""`FeatureConfig` fields that only tune a feature of their own (they turn nothing on)."""


def triton_backend_available() -> bool:
    """Whether this jax still ships Pallas' Triton backend (without it ``"auto"`` keeps XLA)."""
    return module_available(TRITON_BACKEND)


def uncovered_features(features) -> tuple[str, ...]:
    """The `FeatureConfig` fields that are on and that the kernels do not cover (empty: they cover the step).

    ```
    # FeatureConfig(num_speculative_tokens=2, runner="v2") -> ()
    # FeatureConfig(lora=LoRAConfig(...), mrope=True) -> ("mrope", "lora")
    ```
    """
    defaults = type(features)()
    return tuple(field.name for field in dataclasses.fields(features)
                 if field.name not in KERNEL_FEATURES + SETTINGS
                 and getattr(features, field.name) != getattr(defaults, field.name))


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
        V2's outputs (`KERNEL_FEATURES`); with any other feature on the step runs
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
        """Largest valid block id (`jaxprep.bounds.max_block_id`)."""
        return max_block_id(self.num_blocks, self.block_size)

    @property
    def max_tokens_per_step(self) -> int:
        """The most tokens one step can hold: the budget, or every row's whole sequence when that is less."""
        return min(self.max_num_batched_tokens, self.max_num_reqs * self.max_model_len)

    @property
    def reachable_buckets(self) -> tuple[int, ...]:
        """The rungs of ``token_buckets`` a step can be padded to: up to the first that holds
        `max_tokens_per_step` (what a warm-up compiles; the ladder itself is unchanged).

        ```
        # 16 rows of 256 tokens, budget 8192: a step holds at most 4096 tokens -> rungs 8 .. 4096
        #   (6144 and 8192 can never be used)
        ```
        """
        top = self.bucket_for(self.max_tokens_per_step)
        return tuple(b for b in self.token_buckets if b <= top)

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
