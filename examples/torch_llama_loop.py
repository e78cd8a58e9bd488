"""A torch-side serving loop: jaxprep's scheduler and prepare step, torch_bridge, a torch model forward.

    python examples/torch_llama_loop.py --model DIR --prompt-ids "1 2 3" --prompt-ids "4 5" --max-tokens 8

Every step: jaxprep's host `Scheduler` picks the tokens (chunked prefill within the token budget,
preemption by recompute when the KV cache is full), the batch's tables go into a `jaxprep.BatchState`,
`jaxprep.prepare_inputs` prepares the step (positions, slot mapping, block tables, logits indices),
`torch_bridge.to_torch` hands it to torch, `torch_bridge.model.TorchDecoder.forward` runs the
checkpoint's layers over the paged KV cache, and the greedy tokens go back to the scheduler.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

import jaxprep
import torch_bridge
from jaxprep.config import PrepConfig
from jaxprep.serving import Request, Scheduler, ServingConfig
from jaxprep.serving.step import NO_TOKEN
from torch_bridge.model import TorchDecoder, greedy_sample


@dataclasses.dataclass
class LoopStats:
    steps: int = 0
    preemptions: int = 0
    chunked_prefills: int = 0  # steps in which a request computed part of its prompt without sampling


def batch_state(scheduler: Scheduler, num_scheduled_tokens: np.ndarray, prep: PrepConfig) -> jaxprep.BatchState:
    """The state rows of the scheduler's running requests: their tokens, computed counts and blocks."""
    rows = prep.max_num_reqs
    token_ids = np.zeros((rows, prep.max_model_len), np.int32)
    block_table = np.zeros((rows, prep.max_blocks_per_req), np.int32)
    computed = np.zeros(rows, np.int32)
    for request in scheduler.running:
        tokens = request.all_token_ids
        token_ids[request.row, : len(tokens)] = tokens
        block_table[request.row, : len(request.block_ids)] = request.block_ids
        computed[request.row] = request.num_computed_tokens
    return jaxprep.BatchState.from_numpy(token_ids=token_ids, block_table=block_table, num_computed_tokens=computed,
                                         num_scheduled_tokens=num_scheduled_tokens)


def serve_greedy(model: TorchDecoder, prompts: list[list[int]], max_tokens: int, *, block_size: int = 4,
                 budget: int = 8, max_num_reqs: int = 4, num_blocks: int | None = None, edit_inputs=None):
    """Serves ``prompts`` together; returns (the finished `Request`s in prompt order, `LoopStats`).

    ``num_blocks`` (default: every request at once) below that forces preemptions; ``edit_inputs``
    (a function of the bridged step) is a hook for negative controls."""
    max_model_len = -(-(max(map(len, prompts)) + max_tokens) // block_size) * block_size
    if num_blocks is None:
        num_blocks = 1 + sum(-(-(len(p) + max_tokens) // block_size) for p in prompts)
    prep = PrepConfig(max_num_reqs=max_num_reqs, max_model_len=max_model_len, max_num_batched_tokens=budget,
                      block_size=block_size, num_blocks=num_blocks)
    config = ServingConfig(prep=prep, eos_token_id=-1, decode_steps=1, vocab_size=model.config.vocab_size)
    scheduler = Scheduler(config)
    requests = [Request(request_id=i, prompt_token_ids=list(p), max_tokens=max_tokens) for i, p in enumerate(prompts)]
    for request in requests:
        scheduler.add_request(request)
    kv_caches, stats = model.new_kv_caches(num_blocks, block_size), LoopStats()
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        stats.preemptions += out.num_preempted
        num_tokens = np.zeros(max_num_reqs, np.int64)
        for request in scheduler.running:
            num_tokens[request.row] = request.num_tokens
        state = batch_state(scheduler, out.num_scheduled_tokens, prep)
        # on the model's device: JAX's arrays may live elsewhere (a GPU) than the weights (the CPU)
        inputs = torch_bridge.to_torch(jaxprep.prepare_inputs(state, prep), device=model.device)
        if edit_inputs is not None:
            inputs = edit_inputs(inputs)
        next_ids = greedy_sample(model.forward(inputs, kv_caches), inputs)
        tokens = _appended(inputs, next_ids, state, num_tokens, max_num_reqs)
        stats.chunked_prefills += int(((out.num_scheduled_tokens > 0) & (tokens[0] == NO_TOKEN)).sum())
        stats.steps += 1
        scheduler.update(out, tokens, config.eos_token_id)
    return requests, stats


def _appended(inputs, next_ids, state: jaxprep.BatchState, num_tokens: np.ndarray, rows: int) -> np.ndarray:
    """[1, rows] the token each state row appends (NO_TOKEN: none): a row samples when its scheduled
    tokens reach the end of its known tokens; a prefill chunk that stops short discards its sample."""
    tokens = np.full((1, rows), NO_TOKEN, np.int64)
    computed, scheduled = np.asarray(state.num_computed_tokens), np.asarray(state.num_scheduled_tokens)
    for batch_row, row in enumerate(inputs.idx_mapping[: len(next_ids)].tolist()):
        if computed[row] + scheduled[row] >= num_tokens[row]:
            tokens[0, row] = int(next_ids[batch_row])
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint folder: config.json + *.safetensors")
    parser.add_argument("--prompt-ids", action="append", required=True, help='a prompt as token ids: "1 2 3"')
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--budget", type=int, default=8, help="tokens per step (chunked prefill beyond it)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (fewer: preemptions)")
    args = parser.parse_args()
    prompts = [[int(t) for t in text.split()] for text in args.prompt_ids]
    requests, stats = serve_greedy(TorchDecoder.from_pretrained(args.model), prompts, args.max_tokens,
                                   budget=args.budget, num_blocks=args.num_blocks)
    for request in requests:
        print(f"[{request.request_id}] {request.prompt_token_ids} -> {request.output_token_ids}")
    print(f"{stats.steps} steps, {stats.preemptions} preemptions, {stats.chunked_prefills} partial prefill chunks")


if __name__ == "__main__":
    main()
