"""Shape-annotated array aliases.

jaxtyping is a test extra, not a core dependency: with it installed the aliases are jaxtyping's
(and the test suite checks them at run time); without it they fall back to plain `jax.Array`.
"""

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

__all__ = ["Array", "Bool", "Float32", "Int32", "StepArray", "UInt32"]
