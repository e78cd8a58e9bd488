"""Strict JAX settings and run-time shape checks for the whole suite (STYLE.md habit 4, 10).

- dtype promotion is strict and rank promotion raises, so an implicit int64/float upcast or a
  broadcasting slip fails a test instead of passing silently;
- jaxprep is imported under jaxtyping's import hook with beartype, so every annotated function
  checks the shapes and dtypes written in its signature;
- XLA's CPU client runs on one thread (as the CLI and benchmarks do): faster on small hosts;
- XLA compiles for speed of compiling (optimization level 0; on jaxlib 0.10 the CPU's older kernel
  emitters), since the suite compiles thousands of programs and runs each a few times;
- one persistent compilation cache serves the run's processes (xdist workers, subprocesses);
- a test marked ``cpu_only(reason)`` is skipped, with its reason, when JAX runs on an accelerator
  (the GPU runbook runs the whole suite there): nothing is silently run on another backend.
"""

import atexit
import os
import shutil
import tempfile


def _suite_jaxlib_minor() -> tuple[int, ...]:
    """The installed jaxlib's (major, minor), read without importing JAX; () when it cannot be read (no
    jaxlib distribution, a version that is not numbers): the suite then leaves XLA's emitters as they are."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(part) for part in version("jaxlib").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return ()


os.environ.setdefault("PJRT_NPROC", "1")
# One persistent JAX compilation cache for the whole run: the first process of the run (pytest itself,
# or xdist's controller, whose environment its workers inherit) makes the folder and removes it at
# exit; every worker and every subprocess a test starts reads and fills the same folder, so an
# executable that two workers (or a test and the CLI it runs) need is compiled once. Every executable
# is written, however fast it compiled (JAX's default writes only those over 1 s). `jaxprep simulate`'s
# default cache (JAXPREP_CACHE_DIR) is the same folder; tests of the cache itself pass their own.
RUN_CACHE_VARIABLE = "JAXPREP_TEST_RUN_CACHE"
if RUN_CACHE_VARIABLE not in os.environ:
    os.environ[RUN_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="jaxprep-test-cache-")
    atexit.register(shutil.rmtree, os.environ[RUN_CACHE_VARIABLE], ignore_errors=True)
os.environ["JAXPREP_CACHE_DIR"] = os.environ[RUN_CACHE_VARIABLE]
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[RUN_CACHE_VARIABLE]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# The suite compiles a few thousand small executables (op by op under jax.disable_jit, one per config and
# bucket under jit) and runs each a few times: LLVM's optimizations cost more than they save here.
# Subprocesses inherit the flag; a test that sets XLA_FLAGS itself keeps what it sets.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# XLA:CPU's older elemental kernel emitters compile the suite's programs about 3x faster than its MLIR
# fusion emitters (a serving step: 1.0 s against 3.0 s at optimization level 0) and run them correctly;
# the values a test checks are integers and tolerance-compared floats, the same under either. XLA is
# retiring that path and aborts on a flag it does not know, so only the jaxlib this was measured on
# (0.10) gets it; an accelerator run (jax 0.11 there) compiles as it always did.
if _suite_jaxlib_minor() == (0, 10) and "--xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ["XLA_FLAGS"] + " --xla_cpu_use_fusion_emitters=false"

# One XLA:CPU thread (PJRT_NPROC above) runs programs fastest in their depth-first schedule, as the CLI and the
# benchmarks run them (`jaxprep.cli.configure_runtime`, `SEQUENTIAL_CPU_SCHEDULE`); the same programs are checked.
if "xla_cpu_enable_concurrency_optimized_scheduler" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_enable_concurrency_optimized_scheduler=false"

import jax  # noqa: E402  (after the environment above: JAX reads it at import)
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_cpu_enable_async_dispatch", False)

from jaxtyping import install_import_hook  # noqa: E402

with install_import_hook(["jaxprep", "torch_bridge"], "beartype.beartype"):
    import jaxprep
    import jaxprep.reference  # noqa: F401


CACHE_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture(autouse=True)
def compile_cache_left_as_it_was():
    """`jaxprep.cli.main` turns JAX's persistent compilation cache on for its process; a test that runs
    the CLI in this process gets it turned back off afterwards, so later tests compile as before."""
    before = {name: getattr(jax.config, name) for name in CACHE_SETTINGS}
    yield
    if any(getattr(jax.config, name) != value for name, value in before.items()):
        from jax.experimental.compilation_cache import compilation_cache

        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def pytest_collection_modifyitems(config, items):
    backend = jax.default_backend()
    if backend == "cpu":
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            item.add_marker(pytest.mark.skip(reason=f"cpu_only: {marker.args[0]} (JAX runs on {backend} here)"))


# Every executable XLA:CPU compiles maps its code into the process; one pytest process that compiles
# a few thousand of them reaches Linux's default limit of 65,530 memory maps (vm.max_map_count), and
# LLVM aborts the next compile ("Fatal Python error: Aborted", no Python error). Between test modules,
# when the process holds more than MAX_MEMORY_MAPS maps, JAX's caches are dropped (the next module
# compiles what it needs again).
MAX_MEMORY_MAPS = 30_000


def memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return maps.read().count(b"\n")
    except OSError:  # not Linux: no such limit to stay under
        return 0


@pytest.fixture(autouse=True, scope="module")
def bounded_memory_maps():
    yield
    if memory_maps() > MAX_MEMORY_MAPS:
        jax.clear_caches()
        if os.environ.get("JAXPREP_LOG_MAPS"):
            print(f"\n[conftest] dropped JAX's caches at {MAX_MEMORY_MAPS}+ maps -> {memory_maps()} maps")
