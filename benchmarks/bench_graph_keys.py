"""Does a second compile-key dimension pay? Request padding and prepare time on `jaxprep simulate` traces.

    PYTHONPATH=. python benchmarks/bench_graph_keys.py [--large] [--iters 50] [--rounds 3]

vLLM's CUDA-graph key holds more than the padded token count (`vllm/v1/cudagraph_dispatcher.py`):
uniform-decode batches (every request ``1 + K`` tokens) get FULL graphs with
``num_reqs = T_pad // (1 + K)`` rows, mixed ones ``min(T_pad, max_num_seqs)``. jaxprep keys only on
``T_pad`` and always pads requests to ``min(T_pad, max_num_reqs)``. This replays the simulate
trace (as bench_padding.py records it: every model iteration's scheduled tokens and requests)
through three request-padding rules and times `prepare_padded` at every key the trace hits:

- tokens only (jaxprep today): ``R_pad = min(T_pad, max_num_reqs)``;
- + uniform-decode key (vLLM): uniform steps get ``min(ceil(T_pad / (1 + K)), max_num_reqs)`` rows;
- + a request ladder: ``R_pad`` = the next power of two at or above the request count (at most
  the default), so mixed steps with a few long prompts stop padding to ``max_num_reqs``.

The simulate loop has no spec decode (K = 0); a K = 3 variant of the same trace (every decode
iteration scheduling 1 + 3 tokens per request) shows what the uniform key buys with drafts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from jaxprep.cli import configure_runtime

configure_runtime()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_padding import LARGE, run_recorded  # noqa: E402
from common import interleaved_us, load_line, machine_line  # noqa: E402

from jaxprep import BatchState, PrepConfig, prepare_padded  # noqa: E402
from jaxprep.config import cdiv  # noqa: E402


def record_iterations(sizes: dict) -> tuple[PrepConfig, list[tuple[int, int, bool]]]:
    """The prep config and, per model iteration, (scheduled tokens, requests, uniform decode)."""
    trace = []

    def record(out, tokens):
        scheduled = out.num_scheduled_tokens[out.num_scheduled_tokens > 0]
        trace.append((int(scheduled.sum()), len(scheduled), bool((scheduled == 1).all())))
        trace.extend((int(n), int(n), True) for n in (tokens[1:] >= 0).sum(axis=1) if n > 0)

    return run_recorded(sizes, record), trace


def with_drafts(trace, k: int, budget: int):
    """The trace with K drafts on every uniform-decode iteration (1 + K tokens per request, within budget)."""
    return [(min(reqs * (1 + k), budget), min(reqs, budget // (1 + k)), True) if uniform else (tokens, reqs, False)
            for tokens, reqs, uniform in trace]


def keys(trace, prep: PrepConfig, rule: str, k: int) -> list[tuple[int, int]]:
    """(T_pad, R_pad) of every iteration under a request-padding rule."""
    out = []
    for tokens, reqs, uniform in trace:
        bucket = prep.bucket_for(tokens)
        default = prep.num_reqs_padded(bucket)
        if rule == "uniform" and uniform:
            default = min(cdiv(bucket, 1 + k), prep.max_num_reqs)
        if rule == "ladder":
            default = min(1 << (reqs - 1).bit_length(), default)
        out.append((bucket, max(default, reqs)))
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyedConfig(PrepConfig):
    """A `PrepConfig` whose steps have ``reqs_padded`` batch rows: what a second key dimension would compile
    (jaxprep itself keeps ``min(T_pad, max_num_reqs)``)."""

    reqs_padded: int

    def num_reqs_padded(self, num_tokens_padded: int) -> int:
        return self.reqs_padded


def prepare_call(prep: PrepConfig, bucket: int, num_reqs_padded: int):
    """A step of ``num_reqs_padded`` requests (as many as fit) filling ``bucket`` tokens, prepared under that key."""
    rows, width = prep.max_num_reqs, prep.max_model_len
    keyed = KeyedConfig(**{f.name: getattr(prep, f.name) for f in dataclasses.fields(PrepConfig)},
                        reqs_padded=num_reqs_padded)
    num_reqs = min(num_reqs_padded, bucket)
    scheduled = np.zeros(rows, np.int32)
    scheduled[:num_reqs] = bucket // num_reqs
    scheduled[0] += bucket - scheduled.sum()
    computed = np.zeros(rows, np.int32)
    table = np.zeros((rows, prep.max_blocks_per_req), np.int32)
    for row in range(num_reqs):
        needed = cdiv(int(scheduled[row]), prep.block_size)
        table[row, :needed] = 1 + row * prep.max_blocks_per_req + np.arange(needed)
    state = BatchState.from_numpy(token_ids=np.ones((rows, width), np.int32), block_table=table,
                                  num_computed_tokens=computed, num_scheduled_tokens=scheduled)
    jax.block_until_ready(prepare_padded(state, keyed, bucket))
    return lambda: jax.block_until_ready(prepare_padded(state, keyed, bucket))


def report(name: str, prep: PrepConfig, trace, k: int, iters: int, rounds: int) -> None:
    rules = ("tokens", "uniform", "ladder")
    per_rule = {rule: keys(trace, prep, rule, k) for rule in rules}
    distinct = sorted({key for rule_keys in per_rule.values() for key in rule_keys})
    prep = PrepConfig(max_num_reqs=prep.max_num_reqs, max_model_len=prep.max_model_len,
                      max_num_batched_tokens=prep.max_num_batched_tokens, block_size=prep.block_size)
    times = interleaved_us({key: prepare_call(prep, *key) for key in distinct}, iters, rounds)
    real_reqs = sum(reqs for _, reqs, _ in trace)
    print(f"\n{name}: {len(trace)} iterations, K = {k}")
    print("| request padding | executables | request padding waste | prepare µs / iteration |")
    print("|---|---:|---:|---:|")
    for rule in rules:
        rule_keys = per_rule[rule]
        waste = 1 - real_reqs / sum(r for _, r in rule_keys)
        mean_us = sum(times[key] for key in rule_keys) / len(rule_keys)
        print(f"| {rule} | {len(set(rule_keys))} | {waste:.1%} | {mean_us:.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="also the 2048-token-budget trace (~1 min more)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {machine_line()}; {load_line()}")
    traces = {"simulate default": record_iterations({})}
    if args.large:
        traces["simulate --large"] = record_iterations(LARGE)
    for name, (prep, trace) in traces.items():
        report(name, prep, trace, 0, args.iters, args.rounds)
        report(name + " with K = 3 drafts per decode", prep,
               with_drafts(trace, 3, prep.max_num_batched_tokens), 3, args.iters, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
