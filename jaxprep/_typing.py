"""Array types: the shape-annotated aliases, and the dtype bf16 arrays are stored in.

jaxtyping is a test extra, not a core dependency: with it installed the aliases are jaxtyping's
(and the test suite checks them at run time); without it they fall back to plain `jax.Array`.

How bf16 params and KV caches are stored: as bf16, or on XLA:CPU as their uint16 bit patterns.

XLA:CPU emulates bfloat16: its float-normalization pass rewrites every bf16 slice, dynamic slice,
gather and scatter into a float32 one, and the converts are hoisted out of the layer loop, so a
step over bf16 weights and a bf16 KV cache would hold float32 copies of all of them (the compiled
step's ``memory_analysis`` shows it). Integer arrays are left alone, so on the CPU backend bf16
arrays are kept as uint16 and bit-cast to bf16 (`as_compute`) only where a product reads them:
a per-layer slice inside the scan, the gathered rows of the embedding or of the cache. The values
are identical bit for bit; GPU and TPU keep plain bf16 (their bf16 is native).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array as _DeviceArray

StepArray = _DeviceArray | np.ndarray
"""A field of a prepared step: a device array, or a host view after `jaxprep.prepare_to_host`."""

try:
    from jaxtyping import Array, Bool, Float32, Int32, UInt32
except ImportError:  # pragma: no cover - exercised only without the test extra
    Array = _DeviceArray

    class _ShapeAlias:
        def __getitem__(self, item):
            return Array

    Bool = Float32 = Int32 = UInt32 = _ShapeAlias()

__all__ = ["BITS16", "Array", "Bool", "Float32", "Int32", "StepArray", "UInt32", "as_compute", "as_stored",
           "storage_dtype"]


# --- how bf16 params and KV caches are stored ----------------------------------------------------

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
