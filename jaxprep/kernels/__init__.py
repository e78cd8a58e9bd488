"""Hand-written kernels for the plain step, each beside its plain-JAX (XLA) twin (STYLE.md habit 16).

- `prepare_pallas.py`: the plain step as two Pallas (Triton) launches, a row kernel and a token
  kernel; vLLM's counterparts are model runner V2's `vllm/v1/worker/gpu/input_batch.py`
  (``_prepare_prefill_inputs_kernel``, ``_prepare_pos_seq_lens_kernel``) and
  `vllm/v1/worker/gpu/block_table.py` (``_compute_slot_mappings_kernel``, ``_gather_block_tables_kernel``).

`PrepConfig.kernel` picks the path: ``"xla"`` (the jnp step of `jaxprep.prepare`), ``"pallas"``
(the kernels; Pallas' interpreter off CUDA) or ``"auto"`` (the kernels on CUDA, XLA elsewhere).
"""

from jaxprep._checks import module_available

KERNEL_CHOICES = ("xla", "pallas", "auto")
"""Values of `PrepConfig.kernel`."""
TRITON_BACKEND = "jax.experimental.pallas.triton"
"""Pallas' Triton backend, which the kernels are written for. jax 0.11 deprecates it: `prepare_pallas`
is imported only when a config asks for the kernels, so ``import jaxprep`` never needs it."""


def triton_backend_available() -> bool:
    """Whether this jax still ships Pallas' Triton backend (without it ``"auto"`` keeps XLA)."""
    return module_available(TRITON_BACKEND)


def uses_kernels(config) -> bool:
    """Whether `PrepConfig.kernel` routes ``config``'s step to the kernels: the plain step only, and
    ``"auto"`` only where this jax has the Triton backend."""
    if config.kernel == "xla" or config.features.any_on:
        return False
    return config.kernel == "pallas" or triton_backend_available()
