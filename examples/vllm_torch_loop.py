"""vLLM's real scheduler drives a torch model through jaxprep: the whole torch-side loop.

    python examples/vllm_torch_loop.py --model DIR --prompt-ids "1 2 3" --prompt-ids "4 5" --max-tokens 8 --json

The adapter is built from vLLM's own config objects (`VllmAdapter.from_vllm`). Each step: vLLM 0.33.0's
``Scheduler.schedule()`` -> `jaxprep.serving.host.vllm.VllmAdapter.step` (one checked update of jaxprep's
device state, one prepared step) -> `torch_bridge.to_torch` -> `torch_bridge.model.TorchDecoder.forward`
over the paged KV cache -> greedy tokens -> ``adapter.take_sampled`` (recorded in jaxprep's token table,
returned as vLLM's ``ModelRunnerOutput``) -> ``scheduler.update_from_output``. Chunked prefill and
preemption are vLLM's own decisions: a small ``--num-blocks`` makes the scheduler preempt, ``--budget``
chunks long prompts.

Needs vLLM (the ``vllm`` extra, installed ``--no-deps``) and transformers (vLLM reads the checkpoint's
config.json with it). ``VLLM_USE_V2_MODEL_RUNNER=0/1`` picks how the scheduler resumes a preempted
request (``resumed_req_ids`` with ``all_token_ids``, or re-sent as new); the adapter takes both.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch_bridge
from jaxprep.serving import VllmAdapter
from torch_bridge.model import TorchDecoder, greedy_sample


def vllm_scheduler(directory: str, model: TorchDecoder, *, max_model_len: int, block_size: int, num_blocks: int,
                   budget: int, max_num_seqs: int):
    """vLLM's ``Scheduler`` for the checkpoint in ``directory`` on the CPU, built as vLLM's own tests
    build it (`tests/v1/core/utils.py::create_scheduler`): a hand-made one-group ``KVCacheConfig``."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = VllmConfig(
        model_config=ModelConfig(model=directory, skip_tokenizer_init=True, dtype="float32",
                                 max_model_len=max_model_len, seed=0),
        cache_config=CacheConfig(block_size=block_size),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                         max_num_batched_tokens=budget, is_encoder_decoder=False,
                                         enable_chunked_prefill=True),
        device_config=DeviceConfig(device="cpu"))
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=model.config.num_kv_heads,
                             head_size=model.config.head_dim, dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(model.config.num_layers)]
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    return Scheduler(vllm_config=config, kv_cache_config=kv_cache_config, log_stats=False,
                     structured_output_manager=StructuredOutputManager(config), block_size=block_size)


def serve(directory: str, prompts: list[list[int]], max_tokens: int, *, block_size: int = 4,
          num_blocks: int | None = None, budget: int = 8, max_num_seqs: int = 4) -> tuple[list[list[int]], dict]:
    """Each prompt's greedy tokens (in prompt order) and the loop's counts."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    model = TorchDecoder.from_pretrained(directory)
    max_model_len = -(-(max(map(len, prompts)) + max_tokens) // block_size) * block_size
    num_blocks = num_blocks or 1 + sum(-(-(len(p) + max_tokens) // block_size) for p in prompts)
    scheduler = vllm_scheduler(directory, model, max_model_len=max_model_len, block_size=block_size,
                               num_blocks=num_blocks, budget=budget, max_num_seqs=max_num_seqs)
    adapter = VllmAdapter.from_vllm(scheduler.vllm_config, scheduler.kv_cache_config)  # every size read from vLLM
    kv_caches = model.new_kv_caches(num_blocks, block_size)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        scheduler.add_request(Request(f"req-{i}", list(prompt), params, None))
    outputs = {f"req-{i}": [] for i in range(len(prompts))}
    counts = dict(steps=0, preempted=0, partial_prefills=0)
    while scheduler.has_unfinished_requests():
        scheduler_output = scheduler.schedule()
        counts["preempted"] += len(scheduler_output.preempted_req_ids or ())
        step = adapter.step(scheduler_output)
        next_ids = None
        if step.inputs is not None:  # None: the step only reports finished requests
            inputs = torch_bridge.to_torch(step.inputs, device=model.device)  # where the weights are
            next_ids = torch_bridge.from_torch(greedy_sample(model.forward(inputs, kv_caches), inputs),
                                               name="sampled_token_ids")
        # recorded on the device; a prefill chunk that stops short of its request's tokens samples nothing
        runner_output = adapter.take_sampled(step, next_ids)
        counts["partial_prefills"] += sum(not tokens for tokens in runner_output.sampled_token_ids)
        for req_id, tokens in zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True):
            outputs[req_id] += tokens
        scheduler.update_from_output(scheduler_output, runner_output)
        counts["steps"] += 1
    return [outputs[f"req-{i}"] for i in range(len(prompts))], counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint folder: config.json + *.safetensors")
    parser.add_argument("--prompt-ids", action="append", required=True, help='a prompt as token ids: "1 2 3"')
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--budget", type=int, default=8, help="tokens per step (chunked prefill beyond it)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (fewer: preemptions)")
    parser.add_argument("--json", action="store_true",
                        help='print {"outputs": ..., "counts": ...}, the only output on stdout (the text to stderr)')
    args = parser.parse_args()
    prompts = [[int(t) for t in text.split()] for text in args.prompt_ids]
    outputs, counts = serve(args.model, prompts, args.max_tokens, budget=args.budget, num_blocks=args.num_blocks)
    text = sys.stderr if args.json else sys.stdout
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        print(f"[{i}] {prompt} -> {output}", file=text)
    print(f"{counts['steps']} steps, {counts['preempted']} preemptions, {counts['partial_prefills']} partial prefills",
          file=text)
    if args.json:
        print(json.dumps({"outputs": outputs, "counts": counts}))


if __name__ == "__main__":
    main()
