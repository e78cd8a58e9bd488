"""A warm-up's executables are kept beside JAX's persistent compilation cache (`jaxprep.executables`) and a
later warm-up loads them without tracing; the loop then runs them, compiles nothing and serves the same
tokens as an engine that compiled its own. Negative controls: another configuration traces and compiles
its own; a stored file of another executable is not loaded in its place."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest

from jaxprep import count_compiles, use_compile_cache
from jaxprep.executables import STORE_FOLDER, Executable, ExecutableStore, store_key
from jaxprep.serving import Engine, random_workload
from support.loop_workloads import MODEL, make_config

CONFIG = make_config(budget=16, block_size=4, num_blocks=24, max_num_reqs=4, max_model_len=48, decode_steps=4)


def served(engine: Engine) -> list[list[int]]:
    workload = random_workload(2, num_requests=8, vocab_size=MODEL.vocab_size, prompt_len=(1, 30), max_tokens=(1, 8))
    engine.submit(workload.requests)
    with count_compiles() as compiles:
        finished = engine.run()
    assert compiles.compiles == 0 and compiles.traces == 0
    return [r.output_token_ids for r in sorted(finished, key=lambda r: r.request_id)]


@pytest.fixture
def cache(tmp_path):
    jax.clear_caches()  # a test file run before this one in the process may have traced the same programs
    use_compile_cache(tmp_path)  # turned off again after the test (conftest)
    return tmp_path


def test_a_second_warmup_loads_every_executable_without_tracing(cache):
    first = Engine(CONFIG, MODEL, seed=1)
    with count_compiles() as compiled:
        first.warmup()
    assert compiled.traces >= first.num_executables and compiled.cache_hits == 0
    assert len(os.listdir(cache / STORE_FOLDER)) == first.num_executables
    second = Engine(CONFIG, MODEL, seed=1)
    with count_compiles() as loaded:
        second.warmup()
    assert loaded.traces == 0 and loaded.compiles == loaded.cache_hits == second.num_executables
    assert served(second) == served(first)
    other = Engine(dataclasses.replace(CONFIG, decode_steps=2), MODEL, seed=1)  # negative control
    with count_compiles() as again:
        other.warmup()
    assert again.traces > 0


def test_the_key_names_the_function_its_static_arguments_and_shapes(cache):
    from jaxprep.serving.update_packing import widen_packed

    config = CONFIG
    base = Executable(("widen", 64), widen_packed, (np.zeros(64, np.int32),), dict(config=config))
    keys = {store_key(base)}
    for other in (dataclasses.replace(base, args=(np.zeros(96, np.int32),)),
                  dataclasses.replace(base, args=(np.zeros(64, np.int64),)),
                  dataclasses.replace(base, kwargs=dict(config=dataclasses.replace(config, decode_steps=2)))):
        keys.add(store_key(other))
    assert len(keys) == 4
    assert store_key(dataclasses.replace(base, key=("another",))) == store_key(base)  # the table key is not part
    store = ExecutableStore.current()
    assert store.load(base) is None  # nothing stored yet
    os.makedirs(store.folder, exist_ok=True)
    with open(store.path(base), "wb") as f:
        f.write(b"not an executable")
    assert store.load(base) is None  # a broken file is compiled again, never run


SERVE_IN_A_NEW_PROCESS = """
import json, os, sys
sys.path.insert(0, sys.argv[2])
from jaxprep import use_compile_cache
from jaxprep.executables import STORE_FOLDER
from jaxprep.serving import Engine
from support.loop_workloads import MODEL
from test_executable_store import CONFIG, served
use_compile_cache(sys.argv[1])
engine = Engine(CONFIG, MODEL, seed=1)
engine.warmup()
if sys.argv[3:] == ["twice"]:  # a second warm-up of the same programs in this process: JAX hands them back
    Engine(CONFIG, MODEL, seed=1).warmup()
folder = os.path.join(sys.argv[1], STORE_FOLDER)
print("RESULT " + json.dumps(dict(stored=len(os.listdir(folder)) if os.path.isdir(folder) else 0,
                                  tokens=served(engine))))
"""


def _serve_in_a_new_process(cache, *more: str) -> dict:
    import json
    import subprocess
    import sys

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), os.path.join(tests, "serving")])}
    result = subprocess.run([sys.executable, "-c", SERVE_IN_A_NEW_PROCESS, str(cache), tests, *more],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_executables_jax_read_from_its_cache_are_not_stored(tmp_path):
    """An executable JAX's persistent cache served is never serialized into the store: XLA:CPU's copy of one
    misses functions, and a later process running it fails ("Function ... not found"). A first process
    compiles, so it fills JAX's cache and stores every executable (the control); with the store emptied, a
    second process's compiles all come from JAX's cache: it stores nothing and serves the same tokens."""
    compiled = _serve_in_a_new_process(tmp_path)
    folder = tmp_path / STORE_FOLDER
    assert compiled["stored"] == len(os.listdir(folder)) > 0
    for path in folder.iterdir():
        path.unlink()
    assert _serve_in_a_new_process(tmp_path) == dict(stored=0, tokens=compiled["tokens"])
    # a second warm-up in that process gets the same executables back from JAX's memory, with no event at all:
    # still nothing stored (a copy stored then made the next process fail: "Function ... not found")
    assert _serve_in_a_new_process(tmp_path, "twice") == dict(stored=0, tokens=compiled["tokens"])
    assert _serve_in_a_new_process(tmp_path) == dict(stored=0, tokens=compiled["tokens"])
