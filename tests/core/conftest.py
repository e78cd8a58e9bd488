"""The ``kernel`` fixture: a core test that takes it runs once on XLA and once on the Pallas kernels."""

import pytest

from support.kernels import KERNELS


@pytest.fixture(params=KERNELS)
def kernel(request) -> str:
    return request.param
