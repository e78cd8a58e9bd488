"""Helpers shared by the test folders (importable as ``support``: pyproject's pytest ``pythonpath``).

- `batches`: random core batches (hypothesis strategies and seeded NumPy streams);
- `feature_batches`: random batches with feature inputs, and a jit/eager step runner;
- `expect`: a prepared step compared with the NumPy reference, padding included;
- `bridge_checks`: torch_bridge checks (which torch device JAX's arrays land on, views of a buffer);
- `fake_npu`: a fake ``torch_npu`` that records host-to-NPU staging (fixture in tests/torch_bridge);
- `dp_prepare_check`: sharded preparation against the reference, run in a 4-device subprocess.
- `kernels`: the plain step's two paths (XLA, the Pallas kernels) for tests that run both.
- `vllm_workers`: a vLLM worker script run in a subprocess (Triton's interpreter), its JSON report read back.
"""
