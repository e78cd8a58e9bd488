"""The streamed safetensors loader: values equal the safetensors package's own reading, every defect of a
shard is a `CheckpointError` naming the file and the tensor, progress is reported, and the peak memory of
a load stays near the weights (measured in a subprocess, against the whole-file loading it replaced)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("transformers", reason="these tests build their checkpoints with transformers (test extra)")
pytest.importorskip("safetensors", reason="loading checkpoints needs safetensors (test extra)")

import safetensors.numpy as safetensors_numpy

from jaxprep._typing import as_compute
from jaxprep.models import CheckpointError, load_model
from jaxprep.models import load as load_module
from support.hf_checkpoints import SPECS, save_checkpoint


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> str:
    """The 14-shard llama checkpoint of tests/support/hf_checkpoints.py (float32)."""
    directory = str(tmp_path_factory.mktemp("sharded"))
    save_checkpoint(SPECS["llama-sharded"], directory)
    return directory


def _package_tensors(directory: str) -> dict[str, np.ndarray]:
    """Every tensor as the safetensors package reads it."""
    tensors = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            tensors.update(safetensors_numpy.load_file(os.path.join(directory, file)))
    return tensors


def test_streamed_params_equal_the_safetensors_package(sharded, monkeypatch):
    """Chunks of 1 KiB (the embedding in 80 pieces): every param equals the package's tensors, stacked
    by layer; progress grows to the total of the tensors' bytes; bf16 params are the float32 values rounded
    to nearest even. A shifted layer order fails the comparison."""
    monkeypatch.setattr(load_module, "CHUNK_BYTES", 1024)
    tensors = _package_tensors(sharded)
    seen = []
    config, params = load_model(sharded, on_progress=lambda done, total: seen.append((done, total)))
    layers = range(config.num_layers)
    stacked = np.stack([tensors[f"model.layers.{i}.mlp.up_proj.weight"] for i in layers])
    np.testing.assert_array_equal(params["layers"]["mlp.up_proj.weight"], stacked)
    assert not np.array_equal(params["layers"]["mlp.up_proj.weight"], stacked[::-1])
    np.testing.assert_array_equal(params["embed_tokens"], tensors["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["layers"]["input_layernorm.weight"],
                                  np.stack([tensors[f"model.layers.{i}.input_layernorm.weight"] for i in layers]))
    np.testing.assert_array_equal(params["lm_head"], tensors["lm_head.weight"])
    total = sum(t.nbytes for t in tensors.values())
    assert seen[-1] == (total, total) and len(seen) > 80
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))

    _, bf16 = load_model(sharded, dtype="bfloat16")
    assert config.dtype == "float32"
    rounded = tensors["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(as_compute(bf16["embed_tokens"], jnp.bfloat16)), rounded)
    with pytest.raises(ValueError, match="dtype='float16' must be one of float32, bfloat16"):
        load_model(sharded, dtype="float16")


def _write_raw(path: str, header: dict, data: bytes) -> None:
    """A safetensors file from its header dict and data bytes, as the format lays them out."""
    encoded = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded + data)


def _read_raw(path: str) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        raw = f.read()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8: 8 + length]), raw[8 + length:]


def _shard_of(directory: str, tensor: str) -> str:
    with open(os.path.join(directory, load_module.INDEX_FILE)) as f:
        return json.load(f)["weight_map"][tensor]


def _broken_copy(sharded: str, tmp_path, tensor: str, breaks) -> tuple[str, str]:
    """A copy of the sharded checkpoint whose shard holding ``tensor`` is rewritten by ``breaks(header, data,
    path)``; returns (directory, that shard's file name)."""
    directory = tmp_path / "broken"
    directory.mkdir(exist_ok=True)
    for file in os.listdir(sharded):
        with open(os.path.join(sharded, file), "rb") as src, open(directory / file, "wb") as dst:
            dst.write(src.read())
    shard = _shard_of(sharded, tensor)
    header, data = _read_raw(str(directory / shard))
    breaks(header, data, str(directory / shard))
    return str(directory), shard


TENSOR = "model.layers.1.self_attn.k_proj.weight"


def _truncate(header, data, path):
    begin, end = header[TENSOR]["data_offsets"]
    assert begin == 0 and next(iter(k for k in header if k != "__metadata__")) == TENSOR  # first in data and header
    _write_raw(path, header, data[: end - 10])


def _bad_offsets(header, data, path):
    header[TENSOR]["data_offsets"][1] -= 4
    _write_raw(path, header, data)


def _bad_dtype(header, data, path):
    header[TENSOR]["dtype"] = "I32"
    _write_raw(path, header, data)


def _bad_shape(header, data, path):
    header[TENSOR]["shape"] = [32, "64"]
    _write_raw(path, header, data)


def _missing(header, data, path):
    del header[TENSOR]
    _write_raw(path, header, data)


def _garbage_header(header, data, path):
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xfe not json")


def _short_file(header, data, path):
    with open(path, "wb") as f:
        f.write(b"\x05\x00")


@pytest.mark.parametrize("breaks, message", [
    (_truncate, r"{shard}: tensor '{tensor}': truncated file: the tensor's data ends at byte \d+, the file has \d+"),
    (_bad_offsets, r"{shard}: tensor '{tensor}': shape \[32, 64\] of F32 needs 8192 bytes, its data_offsets"),
    (_bad_dtype, r"{shard}: tensor '{tensor}' has dtype I32; supported: F32, F16, BF16"),
    (_bad_shape, r"{shard}: tensor '{tensor}' has shape \[32, '64'\]; a shape is a list of sizes >= 0"),
    (_missing, r"model.safetensors.index.json maps tensor '{tensor}' to {shard}, which does not hold it"),
    (_garbage_header, r"{shard}: the header is not valid JSON"),
    (_short_file, r"{shard}: truncated: 2 bytes, too short for a safetensors header"),
], ids=lambda value: getattr(value, "__name__", "")[1:] if callable(value) else "")
def test_corrupt_shard_names_file_and_tensor(sharded, tmp_path, breaks, message):
    directory, shard = _broken_copy(sharded, tmp_path, TENSOR, breaks)
    with pytest.raises(CheckpointError, match=message.format(shard=shard, tensor=TENSOR)):
        load_model(directory)


def test_wrong_shape_names_file_and_tensor(sharded, tmp_path):
    """A tensor whose stored shape disagrees with config.json (a checkpoint of another size)."""
    def reshape(header, data, path):
        header[TENSOR]["shape"] = [64, 32]
        _write_raw(path, header, data)

    directory, shard = _broken_copy(sharded, tmp_path, TENSOR, reshape)
    with pytest.raises(CheckpointError, match=rf"{shard}: tensor '{TENSOR}' has shape \(64, 32\), the config needs "
                                              r"\(32, 64\)"):
        load_model(directory)


MEASURE = """
import json, sys
import jax, jax.numpy as jnp, numpy as np, safetensors.numpy
from jaxprep.models import load_model
jnp.zeros(1).block_until_ready()

def status_kb(field):  # VmRSS: resident now; VmHWM: its peak (ru_maxrss would carry the parent's over exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))

base_kb = status_kb("VmRSS")
if sys.argv[1] == "streamed":
    _, params = load_model(sys.argv[2])
else:  # what the loader did before: whole files read, then stacked, then sent to the device
    tensors = safetensors.numpy.load_file(sys.argv[2] + "/model.safetensors")
    layers = sorted({name.split(".", 3)[3] for name in tensors if name.startswith("model.layers.")})
    params = {"embed_tokens": tensors["model.embed_tokens.weight"], "norm": tensors["model.norm.weight"],
              "layers": {n: np.stack([tensors[f"model.layers.{i}.{n}"] for i in range(2)]) for n in layers}}
    params = jax.tree.map(jnp.asarray, params)
jax.block_until_ready(params)
print(json.dumps({"extra_bytes": (status_kb("VmHWM") - base_kb) * 1024,
                  "weights_bytes": sum(x.nbytes for x in jax.tree.leaves(params))}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_memory_of_a_load_stays_near_the_weights(tmp_path):
    """A 200 MB float32 checkpoint loaded in a fresh process: the peak RSS above the process's RSS before
    the load is at most 1.3x the weights (that includes a fixed 50-80 MB of XLA's compiled update kernels and
    allocator pools, hence a checkpoint of this size); reading whole files and stacking them, as the loader
    did before, peaks above 2x."""
    raw = {"model_type": "llama", "vocab_size": 45056, "hidden_size": 1024, "intermediate_size": 1024,
           "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
           "max_position_embeddings": 256, "tie_word_embeddings": True}
    from jaxprep.models import parse_config
    from jaxprep.models.load import checkpoint_shapes

    tensors = {name: np.full(shape, 0.5, np.float32) for name, shape in checkpoint_shapes(parse_config(raw)).items()}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    safetensors_numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    del tensors

    def measure(mode: str) -> float:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        out = subprocess.run([sys.executable, "-c", MEASURE, mode, str(tmp_path)], capture_output=True, text=True,
                             env=env, check=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        assert result["weights_bytes"] > 200e6
        return result["extra_bytes"] / result["weights_bytes"]

    streamed, whole_files = measure("streamed"), measure("whole_files")
    print(f"peak RSS over the weights: streamed {streamed:.2f}x, whole files {whole_files:.2f}x")
    assert streamed <= 1.3
    assert whole_files > 2.0
