"""A whole serving step's input work, jaxprep against vLLM V1's host path, in one process.

    PYTHONPATH=. python benchmarks/bench_serving_step.py [--repeats 100] [--rounds 7] [--steps 16] [--default-runtime]

One step = apply the scheduler's per-step update to the batch tables, then prepare the step and
have every output on the host:

- update (small per-step arrays, as a scheduler sends them): every row's new num_computed_tokens
  and num_scheduled_tokens, one block id written per row (the block of its last scheduled token),
  and one sampled token id written per row (after its scheduled tokens);
- jaxprep: one jitted call with the state donated (updated in place) takes the update as one packed
  int32 host array (counters and edits, `pack_update`; as jaxprep's serving door takes its payload,
  `jaxprep.serving.update_packing`), applies it and runs `prepare_body`; the outputs come back packed
  (one buffer plus the gathered block table, `jaxprep.prepare.unpack_to_host`);
- baseline: the same update applied in place to the host tables of vLLM V1's persistent batch
  (as `vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._update_states` writes them), then its host-side preparation
  (`vllm_v1_baseline.VllmV1HostPrep.prepare`), padded to the same bucket.

The shapes and batches are bench_prepare.py's, with every row's blocks allocated up front
(`allocate_every_block`: the rows advance past the blocks bench_prepare.py allocates, and a token
scheduled in the null block is bad input, which jaxprep gives PAD_SLOT_ID, DIVERGENCES.md "Invalid
inputs are rejected"). A sequence of `--steps` updates (rows restart as new requests when they would
pass max_model_len) is replayed; before timing, every step is validated (`jaxprep.validate`) and its
outputs checked equal to the baseline's. Compile time is reported apart. Timing as bench_prepare.py:
best of ``--rounds`` medians, rounds sweeping every shape. Goals (jaxprep / baseline) at the
shapes of 2048 tokens or more: ≤ 1.0x with `jaxprep.cli.configure_runtime()`, ≤ 1.5x with
``--default-runtime``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import configure_benchmark_runtime

RUNTIME = configure_benchmark_runtime()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_prepare import SHAPES, goal, make_batch, v1_baseline  # noqa: E402
from common import add_timing_arguments, assert_same_step, load_line, machine_line, print_goal_table, time_rows  # noqa: E402

from jaxprep import BatchState, PrepConfig  # noqa: E402
from jaxprep._constants import NULL_BLOCK_ID  # noqa: E402
from jaxprep.array_packing import pack_body  # noqa: E402
from jaxprep.metadata import step_fields  # noqa: E402
from jaxprep.prepare import HOST_PACKED, prepare_body, unpack_to_host  # noqa: E402
from jaxprep.validate import validate  # noqa: E402

GOAL_MIN_TOKENS = 2048  # the goals hold at steps of this many scheduled tokens or more


def make_updates(config: PrepConfig, arrays: dict, steps: int, seed: int = 1) -> list[dict]:
    """``steps`` updates: every row advances by what it ran, schedules the same count again, and
    restarts at 0 (a new request in the row) when that would pass max_model_len."""
    rng = np.random.default_rng(seed)
    computed = arrays["num_computed_tokens"].astype(np.int64)
    scheduled = arrays["num_scheduled_tokens"].astype(np.int64)
    rows = np.arange(len(computed))
    updates = []
    for _ in range(steps):
        computed = computed + scheduled
        computed[computed + scheduled > config.max_model_len] = 0
        ends = computed + scheduled
        updates.append(dict(
            num_computed_tokens=computed.astype(np.int32), num_scheduled_tokens=scheduled.astype(np.int32),
            block_rows=rows.astype(np.int32), block_cols=((ends - 1) // config.block_size).astype(np.int32),
            token_rows=rows.astype(np.int32), token_cols=np.minimum(ends, config.max_model_len - 1).astype(np.int32),
            token_values=rng.integers(0, 32000, len(rows), dtype=np.int32)))
    return updates


def allocate_every_block(config: PrepConfig, arrays: dict) -> dict:
    """The batch with every null entry of its block table given a fresh block id, so that every
    token the updates schedule, however far its row advances, lies in an allocated block.

    ```
    # block_table [[3, 0, 0], [5, 6, 0]] -> [[3, 7, 8], [5, 6, 9]]
    ```
    """
    table = arrays["block_table"].copy()
    unallocated = table == NULL_BLOCK_ID
    table[unallocated] = table.max() + 1 + np.arange(np.count_nonzero(unallocated), dtype=table.dtype)
    if table.max() > config.max_block_id:
        raise ValueError(f"allocate_every_block: block id {table.max()} is past max_block_id={config.max_block_id}")
    return dict(arrays, block_table=table)


def with_block_values(update: dict, block_table: np.ndarray) -> dict:
    """The update's block ids: the ids the table already holds there (`allocate_every_block`)."""
    return dict(update, block_values=block_table[update["block_rows"], update["block_cols"]])


EDIT_FIELDS = ("block_rows", "block_cols", "block_values", "token_rows", "token_cols", "token_values")
UPDATE_FIELDS = ("num_computed_tokens", "num_scheduled_tokens", *EDIT_FIELDS)
"""An update's arrays in `pack_update`'s order, each [rows] int32."""


def pack_update(update: dict) -> np.ndarray:
    """The whole update, counters then table edits, as one [8 * rows] int32 host array: one array into the
    jitted call (each host array in costs the call ~2 µs, BENCHMARKS.md "Small CPU measurements")."""
    return np.concatenate([update[name] for name in UPDATE_FIELDS])


