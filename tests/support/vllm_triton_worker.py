"""Runs vLLM 0.33.0's own Triton attention backend on steps prepared by jaxprep; prints a JSON report.

Started by tests/torch_bridge/test_vllm_backend.py in a subprocess whose environment sets
``TRITON_INTERPRET=1`` (Triton's interpreter runs the kernels on the CPU) and ``CUDA_VISIBLE_DEVICES=""``
(vLLM keeps Triton enabled with no active GPU driver, its rule for a worker whose devices are hidden):
both must be set before triton or vllm is imported, and neither may leak into the test session.

Each KV-cache group is one attention layer with its own cache. Every step, for every group:
``TritonAttentionMetadataBuilder.build`` on `torch_bridge.vllm.common_attention_metadata`, then
``TritonAttentionImpl.do_kv_cache_update`` and ``forward``. The oracles never read the bridged metadata:
- each real token's output against dense causal attention over its request's whole K/V history;
- the whole KV cache against a shadow cache written from the test's own block bookkeeping, so a
  padded token (slot -1, K/V 1e6) that wrote anything shows up.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from unittest import mock

import numpy as np

if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("CUDA_VISIBLE_DEVICES") != "":
    sys.exit("run with TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES='' set before Python starts")

import torch

import jaxprep
import torch_bridge
import torch_bridge.vllm as bridge_vllm
from jaxprep.config import cdiv

BLOCK_SIZE = 16  # the Triton backend's kernel block size is a multiple of 16
GROUP_SPECS = (jaxprep.KVCacheGroupSpec(block_size=16, num_blocks=24),
               jaxprep.KVCacheGroupSpec(block_size=32, kernel_block_size=16, num_blocks=12))
CONFIG = jaxprep.PrepConfig(max_num_reqs=3, max_model_len=64, max_num_batched_tokens=32, block_size=BLOCK_SIZE,
                            num_blocks=24, features=jaxprep.FeatureConfig(kv_groups=GROUP_SPECS))
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 32  # the Triton backend wants head_size >= 32
# (arrival step, prompt length, decoded tokens); D waits for a free row and reuses B's row and blocks
REQUESTS = (("A", 0, 40, 3), ("B", 0, 20, 1), ("C", 1, 24, 2), ("D", 2, 18, 2))
PAD_VALUE = 1e6  # q/k/v of padded tokens: a write of it anywhere in the cache is caught
CORRUPT_STEP = 2


@dataclasses.dataclass
class Request:
    name: str
    arrival: int
    prompt_len: int
    total_len: int
    row: int = -1
    num_computed: int = 0
    blocks: list = dataclasses.field(default_factory=lambda: [[] for _ in GROUP_SPECS])  # manager blocks per group

    def next_chunk(self, budget: int) -> int:
        if self.num_computed < self.prompt_len:  # (chunked) prefill
            return min(self.prompt_len - self.num_computed, budget)
        return min(1, self.total_len - self.num_computed, budget)  # decode


def vllm_config():
    """The smallest real VllmConfig: a 1-layer Llama config written locally (no hub access), CPU device."""
    from transformers import LlamaConfig
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_dir = tempfile.mkdtemp(prefix="tiny-llama-")
    LlamaConfig(hidden_size=NUM_HEADS * HEAD_SIZE, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
                head_dim=HEAD_SIZE, num_hidden_layers=1, intermediate_size=256, vocab_size=1000,
                max_position_embeddings=CONFIG.max_model_len,
                architectures=["LlamaForCausalLM"]).save_pretrained(model_dir)
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32",
                               max_model_len=CONFIG.max_model_len, seed=0)
    scheduler_config = SchedulerConfig(max_num_seqs=CONFIG.max_num_reqs, max_model_len=CONFIG.max_model_len,
                                       max_num_batched_tokens=CONFIG.max_num_batched_tokens, is_encoder_decoder=False)
    return VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=BLOCK_SIZE),
                      scheduler_config=scheduler_config, device_config=DeviceConfig(device="cpu"))


class ScaleHolder(torch.nn.Module):
    """What ``TritonAttentionImpl`` reads from its layer: the unit q/k/v scales of an unquantized cache."""

    def __init__(self):
        super().__init__()
        self._q_scale, self._k_scale, self._v_scale = torch.ones(()), torch.ones(()), torch.ones(())


@dataclasses.dataclass
class Backend:
    """One attention layer per KV-cache group: vLLM's builder and impl, and the group's paged cache."""

    builders: list
    impl: object
    layer: ScaleHolder
    caches: list  # [num_kernel_blocks, num_kv_heads, kernel_block_size, 2 * head_size] per group (vLLM's layout)


def make_backend(config) -> Backend:
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.triton_attn import (
        TritonAttentionImpl,
        TritonAttentionMetadataBuilder,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    builders, caches = [], []
    for g, spec in enumerate(GROUP_SPECS):
        kernel_block = spec.kernel_block_size or spec.block_size
        kv_spec = FullAttentionSpec(block_size=kernel_block, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                                    dtype=torch.float32)
        with set_current_vllm_config(config):
            builders.append(TritonAttentionMetadataBuilder(kv_spec, [f"layers.{g}.attn"], config, torch.device("cpu")))
        num_kernel_blocks = spec.num_blocks * spec.blocks_per_kernel_block
        caches.append(torch.zeros(num_kernel_blocks, NUM_KV_HEADS, kernel_block, 2 * HEAD_SIZE))
    impl = TritonAttentionImpl(num_heads=NUM_HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE ** -0.5,
                               num_kv_heads=NUM_KV_HEADS, alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    return Backend(builders, impl, ScaleHolder(), caches)


def dense_causal(q, k, v):
    """Plain causal attention over a whole sequence in float64 ([L, heads, head_size] each): the oracle."""
    q, k, v = q.double(), k.double().repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 1), v.double()
    v = v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_SIZE)
    visible = torch.arange(k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, -math.inf).softmax(-1), v)


@dataclasses.dataclass
class Workload:
    """The requests' fixed q/k/v per group, their oracle outputs, and the test's own block bookkeeping."""

    requests: list
    qkv: dict  # (name, group) -> (q, k, v) of all total_len tokens
    expected: dict  # (name, group) -> [total_len, heads, head_size] float64
    shadow: list  # per group: the cache as the test's own bookkeeping says it must be
    free: list  # per group: free manager blocks, reused last-freed first
    token_ids: np.ndarray
    tables: list  # per group: [max_num_reqs, width] manager block tables
    reused_blocks: bool = False


def make_workload() -> Workload:
    gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    requests = [Request(name, arrival, prompt, prompt + decodes) for name, arrival, prompt, decodes in REQUESTS]
    qkv = {(r.name, g): tuple(torch.randn(r.total_len, heads, HEAD_SIZE, generator=gen)
                              for heads in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
           for r in requests for g in range(len(GROUP_SPECS))}
    expected = {key: dense_causal(*tensors) for key, tensors in qkv.items()}
    widths = [CONFIG.max_blocks_per_req] + [
        jaxprep.config.block_table_width(CONFIG.max_model_len, spec.block_size) for spec in GROUP_SPECS[1:]]
    return Workload(
        requests=requests, qkv=qkv, expected=expected,
        shadow=[torch.zeros(spec.num_blocks * spec.blocks_per_kernel_block, NUM_KV_HEADS,
                            spec.kernel_block_size or spec.block_size, 2 * HEAD_SIZE) for spec in GROUP_SPECS],
        free=[list(rng.permutation(np.arange(1, spec.num_blocks))) for spec in GROUP_SPECS],
        token_ids=rng.integers(1, 1000, (CONFIG.max_num_reqs, CONFIG.max_model_len), dtype=np.int32),
        tables=[np.zeros((CONFIG.max_num_reqs, width), np.int32) for width in widths])


def admit_and_schedule(work: Workload, step: int) -> tuple[list, np.ndarray]:
    """Frees finished requests' rows and blocks, admits arrivals into free rows, fills the token budget."""
    rows_used = {r.row for r in work.requests if r.row >= 0}
    for r in work.requests:
        if r.row >= 0 and r.num_computed == r.total_len:  # finished: its row and blocks go back
            for g, blocks in enumerate(r.blocks):
                work.free[g].extend(reversed(blocks))
                work.tables[g][r.row] = 0
            rows_used.discard(r.row)
            r.row = -2
        elif r.row == -1 and r.arrival <= step and len(rows_used) < CONFIG.max_num_reqs:
            r.row = min(set(range(CONFIG.max_num_reqs)) - rows_used)
            rows_used.add(r.row)
    active = sorted((r for r in work.requests if r.row >= 0), key=lambda r: r.row)
    scheduled = np.zeros(CONFIG.max_num_reqs, np.int32)
    for r in active:
        scheduled[r.row] = r.next_chunk(CONFIG.max_num_batched_tokens - int(scheduled.sum()))
    allocate(work, active, scheduled)
    return [r for r in active if scheduled[r.row] > 0], scheduled


