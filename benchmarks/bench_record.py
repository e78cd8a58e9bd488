"""A step's record under async scheduling: two jitted calls against one, `ServingBatch`, one process.

    PYTHONPATH=. python benchmarks/bench_record.py [--sizes 64,256,1024] [--drafts 2] [--repeats 200] [--rounds 5]

Under vLLM's async scheduling with `FeatureConfig.async_tokens`, `VllmAdapter.take_sampled` records each step
twice on the device: what the next step's ``input_ids`` read (`ServingBatch.record_prev_tokens`: the batch rows,
last sampled tokens and the drafter's proposals) and the samples themselves (`record_sampled`). Compared here,
on a batch of N rows each scheduled one token plus ``--drafts`` drafts, the sampler's output as device arrays
(the read-free path a serving loop takes):

- two calls: `record_prev_tokens`, then `record_sampled` (before `record_with_prev_tokens`);
- one call: `ServingBatch.record_with_prev_tokens` (`transitions.record_with_prev_tokens`).

Each timed record starts from the same state and mirror (restored untimed), ends when the state is ready
(``block_until_ready``); the two sides alternate call by call. Reported: median µs per record over
``--rounds`` rounds of ``--repeats`` records (the best round), the arrays that cross the calls (each costs a
GPU's calling thread ~5 µs, BENCHMARKS.md), and each program's compile seconds and StableHLO op count.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import configure_benchmark_runtime, load_line, machine_line

RUNTIME = configure_benchmark_runtime()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxprep import FeatureConfig, PrepConfig  # noqa: E402
from jaxprep.serving import ServingBatch, ServingConfig, StepUpdates, transitions  # noqa: E402

VOCAB = 1000


def scheduled_batch(rows: int, drafts: int) -> tuple[ServingBatch, tuple]:
    """N decoding rows (16 tokens, 15 computed), each scheduled one token and ``drafts`` drafts; the sampler's
    output for them (every draft accepted but the last) and the drafter's next proposals, as device arrays."""
    prep = PrepConfig(max_num_reqs=rows, max_model_len=256, max_num_batched_tokens=max(1024, rows * (1 + drafts)),
                      block_size=16, num_blocks=rows * 16 + 8,
                      features=FeatureConfig(num_speculative_tokens=drafts, async_tokens=True))
    config = ServingConfig(prep=prep, num_speculative_tokens=drafts, vocab_size=VOCAB)
    batch = ServingBatch(config)
    batch.apply_updates(StepUpdates.build(config, add=[dict(row=r, token_ids=list(range(1, 17)), num_computed_tokens=15,
                                                            block_ids=[2 * r + 1, 2 * r + 2]) for r in range(rows)]))
    batch.apply_updates(StepUpdates.build(config, num_scheduled_tokens=np.full(rows, 1 + drafts),
                                          num_draft_tokens=np.full(rows, drafts),
                                          draft_token_ids=np.full((rows, drafts), 7)))
    width = 1 + drafts
    sampled = np.where(np.arange(width) < max(width - 1, 1), 5, -1) * np.ones((rows, 1), np.int64)
    inputs = (jnp.arange(rows, dtype=jnp.int32), jnp.asarray(sampled, jnp.int32),
              jnp.full(rows, max(width - 1, 1), jnp.int32), jnp.full((rows, drafts), 9, jnp.int32))
    return batch, inputs


def two_calls(batch: ServingBatch, inputs: tuple) -> None:
    batch.record_prev_tokens(*inputs)
    batch.record_sampled(*inputs[:3])


def one_call(batch: ServingBatch, inputs: tuple) -> None:
    batch.record_with_prev_tokens(*inputs)


def timed_us(batch: ServingBatch, inputs: tuple, snapshot, mirror, record) -> float:
    batch.state, batch.rows = jax.tree.map(jnp.copy, snapshot), mirror.copy()
    jax.block_until_ready(batch.state)
    start = time.perf_counter()
    record(batch, inputs)
    jax.block_until_ready(batch.state)
    return (time.perf_counter() - start) * 1e6


def program(function, batch: ServingBatch, inputs: tuple, **static) -> tuple[float, int]:
    """Compile seconds and StableHLO ops of ``function`` at the batch's shapes (a fresh lowering)."""
    lowered = function.lower(batch.state, *inputs, vocab_bound=VOCAB, **static)
    start = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - start, lowered.as_text().count(" = ")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--drafts", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(machine_line())
    print(RUNTIME)
    print(f"drafts per row: {args.drafts}")
    print("| rows | two calls µs | one call µs | ratio | arrays across: two -> one | compile s: two -> one | "
          "StableHLO ops: two -> one |")
    print("|---:|---:|---:|---:|---|---|---|")
    for rows in (int(s) for s in args.sizes.split(",")):
        batch, inputs = scheduled_batch(rows, args.drafts)
        snapshot, mirror = jax.tree.map(jnp.copy, batch.state), batch.rows.copy()
        parts = [program(transitions.record_prev_tokens, batch, inputs),  # first: a compile, not a cache hit
                 program(transitions.record_sampled, batch, inputs[:3])]
        whole = program(transitions.record_with_prev_tokens, batch, inputs)
        for record in (two_calls, one_call):  # compiled before the clock
            timed_us(batch, inputs, snapshot, mirror, record)
        best = {two_calls: [], one_call: []}
        for _ in range(args.rounds):
            times = {two_calls: [], one_call: []}
            for i in range(args.repeats):
                for record in (two_calls, one_call) if i % 2 else (one_call, two_calls):
                    times[record].append(timed_us(batch, inputs, snapshot, mirror, record))
            for record, values in times.items():
                best[record].append(np.median(values))
        two, one = min(best[two_calls]), min(best[one_call])
        state_leaves = len(jax.tree.leaves(batch.state))
        prev = state_leaves * 2 + len(inputs)
        sampled = state_leaves * 2 + 3
        fused = state_leaves * 2 + len(inputs)
        print(f"| {rows} | {two:.1f} | {one:.1f} | {one / two:.2f}x | {prev + sampled} -> {fused} | "
              f"{sum(p[0] for p in parts):.2f} -> {whole[0]:.2f} | {' + '.join(str(p[1]) for p in parts)} -> "
              f"{whole[1]} |", flush=True)
    print(load_line())


if __name__ == "__main__":
    main()
