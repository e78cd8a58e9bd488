"""Hand-written kernels for the step, each beside its plain-JAX (XLA) twin (STYLE.md habit 16).

- `prepare_pallas.py`: the step as two Pallas (Triton) launches, `rows.py` (the batch rows) and
  `tokens.py` (tokens, logits rows, draft rows, block-table rows), `common.py` what they share;
  vLLM's counterparts are model runner V2's `vllm/v1/worker/gpu/input_batch.py`
  (``_prepare_prefill_inputs_kernel``, ``_prepare_pos_seq_lens_kernel``,
  ``_combine_sampled_and_draft_tokens_kernel``, ``_expand_idx_mapping_kernel``) and
  `vllm/v1/worker/gpu/block_table.py` (``_compute_slot_mappings_kernel``, ``_gather_block_tables_kernel``).

The package exports the fused step (`prepare_pallas.fused_step`) and nothing else: the kernel
choices and the backend check live with the config (`jaxprep.config.KERNEL_CHOICES`,
`jaxprep.config.uncovered_features`, `jaxprep.config.triton_backend_available`), and `jaxprep.prepare`
alone picks the path per step (`jaxprep.prepare.uses_kernels`): ``"auto"`` (the default: the kernels
on CUDA, XLA elsewhere), ``"xla"`` (the jnp step) or ``"pallas"`` (the kernels; Pallas' interpreter
off CUDA). Nothing below imports `jaxprep.prepare`, and nothing imports the kernels' modules until a
step is traced onto them: ``import jaxprep`` never needs Pallas' Triton backend.
"""