def allocate(work: Workload, active: list, scheduled: np.ndarray) -> None:
    """Gives each request the manager blocks its scheduled tokens land in, per group."""
    for r in active:
        for g, spec in enumerate(GROUP_SPECS):
            needed = cdiv(r.num_computed + int(scheduled[r.row]), spec.block_size)
            while len(r.blocks[g]) < needed:
                block = int(work.free[g].pop())
                work.reused_blocks |= any(block in other.blocks[g] for other in work.requests if other.row == -2)
                work.tables[g][r.row, len(r.blocks[g])] = block
                r.blocks[g].append(block)


def prepare(work: Workload, scheduled: np.ndarray):
    computed = np.zeros(CONFIG.max_num_reqs, np.int32)
    for r in work.requests:
        if r.row >= 0:
            computed[r.row] = r.num_computed
    state = jaxprep.BatchState.from_numpy(token_ids=work.token_ids, block_table=work.tables[0],
                                          extra_block_tables=tuple(work.tables[1:]), num_computed_tokens=computed,
                                          num_scheduled_tokens=scheduled)
    return torch_bridge.to_torch(jaxprep.prepare_inputs(state, CONFIG, check=True))


def step_tensors(work: Workload, batch: list, scheduled: np.ndarray, group: int, num_tokens_padded: int):
    """q/k/v of the step's tokens in batch order (the test's own order), PAD_VALUE in the padded tail."""
    q = torch.full((num_tokens_padded, NUM_HEADS, HEAD_SIZE), PAD_VALUE)
    k = torch.full((num_tokens_padded, NUM_KV_HEADS, HEAD_SIZE), PAD_VALUE)
    v = k.clone()
    owners = []
    for r in batch:
        for position in range(r.num_computed, r.num_computed + int(scheduled[r.row])):
            token = len(owners)
            q[token], k[token], v[token] = (t[position] for t in work.qkv[(r.name, group)])
            owners.append((r, position))
    return q, k, v, owners


