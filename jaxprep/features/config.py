"""`FeatureConfig`: static switches of the optional vLLM features (docs/semantics.md#features, #masks).

Every switch is static (part of `PrepConfig`, so part of the compile key). A feature that is off
adds no operation and no output to a step: its `StepInputs` fields are ``None`` (an empty pytree
node) and its `BatchState` inputs are not read.
"""

from __future__ import annotations

import dataclasses
import enum

from jaxprep._constants import INT32_MAX
from jaxprep.bounds import cdiv, check_positive_int, max_block_id
from jaxprep.features.lora_config import LoRAConfig
from jaxprep.features.sampling_params import SamplingConfig

ATTN_MASK_MODES = (None, "compressed", "rows_bool", "rows_additive")
"""`FeatureConfig.attn_mask`: no mask, the constant compressed mask, or one mask row per token."""
ATTN_MASK_DTYPES = ("float16", "bfloat16", "float32")
"""`FeatureConfig.attn_mask_dtype`: the dtype of the additive row mask."""
REORDER_MODES = (None, "decode_first", "v2")
"""`FeatureConfig.reorder`: state-row order, decodes first (tpu-inference) or vLLM V2's sort."""
HYBRID_MODES = ("none", "align")
"""`HybridConfig.mode`: how a hybrid model's state blocks fill a block-table row."""
RUNNERS = ("v1", "v2")
"""`FeatureConfig.runner`: whose semantics the outputs follow, vLLM's model runner V1 or V2."""
MROPE_NUM_DIMS = 3
"""Rows of M-RoPE positions (temporal, height, width), as in Qwen2-VL."""


class AttnState(enum.IntEnum):
    """vllm-ascend's ``AscendAttentionState``: names and values as there (docs/semantics.md#ascend-state)."""

    PrefillNoCache = 0
    PrefillCacheHit = 1
    DecodeOnly = 2
    ChunkedPrefill = 3
    SpecDecoding = 4