def apply_update_numpy(tables: dict, update: dict) -> None:
    """The baseline's update: in place on the host tables
    (`vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._update_states`)."""
    tables["num_computed_tokens"][:] = update["num_computed_tokens"]
    tables["num_scheduled_tokens"][:] = update["num_scheduled_tokens"]
    tables["block_table"][update["block_rows"], update["block_cols"]] = update["block_values"]
    tables["token_ids"][update["token_rows"], update["token_cols"]] = update["token_values"]


@functools.partial(jax.jit, static_argnames=("config", "num_tokens_padded"), donate_argnums=(0,))
def update_and_prepare(state: BatchState, packed: jax.Array, config: PrepConfig, num_tokens_padded: int):
    """Applies the packed update (`pack_update`) to the donated state and prepares the step; returns the
    new state, the packed int32 outputs and the gathered block table."""
    rows = state.num_scheduled_tokens.shape[0]
    pieces = {name: packed[i * rows:(i + 1) * rows] for i, name in enumerate(UPDATE_FIELDS)}
    # XLA:CPU's thunk executor hands kernels to its thread pool when more than 8 are ready at once,
    # which costs 10-80 us on a 2-core host: a reduction in front of the edits keeps them from all
    # being ready at the start (the edits still land before any read of the tables)
    ready = jnp.max(pieces["num_scheduled_tokens"]) >= 0
    edits = {name: jnp.where(ready, pieces[name], -1) for name in EDIT_FIELDS}
    block_table = state.block_table.at[edits["block_rows"], edits["block_cols"]].set(edits["block_values"],
                                                                                       mode="drop")
    token_ids = state.token_ids.at[edits["token_rows"], edits["token_cols"]].set(edits["token_values"],
                                                                                   mode="drop")
    state = dataclasses.replace(state, num_computed_tokens=pieces["num_computed_tokens"],
                                num_scheduled_tokens=pieces["num_scheduled_tokens"], block_table=block_table,
                                token_ids=token_ids)
    fields = step_fields(prepare_body(state, config, num_tokens_padded))
    return state, pack_body(fields, HOST_PACKED), fields["block_table"]


def run_update(state, update: dict, config: PrepConfig, bucket: int):
    """jaxprep's whole step: one packed host array in, the new state and the host step out."""
    state, words, table = update_and_prepare(state, pack_update(update), config, bucket)
    return state, unpack_to_host(words, table, config, bucket)


def replayed_steps(config: PrepConfig, arrays: dict, steps: int) -> tuple[dict, list[dict]]:
    """The batch the benchmark starts from (`allocate_every_block`) and its ``steps`` updates."""
    arrays = allocate_every_block(config, arrays)
    return arrays, [with_block_values(u, arrays["block_table"]) for u in make_updates(config, arrays, steps)]


def check_against_baseline(config, arrays, updates, bucket) -> None:
    state = BatchState.from_numpy(**arrays)
    tables = {name: value.copy() for name, value in arrays.items()}
    baseline = v1_baseline(config, tables)
    for update in updates:
        apply_update_numpy(tables, update)
        state, ours = run_update(state, update, config, bucket)
        validate(state, config, num_tokens_padded=bucket)  # a bad update names its field here
        assert_same_step(ours, baseline.prepare(update["num_scheduled_tokens"], bucket,
                                                config.num_reqs_padded(bucket)))


def setup_shape(name, num_reqs, num_tokens, max_model_len, block_size, decode_only, steps):
    """Compiles and checks the shape; returns its row of results so far and the callables to time."""
    config, arrays = make_batch(num_reqs, num_tokens, max_model_len, block_size, decode_only)
    return setup_batch(name, config, arrays, steps, goal_applies=num_tokens >= GOAL_MIN_TOKENS)


def setup_batch(name, config: PrepConfig, arrays: dict, steps: int, goal_applies: bool = False):
    """`setup_shape` for a given batch (`make_batch`'s config and arrays)."""
    arrays, updates = replayed_steps(config, arrays, steps)
    bucket = config.bucket_for(int(arrays["num_scheduled_tokens"].sum()))
    start = time.perf_counter()
    check_against_baseline(config, arrays, updates, bucket)  # compiles, then checks every step
    compile_s = time.perf_counter() - start

    state = [BatchState.from_numpy(**arrays)]
    tables = {n: v.copy() for n, v in arrays.items()}
    baseline = v1_baseline(config, tables)
    num_reqs_padded = config.num_reqs_padded(bucket)
    cursor = iter(range(10**9))

    def jaxprep_step():
        state[0], step = run_update(state[0], updates[next(cursor) % steps], config, bucket)
        return step

    def baseline_step():
        update = updates[next(cursor) % steps]
        apply_update_numpy(tables, update)
        return baseline.prepare(update["num_scheduled_tokens"], bucket, num_reqs_padded)

    row = dict(name=name, compile_s=compile_s, goal=goal() if goal_applies else None)
    return row, {"ours": jaxprep_step, "base": baseline_step}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser)
    parser.add_argument("--steps", type=int, default=16, help="distinct updates replayed in turn")
    args = parser.parse_args()
    rows = time_rows([setup_shape(*shape, steps=args.steps) for shape in SHAPES], args.repeats, args.rounds)
    print(f"machine: {machine_line()}; {load_line()}")
    print(RUNTIME)
    print_goal_table([("jaxprep µs (update + prepare + fetch)", "ours_us"),
                      ("vLLM V1 µs (update + prepare)", "base_us")], rows,
                     ("compile + check s", "compile_s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
