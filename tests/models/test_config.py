"""Checkpoint configs and files without transformers: what config.json parses to, errors naming the
unsupported field or the faulty tensor, RoPE frequencies by hand, and `jaxprep simulate --model --check`
(paged loop against its dense recomputation) plus the CLI's flag errors on a checkpoint written here."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jaxprep.cli import main
from jaxprep.models import CheckpointError, RopeConfig, UnsupportedConfigError, build_params, parse_config, read_config
from jaxprep.models.load import checkpoint_shapes

LLAMA = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "rms_norm_eps": 1e-5, "eos_token_id": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.mark.parametrize("change, field", [
    ({"model_type": "mistral"}, "model_type='mistral'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters.rope_type='yarn'"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic'"),
    ({"rope_parameters": {"rope_type": "linear"}}, "rope_parameters.factor=None"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
     "rope_parameters.high_freq_factor=1.0"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"sliding_window": 4096}, "sliding_window=4096"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types[1]='sliding_attention'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"hidden_size": "64"}, "hidden_size='64'"),
])
def test_unsupported_config_fields_are_named(change, field):
    with pytest.raises(UnsupportedConfigError) as error:
        parse_config(dict(LLAMA, **change))
    assert field in str(error.value)


def test_family_switches_and_rope_formats():
    """qwen2 always has q/k/v biases; qwen3 has q/k norms and an explicit head_dim; llama biases follow
    attention_bias and mlp_bias; a transformers 4.x ``rope_scaling`` + top-level ``rope_theta`` reads
    like 5.x's ``rope_parameters``; EOS lists are kept."""
    qwen2 = parse_config(dict(LLAMA, model_type="qwen2", sliding_window=4096, use_sliding_window=False,
                              layer_types=["full_attention"] * 2))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    qwen3 = parse_config(dict(LLAMA, model_type="qwen3", head_dim=16, attention_bias=True))
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm, qwen3.head_dim) == (True, True, True, 16)
    llama = parse_config(dict(LLAMA, attention_bias=True, mlp_bias=True, eos_token_id=[2, 7]))
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias, llama.head_dim) == (True, True, True, 8)
    assert llama.eos_token_ids == (2, 7)
    old = parse_config(dict(LLAMA, rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0},
                            rope_theta=500.0))
    assert old.rope == RopeConfig(rope_type="linear", theta=500.0, factor=2.0)
    assert parse_config(dict(LLAMA, rope_parameters=None, rope_scaling=None)).rope == RopeConfig(theta=10000.0)


def test_rope_inverse_frequencies_worked_example():
    """head_dim 6, theta 10000: inv_freq 10000^-(0, 1/3, 2/3) = [1, 0.046416, 0.0021544], wavelengths
    2 pi / inv_freq = [6.28, 135.37, 2916.4]. llama3 with factor 8, low 1, high 4, original 400
    (wavelength bounds 400 / 4 = 100 and 400 / 1 = 400): 6.28 < 100 keeps 1; 2916 > 400 divides by 8
    -> 0.00026930; 135.37 blends with smooth = (400 / 135.37 - 1) / 3 = 0.65162:
    0.046416 * (0.34838 / 8 + 0.65162) = 0.032267. linear with factor 2 halves every entry."""
    default = np.array([1.0, 0.046416, 0.0021544])
    np.testing.assert_allclose(RopeConfig().inv_freq(6), default, rtol=1e-4)
    np.testing.assert_allclose(RopeConfig(rope_type="linear", factor=2.0).inv_freq(6), default / 2, rtol=1e-4)
    llama3 = RopeConfig(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=400)
    np.testing.assert_allclose(llama3.inv_freq(6), [1.0, 0.032267, 0.00026930], rtol=1e-4)
    assert 2 * math.pi / default[1] == pytest.approx(135.37, rel=1e-4)


