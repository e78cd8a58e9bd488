"""vLLM V1's host preparation on pinned ``CpuGpuBuffer`` pairs, its fields copied to the device as vLLM
copies them (`vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._prepare_inputs`): the V1 baseline
of the GPU benchmarks (bench_gpu.py, bench_fused_step.py). Needs torch; any torch device works (on
the CPU the "device" twin is a second CPU tensor, which is how the tests check it)."""

from __future__ import annotations

import numpy as np
import torch
from vllm_v1_baseline import VllmV1HostPrep


class CpuGpuBuffers:
    """`vllm/v1/utils.py::CpuGpuBuffer` per name: a zeroed pinned host tensor, whose NumPy view the
    baseline writes, and its device twin. Used as `VllmV1HostPrep`'s ``make_buffer``."""

    def __init__(self, device):
        self.device, self.pairs = device, {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        cpu = torch.zeros(shape, dtype=torch.from_numpy(np.zeros(0, dtype)).dtype, pin_memory=torch.cuda.is_available())
        self.pairs[name] = (cpu, torch.zeros_like(cpu, device=self.device))
        return cpu.numpy()

    def copy_to_gpu(self, name: str, n: int):
        cpu, gpu = self.pairs[name]
        return gpu[:n].copy_(cpu[:n], non_blocking=True)


class VllmV1WithCopies(VllmV1HostPrep):
    """The V1 host path on pinned buffers, its results copied to the device as vLLM copies them.

    vLLM 0.33.0 copies ``req_indices``/``query_pos`` and rebuilds positions, ``seq_lens`` and the
    slot mapping on the GPU; this copies the host-built fields instead (the same bytes or fewer).
    """

    def __init__(self, config, arrays: dict, device):
        self.buffers = CpuGpuBuffers(device)
        block_table = self.buffers("block_table", arrays["block_table"].shape, np.int32)
        block_table[:] = arrays["block_table"]
        super().__init__(arrays["token_ids"], block_table, arrays["num_computed_tokens"], config.block_size,
                         config.max_num_batched_tokens, make_buffer=self.buffers)

    def commit_block_table(self, num_reqs: int) -> None:
        self.buffers.copy_to_gpu("block_table", num_reqs)

    def prepare_on_device(self, num_scheduled_tokens, num_tokens_padded: int, num_reqs_padded: int) -> dict:
        step = self.prepare(num_scheduled_tokens, num_tokens_padded, num_reqs_padded)
        for name in ("input_ids", "positions", "slot_mapping"):
            self.buffers.copy_to_gpu(name, num_tokens_padded)
        for name in ("seq_lens", "logits_indices"):
            self.buffers.copy_to_gpu(name, num_reqs_padded)
        self.buffers.copy_to_gpu("query_start_loc", num_reqs_padded + 1)
        self.buffers.pairs["block_table"][1][step["num_reqs"]:num_reqs_padded].fill_(0)  # the null block
        return step

    def landed(self, step: dict) -> dict:
        """``step`` (`prepare_on_device`'s) with each copied field as it landed on the device, read back:
        for checking only. (The host step's ``block_table`` is V1's staging buffer, which this path
        never fills: vLLM copies the rows straight from ``block_table.cpu`` to the device.)"""
        sizes = {name: len(step[name]) for name in ("input_ids", "positions", "slot_mapping", "seq_lens",
                                                    "logits_indices", "query_start_loc", "block_table")}
        return {**step, **{name: self.buffers.pairs[name][1][:size].cpu().numpy() for name, size in sizes.items()}}
