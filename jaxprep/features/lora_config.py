"""`LoRAConfig`: the static LoRA settings, and vLLM's CUDA-graph capture cases derived from them.

The three options carry vLLM's names: ``max_loras`` and ``specialize_active_lora`` from
`vllm/config/lora.py::LoRAConfig`, ``cudagraph_specialize_lora`` from
`vllm/config/compilation.py::CompilationConfig`. The capture cases and the rounding of an active
count to a captured case are small static tables, built here once per config, that the jitted
step indexes with an integer count (`jaxprep.features.lora`).
"""

from __future__ import annotations

import dataclasses

from jaxprep._constants import INT32_MAX

PROMPT_MAPPINGS = ("runner", "logits_rows", "requests")
"""`LoRAConfig.prompt_mapping`: follow the runner (V1: one entry per logits row, V2: one per
request), or force one of the two."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Static LoRA settings (`FeatureConfig.lora`).

    Attributes:
      max_loras: GPU adapter slots (vLLM ``max_loras``): `BatchState.lora_slots` has this many entries.
      specialize_active_lora: round the active count up to a captured power of two (vLLM option).
      cudagraph_specialize_lora: capture graphs apart for steps with and without LoRA (vLLM
        ``CompilationConfig`` option, default True).
      vocab_size: the model's vocabulary, for ``embeddings_indices = slot * vocab_size``; ``None``
        leaves ``step.lora.embeddings_indices`` out.
      prompt_mapping: "runner" (default: V1 one entry per logits row, V2 one per request, as each
        runner builds it), "logits_rows" or "requests" (see DIVERGENCES.md, LoRA prompt mapping).
    """

    max_loras: int
    specialize_active_lora: bool = False
    cudagraph_specialize_lora: bool = True
    vocab_size: int | None = None
    prompt_mapping: str = "runner"

    def __post_init__(self):
        for name in ("max_loras", "vocab_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"LoRAConfig.{name} must be a positive int, got {value!r}")
        for name in ("specialize_active_lora", "cudagraph_specialize_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LoRAConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.prompt_mapping not in PROMPT_MAPPINGS:
            raise ValueError(f"LoRAConfig.prompt_mapping={self.prompt_mapping!r} must be one of {PROMPT_MAPPINGS}")
        if self.vocab_size is not None and (self.max_loras - 1) * self.vocab_size > INT32_MAX:
            raise ValueError(f"LoRAConfig: (max_loras - 1) * vocab_size = {(self.max_loras - 1) * self.vocab_size} "
                             f"overflows int32 embeddings_indices (max {INT32_MAX})")

    def prompt_per_logits_row(self, runner: str) -> bool:
        """Whether the prompt mapping has one entry per logits row (else one per request)."""
        if self.prompt_mapping == "runner":
            return runner == "v1"
        return self.prompt_mapping == "logits_rows"

    def captured_lora_counts(self) -> tuple[int, ...]:
        """vLLM `vllm/lora/utils.py::get_captured_lora_counts`: the kernel's rounding targets.

        ```
        # max_loras 4: specialize -> (1, 2, 4, 5); else -> (5,)
        ```
        """
        last = self.max_loras + 1
        if not self.specialize_active_lora:
            return (last,)
        return tuple(n for n in range(1, last + 1) if n & (n - 1) == 0 or n == last)

    def capture_cases(self, runner: str) -> tuple[int, ...]:
        """``num_active_loras`` values graphs are captured for (0: the graph without LoRA).

        V1 `vllm/v1/cudagraph_dispatcher.py::CudagraphDispatcher._get_lora_cases`, V2
        `vllm/v1/worker/gpu/lora_utils.py::get_lora_capture_cases`. A step whose key is not here
        runs eagerly: V1 without ``cudagraph_specialize_lora`` captures no case 0.

        ```
        # max_loras 4, defaults: V1 (0, 5), V2 (0, 5); cudagraph_specialize_lora=False: V1 (5,), V2 (0, 5)
        ```
        """
        if self.cudagraph_specialize_lora:
            return (0, *self.captured_lora_counts())
        return (self.max_loras + 1,) if runner == "v1" else (0, self.max_loras + 1)

    def kernel_count_table(self) -> tuple[int, ...]:
        """Entry ``k``: the kernel's ``num_active_loras`` for ``k`` distinct slot indices (-1 included).

        `vllm/lora/ops/triton_ops/lora_kernel_metadata.py::LoRAKernelMeta.prepare_tensors`: the
        smallest captured count >= k, or k itself past them. (No LoRA token at all is handled apart: 0.)

        ```
        # max_loras 4, specialize: k 0..5 -> (0, 1, 2, 4, 4, 5)
        ```
        """
        return tuple(_round_up(k, self.captured_lora_counts(), clamp=False) for k in range(self.max_loras + 2))

    def graph_key_table(self, runner: str) -> tuple[int, ...]:
        """Entry ``n``: the CUDA-graph key's ``num_active_loras`` for ``n`` distinct adapters in the step.

        V1 (`vllm/v1/cudagraph_dispatcher.py::CudagraphDispatcher.dispatch`): 0 for none; with
        ``specialize_active_lora`` the smallest captured count >= n (n past them), else max_loras + 1.
        V2 (`vllm/v1/worker/gpu/cudagraph_utils.py::CudaGraphManager._resolve_effective_loras`): 0 for
        none, else the smallest nonzero capture case >= n, clamped to the largest.

        ```
        # max_loras 4, defaults: V1 and V2 (0, 5, 5, 5, 5, 5); specialize: (0, 1, 2, 4, 4, 5)
        ```
        """
        table = [0]
        for n in range(1, self.max_loras + 2):
            if runner == "v2":
                table.append(_round_up(n, [c for c in self.capture_cases("v2") if c > 0], clamp=True))
            elif self.specialize_active_lora:
                cases = self.captured_lora_counts() if self.cudagraph_specialize_lora else (self.max_loras + 1,)
                table.append(_round_up(n, cases, clamp=False))
            else:
                table.append(self.max_loras + 1)
        return tuple(table)


def _round_up(n: int, cases, *, clamp: bool) -> int:
    """Smallest case >= n (for n > 0); past the largest: the largest if ``clamp``, else n."""
    if n == 0:
        return 0
    above = [c for c in sorted(cases) if c >= n]
    if above:
        return above[0]
    return max(cases) if clamp else n
