"""vLLM 0.33.0's real scheduler on this CPU machine, built as vLLM's own tests build it, and driven by a fake model.

`vllm/tests/v1/core/utils.py::create_scheduler` builds ``Scheduler`` from a `VllmConfig` and a hand-made
`KVCacheConfig`; here the model directory holds only a tiny Llama ``config.json`` (no weights, no hub), the
device is the CPU and ``cache_config.num_gpu_blocks`` is set. `Workload` names what a run exercises
(chunked prefill, a small KV pool that forces preemption, prefix caching, n-gram drafts, async scheduling, with
and without EAGLE-style drafts, a second KV-cache group with a sliding window, LoRA requests).

The fake model samples ``fake_token(request, position)``: a per-request periodic pattern with rare
deviations, so vLLM's n-gram proposer finds matches and some drafts are rejected.

Import this only where vLLM is installed (``pytest.importorskip("vllm")`` first). vLLM's platform is the
unspecified one on a CPU-only machine; `cpu_platform_stubs` turns off pinned memory and CUDA events for
the runner pieces that `tests/support/vllm_v1_runner.py` builds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import tempfile
import types

import numpy as np

VOCAB_SIZE = 1000
HEAD_SIZE = 32


@dataclasses.dataclass(frozen=True)
class Workload:
    """One run of vLLM's scheduler: its configuration and the requests it is given."""

    name: str
    num_steps: int
    max_num_seqs: int = 8
    max_model_len: int = 128
    max_num_batched_tokens: int = 48
    block_size: int = 8
    num_blocks: int = 64  # the KV pool; small pools force preemption
    prefix_caching: bool = False
    num_speculative_tokens: int = 0
    spec_method: str = "ngram"  # "eagle": drafts proposed by the worker (`fake_drafts`), the only kind async allows
    async_scheduling: bool = False
    sliding_window: int | None = None  # a second KV-cache group with this window
    num_loras: int = 0  # LoRA adapters the requests cycle through (0: no LoRA)
    num_requests: int = 12
    arrivals_per_step: int = 2
    prompt_lens: tuple[int, int] = (6, 40)
    max_tokens: tuple[int, int] = (4, 24)
    shared_prefix: int = 0  # leading prompt tokens shared by all requests (prefix-cache hits)
    seed: int = 0


WORKLOADS = (
    Workload("chunked prefill, preemption", num_steps=40, num_blocks=22, max_num_batched_tokens=32),
    Workload("prefix caching", num_steps=30, prefix_caching=True, shared_prefix=24, num_blocks=40),
    Workload("n-gram spec decode", num_steps=34, num_speculative_tokens=2, num_blocks=26),
    Workload("async scheduling", num_steps=30, async_scheduling=True, num_blocks=24),
    Workload("async scheduling + spec decode", num_steps=18, async_scheduling=True, num_speculative_tokens=2,
             spec_method="eagle", num_blocks=24, num_requests=6, max_tokens=(8, 20)),
    Workload("full + sliding window, LoRA", num_steps=34, sliding_window=16, num_loras=2, prefix_caching=True,
             shared_prefix=16, num_blocks=40),
    Workload("six admissions in one step", num_steps=12, arrivals_per_step=7, prompt_lens=(3, 6), num_requests=14),
)
"""Each run (both runner modes) schedules about 200 non-empty steps; the KV pools of the first four are small
enough to preempt requests. Async scheduling with drafts takes an EAGLE-style drafter (`fake_drafts`): V1
refuses n-gram drafting with async scheduling."""


def fake_token(req_id: str, position: int) -> int:
    """The fake model's token at ``position`` of ``req_id``: pattern ``period`` long, one deviation in 7."""
    seed = _request_seed(req_id)
    period = 3 + seed % 5
    if _hash_int(f"{req_id}:{position}") % 7 == 0:
        return 1 + _hash_int(f"dev:{req_id}:{position}") % (VOCAB_SIZE - 1)
    return 1 + (seed + position % period * 37) % (VOCAB_SIZE - 1)


def fake_drafts(req_id: str, position: int, k: int) -> list[int]:
    """An EAGLE-style drafter's ``k`` proposals for ``position``, ``position + 1``, ...: the fake model's
    tokens, one in three replaced by another (so drafts are rejected as well as accepted)."""
    drafts = []
    for p in range(position, position + k):
        token = fake_token(req_id, p)
        drafts.append(token % (VOCAB_SIZE - 1) + 1 if _hash_int(f"draft:{req_id}:{p}") % 3 == 0 else token)
    return drafts


