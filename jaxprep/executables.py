"""The executables a warm-up makes, compiled on a thread pool or loaded from disk without tracing.

A serving loop's warm-up is a list of `Executable`s: each a jitted function, the arguments it is lowered
with (arrays or ``jax.ShapeDtypeStruct`` leaves) and its static arguments, and the key its owner looks it up
by (``("serve_step", bucket, words)``). `warm` turns them into ``{key: jax.stages.Compiled}``; the owner
calls those directly, and any other call still goes through the jitted function.

Where JAX's persistent compilation cache is on (`jaxprep.use_compile_cache`, ``jax_compilation_cache_dir``),
each compiled executable is also written, serialized, into its `STORE_FOLDER`, under a key made without
tracing: the jitted function's name, the static arguments, the arguments' shapes, dtypes and shardings, and
a fingerprint of everything else that shapes the program (jaxprep's own sources, jax and jaxlib, the
devices, XLA's flags, JAX's settings). A later warm-up loads it from there: no trace, no lowering, no
hashing of a lowered module, only the executable read back (docs/benchmarks-history.md, "The door's fixed
cost, compile cost, first look"). JAX's own cache still serves whatever is compiled, and what it served is
not stored again. Like JAX's, the folder holds code that is run: keep it private.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import os
import pickle
import platform
import threading
import time
from collections.abc import Callable, Iterable

import jax

STORE_FOLDER = "jaxprep-executables"
"""Subfolder of JAX's persistent compilation cache folder that holds jaxprep's serialized executables."""
STORE_HIT_EVENT = "/jaxprep/executable_store/hits"
"""`jax.monitoring` event recorded for each executable loaded from the store (`count_compiles` counts it
as a compile served from the cache)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Executable:
    """One executable of a warm-up: ``function`` (a jitted function) lowered with ``args`` and the static
    ``kwargs``; ``key``: where its owner's table keeps it."""

    key: tuple
    function: Callable
    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)
    what: str = ""
    """In words, for the warm-up's log and progress (default: the function's name and the key)."""

    def lower(self) -> jax.stages.Lowered:
        return self.function.lower(*self.args, **self.kwargs)

    def describe(self) -> str:
        return self.what or f"{getattr(self.function, '__name__', 'executable')} {self.key}"

    @functools.cached_property
    def stored_as(self) -> str:
        """`store_key`, computed once (a warm-up asks for it to look, to load and to save)."""
        return store_key(self)


def run(table: dict, key: tuple, jitted: Callable, *args, **static):
    """``table[key](*args)`` (a warm-up's executable: no trace, no cache lookup) if the table holds one,
    else ``jitted(*args, **static)``."""
    compiled = table.get(key)
    return jitted(*args, **static) if compiled is None else compiled(*args)


def warm(executables: Iterable[Executable], threads: int | None = None, on_compiled=None, *, why: str,
         cache_dir: str | os.PathLike | None = None) -> dict:
    """``{key: jax.stages.Compiled}`` of every one of ``executables`` (in order: put the largest first). Each
    is loaded from the `ExecutableStore` if the persistent cache is on and holds it, else lowered (in this
    thread, under the GIL) and compiled on one of ``threads`` threads (default: the CPU count) while the next
    is lowered, then stored. What is compiled and ``why`` is logged on ``jaxprep.warmup``, and
    ``on_compiled(done, total, what)`` is called (from a worker thread, one call at a time) as each one is
    ready (`jaxprep.compilation.WarmupProgress`). ``cache_dir``: `jaxprep.use_compile_cache` there first."""
    from jaxprep.compilation import WarmupProgress, count_compiles, use_compile_cache

    start = time.perf_counter()
    if cache_dir is not None:
        use_compile_cache(cache_dir)
    executables = list(executables)
    store = ExecutableStore.current()
    table, lock = {}, threading.Lock()
    progress = WarmupProgress(len(executables), why, on_compiled)

    def load_or_compile(executable: Executable, lowered) -> None:
        compiled = None if lowered is not None else store.load(executable)
        if compiled is None:
            with _compile_events() as events:
                compiled = (lowered or executable.lower()).compile()
            if store is not None and events == [_COMPILED]:  # XLA compiled it here, now: serialized whole
                store.save(executable, compiled)
        with lock:
            table[executable.key] = compiled
        progress.compiled(executable.describe())

    with count_compiles() as count, concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
        futures = []
        for executable in executables:
            # a stored one is read on a worker; any other is lowered here, as the workers compile
            lowered = None if store is not None and store.holds(executable) else executable.lower()
            futures.append(pool.submit(load_or_compile, executable, lowered))
        for future in futures:
            future.result()
    progress.finish(time.perf_counter() - start, count.cache_hits)
    return table


_THREAD = threading.local()
_COMPILED, _CACHE_HIT = "compiled", "cache hit"


