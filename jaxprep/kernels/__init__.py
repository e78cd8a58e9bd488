"""Hand-written kernels for the plain step, each beside its plain-JAX (XLA) twin (STYLE.md habit 16).

- `prepare_pallas.py`: the plain step as two Pallas (Triton) launches, a row kernel and a token
  kernel; vLLM's counterparts are model runner V2's `vllm/v1/worker/gpu/input_batch.py`
  (``_prepare_prefill_inputs_kernel``, ``_prepare_pos_seq_lens_kernel``) and
  `vllm/v1/worker/gpu/block_table.py` (``_compute_slot_mappings_kernel``, ``_gather_block_tables_kernel``).

`PrepConfig.kernel` picks the path: ``"xla"`` (the jnp step of `jaxprep.prepare`), ``"pallas"``
(the kernels; Pallas' interpreter off CUDA) or ``"auto"`` (the kernels on CUDA, XLA elsewhere).
"""

KERNEL_CHOICES = ("xla", "pallas", "auto")
"""Values of `PrepConfig.kernel`."""