def _hash_int(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


@functools.cache
def _request_seed(req_id: str) -> int:
    return _hash_int(req_id)


def prompt_tokens(req_id: str, length: int, shared_prefix: int) -> list[int]:
    """A prompt that repeats the request's pattern after ``shared_prefix`` tokens common to all requests."""
    shared = [1 + (7 * i) % (VOCAB_SIZE - 1) for i in range(min(shared_prefix, length))]
    return shared + [fake_token(req_id, p) for p in range(len(shared), length)]


def model_dir(max_model_len: int) -> str:
    """A directory holding only a tiny Llama ``config.json``."""
    from transformers import LlamaConfig

    path = tempfile.mkdtemp(prefix="tiny-llama-")
    LlamaConfig(hidden_size=2 * HEAD_SIZE, num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_SIZE,
                num_hidden_layers=2, intermediate_size=128, vocab_size=VOCAB_SIZE,
                max_position_embeddings=max_model_len, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


def vllm_config(work: Workload, *, lora: bool = True):
    """The `VllmConfig` of ``work`` (``lora=False`` leaves LoRA out, for the runner: it has no adapters)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        LoRAConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    model_config = ModelConfig(model=model_dir(work.max_model_len), skip_tokenizer_init=True, dtype="float32",
                               max_model_len=work.max_model_len, seed=0)
    scheduler_config = SchedulerConfig(max_num_seqs=work.max_num_seqs, max_model_len=work.max_model_len,
                                       max_num_batched_tokens=work.max_num_batched_tokens,
                                       is_encoder_decoder=False, enable_chunked_prefill=True,
                                       async_scheduling=work.async_scheduling)
    cache_config = CacheConfig(block_size=work.block_size, enable_prefix_caching=work.prefix_caching)
    speculative_config = None
    if work.num_speculative_tokens and work.spec_method == "ngram":
        speculative_config = SpeculativeConfig(method="ngram", num_speculative_tokens=work.num_speculative_tokens,
                                               prompt_lookup_min=2, prompt_lookup_max=3)
    elif work.num_speculative_tokens:  # an EAGLE head read from the same tiny config: never loaded
        speculative_config = SpeculativeConfig(method=work.spec_method, model=model_config.model,
                                               num_speculative_tokens=work.num_speculative_tokens,
                                               target_model_config=model_config,
                                               target_parallel_config=ParallelConfig())
    lora_config = LoRAConfig(max_loras=work.num_loras, max_lora_rank=8) if work.num_loras and lora else None
    config = VllmConfig(model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config,
                        device_config=DeviceConfig(device="cpu"), speculative_config=speculative_config,
                        lora_config=lora_config)
    config.cache_config.num_gpu_blocks = work.num_blocks
    return config


def kv_cache_config(work: Workload):
    """One full-attention group, and a sliding-window group beside it when ``work.sliding_window`` is set."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    spec = dict(block_size=work.block_size, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(**spec))]
    if work.sliding_window:
        groups.append(KVCacheGroupSpec(["model.layers.1.self_attn.attn"],
                                       SlidingWindowSpec(**spec, sliding_window=work.sliding_window)))
    return KVCacheConfig(num_blocks=work.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def make_scheduler(work: Workload):
    """vLLM's ``Scheduler`` (``AsyncScheduler`` under async scheduling) for ``work``."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config = vllm_config(work)
    cls = AsyncScheduler if work.async_scheduling else Scheduler
    return cls(vllm_config=config, kv_cache_config=kv_cache_config(work), log_stats=False,
               structured_output_manager=StructuredOutputManager(config), block_size=work.block_size)


class Requests:
    """The requests of ``work``, made in arrival order (`vllm.v1.request.Request` with a block hasher)."""

    def __init__(self, work: Workload):
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        self.work = work
        self.rng = np.random.default_rng(work.seed)
        self.block_hasher = get_request_block_hasher(work.block_size, sha256)
        self.made = 0

    def arrivals(self, step: int) -> list:
        count = min(self.work.arrivals_per_step if step % 3 == 0 else 0, self.work.num_requests - self.made)
        return [self.make() for _ in range(max(count, 0))]

    def make(self):
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        req_id = f"req-{self.made}"
        self.made += 1
        work, rng = self.work, self.rng
        length = int(rng.integers(*work.prompt_lens, endpoint=True))
        params = SamplingParams(max_tokens=int(rng.integers(*work.max_tokens, endpoint=True)), ignore_eos=True,
                                temperature=0.0)
        lora = None
        if work.num_loras and self.made % (work.num_loras + 1):
            lora_id = 1 + self.made % (work.num_loras + 1) - 1
            lora = LoRARequest(f"adapter-{lora_id}", lora_id, f"adapters/{lora_id}")
        return Request(req_id, prompt_tokens(req_id, length, work.shared_prefix), params, None,
                       lora_request=lora, block_hasher=self.block_hasher)


def no_pinned_memory() -> None:
    """vLLM's unspecified platform (a machine without an accelerator) claims pinned memory; its modules copy
    ``vllm.utils.torch_utils.PIN_MEMORY`` when imported, so call this first in the process, before any
    vLLM module but the platform is imported."""
    from vllm.platforms import current_platform

    type(current_platform).is_pin_memory_available = classmethod(lambda cls: False)
    from vllm.utils.platform_utils import is_pin_memory_available

    is_pin_memory_available.cache_clear()
    import vllm.utils.torch_utils as torch_utils

    if torch_utils.PIN_MEMORY:
        raise RuntimeError("vllm.utils.torch_utils was imported before no_pinned_memory()")


@contextlib.contextmanager
def cpu_platform_stubs():
    """For the runner pieces: CUDA events that do nothing (vLLM's ``CPUModelRunner`` stubs streams alike), and
    a one-rank pipeline group in place of torch.distributed's (``_update_states`` asks whether it is the last)."""
    from unittest import mock

    import torch
    from vllm.v1.worker import gpu_model_runner

    one_rank = types.SimpleNamespace(is_first_rank=True, is_last_rank=True, world_size=1, rank_in_group=0)
    with mock.patch.object(torch.cuda, "Event", NoEvent), \
            mock.patch.object(gpu_model_runner, "get_pp_group", lambda: one_rank):
        yield


class NoEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self) -> bool:
        return True
