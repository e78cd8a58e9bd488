"""The two paths of the plain step (`PrepConfig.kernel`), for tests that run on both.

``"pallas"`` runs the fused kernels (jaxprep/kernels/prepare_pallas.py) in Pallas' interpreter on
CPU: each (config, bucket) compiles for seconds there, so the tests give it a few small shapes and
reuse them (equal configs share one executable).
"""

from __future__ import annotations

import dataclasses

KERNELS = ("xla", "pallas")


def on_kernel(config, kernel: str):
    """``config`` with its step on ``kernel``."""
    return dataclasses.replace(config, kernel=kernel)
