"""Sharded preparation against the NumPy reference, rank by rank; run as a script in a process
that sees several devices (`test_data_parallel.py` starts it with forced host devices).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/support/dp_prepare_check.py

Exits non-zero on the first mismatch; prints ``ok <steps>`` at the end.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the support package

from jaxprep.cli import configure_runtime

configure_runtime()

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")  # as tests/conftest.py
jax.config.update("jax_numpy_rank_promotion", "raise")
from jax.sharding import PartitionSpec  # noqa: E402

from jaxprep import BatchState, InvalidBatchError, PrepConfig, count_compiles  # noqa: E402
from jaxprep.metadata import step_fields  # noqa: E402
from jaxprep.sharding import DATA_AXIS, data_mesh, dp_bucket, prepare_data_parallel, rank_slice, stack_ranks  # noqa: E402
from support.batches import numpy_batches  # noqa: E402
from support.expect import assert_step_matches_reference  # noqa: E402

CONFIGS = [
    PrepConfig(max_num_reqs=6, max_model_len=64, max_num_batched_tokens=80, block_size=4),
    PrepConfig(max_num_reqs=3, max_model_len=40, max_num_batched_tokens=24, block_size=8, num_blocks=64),
]


def idle_rank(config: PrepConfig) -> dict:
    """A rank with nothing scheduled (its rows may still hold requests): a padding-only batch."""
    arrays = next(numpy_batches(config, seed=99))
    arrays["num_scheduled_tokens"] = np.zeros_like(arrays["num_scheduled_tokens"])
    return arrays


def check_steps(config: PrepConfig, mesh, steps: int, seed: int) -> int:
    stream = numpy_batches(config, seed)
    for step_index in range(steps):
        ranks = [next(stream) for _ in range(mesh.size)]
        if step_index % 3 == 0:
            ranks[step_index % mesh.size] = idle_rank(config)
        state = stack_ranks([BatchState.from_numpy(**arrays) for arrays in ranks], mesh)
        step = prepare_data_parallel(state, config, mesh, check=True)
        totals = [int(arrays["num_scheduled_tokens"].sum()) for arrays in ranks]
        assert step.num_tokens_padded == dp_bucket(config, totals)
        for name, field in step_fields(step).items():
            assert field.shape[0] == mesh.size, name
            assert field.sharding.spec == PartitionSpec(DATA_AXIS), (name, field.sharding)
        for rank, arrays in enumerate(ranks):
            local = jax.tree.map(lambda leaf: leaf[0], rank_slice(step, rank, mesh.size))
            assert_step_matches_reference(local, arrays, config)
    return steps


def check_one_executable_per_bucket(config: PrepConfig, mesh) -> None:
    stream = numpy_batches(config, seed=5)
    bucket = config.token_buckets[-1]
    states = [stack_ranks([BatchState.from_numpy(**next(stream)) for _ in range(mesh.size)], mesh) for _ in range(3)]
    jax.block_until_ready(prepare_data_parallel(states[0], config, mesh, bucket))
    with count_compiles() as count:
        for state in states:
            jax.block_until_ready(prepare_data_parallel(state, config, mesh, bucket))
    assert count.compiles == 0 and count.traces == 0, count


def check_errors_name_the_rank(config: PrepConfig, mesh) -> None:
    stream = numpy_batches(config, seed=8)
    ranks = [next(stream) for _ in range(mesh.size)]
    ranks[2]["num_scheduled_tokens"][0] = -1
    state = stack_ranks([BatchState.from_numpy(**arrays) for arrays in ranks], mesh)
    try:
        prepare_data_parallel(state, config, mesh, config.token_buckets[-1], check=True)
    except InvalidBatchError as error:
        assert str(error).startswith("rank 2: num_scheduled_tokens at row 0 is -1"), error
    else:
        raise AssertionError("a negative count on rank 2 was accepted")
    idle = stack_ranks([BatchState.from_numpy(**idle_rank(config)) for _ in range(mesh.size)], mesh)
    try:
        prepare_data_parallel(idle, config, mesh, check=True)
    except InvalidBatchError as error:
        assert "every rank" in str(error), error
    else:
        raise AssertionError("a step with no tokens on any rank was accepted")


def main() -> int:
    mesh = data_mesh(4)
    checked = sum(check_steps(config, mesh, steps=12, seed=i) for i, config in enumerate(CONFIGS))
    check_one_executable_per_bucket(CONFIGS[0], mesh)
    check_errors_name_the_rank(CONFIGS[0], mesh)
    print(f"ok {checked}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
