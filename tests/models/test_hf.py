"""Hugging Face checkpoints in the serving loop, checked against transformers itself.

For each tiny checkpoint (llama with llama3 RoPE, llama with linear RoPE and tied embeddings, qwen2,
qwen3, a bf16 qwen3 and a sharded llama; see tests/support/hf_checkpoints.py): the loop's greedy tokens over a
workload with chunked prefill, preemption and mixed batches equal transformers'
``generate(do_sample=False)`` of each request alone, and chunked paged-prefill logits equal
transformers' forward. `jaxprep generate` end to end, RoPE frequencies against transformers'.
"""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest

pytest.importorskip("transformers", reason="these tests build their checkpoints with transformers (test extra)")
pytest.importorskip("safetensors", reason="loading checkpoints needs safetensors (test extra)")

from jaxprep import PrepConfig, prepare_padded
from jaxprep.cli import main
from jaxprep.models import load_model, parse_config
from jaxprep.serving import AddRequests, AppendBlocks, Engine, KVCache, Schedule, ServingBatch, ServingConfig
from jaxprep.serving.host.workload import random_workload
from support import hf_checkpoints
from support.hf_checkpoints import SPECS, compare_greedy, hf_logits, reference_model, saved_checkpoints

# budget 16 (one bucket, one executable per model): prompts up to 36 tokens are prefilled in chunks;
# 19 blocks of 4 for 4 rows of up to 56 tokens: requests are preempted
PREP = PrepConfig(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=16, block_size=4, num_blocks=20,
                  token_buckets=(16,))
MAX_LOGITS_ERROR = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> directory of that checkpoint, saved once per module."""
    return saved_checkpoints(tmp_path_factory)


def _record_batch_kinds(engine) -> list[set[str]]:
    """Wraps the engine's scheduler to note, per step, whether it ran prefill chunks, decodes or both."""
    kinds, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        step = set()
        for request in engine.scheduler.running:
            if out.num_scheduled_tokens[request.row]:
                step.add("decode" if request.num_tokens - request.num_computed_tokens == 1 else "prefill")
        kinds.append(step)
        return out

    engine.scheduler.schedule = recording
    return kinds


@pytest.mark.parametrize("name", SPECS)
def test_serving_loop_greedy_tokens_match_transformers(name, checkpoint):
    model, params = load_model(checkpoint(name))
    config = ServingConfig(prep=PREP, eos_token_id=model.eos_token_ids[0], decode_steps=4)
    workload = random_workload(3, num_requests=8, vocab_size=model.vocab_size, prompt_len=(2, 36),
                               max_tokens=(4, 20), arrival_spread=6)
    engine = Engine(config, model, params=params)
    kinds = _record_batch_kinds(engine)
    engine.submit(workload.requests, workload.arrival_steps)
    finished = engine.run()
    assert len(finished) == len(workload.requests)
    assert engine.stats.preemptions > 0
    assert any(len(r.prompt_token_ids) > PREP.max_num_batched_tokens for r in finished)  # chunked prefill
    assert any(step == {"prefill", "decode"} for step in kinds)  # mixed batches
    check = compare_greedy(reference_model(checkpoint(name)), sorted(finished, key=lambda r: r.request_id))
    print(f"{name}: {check}")
    assert check.num_tokens > 60
    assert check.mismatches == 0, check
    assert check.near_ties <= 1, check


@functools.partial(jax.jit, static_argnames=("model", "num_tokens_padded"))
def _paged_logits(params, kv_cache, state, *, model, num_tokens_padded):
    inputs = prepare_padded(state.batch, PREP, num_tokens_padded)
    kv_cache, logits = model.forward(params, kv_cache, inputs, block_size=PREP.block_size,
                                     max_model_len=PREP.max_model_len)
    return kv_cache, logits, inputs.idx_mapping


def _chunked_prefill_logits(model, params, prompts, chunk: int):
    """Prefills ``prompts`` together in chunks of at most ``chunk`` tokens, in scattered blocks; yields
    (prompt index, tokens computed so far, logits of the chunk's last token) for every chunk."""
    config = ServingConfig(prep=PREP)
    batch, kv_cache = ServingBatch(config), KVCache.zeros(model, PREP.num_blocks, PREP.block_size)
    blocks = np.random.default_rng(0).permutation(np.arange(1, PREP.num_blocks))
    blocks_of = np.array_split(blocks, len(prompts))
    batch.add_requests(AddRequests.build(config, [{"row": r, "token_ids": p, "stop_len": PREP.max_model_len,
                                                   "block_ids": []} for r, p in enumerate(prompts)]))
    lengths = np.zeros(PREP.max_num_reqs, np.int64)
    lengths[: len(prompts)] = [len(p) for p in prompts]
    rows = batch.rows
    while (rows.num_computed_tokens < lengths).any():
        computed = rows.num_computed_tokens.copy()
        scheduled = np.minimum(lengths - computed, chunk)
        needed = -(-(computed + scheduled) // PREP.block_size) - rows.num_blocks
        batch.append_block_ids(AppendBlocks.build(config, {
            r: blocks_of[r][rows.num_blocks[r]: rows.num_blocks[r] + needed[r]].tolist()
            for r in range(len(prompts)) if needed[r] > 0}))
        batch.schedule(Schedule.build(config, scheduled))
        kv_cache, logits, idx_mapping = _paged_logits(params, kv_cache, batch.state, model=model, num_tokens_padded=16)
        for b, row in enumerate(np.asarray(idx_mapping)):
            if row >= 0:
                yield row, int(computed[row] + scheduled[row]), np.asarray(logits[b])
        batch.record_sampled(np.asarray(idx_mapping), np.zeros((PREP.max_num_reqs, 1), np.int32),
                             np.ones(PREP.max_num_reqs, np.int32))
        rows = batch.rows


@pytest.mark.parametrize("name", SPECS)
def test_chunked_paged_prefill_logits_match_transformers(name, checkpoint):
    """Three prompts prefilled together in chunks of <= 5 tokens: each chunk's last-token logits equal
    transformers' forward logits at that position (bf16 checkpoints: transformers in float32 on the same
    bf16 weights)."""
    model, params = load_model(checkpoint(name))
    hf_model = reference_model(checkpoint(name))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, model.vocab_size, n).tolist() for n in (13, 6, 11)]
    expected = [hf_logits(hf_model, p) for p in prompts]
    errors = [np.abs(logits - expected[row][end - 1]).max()
              for row, end, logits in _chunked_prefill_logits(model, params, prompts, chunk=5)]
    print(f"{name}: {len(errors)} chunks, max abs logits error {max(errors):.2e}")
    assert len(errors) == 3 + 2 + 3
    assert max(errors) < MAX_LOGITS_ERROR


