"""`simulate --model` and `generate --model` on a broken checkpoint folder: one line naming the file
and the field, exit status 2, no traceback (each used to end in a traceback, exit 1), and no progress
line before it (the folder is checked with the flags, before the loading starts)."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from jaxprep import cli

pytest.importorskip("safetensors")


def _edit_config(name: str, change):
    def edit(folder: str) -> None:
        path = os.path.join(folder, name)
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        change(raw)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(raw, f)
    return edit


def _write(name: str, content: bytes | None = None, cut: float | None = None):
    def edit(folder: str) -> None:
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(content if cut is None else data[: int(len(data) * cut)])
    return edit


def _config_folder(folder: str) -> None:
    os.remove(os.path.join(folder, "config.json"))
    os.mkdir(os.path.join(folder, "config.json"))


BROKEN = {  # what is broken -> (how, what the one line must say)
    "truncated config.json": (_write("config.json", cut=0.3), "config.json: not valid JSON"),
    "list-valued config.json": (_write("config.json", b"[1, 2]"), "config.json: must hold a JSON object"),
    "non-numeric rms_norm_eps": (_edit_config("config.json", lambda c: c.update(rms_norm_eps="1e-6x")),
                                 "config.json: rms_norm_eps='1e-6x' must be a positive number"),
    "string tie_word_embeddings": (_edit_config("config.json", lambda c: c.update(tie_word_embeddings="false")),
                                   "config.json: tie_word_embeddings='false' must be true or false"),
    "config.json a folder": (_config_folder, "config.json: is a folder"),
    "truncated safetensors": (_write("model.safetensors", cut=0.5), "safetensors"),
    "safetensors of 4 bytes": (_write("model.safetensors", b"\0\0\0\0"), "safetensors"),
    "truncated generation_config.json": (_write("generation_config.json", b'{"eos_token_id": '),
                                         "generation_config.json: not valid JSON"),
    "list-valued generation_config.json": (_write("generation_config.json", b"[2]"),
                                           "generation_config.json: must hold a JSON object"),
    "bad eos in generation_config.json": (_edit_config("generation_config.json", lambda c: c.update(eos_token_id="x")),
                                          "generation_config.json: eos_token_id='x' must be an int"),
}
COMMANDS = {"generate": ["--prompt-ids", "1 2", "--max-tokens", "2"], "simulate": ["--requests", "2"]}


CONFIG = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
          "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "tie_word_embeddings": False, "eos_token_id": 2,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
"""A one-layer Qwen3 in the layout transformers saves (config.json, generation_config.json, safetensors),
written without transformers so that the test stays fast."""


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    import numpy as np
    from safetensors.numpy import save_file

    from jaxprep.models import parse_config
    from jaxprep.models.load import checkpoint_shapes

    folder = str(tmp_path_factory.mktemp("good"))
    rng = np.random.default_rng(0)
    tensors = {name: rng.normal(size=shape).astype(np.float32)
               for name, shape in checkpoint_shapes(parse_config(CONFIG)).items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    for name, content in (("config.json", CONFIG), ("generation_config.json", {"eos_token_id": 2})):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(content, f)
    return folder


@pytest.fixture(autouse=True)
def _keep_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))


def _run(argv, capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    return exit_info.value.code, captured.err.splitlines()


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("broken", BROKEN)
def test_a_broken_checkpoint_is_one_line_exit_2(broken, command, good_checkpoint, tmp_path, capsys):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(good_checkpoint, folder)
    breaks, message = BROKEN[broken]
    breaks(folder)
    # progress on (stderr is not a terminal: plain lines): the folder is checked before the first one is written
    code, lines = _run([command, "--model", folder, *COMMANDS[command]], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert re.match(rf"jaxprep {command}: error: --model {re.escape(folder)}: ", lines[0]), lines[0]
    assert message in lines[0], lines[0]


def test_the_good_checkpoint_loads(good_checkpoint):
    """Control: the folder the broken ones are copied from loads, so each error comes from its break."""
    from jaxprep.models import load_model

    model, params = load_model(good_checkpoint)
    assert model.model_type == "qwen3" and model.rms_norm_eps == 1e-6 and model.eos_token_ids == (2,)
    assert params["layers"]["self_attn.q_norm.weight"].shape == (1, 8)


@pytest.mark.parametrize("prompt", [["--prompt", "hello"], ["--prompt-ids", "1 2"]])
def test_a_broken_tokenizer_is_one_line_exit_2(prompt, good_checkpoint, tmp_path, capsys):
    """Issue 31: a tokenizer.json the tokenizers package cannot parse ended in a traceback, exit 1."""
    pytest.importorskip("tokenizers")
    folder = str(tmp_path / "ckpt")
    shutil.copytree(good_checkpoint, folder)
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write('{"version": "1.0", "model": {"type": "Nonsense"')
    code, lines = _run(["generate", "--model", folder, *prompt], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert re.match(rf"jaxprep generate: error: --model {re.escape(folder)}: tokenizer.json cannot be read", lines[0])


def test_a_good_tokenizer_loads(good_checkpoint, tmp_path):
    """Control: a tokenizer.json the package wrote is read by the same code."""
    import argparse

    tokenizers = pytest.importorskip("tokenizers")
    from jaxprep.cli.generate import _tokenizer

    folder = str(tmp_path / "ckpt")
    shutil.copytree(good_checkpoint, folder)
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hello": 1, "[UNK]": 0}, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.save(os.path.join(folder, "tokenizer.json"))
    tokenizer = _tokenizer(argparse.Namespace(model=folder, prompts=["hello"]))
    assert tokenizer.encode("hello").ids == [1]