@contextlib.contextmanager
def _compile_events():
    """A list of what JAX reported in this thread inside the block: `_COMPILED` for each backend compile,
    `_CACHE_HIT` each time its persistent cache served one. Only an executable whose list is exactly
    ``[_COMPILED]`` is written to the store: XLA:CPU's serialization of an executable JAX loaded from its
    cache misses functions ("Function ... not found" when a later process runs it), and JAX hands a module it
    compiled before in this process, perhaps one it loaded from that cache, back from memory with no event
    at all."""
    _listen_for_compile_events()
    events = _THREAD.events = []
    try:
        yield events
    finally:
        _THREAD.events = None


@functools.lru_cache(maxsize=1)
def _listen_for_compile_events() -> None:
    from jaxprep.compilation import CACHE_HIT_EVENT, COMPILE_EVENT

    def hit(event: str, **kwargs) -> None:
        events = getattr(_THREAD, "events", None)
        if event == CACHE_HIT_EVENT and events is not None:
            events.append(_CACHE_HIT)

    def compiled(event: str, duration: float, **kwargs) -> None:
        events = getattr(_THREAD, "events", None)
        if event == COMPILE_EVENT and events is not None:
            events.append(_COMPILED)

    jax.monitoring.register_event_listener(hit)
    jax.monitoring.register_event_duration_secs_listener(compiled)


class ExecutableStore:
    """Serialized executables in a folder, one file per `Executable` key (`store_key`)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)

    @staticmethod
    def current() -> ExecutableStore | None:
        """The store beside JAX's persistent compilation cache, when one is on."""
        folder = jax.config.jax_compilation_cache_dir
        return ExecutableStore(os.path.join(folder, STORE_FOLDER)) if folder else None

    def path(self, executable: Executable) -> str:
        return os.path.join(self.folder, executable.stored_as + ".bin")

    def holds(self, executable: Executable) -> bool:
        return os.path.exists(self.path(executable))

    def load(self, executable: Executable):
        """The stored executable, loaded onto the devices it was compiled for; None if it cannot be."""
        from jax.experimental import serialize_executable

        try:
            with open(self.path(executable), "rb") as f:
                device_ids, payload, in_tree, out_tree = pickle.load(f)
            devices = {d.id: d for d in jax.devices()}
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=[devices[i] for i in device_ids])
        except Exception:  # a missing, partial or foreign file: compiled again instead
            return None
        jax.monitoring.record_event(STORE_HIT_EVENT)
        return compiled

    def save(self, executable: Executable, compiled) -> None:
        """Writes ``compiled`` (single-device executables only; a file appears whole or not at all)."""
        from jax.experimental import serialize_executable

        devices = {d for sharding in jax.tree.leaves(compiled.input_shardings) for d in sharding.device_set}
        if len(devices) != 1:
            return
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            path = self.path(executable)
            temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(temporary, "wb") as f:
                pickle.dump(([d.id for d in devices], payload, in_tree, out_tree), f)
            os.replace(temporary, path)
        except Exception:  # a backend that cannot serialize, a folder that cannot be written: not stored
            return


def store_key(executable: Executable) -> str:
    """A hash of what the executable is compiled from, made without tracing: the function's name, its static
    arguments (and the source of each one's class defined outside jaxprep: a model's forward), its arguments'
    tree, shapes, dtypes and shardings, and `fingerprint`."""
    function = executable.function
    leaves, tree = jax.tree.flatten(executable.args)
    static = sorted(executable.kwargs.items())
    parts = [fingerprint(), f"{function.__module__}.{function.__qualname__}", repr(static), repr(tree),
             *(_source_digest(type(value)) for _, value in static)]
    parts += [f"{tuple(leaf.shape)} {leaf.dtype} {getattr(leaf, 'sharding', None)}" for leaf in leaves]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """What shapes every program besides its arguments: jaxprep's sources, jax and jaxlib, the devices and
    the CPU, XLA's flags and JAX's settings (its cache settings aside)."""
    import jaxlib

    digest = hashlib.sha256()
    root = os.path.dirname(os.path.abspath(__file__))
    for folder, names, files in sorted(os.walk(root)):
        names.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    devices = jax.devices()
    settings = {name: value for name, value in jax.config.values.items() if "cache" not in name}
    environment = [os.environ.get(name, "") for name in ("XLA_FLAGS", "PJRT_NPROC")]
    for part in (jax.__version__, jaxlib.__version__, devices[0].client.platform_version,
                 [(d.platform, d.device_kind, d.id) for d in devices], jax.process_count(), platform.machine(),
                 _cpu_flags(), environment, sorted(settings.items())):
        digest.update(repr(part).encode())
    return digest.hexdigest()


@functools.lru_cache(maxsize=64)
def _source_digest(cls: type) -> str:
    """A hash of the file defining ``cls`` when it lies outside jaxprep (`fingerprint` covers jaxprep's own)."""
    try:
        path = inspect.getsourcefile(cls)
        if path is None or path.startswith(os.path.dirname(os.path.abspath(__file__)) + os.sep):
            return ""
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except (TypeError, OSError):  # a builtin class: nothing to read
        return ""


def _cpu_flags() -> str:
    """The CPU's instruction-set flags (Linux), so that machine code for one CPU is not loaded on another."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""
