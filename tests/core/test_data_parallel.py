"""Data parallelism over a device mesh (`jaxprep.sharding`, `jaxprep.serving.host.dp_engine`).

Several devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before JAX starts,
so the multi-device checks run in subprocesses; the in-process tests use a one-device mesh, or
skip unless the suite itself was started with several devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxprep import BatchState, PrepConfig, prepare_padded
from jaxprep.metadata import step_fields
from jaxprep.sharding import data_mesh, prepare_data_parallel, rank_slice, stack_ranks
from support.batches import numpy_batches
from support.expect import assert_step_matches_reference

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
FOUR_DEVICES = "--xla_force_host_platform_device_count=4"
SMALL = ["--requests", "24", "--budget", "32", "--max-num-reqs", "4", "--max-model-len", "64", "--num-blocks", "48",
         "--block-size", "4", "--layers", "1", "--d-model", "32", "--heads", "2", "--vocab-size", "64",
         "--max-prompt-len", "24", "--max-tokens", "12", "--arrival-spread", "4", "--decode-steps", "4"]
"""`jaxprep simulate`'s flags: the serving configuration and model of tests/support/dp_policy_check.py and
multihost_dp.py, so the subprocesses load each other's executables from the run's compilation cache."""
CONFIG = PrepConfig(max_num_reqs=5, max_model_len=48, max_num_batched_tokens=40, block_size=4)


def with_xla_flag(flag: str) -> str:
    """The suite's XLA_FLAGS (tests/conftest.py's compile settings) and ``flag``."""
    return " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), flag]))


def run_with_four_devices(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=with_xla_flag(FOUR_DEVICES),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.cpu_only("forces 4 host-platform devices in a subprocess")
def test_simulate_on_four_devices_checks_and_reports_devices():
    """`jaxprep simulate --devices 4 --check --json`: every rank's greedy tokens are the dense ones,
    nothing compiles after warm-up, and the summary says how many devices ran."""
    result = run_with_four_devices("-m", "jaxprep", "simulate", "--devices", "4", "--check", "--json", *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["devices"] == 4
    assert summary["check_passed"] is True and summary["check_mismatches"] == 0
    assert summary["compiles_after_warmup"] == 0
    assert summary["finished"] == summary["requests"] == 24
    assert 0 <= summary["padding_waste"] < 1


@pytest.mark.cpu_only("forces 4 host-platform devices in a subprocess")
def test_sharded_prepare_matches_reference_on_every_rank():
    """tests/support/dp_prepare_check.py: each rank's metadata equals the NumPy reference on that rank's rows
    (idle ranks included), fields are sharded by rank, one executable per bucket, errors name the rank."""
    result = run_with_four_devices(os.path.join(TESTS, "support", "dp_prepare_check.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().startswith("ok ")


def test_one_rank_mesh_matches_prepare_padded():
    mesh = data_mesh(1)
    stream = numpy_batches(CONFIG, seed=4)
    for _ in range(10):
        arrays = next(stream)
        state = stack_ranks([BatchState.from_numpy(**arrays)], mesh)
        step = prepare_data_parallel(state, CONFIG, mesh)
        local = jax.tree.map(lambda leaf: leaf[0], step)
        assert_step_matches_reference(local, arrays, CONFIG)
        single = step_fields(prepare_padded(BatchState.from_numpy(**arrays), CONFIG, step.num_tokens_padded))
        for name, value in step_fields(local).items():
            np.testing.assert_array_equal(value, single[name], err_msg=name)


def test_rows_must_match_ranks_times_max_num_reqs():
    mesh = data_mesh(1)
    state = stack_ranks([BatchState.from_numpy(**next(numpy_batches(CONFIG, seed=1)))], mesh)
    wider = PrepConfig(max_num_reqs=10, max_model_len=48, max_num_batched_tokens=40, block_size=4)
    with pytest.raises(ValueError, match=r"BatchState has 5 rows; 1 ranks of max_num_reqs=10 need 10"):
        prepare_data_parallel(state, wider, mesh)


def test_more_devices_than_jax_sees_names_the_flag():
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=64"):
        data_mesh(64)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs several devices (XLA_FLAGS=" + FOUR_DEVICES + ")")
def test_in_process_ranks_match_reference():
    mesh = data_mesh(2)
    stream = numpy_batches(CONFIG, seed=6)
    ranks = [next(stream) for _ in range(2)]
    step = prepare_data_parallel(stack_ranks([BatchState.from_numpy(**a) for a in ranks], mesh), CONFIG, mesh)
    for rank, arrays in enumerate(ranks):
        assert_step_matches_reference(jax.tree.map(lambda leaf: leaf[0], rank_slice(step, rank, 2)), arrays, CONFIG)


def serving_config(**overrides):
    from jaxprep.serving import ServingConfig

    prep = PrepConfig(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=8, block_size=2, num_blocks=24)
    return ServingConfig(prep=prep, eos_token_id=1, decode_steps=4, **overrides)


def test_one_rank_engine_serves_like_the_single_device_engine():
    """With one rank the data-parallel loop is the plain loop: same tokens, step for step (chunked
    prefill, preemption, multi-step decode, and several admissions in one step all occur)."""
    from jaxprep.serving import Engine, ModelConfig, check_against_dense, random_workload
    from jaxprep.serving.host.dp_engine import DataParallelEngine

    model = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=2, d_ff=64)
    config = serving_config()
    engines = [Engine(config, model, seed=3), DataParallelEngine(config, model, data_mesh(1), seed=3)]
    for engine in engines:  # requests are mutable: each engine gets its own copies
        workload = random_workload(3, num_requests=12, vocab_size=64, prompt_len=(1, 20), max_tokens=(1, 10))
        engine.submit(workload.requests, workload.arrival_steps)  # all arrive at step 0: extra adds
    plain, sharded = ({r.request_id: list(r.output_token_ids) for r in engine.run()} for engine in engines)
    assert plain == sharded and len(plain) == 12
    assert engines[1].stats.dispatches == engines[0].stats.dispatches
    assert engines[1].stats.preemptions > 0 and engines[1].stats.multi_step_dispatches > 0
    assert check_against_dense(engines[1].params, model, engines[1].finished, config.max_model_len).passed


def test_sharded_batch_rejects_an_update_naming_the_rank():
    from jaxprep.serving import InvalidUpdateError, StepUpdates
    from jaxprep.serving.host.sharded import ShardedServingBatch

    config = serving_config()
    batch = ShardedServingBatch(config, data_mesh(1))
    before = batch.state
    bad = StepUpdates.build(config, num_scheduled_tokens=[3, 0, 0, 0])  # row 0 holds no request
    with pytest.raises(InvalidUpdateError, match=r"^rank 0: Schedule.num_scheduled_tokens at row 0 is 3"):
        batch.apply_updates([bad])
    assert batch.state is before  # nothing dispatched, nothing donated


@pytest.mark.cpu_only("forces 4 host-platform devices in a subprocess")
def test_dp_policy_cuts_padding_and_keeps_outputs():
    """tests/support/dp_policy_check.py on a 40-request trace over 4 ranks: the loop's padding waste
    equals the waste recomputed from every rank's tokens, is at most 0.6 of the old policy's (fewest
    requests, busiest rank's bucket; measured in the same process by its own rules), and every
    policy's outputs are the single-device loop's."""
    result = run_with_four_devices(os.path.join(TESTS, "support", "dp_policy_check.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    new, old = report["new"], report["old"]
    for policy in (new, old):
        assert policy["waste"] == pytest.approx(policy["recomputed"], abs=1e-12)
        assert policy["outputs"] == report["single"] and len(report["single"]) == 40
    assert old["waste"] > 0.5
    assert new["waste"] <= 0.6 * old["waste"], (new["waste"], old["waste"])


def test_shared_bucket_wastes_least_and_holds_every_decode():
    from jaxprep.serving.host.dp_policy import shared_bucket

    prep = PrepConfig(max_num_reqs=16, max_model_len=256, max_num_batched_tokens=64, block_size=16)
    assert prep.token_buckets == (8, 16, 32, 64)
    # 16: 1 - 60/64; 32: 1 - 108/128; 64: 1 - 204/256 (8 cannot hold rank 1's 12 decodes)
    assert shared_bucket(prep, [64, 12, 64, 64], [0, 12, 0, 0]) == 16
    # 8: 1 - 16/32; 16: 1 - 24/64; 32: 1 - 40/128; 64: 1 - 72/256: the prefill goes 8 tokens at a time
    assert shared_bucket(prep, [64, 2, 3, 3], [0, 2, 3, 3]) == 8
    # 8 and 16 waste nothing (each rank gives back 12 or 4 tokens), 32: 1 - 80/128: the larger of the two
    assert shared_bucket(prep, [20, 20, 20, 20], [0, 0, 0, 0]) == 16
    assert shared_bucket(prep, [64, 64, 64, 64], [0, 0, 0, 0]) == 64  # no waste anywhere: the larger rung
    assert shared_bucket(prep, [0, 0, 0, 1], [0, 0, 0, 1]) == 8


def test_routing_balances_tokens_not_requests():
    from jaxprep.serving import Request, Scheduler
    from jaxprep.serving.host.dp_policy import route

    schedulers = [Scheduler(serving_config()) for _ in range(3)]
    schedulers[0].add_request(Request(0, [2] * 20, 4))  # one long prompt
    schedulers[1].add_request(Request(1, [2] * 3, 4))
    schedulers[1].add_request(Request(2, [2] * 3, 4))  # two short ones
    assert route(schedulers) == 2  # empty
    schedulers[2].add_request(Request(3, [2] * 5, 4))
    assert route(schedulers) == 2  # 5 tokens against 6 and 20, though it has fewer requests than rank 1
    schedulers[2].add_request(Request(4, [2] * 1, 4))
    assert route(schedulers) == 1  # 6 tokens and 2 requests on ranks 1 and 2: the lower rank


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.cpu_only("forces 2 and 4 host-platform devices in subprocesses")
def test_two_processes_serve_like_one_process_with_four_devices():
    """tests/support/multihost_dp.py as a 2-process JAX cluster on localhost (2 forced CPU devices
    each, gloo collectives, each process placing only its own ranks' data) gives every request
    the outputs of the same loop in one process with 4 devices."""
    script = os.path.join(TESTS, "support", "multihost_dp.py")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=with_xla_flag("--xla_force_host_platform_device_count=2"),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    port = str(_free_port())
    workers = [subprocess.Popen([sys.executable, script, port, str(i)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [worker.communicate(timeout=90) for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    single = run_with_four_devices(script)
    assert single.returncode == 0, single.stderr[-3000:]
    expected = json.loads(single.stdout.strip().splitlines()[-1])
    assert expected["processes"] == 1 and len(expected["outputs"]) == 20
    for i, (worker, (stdout, stderr)) in enumerate(zip(workers, outs)):
        assert worker.returncode == 0, stderr[-3000:]
        report = json.loads(stdout.strip().splitlines()[-1])
        assert (report["processes"], report["process"], len(report["local_devices"])) == (2, i, 2)
        assert report["outputs"] == expected["outputs"]
        assert report["dispatches"] == expected["dispatches"]
