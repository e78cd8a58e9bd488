"""The data-parallel loop's padding on a small deterministic trace, under jaxprep's routing and bucket
policy (`jaxprep.serving.host.dp_policy`) and under the old one (fewest requests, the busiest rank's
bucket, each rank multi-stepping alone); run in a process that sees 4 devices
(`test_data_parallel.py` starts it with forced host devices).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/support/dp_policy_check.py

Prints one JSON object: each policy's `LoopStats.padding_waste`, the waste recomputed here from
every rank's scheduled tokens and appended tokens, and each run's outputs by request id, with the
single-device loop's.
"""

from __future__ import annotations

import json

from jaxprep.cli import configure_runtime

configure_runtime()

import numpy as np  # noqa: E402

from jaxprep import PrepConfig  # noqa: E402
from jaxprep.serving import Engine, ModelConfig, ServingConfig, random_workload  # noqa: E402
from jaxprep.serving.host import dp_policy  # noqa: E402
from jaxprep.serving.host.dp_engine import DataParallelEngine  # noqa: E402
from jaxprep.sharding import data_mesh  # noqa: E402

MODEL = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=2, d_ff=64)
CONFIG = ServingConfig(prep=PrepConfig(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=32, block_size=4,
                                       num_blocks=48), eos_token_id=1, decode_steps=4)


def old_route(schedulers) -> int:
    return int(np.argmin([len(s.waiting) + len(s.running) for s in schedulers]))


def old_coordinate(prep, schedulers, outs) -> int:
    busiest = max(out.total_num_scheduled_tokens for out in outs)
    return next(b for b in prep.token_buckets if b >= busiest)


class Recording(DataParallelEngine):
    """Keeps every rank's scheduled tokens and appended tokens, for the waste recomputed below."""

    def _count(self, outs, tokens, bucket):  # tokens: each rank's raw array or its StepTokens
        arrays = [np.array(getattr(t, "tokens", t)) for t in tokens]
        self.log.append(([int(out.num_scheduled_tokens.sum()) for out in outs], arrays, bucket))
        super()._count(outs, tokens, bucket)


def recomputed_waste(log) -> float:
    """1 - real / padded: each rank runs its scheduled tokens then one token per later appended
    token, and pads to the bucket in the first iteration and every later one in which it appended."""
    real = padded = 0
    for totals, tokens, bucket in log:
        for total, rank_tokens in zip(totals, tokens):
            later = rank_tokens[1:] >= 0  # [iterations - 1, rows]
            real += total + int(later.sum())
            padded += bucket * (1 + int(later.any(axis=1).sum()))
    return 1.0 - real / padded


def serve(engine) -> dict:
    workload = random_workload(5, num_requests=40, vocab_size=64, prompt_len=(4, 40), max_tokens=(1, 24),
                               arrival_spread=10)
    engine.submit(workload.requests, workload.arrival_steps)
    return {r.request_id: r.output_token_ids for r in engine.run()}


def run_policy() -> dict:
    engine = Recording(CONFIG, MODEL, data_mesh(4), seed=1)
    engine.log = []
    outputs = serve(engine)
    return dict(waste=engine.stats.padding_waste, recomputed=recomputed_waste(engine.log), outputs=outputs,
                model_steps=engine.stats.model_steps)


def main() -> None:
    report = dict(single=serve(Engine(CONFIG, MODEL, seed=1)), new=run_policy())
    dp_policy.route, dp_policy.coordinate = old_route, old_coordinate
    report["old"] = run_policy()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