@dataclasses.dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group (docs/semantics.md#kv-groups): its manager block size and how its kernel reads it.

    Attributes:
      block_size: manager block size ``B_g``: slots are ``block * B_g + offset``.
      kernel_block_size: block size the attention kernel wants (divides ``block_size``); the
        kernel block table expands every manager block into ``block_size // kernel_block_size``.
        ``None``: the kernel uses ``block_size``.
      sliding_window: window in tokens (docs/semantics.md#sliding-window); blocks wholly outside it read the null block.
      num_blocks: KV-cache size of this group in blocks; ``None`` bounds ids by the int32 range.
    """

    block_size: int
    kernel_block_size: int | None = None
    sliding_window: int | None = None
    num_blocks: int | None = None

    def __post_init__(self):
        check_positive_int("KVCacheGroupSpec.block_size", self.block_size)
        for name in ("kernel_block_size", "sliding_window", "num_blocks"):
            if getattr(self, name) is not None:
                check_positive_int(f"KVCacheGroupSpec.{name}", getattr(self, name))
        if self.kernel_block_size is not None and self.block_size % self.kernel_block_size:
            raise ValueError(f"KVCacheGroupSpec.kernel_block_size={self.kernel_block_size} must divide "
                             f"block_size={self.block_size}")

    @property
    def max_block_id(self) -> int:
        """Largest valid block id of the group: ``num_blocks - 1``, or what keeps slots in int32."""
        return max_block_id(self.num_blocks, self.block_size)

    @property
    def blocks_per_kernel_block(self) -> int:
        """``k = B / b``: kernel blocks per manager block (1 without a kernel block size)."""
        return self.block_size // (self.kernel_block_size or self.block_size)


@dataclasses.dataclass(frozen=True)
class DCPConfig:
    """Decode context parallelism (docs/semantics.md#dcp): this process is ``rank`` of ``world_size``.

    Tokens are stored round-robin over the ranks in chunks of ``interleave`` tokens (vLLM
    ``cp_kv_cache_interleave_size``), which must divide every group's block size.
    """

    world_size: int
    rank: int
    interleave: int = 1

    def __post_init__(self):
        check_positive_int("DCPConfig.world_size", self.world_size)
        check_positive_int("DCPConfig.interleave", self.interleave)
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"DCPConfig.rank={self.rank!r} is outside the world [0, world_size={self.world_size})")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A target-dependent autoregressive drafter (EAGLE, EAGLE-3, MTP).

    Attributes:
      advance_draft_positions: positions and ``seq_lens`` grow by one per draft step; False for
        Gemma4 MTP, which reads the target's KV and writes none (vLLM ``advance_draft_positions``).
    """

    advance_draft_positions: bool = True


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """The Mamba group of a hybrid model (vLLM ``MambaSpec`` and ``cache_config.mamba_cache_mode``).

    Attributes:
      mode: "none" (a row is the request's ``1 + num_speculative_blocks`` state blocks) or "align"
        (prefix caching: a row holds one state block per ``block_size`` tokens).
      block_size: tokens per state block (mode "align" only).
      num_speculative_blocks: extra state blocks per request for spec decode.
      chunk_size: the Mamba2 SSD chunk size; ``None``: no chunk metadata (Mamba1, GDN, ...).
      checkpoints: split prefills at `BatchState.mamba_checkpoint_offsets` (prefix-cache checkpoints).
    """

    mode: str = "none"
    block_size: int | None = None
    num_speculative_blocks: int = 0
    chunk_size: int | None = None
    checkpoints: bool = False

    def __post_init__(self):
        if self.mode not in HYBRID_MODES:
            raise ValueError(f"HybridConfig.mode={self.mode!r} must be one of {HYBRID_MODES}")
        if self.mode == "align" and self.block_size is None:
            raise ValueError("HybridConfig.block_size is needed in mode 'align'")
        for name in ("block_size", "chunk_size"):
            if getattr(self, name) is not None:
                check_positive_int(f"HybridConfig.{name}", getattr(self, name))
        if not isinstance(self.num_speculative_blocks, int) or self.num_speculative_blocks < 0:
            raise ValueError(f"HybridConfig.num_speculative_blocks must be an int >= 0, "
                             f"got {self.num_speculative_blocks!r}")
        if self.checkpoints and self.chunk_size is None:
            raise ValueError("HybridConfig.checkpoints splits SSD chunks: it needs a chunk_size")

    @property
    def num_state_columns(self) -> int:
        """Columns of ``state_indices``: ``1 + num_speculative_blocks``."""
        return 1 + self.num_speculative_blocks

    def table_width(self, max_model_len: int) -> int:
        """Least width of `BatchState.mamba_block_table` (vLLM ``MambaSpec.max_num_blocks_per_req``)."""
        if self.mode == "align":
            return cdiv(max_model_len, self.block_size) + self.num_speculative_blocks
        return self.num_state_columns


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureConfig:
    """Static switches of the optional features; the default turns all of them off.

    Attributes:
      num_speculative_tokens: ``K``, the most draft tokens of one request (docs/semantics.md#spec-decode); > 0
        turns on `StepInputs.spec_decode` and reads `BatchState.num_draft_tokens`.
      speculative_method: vLLM ``speculative_config.method`` ("mtp", "eagle", "ngram", ...);
        only the attention state reads it.
      discard_request_mask: `StepInputs.discard_request_mask` from `BatchState.prefill_len`
        (docs/semantics.md#logits-indices).
      kv_groups: one spec per KV-cache group (docs/semantics.md#kv-groups); group 0 is `BatchState.block_table` with
        ``PrepConfig.block_size``, groups 1.. are `BatchState.extra_block_tables`. ``()``: off.
      dcp: decode context parallelism (docs/semantics.md#dcp); ``None``: off.
      mrope: `StepInputs.mrope_positions` ``[3, T_pad]`` (docs/semantics.md#m-rope).
      prompt_embeds: `StepInputs.prompt_embeds` (docs/semantics.md#prompt-embeddings).
      async_tokens: write last step's sampled (and draft) token ids into ``input_ids``
        (docs/semantics.md#async-scheduling).
      attn_state: `StepInputs.attn_state`, vllm-ascend's state ladder (docs/semantics.md#ascend-state).
      enable_chunked_prefill: the ladder's rung 4 (vLLM ``scheduler_config.enable_chunked_prefill``).
      attn_mask: None, "compressed" (constant 2048x2048 int8), "rows_bool" or "rows_additive"
        (a row per token for chunked prefill, docs/semantics.md#ascend-masks).
      attn_mask_dtype: dtype of the additive row mask.
      mask_kv_len: columns of a row mask (a bound on ``seq_lens``); ``None``: ``max_model_len``.
      reorder: None (state-row order), "decode_first" (tpu-inference) or "v2" (vLLM V2 sort),
        docs/semantics.md#batch-order.
      request_distribution: `StepInputs.request_distribution` ``[decode_end, prefill_end, mixed_end]``.
      runner: "v1" (default) or "v2": every output follows that vLLM model runner where the two
        differ (docs/semantics.md, V1 and V2). "v2" implies V2's batch order (`batch_order`) and
        the logits indirection unless ``logits_indirection=False``; a ``reorder`` other than "v2"
        is rejected with it.
      lora: `jaxprep.LoRAConfig`: `StepInputs.lora` from `BatchState.lora_ids` / ``lora_slots``.
      logits_indirection: `StepInputs.logits_indirection`, V2's logits rows (``cu_num_logits``,
        ``expanded_idx_mapping``, ...). ``None``: on exactly when ``runner="v2"``
        (`logits_indirection_on`).
      drafter: EAGLE / MTP drafter inputs (`jaxprep.features.drafter`); needs spec decode. ``None``: off.
      hybrid: Mamba / linear-attention metadata (`jaxprep.features.hybrid`). ``None``: off.
      structured_outputs: grammar-bitmask rows per logits row (`jaxprep.features.grammar`), from
        `BatchState.grammar_index`.
      num_ubatches: split each step into this many micro-batches (`jaxprep.features.ubatch`); 1: off.
      sampling: `jaxprep.SamplingConfig`: `StepInputs.sampling`, every logits row's sampling
        parameters gathered from the `BatchState` sampling rows (``temperature``, ``top_k``, ...).
    """

    num_speculative_tokens: int = 0
    speculative_method: str | None = None
    discard_request_mask: bool = False
    kv_groups: tuple[KVCacheGroupSpec, ...] = ()
    dcp: DCPConfig | None = None
    mrope: bool = False
    prompt_embeds: bool = False
    async_tokens: bool = False
    attn_state: bool = False
    enable_chunked_prefill: bool = True
    attn_mask: str | None = None
    attn_mask_dtype: str = "float16"
    mask_kv_len: int | None = None
    reorder: str | None = None
    request_distribution: bool = False
    runner: str = "v1"
    lora: LoRAConfig | None = None
    logits_indirection: bool | None = None
    drafter: DrafterConfig | None = None
    hybrid: HybridConfig | None = None
    structured_outputs: bool = False
    num_ubatches: int = 1
    sampling: SamplingConfig | None = None

    def __post_init__(self):
        object.__setattr__(self, "kv_groups", tuple(self.kv_groups))
        self._check_runner()
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ValueError(f"FeatureConfig.num_speculative_tokens must be an int >= 0, "
                             f"got {self.num_speculative_tokens!r}")
        _check_choice("attn_mask", self.attn_mask, ATTN_MASK_MODES)
        _check_choice("attn_mask_dtype", self.attn_mask_dtype, ATTN_MASK_DTYPES)
        _check_choice("reorder", self.reorder, REORDER_MODES)
        if self.mask_kv_len is not None:
            check_positive_int("FeatureConfig.mask_kv_len", self.mask_kv_len)
        if self.speculative_method is not None and not self.spec_decode:
            raise ValueError(f"FeatureConfig.speculative_method={self.speculative_method!r} needs "
                             f"num_speculative_tokens > 0")
        if self.dcp is not None and any(g.sliding_window for g in self.kv_groups):
            raise ValueError("FeatureConfig: DCP does not support sliding-window KV groups (as in vLLM)")
        for name, kind in (("drafter", DrafterConfig), ("hybrid", HybridConfig), ("lora", LoRAConfig),
                           ("sampling", SamplingConfig)):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), kind):
                raise ValueError(f"FeatureConfig.{name} must be a jaxprep.{kind.__name__} or None, "
                                 f"got {getattr(self, name)!r}")
        if self.drafter is not None and not self.spec_decode:
            raise ValueError("FeatureConfig.drafter needs num_speculative_tokens > 0 (the drafter proposes them)")
        check_positive_int("FeatureConfig.num_ubatches", self.num_ubatches)

    def _check_runner(self) -> None:
        """runner="v2" implies V2's batch order and the logits indirection (unless switched off).

        The implied values are properties (`batch_order`, `logits_indirection_on`), not rewritten
        fields, so ``dataclasses.replace(features, runner=...)`` changes them too.
        """
        _check_choice("runner", self.runner, RUNNERS)
        if self.runner == "v2" and self.reorder not in (None, "v2"):
            raise ValueError(f"FeatureConfig(runner='v2', reorder={self.reorder!r}) contradicts itself: "
                             f"the V2 runner sorts its batch one way (reorder='v2'); drop reorder")
        if self.logits_indirection is not None and not isinstance(self.logits_indirection, bool):
            raise ValueError(f"FeatureConfig.logits_indirection must be a bool or None, "
                             f"got {self.logits_indirection!r}")

    @property
    def batch_order(self) -> str | None:
        """The batch order in force: ``reorder``, or "v2" under ``runner="v2"`` (None: state-row order)."""
        return self.reorder or ("v2" if self.runner == "v2" else None)

    @property
    def logits_indirection_on(self) -> bool:
        """Whether the step carries `StepInputs.logits_indirection`."""
        return self.runner == "v2" if self.logits_indirection is None else self.logits_indirection

    @property
    def spec_decode(self) -> bool:
        return self.num_speculative_tokens > 0

    @property
    def dcp_world_size(self) -> int:
        """DCP world size, 1 when DCP is off."""
        return self.dcp.world_size if self.dcp is not None else 1

    @property
    def any_on(self) -> bool:
        """True unless every feature is off (the plain step)."""
        return bool(self.spec_decode or self.discard_request_mask or self.kv_groups or self.dcp or self.mrope
                    or self.prompt_embeds or self.async_tokens or self.attn_state or self.attn_mask
                    or self.batch_order or self.request_distribution or self.lora or self.logits_indirection_on
                    or self.drafter or self.hybrid or self.structured_outputs or self.num_ubatches > 1
                    or self.sampling)

    def check_against(self, config) -> None:
        """Checks that need the `PrepConfig` (block sizes, lengths); raises ValueError."""
        if self.kv_groups and self.kv_groups[0].block_size != config.block_size:
            raise ValueError(f"FeatureConfig.kv_groups[0].block_size={self.kv_groups[0].block_size} must equal "
                             f"PrepConfig.block_size={config.block_size} (group 0 is BatchState.block_table)")
        if self.dcp is not None:
            for block_size in {config.block_size, *(g.block_size for g in self.kv_groups)}:
                if block_size % self.dcp.interleave:
                    raise ValueError(f"DCPConfig.interleave={self.dcp.interleave} must divide block size {block_size}")
        if self.lora is not None and config.max_num_batched_tokens * (self.lora.max_loras + 1) > INT32_MAX:
            raise ValueError(f"FeatureConfig.lora: max_num_batched_tokens * (max_loras + 1) overflows int32 "
                             f"sampler_indices_padded (max {INT32_MAX})")
        if self.mask_kv_len is not None and self.mask_kv_len > config.max_model_len:
            raise ValueError(f"FeatureConfig.mask_kv_len={self.mask_kv_len} exceeds "
                             f"max_model_len={config.max_model_len}")
        if self.num_ubatches > config.token_buckets[0]:
            raise ValueError(f"FeatureConfig.num_ubatches={self.num_ubatches} exceeds the smallest token bucket "
                             f"{config.token_buckets[0]}: every micro-batch needs at least one token")

    def mask_columns(self, config) -> int:
        """Columns of a row mask: ``mask_kv_len`` or ``max_model_len``."""
        return self.mask_kv_len or config.max_model_len


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"FeatureConfig.{name}={value!r} must be one of {choices}")