def write_shadow(work: Workload, group: int, owners: list, k, v) -> None:
    """The cache as it must be after the step: each real token at its own block/offset; nothing else."""
    spec = GROUP_SPECS[group]
    kernel_block = spec.kernel_block_size or spec.block_size
    for token, (r, position) in enumerate(owners):
        slot = r.blocks[group][position // spec.block_size] * spec.block_size + position % spec.block_size
        block, offset = divmod(slot, kernel_block)
        work.shadow[group][block, :, offset, :HEAD_SIZE] = k[token]
        work.shadow[group][block, :, offset, HEAD_SIZE:] = v[token]


def run_group(backend: Backend, cam, group: int, q, k, v):
    """vLLM's own path for one layer: build the backend metadata, write the KV cache, attend."""
    metadata = backend.builders[group].build(0, cam)
    output = torch.zeros_like(q)
    # Triton's interpreter has no CUDA device to report a capability for; the kernel-launch heuristic
    # of vLLM's cache write asks anyway. Answer as a Hopper GPU would: it only picks a tile size.
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        backend.impl.do_kv_cache_update(backend.layer, k, v, backend.caches[group], cam.slot_mapping)
    backend.impl.forward(backend.layer, q, k, v, backend.caches[group], metadata, output)
    return output


def corrupt(cam, kind: str | None, work: Workload):
    """A copy of ``cam`` with one wrong entry (the negative controls), or ``cam`` itself."""
    if kind is None:
        return cam
    if kind == "slot":  # token 0 writes into a free block instead of its own
        slots = cam.slot_mapping.clone()
        slots[0] = int(work.free[0][0]) * BLOCK_SIZE
        return cam.replace(slot_mapping=slots)
    if kind == "pad_slot":  # the last padded token writes (its K/V are PAD_VALUE) into a free block
        slots = cam.slot_mapping.clone()
        assert slots[-1] == jaxprep.PAD_SLOT_ID, "the corrupted step must have padded tokens"
        slots[-1] = int(work.free[0][0]) * BLOCK_SIZE
        return cam.replace(slot_mapping=slots)
    if kind == "seq_len":  # request 0 reads one key too few
        seq_lens = cam.seq_lens.clone()
        seq_lens[0] -= 1
        return cam.replace(seq_lens=seq_lens)
    if kind == "block_table":  # request 0 reads its first block from a free block
        table = cam.block_table_tensor.clone()
        table[0, 0] = int(work.free[0][0])
        return cam.replace(block_table_tensor=table)
    raise ValueError(kind)


def field_checks(cam, batch: list, scheduled: np.ndarray, prompt_by_row: np.ndarray) -> dict[str, bool]:
    """The host-side fields against the test's own bookkeeping (batch = rows with work, in row order)."""
    real = len(batch)
    return {
        "req_idx": cam.req_idx.tolist() == [r.row for r in batch],
        "is_prefilling": cam.is_prefilling[:real].tolist() == [r.num_computed < r.prompt_len for r in batch]
        and not cam.is_prefilling[real:].any(),
        "seq_lens_cpu_upper_bound": cam.seq_lens_cpu_upper_bound[:real].tolist()
        == [r.num_computed + int(scheduled[r.row]) for r in batch],
        "query_start_loc_cpu": cam.query_start_loc_cpu[:real + 1].tolist()
        == np.concatenate([[0], np.cumsum([scheduled[r.row] for r in batch])]).tolist(),
        "positions": all(cam.positions[t] == p for t, (_, p) in enumerate(
            (r, p) for r in batch for p in range(r.num_computed, r.num_computed + int(scheduled[r.row])))),
    }


def run_workload(backend: Backend, *, padded: bool = False, corruption: str | None = None) -> dict:
    """The multi-step workload through vLLM's backend; errors and checks per step."""
    for cache in backend.caches:
        cache.zero_()
    work, report, step = make_workload(), {"steps": []}, 0
    prompt_by_row = np.zeros(CONFIG.max_num_reqs, np.int32)
    while any(r.row != -2 for r in work.requests):
        batch, scheduled = admit_and_schedule(work, step)
        if not batch:
            break
        for r in batch:
            prompt_by_row[r.row] = r.prompt_len
        inputs = prepare(work, scheduled)
        cams = bridge_vllm.group_common_attention_metadata(inputs, prefill_len=prompt_by_row, padded=padded)
        entry = {"scheduled": {r.name: int(scheduled[r.row]) for r in batch}, "rows": {r.name: r.row for r in batch},
                 "num_tokens_padded": inputs.num_tokens_padded, "max_error": 0.0, "cache_equal": True,
                 "fields": field_checks(cams[0], batch, scheduled, prompt_by_row)}
        for g, cam in enumerate(cams):
            q, k, v, owners = step_tensors(work, batch, scheduled, g, inputs.num_tokens_padded)
            cam = corrupt(cam, corruption if step == CORRUPT_STEP and g == 0 else None, work)
            output = run_group(backend, cam, g, q, k, v)
            write_shadow(work, g, owners, k, v)
            errors = [float((output[t].double() - work.expected[(r.name, g)][p]).abs().max())
                      for t, (r, p) in enumerate(owners)]
            entry["max_error"] = max(entry["max_error"], max(errors))
            entry["cache_equal"] &= bool(torch.equal(backend.caches[g], work.shadow[g]))
        report["steps"].append(entry)
        if corruption is not None and step == CORRUPT_STEP:  # what the corruption tests read: the steps up to it
            break
        for r in batch:
            r.num_computed += int(scheduled[r.row])
        step += 1
    report["reused_blocks"] = work.reused_blocks
    return report


def other_field_checks() -> dict[str, bool]:
    """What the Triton workload leaves unset (DCP lengths, KV-sharing fast-prefill indices), and a bad group."""
    dcp = jaxprep.DCPConfig(world_size=2, rank=1)
    config = dataclasses.replace(CONFIG, features=jaxprep.FeatureConfig(dcp=dcp))
    table = np.zeros((CONFIG.max_num_reqs, CONFIG.max_blocks_per_req), np.int32)
    table[0, :2], table[2, :1] = [3, 4], [5]
    state = jaxprep.BatchState.from_numpy(token_ids=np.ones((3, CONFIG.max_model_len), np.int32), block_table=table,
                                          num_computed_tokens=[17, 0, 4], num_scheduled_tokens=[1, 0, 3])
    inputs = torch_bridge.to_torch(jaxprep.prepare_inputs(state, config, check=True))
    cam = bridge_vllm.common_attention_metadata(inputs, kv_sharing_fast_prefill=True)
    # seq_lens [18, 7]; rank 1 of 2 holds the odd positions: 9 and 3 tokens
    return {
        "dcp_local_seq_lens": cam.dcp_local_seq_lens.tolist() == [9, 3],
        "dcp_local_seq_lens_cpu_upper_bound": cam.dcp_local_seq_lens_cpu_upper_bound.tolist() == [9, 3],
        # tokens [row 0: 1, row 2: 3] -> sampled rows [0, 3]; pads repeat 3
        "logits_indices_padded": cam.logits_indices_padded.tolist()[:2] == [0, 3]
        and set(cam.logits_indices_padded.tolist()[2:]) <= {3},
        "num_logits_indices": cam.num_logits_indices == 2 and cam.max_logits_per_req == 1,
        "no_groups_error": _raises_value_error(lambda: bridge_vllm.common_attention_metadata(inputs, group=0)),
        **spec_decode_fast_prefill_checks(),
    }


def spec_decode_fast_prefill_checks() -> dict[str, bool]:
    """With drafts, the fast-prefill indices are the sampled rows of every draft and bonus token."""
    config = dataclasses.replace(CONFIG, features=jaxprep.FeatureConfig(num_speculative_tokens=2))
    table = np.zeros((CONFIG.max_num_reqs, CONFIG.max_blocks_per_req), np.int32)
    table[0, 0], table[1, 0] = 3, 4
    state = jaxprep.BatchState.from_numpy(token_ids=np.ones((3, CONFIG.max_model_len), np.int32), block_table=table,
                                          num_computed_tokens=[5, 0, 0], num_scheduled_tokens=[3, 4, 0],
                                          num_draft_tokens=[2, 0, 0])
    step = jaxprep.prepare_inputs(state, config, check=True)
    cam = bridge_vllm.common_attention_metadata(torch_bridge.to_torch(step),
                                                kv_sharing_fast_prefill=True)
    # row 0: 3 tokens, 2 drafts -> rows 0, 1, 2 sampled; row 1: a 4-token prefill chunk -> row 6
    return {"spec_logits_indices": cam.logits_indices_padded.tolist()[:4] == [0, 1, 2, 6]
            and set(cam.logits_indices_padded.tolist()[4:]) <= {6},
            "spec_counts": (cam.num_logits_indices, cam.max_logits_per_req) == (4, 3)}


def _raises_value_error(call) -> bool:
    try:
        call()
    except ValueError as error:
        return "FeatureConfig.kv_groups" in str(error)
    return False


def main() -> None:
    started = time.perf_counter()
    backend = make_backend(vllm_config())
    setup = time.perf_counter() - started
    report = {"setup_s": setup, "runs": {}}
    for name, options in {"unpadded": {}, "padded": {"padded": True}, "slot": {"corruption": "slot"},
                          "seq_len": {"corruption": "seq_len"}, "block_table": {"corruption": "block_table"},
                          "pad_slot": {"corruption": "pad_slot"}}.items():
        run_started = time.perf_counter()
        report["runs"][name] = run_workload(backend, **options)
        report["runs"][name]["seconds"] = time.perf_counter() - run_started
    report["other_fields"] = other_field_checks()
    report["total_s"] = time.perf_counter() - started
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
