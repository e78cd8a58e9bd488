"""What a GPU runs of the step with ``PrepConfig.kernel`` "auto" or "pallas": read from the StableHLO
lowered for CUDA on this CPU machine (no device needed; an abstract H100 names the target).

The step, plain or with the features the kernels cover (spec decode, runner V2), is the two Triton
kernels (`jaxprep/kernels/`) and nothing else that computes: outside the two custom calls only
constants (the unused XLA twin's, hoisted by the platform switch and dropped by XLA), reshapes of
the kernels' (1,) scalars to 0-d, and the platform switch itself, resolved to one branch. The same
step on "xla" is the negative control: the counter sees its dozens of ops. On a machine without a
CUDA device "auto" traces no kernel at all.
"""

from __future__ import annotations

import collections
import functools
import re

import jax
import pytest

from jaxprep import BatchState, FeatureConfig, PrepConfig, prepare_padded
from jaxprep.prepare import prepare_body
from support.kernels import TRITON_CALL, lowering_target

NOT_WORK = {"stablehlo.constant", "stablehlo.reshape", "stablehlo.case", "stablehlo.return"}
"""Ops the lowered step may hold besides the kernels: none computes anything per token."""
SHAPES = {"256 decode": (256, 8192, 256), "256 req / 8192 tok": (256, 8192, 8192),
          "1024 req / 16384 tok": (1024, 16384, 16384)}


FEATURES = {"spec decode": FeatureConfig(num_speculative_tokens=3),
            "spec decode, runner v2": FeatureConfig(num_speculative_tokens=3, runner="v2")}
"""The features the kernels cover, lowered at every shape: spec decode alone (state-row order), and
with model runner V2 (its sort, its logits rows)."""


@functools.cache
def _lowered(kernel: str, max_num_reqs: int, budget: int, bucket: int, platform: str = "cuda",
             features: FeatureConfig | None = None) -> str:
    config = PrepConfig(max_num_reqs=max_num_reqs, max_model_len=4096, max_num_batched_tokens=budget, block_size=16,
                        kernel=kernel, features=features or FeatureConfig())
    state = BatchState.empty(config)
    with lowering_target(platform):
        return prepare_padded.trace(state, config, bucket).lower(lowering_platforms=(platform,)).as_text()


def _ops(text: str) -> collections.Counter:
    """Every op of the module, Triton calls apart (their IR is an opaque attribute)."""
    text = re.sub(r'ir = "[^"]*"', "", text)
    body = [line for line in text.splitlines() if "=" in line or "stablehlo.return" in line]
    counts = collections.Counter()
    for line in body:
        if TRITON_CALL in line:
            counts["triton kernel"] += 1
            continue
        counts.update(re.findall(r"\b(stablehlo\.[a-z_]+)", line.split("{")[0] if "custom_call" in line else line))
    return counts


@pytest.mark.parametrize("kernel", ["auto", "pallas"])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_cuda_step_is_two_triton_kernels_and_nothing_else(kernel, shape):
    ops = _ops(_lowered(kernel, *SHAPES[shape]))
    assert ops.pop("triton kernel") == 2, ops
    assert set(ops) <= NOT_WORK, f"work outside the kernels: {set(ops) - NOT_WORK}"
    assert ops["stablehlo.reshape"] == 5  # num_actual_tokens, num_reqs, max_query_len, max_seq_len, errors


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("shape", SHAPES)
def test_spec_decode_and_runner_v2_are_the_same_two_triton_kernels(features, shape):
    """The feature outputs come out of the two launches too: no third kernel, nothing else computes; one
    more reshape (``max_spec_len``)."""
    ops = _ops(_lowered("auto", *SHAPES[shape], features=FEATURES[features]))
    assert ops.pop("triton kernel") == 2, ops
    assert set(ops) <= NOT_WORK, f"work outside the kernels: {set(ops) - NOT_WORK}"
    assert ops["stablehlo.reshape"] == 6


def test_the_reshapes_only_make_the_kernels_scalars_0d():
    text = _lowered("auto", *SHAPES["256 decode"])
    reshapes = [line for line in text.splitlines() if "stablehlo.reshape" in line]
    assert reshapes and all("(tensor<1xi32>) -> tensor<i32>" in line for line in reshapes)


def test_the_xla_step_lowers_to_many_ops_the_counter_sees():
    """Negative control: on "xla" the counter finds no Triton call and the step's own ops."""
    ops = _ops(_lowered("xla", *SHAPES["256 decode"]))
    assert "triton kernel" not in ops
    assert sum(ops.values()) > 20 and set(ops) - NOT_WORK, ops


def test_auto_keeps_xla_on_cpu_and_tpu():
    for platform in ("cpu", "tpu"):
        text = _lowered("auto", *SHAPES["256 decode"], platform=platform)
        assert TRITON_CALL not in text and "stablehlo.gather" in text, platform


