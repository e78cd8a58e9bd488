"""How bf16 params and KV caches are stored: as bf16, or on XLA:CPU as their uint16 bit patterns.

XLA:CPU emulates bfloat16: its float-normalization pass rewrites every bf16 slice, dynamic slice,
gather and scatter into a float32 one, and the converts are hoisted out of the layer loop, so a
step over bf16 weights and a bf16 KV cache would hold float32 copies of all of them (the compiled
step's ``memory_analysis`` shows it). Integer arrays are left alone, so on the CPU backend bf16
arrays are kept as uint16 and bit-cast to bf16 (`as_compute`) only where a product reads them:
a per-layer slice inside the scan, the gathered rows of the embedding or of the cache. The values
are identical bit for bit; GPU and TPU keep plain bf16 (their bf16 is native).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BITS16 = np.dtype(np.uint16)


def storage_dtype(dtype) -> np.dtype:
    """The dtype arrays of compute dtype ``dtype`` are stored in on the default backend."""
    dtype = np.dtype(jnp.dtype(dtype))
    if dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        return BITS16
    return dtype


def as_compute(x: jax.Array, dtype) -> jax.Array:
    """``x`` as values of ``dtype``: a bit-cast if it is stored as bit patterns (uint16), else ``x``."""
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype == BITS16 else x


def as_stored(x: jax.Array, storage) -> jax.Array:
    """``x`` in the storage dtype ``storage``: its bit patterns when that is uint16, else cast."""
    return jax.lax.bitcast_convert_type(x, BITS16) if storage == BITS16 else x.astype(storage)
