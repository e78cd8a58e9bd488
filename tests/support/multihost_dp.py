"""The data-parallel serving loop over 4 ranks, in one process or as one of 2 processes on localhost
(`test_data_parallel.py` starts it with 2 or 4 forced host devices).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/support/multihost_dp.py
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/support/multihost_dp.py PORT 0  # and PORT 1

With ``PORT PROCESS_ID`` it first joins a 2-process JAX cluster whose coordinator is 127.0.0.1:PORT
(XLA:CPU then needs a cross-process collectives implementation: gloo). Prints one JSON object:
the process count and index, the devices it feeds, and every request's greedy output.
"""

from __future__ import annotations

import json
import sys

from jaxprep.cli import configure_runtime

configure_runtime()

import jax  # noqa: E402

if len(sys.argv) == 3:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{sys.argv[1]}", num_processes=2,
                               process_id=int(sys.argv[2]), initialization_timeout=60)

from jaxprep import PrepConfig  # noqa: E402
from jaxprep.serving import ModelConfig, ServingConfig, random_workload  # noqa: E402
from jaxprep.serving.host.dp_engine import DataParallelEngine  # noqa: E402
from jaxprep.sharding import data_mesh  # noqa: E402

MODEL = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=2, d_ff=64)
CONFIG = ServingConfig(prep=PrepConfig(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=32, block_size=4,
                                       num_blocks=48), eos_token_id=1, decode_steps=4)
"""tests/support/dp_policy_check.py's configuration: the one-process run loads its executables from the test run's
compilation cache."""


def main() -> None:
    engine = DataParallelEngine(CONFIG, MODEL, data_mesh(4), seed=2)
    workload = random_workload(7, num_requests=20, vocab_size=64, prompt_len=(2, 24), max_tokens=(1, 12),
                               arrival_spread=5)
    engine.submit(workload.requests, workload.arrival_steps)
    outputs = {r.request_id: r.output_token_ids for r in engine.run()}
    local = [d.id for d in engine.mesh.devices.ravel() if d.process_index == jax.process_index()]
    print(json.dumps(dict(processes=jax.process_count(), process=jax.process_index(), local_devices=local,
                          dispatches=engine.stats.dispatches, outputs=outputs)))
    if jax.process_count() > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