def _random_tensors(raw: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors of every name and shape a checkpoint of ``raw`` needs (norms near 1)."""
    rng = np.random.default_rng(seed)
    return {name: (1.0 + 0.2 * rng.standard_normal(shape) if name.endswith("norm.weight")
                   else 0.2 * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in checkpoint_shapes(parse_config(raw)).items()}


def _write_checkpoint(directory, raw: dict, tensors: dict[str, np.ndarray]) -> str:
    safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="writing a checkpoint needs safetensors")
    (directory / "config.json").write_text(json.dumps(raw))
    safetensors_numpy.save_file(tensors, str(directory / "model.safetensors"))
    return str(directory)


def test_checkpoint_tensor_errors_name_the_tensor():
    config = parse_config(LLAMA)
    tensors = _random_tensors(LLAMA)
    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' is missing"):
        build_params(config, missing)
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \(31,\), the config needs \(32,\)"):
        build_params(config, dict(tensors, **{"model.norm.weight": np.ones(31, np.float32)}))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.q_proj.bias' is not part of a llama"):
        build_params(config, dict(tensors, **{"model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)}))
    params = build_params(config, dict(tensors, **{"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4)}))
    assert params["layers"]["self_attn.k_proj.weight"].shape == (2, 16, 32)  # [layers, kv heads * head_dim, hidden]


def test_unsupported_dtype_and_missing_files(tmp_path):
    tensors = dict(_random_tensors(LLAMA), **{"model.norm.weight": np.ones(32, np.int8)})
    directory = _write_checkpoint(tmp_path, LLAMA, tensors)
    from jaxprep.models import load_model

    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has dtype I8; supported: F32, F16, BF16"):
        load_model(directory)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"holds no \*.safetensors file"):
        load_model(directory)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert read_config(directory).eos_token_ids == (2, 5)


def test_simulate_model_check_passes(tmp_path, capsys):
    """`jaxprep simulate --model DIR --check` on a qwen3-shaped random checkpoint: the loop's greedy tokens
    (chunked prefill, preemption) equal a dense recomputation of the same model, nothing compiles after
    warm-up."""
    raw = dict(LLAMA, model_type="qwen3", head_dim=16, attention_bias=True)
    directory = _write_checkpoint(tmp_path, raw, _random_tensors(raw, seed=1))
    argv = ["simulate", "--model", directory, "--check", "--json", "--no-progress", "--requests", "8",
            "--budget", "8", "--block-size", "4", "--max-num-reqs", "4", "--max-model-len", "48",
            "--num-blocks", "16", "--max-prompt-len", "20", "--max-tokens", "12", "--arrival-spread", "4",
            "--decode-steps", "4", "--no-compile-cache"]  # in this process: no persistent cache
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["check_passed"] is True and summary["check_near_ties"] == 0
    assert summary["finished"] == 8 and summary["preemptions"] > 0
    assert summary["model"].startswith("qwen3 from")


@pytest.mark.parametrize("flags, message", [
    (["--prompt-ids", "1 x 3"], "--prompt-ids '1 x 3': must be token ids >= 0 separated by spaces"),
    (["--prompt-ids", "1 2", "--max-tokens", "0"], "--max-tokens 0: must be >= 1"),
    (["--prompt-ids", "1 2", "--num-blocks", "1"], "--num-blocks 1: must be >= 2"),
    ([], "--prompt-ids: give at least one prompt (--prompt-ids or --prompt)"),
    (["--prompt-ids", "1 96"], "--prompt-ids 1 96: token id 96 is outside the model's vocabulary [0, vocab_size=96)"),
    (["--prompt-ids", "1 2 3 4", "--max-model-len", "4"], "--max-model-len 4: must exceed every prompt's length"),
    (["--prompt-ids", "1 2 3 4 5", "--num-blocks", "3", "--block-size", "4", "--max-tokens", "8"],
     ("--num-blocks 3: must be >= 5: blocks of 4 (one is the null block) for prompt 0: 5 tokens + up to 8 "
      "generated need 4")),
    (["--prompt", "hello"], "--prompt 'hello': needs"),
])
def test_generate_flag_errors(tmp_path, capsys, flags, message):
    """Bad flags: argparse's exit 2 and one error line naming the flag and the bound, no traceback."""
    directory = _write_checkpoint(tmp_path, LLAMA, _random_tensors(LLAMA))
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", directory, *flags, "--no-progress"])  # no loading lines before the error
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.splitlines()) == 1 and err.startswith("jaxprep generate: error: --")


def test_generate_unsupported_config_is_a_flag_error(tmp_path, capsys):
    directory = _write_checkpoint(tmp_path, LLAMA, _random_tensors(LLAMA))
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA, rope_parameters={"rope_type": "longrope"})))
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", directory, "--prompt-ids", "1 2"])
    assert exit_info.value.code == 2
    assert f"--model {directory}: config.json: rope_parameters.rope_type='longrope' is not supported" in \
        capsys.readouterr().err
