"""`jaxprep.warmup(config, cache_dir=...)`: the persistent compilation cache, in fresh processes.

The cache is process-wide JAX configuration, so each case runs in its own interpreter: the first
fills an empty directory, the second compiles nothing itself and is served from the disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = """
import json, jax, jaxprep
hits = []
jax.monitoring.register_event_listener(lambda event, **kw: hits.append(event))
config = jaxprep.PrepConfig(max_num_reqs=3, max_model_len=32, max_num_batched_tokens=48, block_size=4)
jaxprep.warmup(config, cache_dir={cache_dir!r})
state = jaxprep.BatchState.empty(config)
with jaxprep.count_compiles() as after:
    jaxprep.prepare_inputs(state, config, config.token_buckets[-1])
print(json.dumps(dict(buckets=len(config.token_buckets), hits=hits.count("/jax/compilation_cache/cache_hits"),
                      misses=hits.count("/jax/compilation_cache/cache_misses"), compiles_after=after.compiles)))
"""


def warm_in_fresh_process(cache_dir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # only the cache under test (tests/conftest.py sets a run-wide one)
    out = subprocess.run([sys.executable, "-c", CHILD.format(cache_dir=cache_dir)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_warms_up_from_the_cache(tmp_path):
    cache_dir = str(tmp_path / "jax-cache")
    first = warm_in_fresh_process(cache_dir)
    assert first["hits"] == 0 and first["misses"] >= first["buckets"]
    assert os.listdir(cache_dir), "nothing was written to the cache"
    second = warm_in_fresh_process(cache_dir)
    assert second["hits"] >= second["buckets"] and second["misses"] == 0
    assert first["compiles_after"] == second["compiles_after"] == 0


def test_library_import_leaves_the_cache_off():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the suite's own run-wide cache (tests/conftest.py)
    out = subprocess.run([sys.executable, "-c", "import jax, jaxprep; print(jax.config.jax_compilation_cache_dir)"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"