def test_the_ragged_kernel_serves_a_checkpoint_as_transformers_does(checkpoint):
    """The Qwen3 checkpoint (GQA 4 over 2, q/k norms) with attention on jaxprep's ragged kernel (Pallas'
    interpreter here; the kernel `auto` lowers for CUDA): chunked paged-prefill logits equal transformers'."""
    import dataclasses

    model, params = load_model(checkpoint("qwen3"))
    model = dataclasses.replace(model, attention="ragged")
    hf_model = reference_model(checkpoint("qwen3"))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, model.vocab_size, n).tolist() for n in (13, 6, 11)]
    expected = [hf_logits(hf_model, p) for p in prompts]
    errors = [np.abs(logits - expected[row][end - 1]).max()
              for row, end, logits in _chunked_prefill_logits(model, params, prompts, chunk=5)]
    assert len(errors) == 3 + 2 + 3 and max(errors) < MAX_LOGITS_ERROR


def test_rope_inverse_frequencies_match_transformers():
    """`RopeConfig.inv_freq` equals the ``inv_freq`` buffer of transformers' rotary embedding for
    each supported RoPE type."""
    import transformers

    ropes = [{"rope_type": "default", "rope_theta": 1e6}, {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
             hf_checkpoints.LLAMA3_ROPE, dict(hf_checkpoints.LLAMA3_ROPE, original_max_position_embeddings=8192)]
    for rope in ropes:
        hf_config = transformers.LlamaConfig(**dict(hf_checkpoints.TINY, head_dim=32, rope_parameters=dict(rope)))
        expected = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config).inv_freq.numpy()
        ours = parse_config(hf_config.to_dict()).inv_freq()
        np.testing.assert_allclose(ours, expected, rtol=1e-6, err_msg=str(rope))


def _save_word_tokenizer(directory: str, vocab_size: int) -> None:
    """A word-level tokenizer.json: word "w<i>" is token i ("w5 w17" -> [5, 17])."""
    import tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(f"{directory}/tokenizer.json")


class _Finished:
    """What compare_greedy reads of a finished request."""

    def __init__(self, request_id: int, prompt: list[int], output: list[int], max_tokens: int):
        self.request_id, self.prompt_token_ids, self.output_token_ids = request_id, prompt, output
        self.max_tokens = max_tokens


def test_generate_command_matches_transformers(checkpoint, capsys):
    """`jaxprep generate --json` serves the prompts together (chunked: budget 8) in the order given,
    token ids and text alike; stdout is one JSON object holding each one's generated ids, equal to
    transformers' greedy tokens, and with a tokenizer in DIR their decoded text."""
    pytest.importorskip("tokenizers", reason="text prompts need the tokenizers package")
    directory = checkpoint("qwen2")
    prompts = [[5, 17, 300, 42, 9, 11, 23, 4, 4, 8, 19], [7, 7, 100], [31, 8, 250]]
    sizes = ["--max-tokens", "6", "--budget", "8", "--block-size", "4", "--max-num-reqs", "3", "--max-model-len", "20",
             "--num-blocks", "16", "--json"]
    argv = ["generate", "--model", directory, *sizes]
    for prompt in prompts:
        argv += ["--prompt-ids", " ".join(map(str, prompt))]
    assert main(argv) == 0
    outputs = json.loads(capsys.readouterr().out)["outputs"]
    check = compare_greedy(reference_model(directory),
                           [_Finished(i, p, o, max_tokens=6) for i, (p, o) in enumerate(zip(prompts, outputs))])
    assert check.num_tokens == 18 and check.mismatches == 0 and check.near_ties == 0

    _save_word_tokenizer(directory, 320)
    argv = ["generate", "--model", directory, *sizes, "--prompt-ids", "7 7 100", "--prompt", "w31 w8 w250"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)  # the whole of stdout; the text is on stderr
    assert result["outputs"] == outputs[1:]
    assert result["texts"][1] == " ".join(f"w{i}" for i in outputs[2])
    assert "prompt (3 ids): 31 8 250" in captured.err
