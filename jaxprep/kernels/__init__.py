"""Hand-written kernels for the step, each beside its plain-JAX (XLA) twin (STYLE.md habit 16).

- `prepare_pallas.py`: the step as two Pallas (Triton) launches, `rows.py` (the batch rows) and
  `tokens.py` (tokens, logits rows, draft rows, block-table rows), `common.py` what they share;
  vLLM's counterparts are model runner V2's `vllm/v1/worker/gpu/input_batch.py`
  (``_prepare_prefill_inputs_kernel``, ``_prepare_pos_seq_lens_kernel``,
  ``_combine_sampled_and_draft_tokens_kernel``, ``_expand_idx_mapping_kernel``) and
  `vllm/v1/worker/gpu/block_table.py` (``_compute_slot_mappings_kernel``, ``_gather_block_tables_kernel``).

`PrepConfig.kernel` picks the path: ``"auto"`` (the default: the kernels on CUDA, XLA elsewhere),
``"xla"`` (the jnp step of `jaxprep.prepare`) or ``"pallas"`` (the kernels; Pallas' interpreter off
CUDA). The kernels cover the plain step and the features of `KERNEL_FEATURES`; a step with any other
feature on runs on XLA under ``"auto"`` and is refused under ``"pallas"`` (`uncovered_features`).
Nothing here imports the kernels' modules: ``import jaxprep`` never needs Pallas' Triton backend.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxprep._checks import module_available

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