FLOAT_OPS = ("addf", "subf", "mulf", "divf", "cmpf", "sitofp", "uitofp", "fptosi", "fptoui", "dot", "exp", "log")


@pytest.mark.parametrize("features", ["plain", *FEATURES])
def test_the_kernels_do_integer_math_only(features):
    """The Triton IR inside both calls (bytecode; its string table names every op it uses) holds
    integer arithmetic and no float op: no index can round on any GPU."""
    text = _lowered("auto", *SHAPES["1024 req / 16384 tok"], features=FEATURES.get(features, FeatureConfig()))
    kernels = re.findall(r'ir = "([^"]*)"', text)
    assert len(kernels) == 2
    for ir in kernels:
        names = set(ir.split("\\00"))
        assert {"addi", "muli", "cmpi", "load", "store"} <= names  # the table is read: positive control
        assert not names & set(FLOAT_OPS), names & set(FLOAT_OPS)


@pytest.mark.parametrize("features", ["plain", *FEATURES])
def test_auto_without_a_cuda_device_traces_the_xla_step_alone(features, monkeypatch):
    """On this CPU machine "auto" traces exactly the XLA step (no kernel, no platform switch: no trace-time
    cost, the same outputs as "xla"). Control: where a CUDA device is present, "auto" traces the kernels
(behind the platform switch that picks them on CUDA)."""
    import jaxprep.prepare

    def jaxpr(kernel, max_model_len=32):  # jax caches a trace by its static arguments: the control needs its own
        config = PrepConfig(max_num_reqs=4, max_model_len=max_model_len, max_num_batched_tokens=16, block_size=4,
                            kernel=kernel, features=FEATURES.get(features, FeatureConfig()))
        return str(jax.make_jaxpr(prepare_body, static_argnums=(1, 2))(BatchState.empty(config), config, 16))

    auto = jaxpr("auto")
    assert "pallas_call" not in auto and auto == jaxpr("xla")
    monkeypatch.setattr(jaxprep.prepare, "cuda_devices_present", lambda: True)
    assert "pallas_call" in jaxpr("auto", max_model_len=36)


def test_a_jax_without_the_triton_backend_keeps_auto_on_xla_and_refuses_pallas(monkeypatch):
    """jax 0.11 deprecates Pallas' Triton backend: where it is gone, ``"auto"`` lowers the XLA step even for
    CUDA and ``"pallas"`` is refused naming the backend. Control: with the backend, ``"auto"`` lowers the
    Triton kernels for CUDA. (Two shapes: a traced step is cached by its config.)"""
    import jaxprep.config
    import jaxprep.prepare

    assert TRITON_CALL in _lowered("auto", 8, 64, 64)
    monkeypatch.setattr(jaxprep.prepare, "triton_backend_available", lambda: False)
    monkeypatch.setattr(jaxprep.config, "triton_backend_available", lambda: False)
    text = _lowered("auto", 8, 32, 32)
    assert TRITON_CALL not in text and "stablehlo.gather" in text
    with pytest.raises(ValueError, match=r"'pallas' needs Pallas' Triton backend \(jax.experimental.pallas.triton\)"):
        PrepConfig(max_num_reqs=2, max_model_len=16, max_num_batched_tokens=8, block_size=4, kernel="pallas")


def test_auto_inside_shard_map_lowers_the_kernels_for_cuda(monkeypatch):
    """`prepare_sharded` runs `prepare_body` under `jax.shard_map`, which checks what varies over the mesh:
    the kernels' outputs are declared to vary as the state rows do, so data parallelism keeps the two
    kernels per rank on a GPU. Negative control: outputs declared without it are refused there."""
    import numpy as np

    import jaxprep.prepare
    from jaxprep.kernels import prepare_pallas
    from jaxprep.sharding import DATA_AXIS, prepare_sharded

    monkeypatch.setattr(jaxprep.prepare, "cuda_devices_present", lambda: True)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), (DATA_AXIS,))

    def lowered(max_model_len):  # a fresh config each time: jax caches a trace by its static arguments
        config = PrepConfig(max_num_reqs=4, max_model_len=max_model_len, max_num_batched_tokens=16, block_size=4,
                            features=FEATURES["spec decode, runner v2"])
        return prepare_sharded.trace(BatchState.empty(config), config, 16, mesh).lower(
            lowering_platforms=("cuda",)).as_text()

    assert lowered(32).count(TRITON_CALL) == 2
    monkeypatch.setattr(prepare_pallas, "_varying_like", lambda shapes, array: tuple(shapes.values()))
    with pytest.raises(ValueError, match="manual_axis_type"):
        lowered(36)
