"""The two paths of the plain step (`PrepConfig.kernel`), for tests that run on both.

``"pallas"`` runs the fused kernels (jaxprep/kernels/prepare_pallas.py) in Pallas' interpreter on
CPU: each (config, bucket) compiles for seconds there, so the tests give it a few small shapes and
reuse them (equal configs share one executable).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax

KERNELS = ("xla", "pallas")
TRITON_CALL = "stablehlo.custom_call @__gpu$xla.gpu.triton"
"""How a Pallas (Triton) kernel appears in StableHLO lowered for CUDA."""


def on_kernel(config, kernel: str):
    """``config`` with its step on ``kernel``."""
    return dataclasses.replace(config, kernel=kernel)


def lowering_target(platform: str):
    """Lowering for CUDA on a machine without one names the GPU it is for (an abstract H100): the
    Triton lowering reads its compute capability (jax >= 0.11 refuses without a device or a target)."""
    if platform != "cuda":
        return contextlib.nullcontext()
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="cuda")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Auto,),
                                                                abstract_device=h100))
