"""`torch_bridge.model.TorchDecoder` driven by jaxprep: the scheduler picks chunks (chunked prefill,
preemption), `prepare_inputs` prepares each step, `to_torch` bridges it, the torch forward runs the
checkpoint over the paged KV cache. Greedy tokens equal transformers' ``generate(do_sample=False)``."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import jaxprep  # noqa: E402
import torch_bridge  # noqa: E402
from support.hf_checkpoints import compare_greedy, hf_logits, reference_model, saved_checkpoints  # noqa: E402
from torch_bridge.model import TorchDecoder  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_TOKENS = 6
PROMPT_LENS = (5, 13, 9, 20)  # with budget 8: every prompt but the first is prefilled in chunks


def _example():
    """examples/torch_llama_loop.py, imported from its file (examples/ is not a package)."""
    name = "torch_llama_loop"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Matrices this small run ~50x faster on one thread than on two that contend with other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> directory of that checkpoint, saved once per module."""
    return saved_checkpoints(tmp_path_factory)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 320, size=n).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("name", ["llama-llama3-rope", "qwen3"])
def test_greedy_tokens_equal_transformers_with_chunked_prefill_and_preemption(name, checkpoint):
    """llama: llama3 RoPE scaling, Llama biases off; qwen3: per-head q/k norms, head_dim 32 != hidden/heads.
    12 blocks of 4 cannot hold the four requests at once: the scheduler preempts and recomputes."""
    directory = checkpoint(name)
    requests, stats = _example().serve_greedy(TorchDecoder.from_pretrained(directory), _prompts(), MAX_TOKENS,
                                              budget=8, num_blocks=12)
    assert stats.preemptions > 0 and stats.chunked_prefills > 0
    assert [len(r.output_token_ids) for r in requests] == [MAX_TOKENS] * len(PROMPT_LENS)
    check = compare_greedy(reference_model(directory), requests)
    assert check.num_tokens == MAX_TOKENS * len(PROMPT_LENS)
    assert check.mismatches == 0 and check.near_ties == 0


def test_a_seq_len_one_short_makes_the_comparison_fail(checkpoint):
    """Negative control: the same loop with every request's seq_len one short (attention misses the
    newest key, an off-by-one in the metadata) gives tokens transformers does not. (Shifting every
    position by one would not do: RoPE scores depend on position differences only.)"""
    directory = checkpoint("llama-llama3-rope")

    def one_short(inputs):
        meta = inputs.attn_metadata
        short = meta.seq_lens_cpu.clone()
        short[: meta.num_reqs] -= 1
        return dataclasses.replace(inputs, attn_metadata=dataclasses.replace(meta, seq_lens_cpu=short, seq_lens=short))

    requests, _ = _example().serve_greedy(TorchDecoder.from_pretrained(directory), _prompts(), MAX_TOKENS,
                                          budget=8, num_blocks=12, edit_inputs=one_short)  # the same executables
    assert compare_greedy(reference_model(directory), requests).mismatches > 0


def test_prefill_logits_equal_transformers(checkpoint):
    """One 11-token prompt prefilled in one step: the logits at its last token equal transformers'
    (float32, within 1e-4), and with the checkpoint's llama3 RoPE replaced by the default RoPE they do not."""
    directory = checkpoint("llama-llama3-rope")
    model = TorchDecoder.from_pretrained(directory)
    prompt = _prompts()[1][:11]
    expected = hf_logits(reference_model(directory), prompt)[-1]

    def last_logits(model: TorchDecoder) -> np.ndarray:
        config = jaxprep.PrepConfig(max_num_reqs=1, max_model_len=16, max_num_batched_tokens=16, block_size=4,
                                    num_blocks=5)
        token_ids = np.zeros((1, 16), np.int32)
        token_ids[0, :11] = prompt
        state = jaxprep.BatchState.from_numpy(token_ids=token_ids, block_table=[[1, 2, 3, 4]],
                                              num_computed_tokens=[0], num_scheduled_tokens=[11])
        inputs = torch_bridge.to_torch(jaxprep.prepare_inputs(state, config), device=model.device)
        return model.forward(inputs, model.new_kv_caches(5, 4))[0].numpy()

    np.testing.assert_allclose(last_logits(model), expected, rtol=1e-4, atol=1e-4)
    default_rope = TorchDecoder(dataclasses.replace(model.config, rope=type(model.config.rope)()), model.weights)
    assert np.abs(last_logits(default_rope) - expected).max() > 1e-3


def test_a_step_on_another_device_than_the_weights_is_named(checkpoint):
    """JAX may hold the step on a GPU while the weights are on the CPU: forward names the field and both
    devices instead of failing deep in an index op (here the step's input_ids moved to the meta device)."""
    model = TorchDecoder.from_pretrained(checkpoint("llama-llama3-rope"))
    config = jaxprep.PrepConfig(max_num_reqs=1, max_model_len=16, max_num_batched_tokens=16, block_size=4,
                                num_blocks=5)
    state = jaxprep.BatchState.from_numpy(token_ids=np.arange(1, 17, dtype=np.int32)[None], block_table=[[1, 2, 3, 4]],
                                          num_computed_tokens=[0], num_scheduled_tokens=[3])
    inputs = torch_bridge.to_torch(jaxprep.prepare_inputs(state, config), device=model.device)
    assert model.forward(inputs, model.new_kv_caches(5, 4)).shape[-1] == model.config.vocab_size  # control
    elsewhere = dataclasses.replace(inputs, input_ids=inputs.input_ids.to("meta"))
    with pytest.raises(ValueError, match=r"inputs.input_ids is on meta, the model's weights on cpu"):
        model.forward(elsewhere, model.new_kv_caches(5, 4))
