"""The Engine runs a step in ONE jitted dispatch: the packed update applied, the step prepared, the model
run and its tokens recorded by `serve_step`, the state and KV cache donated (issue 30, item 1); built with
``separate_updates``, the update's dispatches and then `run_step` (counted last).

Every jitted function the loop's modules reach by name (`jaxprep.serving.host.engine`, ``batch``, ``step``,
``transitions``, ``overlap``) is wrapped by a counter, so a dispatch added anywhere on the loop's path is
counted. Negative control: a step whose update does not fit the step's buffer sends the rest first
(`transitions.apply_packed`, after `widen_packed` for a buffer below the top rung): the same counter
sees those extra dispatches.
"""

from __future__ import annotations

import collections
import importlib

import jax
import pytest

from jaxprep import PrepConfig
from jaxprep.serving import Engine, ServingConfig, random_workload
from support.loop_workloads import EOS, MODEL, make_config

MODULES = ("host.engine", "host.batch", "step", "transitions", "host.overlap")


@pytest.fixture
def dispatches(monkeypatch):
    """{function name: calls} of every jitted function in the loop's modules, while the test runs."""
    counts = collections.Counter()
    for module_name in MODULES:
        module = importlib.import_module(f"jaxprep.serving.{module_name}")
        for name, value in list(vars(module).items()):
            if callable(value) and hasattr(value, "lower") and hasattr(value, "trace"):  # a jax.jit function
                monkeypatch.setattr(module, name, _counted(counts, name, value))
    return counts


def _counted(counts, name, function):
    def call(*args, **kwargs):
        traced = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs)))
        counts[name] += not traced  # a call inside another jit's trace is inlined, not dispatched
        return function(*args, **kwargs)

    call.lower = function.lower
    return call


def test_one_jitted_dispatch_per_engine_step(dispatches):
    config = make_config(budget=16, block_size=4, num_blocks=24, max_num_reqs=4, max_model_len=48, decode_steps=1)
    workload = random_workload(0, num_requests=6, vocab_size=MODEL.vocab_size, prompt_len=(1, 12),
                               max_tokens=(2, 8))
    engine = Engine(config, MODEL, seed=0)
    engine.submit(workload.requests)
    engine.run()
    assert engine.stats.dispatches >= 8
    assert +dispatches == {"serve_step": engine.stats.dispatches}


def test_a_crowded_step_is_counted_as_more_dispatches(dispatches):
    """Negative control: updates past the step's buffer (64 words here) go first: one `apply_packed` each, at the
    top payload rung, after a `widen_packed` when the buffer is shorter."""
    prep = PrepConfig(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, block_size=2, num_blocks=40)
    config = ServingConfig(prep=prep, eos_token_id=EOS, decode_steps=4)
    workload = random_workload(5, num_requests=12, vocab_size=MODEL.vocab_size, prompt_len=(10, 20),
                               max_tokens=(2, 10))
    engine = Engine(config, MODEL, seed=4)
    engine.submit(workload.requests)
    engine.run()
    assert dispatches["serve_step"] == engine.stats.dispatches
    assert dispatches["apply_packed"] > 0 and set(+dispatches) <= {"serve_step", "apply_packed", "widen_packed"}
    assert dispatches["widen_packed"] <= dispatches["apply_packed"]


def test_separate_updates_dispatch_the_update_then_the_bare_step(dispatches):
    """``separate_updates``: each step's buffer goes to `apply_packed` (widened first when below the top rung),
    then `run_step` runs the step; no `serve_step`."""
    config = make_config(budget=16, block_size=4, num_blocks=24, max_num_reqs=4, max_model_len=48, decode_steps=1)
    workload = random_workload(0, num_requests=6, vocab_size=MODEL.vocab_size, prompt_len=(1, 12),
                               max_tokens=(2, 8))
    engine = Engine(config, MODEL, seed=0, separate_updates=True)
    engine.submit(workload.requests)
    engine.run()
    assert engine.stats.dispatches >= 8
    assert dispatches["run_step"] == dispatches["apply_packed"] == engine.stats.dispatches
    assert set(+dispatches) == {"run_step", "apply_packed", "widen_packed"}
    assert dispatches["widen_packed"] <= dispatches["apply_packed"]

