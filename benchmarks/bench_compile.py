"""What a cold start compiles, executable by executable, against an older commit in the same run.

    PYTHONPATH=. python benchmarks/bench_compile.py [--against a0584b9 89b68cf] [--parts exe,warmup,simulate,generate]
                                                    [--runs 3] [--workloads simulate,simulate-8192,vllm,generate]
    PYTHONPATH=. python benchmarks/bench_compile.py --parts update --workloads simulate,generate --runs 3

Each commit named by ``--against`` is checked out in a temporary ``git worktree add --detach`` (removed at
the end) and measured beside the working tree (``HEAD+``), every measurement a fresh child process with
``PYTHONPATH`` at that tree, the trees taking turns within each round.

- ``exe``: every executable a workload's warm-up compiles (`Engine.warmup` for ``simulate`` and
  ``generate``, `ServingBatch.warmup` for ``vllm``, as each commit writes them), compiled one after
  another: its trace, lower and compile seconds (JAX's monitoring events, per ``fun_name``; the
  compile's CPU seconds too, steadier than wall time on a shared machine),
  its StableHLO op count, the kernels XLA made of it (fusions and other non-fused instructions of the
  entry computation and loop bodies) and the memory it holds: its serialized size (machine code and
  what XLA keeps to reload it) and its temporaries (`Compiled.memory_analysis`). The compile's CPU
  seconds are the process's (XLA compiles on a thread of its own; nothing else runs meanwhile). The
  bucket and payload rung are read from the call that lowered it.
- ``warmup``: the workload's warm-up as the commit runs it (threads and all) in a process of its own,
  from an empty persistent compilation cache folder (filling it), then from that folder: seconds,
  compiles, cache hits, peak RSS (default: the ``vllm`` and ``readme`` workloads, which have no command
  of their own).
- ``simulate``: ``jaxprep simulate --json`` whole processes, an empty cache folder, then the same
  folder again: the ``warmup_s`` it prints and the process wall time.
- ``generate``: ``jaxprep generate`` on Qwen3-0.6B's shape cut to 2 layers (random float32 weights,
  built by transformers), one 1000-token prompt, 8 new tokens, EOS ignored: the process wall with an
  empty cache and with the cache it filled, against transformers' ``generate`` in a process of its own
  (`bench_generate.transformers_process`).

- ``update``: the working tree only: each serving step of the workloads' warm-up (``simulate``, ``generate``)
  compiled as it is and again with its packed update traced out (`unpack_updates` and `apply_updates_body`
  replaced by identities while a fresh process traces; the benchmark's build only, as `common.unchecked_step`
  does for the prepare checks), each in a process of its own: the compile CPU seconds, ops and kernels the
  update adds to every bucket's step, because it travels with the step in one dispatch.

Workloads: ``simulate`` (the default ``jaxprep simulate``), ``simulate-8192`` (``--budget 8192``),
``simulate-fused``, ``simulate-8192-fused`` and ``simulate-separate`` (the same with ``--update-dispatch fused`` or
``separate``, the working tree only),
``vllm`` (`ServingBatch.warmup` of simulate's default config, what a `VllmAdapter` warms), ``readme``
(the Engine of README.md's serving loop),
``generate`` (the Engine of the generate run above). A commit without a workload's entry point (the
adapter, a generate warm-up) skips it.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = "HEAD+"
"""The working tree's name in the tables."""
WORKLOADS = ("simulate", "simulate-8192", "vllm", "readme", "generate")
SIMULATE_ARGV = {"simulate": [], "simulate-8192": ["--budget", "8192"], "vllm": [],
                 "simulate-fused": ["--update-dispatch", "fused"],
                 "simulate-8192-fused": ["--budget", "8192", "--update-dispatch", "fused"],
                 "simulate-separate": ["--update-dispatch", "separate"]}
HERE_ONLY = ("simulate-fused", "simulate-8192-fused", "simulate-separate")
"""Workloads of the working tree alone (the flag is new): ``simulate --update-dispatch fused``, the step that
carries its updates (the default ``auto`` applies them apart on the CPU), and ``separate`` (``auto`` on a GPU
is fused)."""
GENERATE = dict(prompt_len=1000, max_tokens=8, layers=2, shape="qwen3-0.6b")
QWEN3_VOCAB = 151936
KERNEL_OPS_SKIPPED = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
                      "after-all")


# --- the child: one tree, one workload --------------------------------------------------------------------


def _engine_for(workload: str, checkpoint: str | None):
    """The object whose ``warmup()`` the workload times, built as the commit's CLI builds it."""
    from jaxprep.cli import parse_args

    if workload == "generate":
        return _generate_engine(checkpoint)
    if workload == "readme":
        return _readme_engine()
    from jaxprep.cli import simulate

    _, args = parse_args(["simulate", *SIMULATE_ARGV[workload]])
    config, model, params, _ = simulate._setup(args)
    if workload == "vllm":
        from jaxprep.serving import ServingBatch

        return ServingBatch(config) if hasattr(ServingBatch, "warmup") else None
    return simulate._engine(config, model, args, params)


def _readme_engine():
    """The Engine of README.md's serving loop."""
    import jaxprep
    from jaxprep.serving import Engine, ModelConfig, ServingConfig

    prep = jaxprep.PrepConfig(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=16, block_size=8, num_blocks=32)
    model = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=2, d_ff=64)
    return Engine(ServingConfig(prep=prep, eos_token_id=1), model, seed=0)


def _generate_engine(checkpoint: str):
    """`jaxprep generate`'s Engine for the benchmark's prompt (None if the commit's generate has no warm-up)."""
    from jaxprep.cli import generate, parse_args

    if not hasattr(generate, "serving_config"):
        return None
    prompt = " ".join(map(str, generate_prompt()))
    _, args = parse_args(["generate", "--model", checkpoint, "--prompt-ids", prompt,
                          "--max-tokens", str(GENERATE["max_tokens"]), "--ignore-eos"])
    from jaxprep.cli._checkpoint import load_checkpoint
    from jaxprep.serving import Engine

    model, params = load_checkpoint(args)
    config = generate.serving_config(args, [list(map(int, prompt.split()))], -1)
    return Engine(config, model, params=params)


def generate_prompt() -> list[int]:
    """The prompt both sides generate from (`bench_generate.prompts_for`'s, Qwen3's vocabulary)."""
    import bench_generate

    run = bench_generate.Run(prompt_lens=(GENERATE["prompt_len"],), max_tokens=GENERATE["max_tokens"], dtype="float32")
    return bench_generate.prompts_for(run, QWEN3_VOCAB)[0]


def _label_recorders(labels: dict):
    """Wraps every jitted function of jaxprep's modules so that the call that lowers (or traces) it
    records its name, bucket and payload rung against the stage it returns (``labels[id(stage)]``)."""
    import numpy as np

    def label(name, args, kwargs):
        bucket = kwargs.get("num_tokens_padded", kwargs.get("bucket"))
        ints = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
        bucket = bucket if bucket is not None else (ints[0] if ints else None)
        rung = next((a.shape[-1] for a in (*args, *kwargs.values())
                     if hasattr(a, "shape") and getattr(a, "dtype", None) == np.int32 and len(a.shape) in (1, 2)
                     and not hasattr(a, "tokens")), None)
        return {"function": name, "bucket": bucket, "rung": rung}

    class Recorder:
        def __init__(self, name, function):
            self.name, self.function = name, function

        def __call__(self, *args, **kwargs):
            return self.function(*args, **kwargs)

        def lower(self, *args, **kwargs):
            stage = self.function.lower(*args, **kwargs)
            labels[id(stage)] = label(self.name, args, kwargs)
            return stage

        def trace(self, *args, **kwargs):
            traced = self.function.trace(*args, **kwargs)
            return TracedLabel(traced, label(self.name, args, kwargs))

        def __getattr__(self, item):
            return getattr(self.function, item)

    class TracedLabel:
        def __init__(self, traced, stage_label):
            self.traced, self.stage_label = traced, stage_label

        def lower(self, *args, **kwargs):
            stage = self.traced.lower(*args, **kwargs)
            labels[id(stage)] = self.stage_label
            return stage

        def __getattr__(self, item):
            return getattr(self.traced, item)

    wrapped = {}
    for module in [m for name, m in sys.modules.items() if name.startswith("jaxprep") and m is not None]:
        for name, value in list(vars(module).items()):
            if callable(value) and hasattr(value, "lower") and hasattr(value, "trace") and not isinstance(value, type):
                if id(value) not in wrapped:
                    wrapped[id(value)] = Recorder(getattr(value, "__name__", name), value)
                setattr(module, name, wrapped[id(value)])


def _kernels(compiled_text: str) -> int:
    """Instructions XLA runs as kernels: the non-fused instructions of the entry computation and of every
    loop body, condition and branch (a fusion counts once, whatever it fuses)."""
    bodies = set(re.findall(r"(?:body|condition)=%?([\w.\-]+)", compiled_text))
    for names in re.findall(r"branch_computations=\{([^}]*)\}", compiled_text):
        bodies |= {n.strip().lstrip("%") for n in names.split(",")}
    count, inside = 0, False
    for line in compiled_text.split("\n"):
        header = re.match(r"(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header and not line.startswith(" "):
            inside = bool(header.group(1)) or header.group(2) in bodies
            continue
        op = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = \S+ ([\w\-]+)\(", line) if inside else None
        count += bool(op) and op.group(1) not in KERNEL_OPS_SKIPPED
    return count


def _executable_bytes(compiled) -> int:
    """The executable's serialized size (its machine code and what XLA keeps to load it again)."""
    from jax.experimental import serialize_executable

    try:
        return len(serialize_executable.serialize(compiled)[0])
    except Exception:  # a backend that cannot serialize: not counted
        return 0


def _report(on_compiled, done: int, total: int, what: str) -> None:
    """Calls a warm-up's progress callback as the measured commit writes it: ``(done, total, what)`` since
    the warm-up log, no arguments before."""
    if on_compiled is None:
        return
    import inspect

    if inspect.signature(on_compiled).parameters:
        on_compiled(done, total, what)
    else:
        on_compiled()


def child_executables(workload: str, checkpoint: str | None) -> dict:
    """Every executable of the workload's warm-up, compiled one by one on this thread."""
    import jax

    labels, events, rows = {}, [], []

    def listener(event: str, duration: float, **kwargs) -> None:
        events.append((event.rsplit("/", 1)[-1], kwargs.get("fun_name"), duration))

    target = _engine_for(workload, checkpoint)
    if target is None:
        return {"skipped": True}
    _label_recorders(labels)
    jax.monitoring.register_event_duration_secs_listener(listener)

    def measure(stage, stage_label: dict):
        traced = dict(trace=0.0, lower=0.0)
        for event, _, duration in events:
            key = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lower"}.get(event)
            if key:
                traced[key] += duration
        ops = stage.as_text().count("stablehlo.")
        wall, cpu = time.perf_counter(), time.process_time()
        compiled = stage.compile()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        memory = compiled.memory_analysis()
        text = compiled.as_text()
        rows.append(dict(stage_label, trace_s=traced["trace"], lower_s=traced["lower"], compile_s=wall,
                         compile_cpu_s=cpu, ops=ops, kernels=_kernels(text), code_bytes=_executable_bytes(compiled),
                         temp_bytes=getattr(memory, "temp_size_in_bytes", 0)))
        return compiled

    def compile_each(lowered, threads=None, on_compiled=None, **_) -> None:  # `compilation.compile_all`, one by one
        stages = list(lowered)
        for done, stage in enumerate(stages, 1):
            events.clear()
            measure(stage, labels.get(id(stage), {"function": "?"}))
            _report(on_compiled, done, len(stages), "")

    def warm_each(executables, threads=None, on_compiled=None, **_) -> dict:  # `executables.warm`, one by one
        table, executables = {}, list(executables)
        for done, executable in enumerate(executables, 1):
            events.clear()
            stage = executable.lower()
            table[executable.key] = measure(stage, labels.get(id(stage), {"function": "?"}))
            _report(on_compiled, done, len(executables), getattr(executable, "what", ""))
        return table

    warm = getattr(sys.modules.get("jaxprep.executables"), "warm", None)
    for module in [m for name, m in sys.modules.items() if name.startswith("jaxprep") and m is not None]:
        if getattr(module, "compile_all", None) is not None:
            module.compile_all = compile_each
        if warm is not None and getattr(module, "warm", None) is warm:
            module.warm = warm_each
    target.warmup()
    return {"rows": rows}


def child_step_compiles(workload: str, checkpoint: str | None, without_update: bool) -> dict:
    """Each serving step of the workload's warm-up lowered and compiled on this thread, with its update traced
    out when ``without_update`` (the benchmark's stand-ins: no update read, none applied, one iteration)."""
    import types

    import jax.numpy as jnp

    import jaxprep.serving.step as step_module

    if without_update:
        step_module.unpack_updates = lambda packed, config: types.SimpleNamespace(decode_steps=jnp.int32(1))
        step_module.apply_updates_body = lambda state, updates: state
    target = _engine_for(workload, checkpoint)
    rows = []
    for executable in target._warmup_executables():
        if executable.key[0] != "serve_step":
            continue
        cpu = time.process_time()
        stage = executable.lower()
        ops = stage.as_text().count("stablehlo.")
        lowered = time.process_time()
        text = stage.compile().as_text()
        rows.append(dict(bucket=executable.key[-2], words=executable.key[-1], lower_cpu_s=lowered - cpu,
                         compile_cpu_s=time.process_time() - lowered, ops=ops, kernels=_kernels(text)))
    return {"rows": rows}


def child_warmup(workload: str, checkpoint: str | None, cache_dir: str | None) -> dict:
    """The workload's own warm-up, timed (threads as the commit has them)."""
    import jax

    from jaxprep.compilation import count_compiles

    target = _engine_for(workload, checkpoint)
    if target is None:
        return {"skipped": True}
    if cache_dir:
        from jaxprep.compilation import use_compile_cache

        use_compile_cache(cache_dir)
    jax.devices()
    with count_compiles() as count:
        start = time.perf_counter()
        target.warmup()
        seconds = time.perf_counter() - start
    import resource

    return {"seconds": seconds, "compiles": count.compiles, "cache_hits": count.cache_hits,
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def child_main(spec: dict) -> None:
    from jaxprep.cli import configure_runtime

    if spec["workload"] == "generate":
        configure_runtime(single_thread_cpu=False)  # as the CLI runs a checkpoint
    else:
        configure_runtime()
    if spec["part"] == "exe":
        out = child_executables(spec["workload"], spec.get("checkpoint"))
    elif spec["part"] == "update":
        out = child_step_compiles(spec["workload"], spec.get("checkpoint"), spec["without_update"])
    else:
        out = child_warmup(spec["workload"], spec.get("checkpoint"), spec.get("cache_dir"))
    print("RESULT " + json.dumps(out))


# --- the parent -------------------------------------------------------------------------------------------


def checkout(commit: str) -> str:
    """A temporary detached worktree of ``commit`` (removed at exit)."""
    path = tempfile.mkdtemp(prefix=f"jaxprep-{commit}-")
    subprocess.run(["git", "worktree", "add", "--detach", "--force", path, commit], cwd=ROOT, check=True,
                   capture_output=True)
    atexit.register(lambda: subprocess.run(["git", "worktree", "remove", "--force", path], cwd=ROOT,
                                           capture_output=True))
    return path


def run_child(tree: str, spec: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAXPREP_CACHE_DIR", "XLA_FLAGS", "PJRT_NPROC"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)], cwd=tree,
                          capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-3:]}
    return json.loads(lines[-1][len("RESULT "):])


def run_cli(tree: str, argv: list[str], cache_dir: str) -> dict:
    """``python -m jaxprep ARGV --json --compile-cache CACHE`` in ``tree``: its JSON line and its wall time."""
    env = dict(os.environ, PYTHONPATH=tree)
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAXPREP_CACHE_DIR", "XLA_FLAGS", "PJRT_NPROC"):
        env.pop(name, None)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "jaxprep", *argv, "--json", "--compile-cache", cache_dir], cwd=tree,
                          capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-3:]}
    out = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    out["process_wall_s"] = wall
    return out


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def part_exe(trees: dict, workloads, checkpoint) -> None:
    for workload in workloads:
        print(f"\n### {workload}: every executable of the warm-up, compiled one by one\n")
        print("| commit | function | bucket | rung | trace s | lower s | compile s | compile CPU s | StableHLO ops | "
              "kernels | code KiB | temp KiB |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        totals = {}
        for name, tree in trees.items():
            out = run_child(tree, dict(part="exe", workload=workload, checkpoint=checkpoint))
            if "rows" not in out:
                print(f"| {name} | {'skipped' if out.get('skipped') else out.get('error')} |")
                continue
            for r in out["rows"]:
                print(f"| {name} | {r['function']} | {r['bucket'] or '-'} | {r['rung'] or '-'} | {r['trace_s']:.2f} | "
                      f"{r['lower_s']:.2f} | {r['compile_s']:.2f} | {r['compile_cpu_s']:.2f} | {r['ops']} | "
                      f"{r['kernels']} | {r['code_bytes'] / 1024:.0f} | {r['temp_bytes'] / 1024:.0f} |")
            rows = out["rows"]
            totals[name] = dict(n=len(rows), **{key: sum(r[key] for r in rows) for key in (
                "trace_s", "lower_s", "compile_s", "compile_cpu_s", "ops", "kernels", "code_bytes", "temp_bytes")})
        print(f"\n| {workload}: totals | executables | trace s | lower s | compile s | compile CPU s | ops | kernels | "
              "code MiB | temp MiB |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, t in totals.items():
            print(f"| {name} | {t['n']} | {t['trace_s']:.2f} | {t['lower_s']:.2f} | {t['compile_s']:.2f} | "
                  f"{t['compile_cpu_s']:.2f} | {t['ops']} | {t['kernels']} | {t['code_bytes'] / 2**20:.2f} | "
                  f"{t['temp_bytes'] / 2**20:.2f} |")
        sys.stdout.flush()


def part_update(workloads, checkpoint, runs: int) -> None:
    """What the packed update adds to each serving step's compile (the working tree; the module docstring)."""
    from common import load_line

    for workload in [w for w in workloads if w in ("simulate", "simulate-8192", "generate", "readme")]:
        results = {False: [], True: []}
        for _ in range(runs):
            for without in (False, True):
                spec = dict(part="update", workload=workload, checkpoint=checkpoint, without_update=without)
                results[without].append(run_child(ROOT, spec))
        if any("rows" not in out for outs in results.values() for out in outs):
            print(f"\n### {workload}: {next(o for outs in results.values() for o in outs if 'rows' not in o)}")
            continue
        print(f"\n### {workload}: each serving step with its update and without it, compile CPU s the median of "
              f"{runs} processes each ({load_line()})\n")
        print("| bucket | update words | compile CPU s | without the update | the update's share | StableHLO ops | "
              "without | kernels | without |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        totals = [0.0, 0.0]
        for i, row in enumerate(results[False][0]["rows"]):
            with_s, without_s = (median([out["rows"][i]["compile_cpu_s"] for out in results[w]]) for w in (False, True))
            bare = results[True][0]["rows"][i]
            totals[0] += with_s
            totals[1] += without_s
            share = 1 - without_s / with_s
            print(f"| {row['bucket']} | {row['words']} | {with_s:.2f} | {without_s:.2f} | {share:.0%} | {row['ops']} | "
                  f"{bare['ops']} | {row['kernels']} | {bare['kernels']} |")
        print(f"| all | | {totals[0]:.2f} | {totals[1]:.2f} | {1 - totals[1] / totals[0]:.0%} | | | | |")
        sys.stdout.flush()


def part_warmup(trees: dict, workloads, checkpoint, runs: int) -> None:
    from common import load_line

    for workload in workloads:
        results = {name: {"cold": [], "cached": []} for name in trees}
        loads = []
        for _ in range(runs):
            for name, tree in trees.items():
                with tempfile.TemporaryDirectory() as cache:
                    spec = dict(part="warmup", workload=workload, checkpoint=checkpoint, cache_dir=cache)
                    results[name]["cold"].append(run_child(tree, spec))
                    results[name]["cached"].append(run_child(tree, spec))
                loads.append(os.getloadavg()[0])
        print(f"\n### {workload}: warm-up as the commit runs it, an empty cache folder then the same folder, median of "
              f"{runs} processes each (load {min(loads):.1f}-{max(loads):.1f}; {load_line()} at the end)\n")
        print("| commit | cold s | from the cache s | cached / cold | compiles | cache hits | peak RSS MiB, cold |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, r in results.items():
            if any("seconds" not in v for v in r["cold"] + r["cached"]):
                print(f"| {name} | {(r['cold'] + r['cached'])[0].get('error', 'skipped')} |")
                continue
            cold, cached = (median([v["seconds"] for v in r[k]]) for k in ("cold", "cached"))
            print(f"| {name} | {cold:.2f} | {cached:.2f} | {cached / cold:.3f} | {r['cold'][0]['compiles']} | "
                  f"{r['cached'][0]['cache_hits']} | {median([v['max_rss_mib'] for v in r['cold']]):.0f} |")
        sys.stdout.flush()


def part_simulate(trees: dict, workloads, runs: int) -> None:
    for workload in [w for w in workloads if w in ("simulate", "simulate-8192", *HERE_ONLY)]:
        trees_now = {HERE: trees[HERE]} if workload in HERE_ONLY else trees
        results = {name: {"cold": [], "cached": []} for name in trees_now}
        loads = []
        argv = ["simulate", *SIMULATE_ARGV[workload], "--progress", "never"]
        for _ in range(runs):
            run_cold_then_cached(trees_now, argv, results)
            loads.append(os.getloadavg()[0])
        print(f"\n### jaxprep simulate {' '.join(SIMULATE_ARGV[workload])}: whole processes, median of {runs} "
              f"(load {min(loads):.1f}-{max(loads):.1f})\n")
        print("| commit | warmup_s, empty cache | warmup_s, cached | cached / cold | process s, empty cache | "
              "process s, cached | compiles after warm-up | step_us median | dispatch_us median |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, r in results.items():
            if any("warmup_s" not in v for v in r["cold"] + r["cached"]):
                print(f"| {name} | {(r['cold'] + r['cached'])[0].get('error')} |")
                continue
            cold, cached = (median([v["warmup_s"] for v in r[k]]) for k in ("cold", "cached"))
            wall_cold, wall_cached = (median([v["process_wall_s"] for v in r[k]]) for k in ("cold", "cached"))
            after = max(v["compiles_after_warmup"] for v in r["cold"] + r["cached"])
            step_us, dispatch_us = (median([v[f"{k}_us_median"] for v in r["cold"] + r["cached"]
                                            if v.get(f"{k}_us_median") is not None]) for k in ("step", "dispatch"))
            print(f"| {name} | {cold:.2f} | {cached:.2f} | {cached / cold:.3f} | {wall_cold:.1f} | {wall_cached:.1f} | "
                  f"{after} | {fmt(step_us, 0)} | {fmt(dispatch_us, 0)} |")
        sys.stdout.flush()


def run_cold_then_cached(trees: dict, argv: list[str], results: dict) -> None:
    """``jaxprep argv`` at each tree twice in one fresh cache folder, empty then as the first run left it; the
    results appended to ``results[tree name]["cold"]`` and ``["cached"]``."""
    for name, tree in trees.items():
        with tempfile.TemporaryDirectory() as cache:
            results[name]["cold"].append(run_cli(tree, argv, cache))
            results[name]["cached"].append(run_cli(tree, argv, cache))


def part_generate(trees: dict, checkpoint: str, runs: int) -> None:
    import bench_generate

    prompt = " ".join(map(str, generate_prompt()))
    argv = ["generate", "--model", checkpoint, "--prompt-ids", prompt, "--max-tokens", str(GENERATE["max_tokens"]),
            "--ignore-eos", "--progress", "never"]
    results = {name: {"cold": [], "cached": []} for name in trees}
    theirs, loads = [], []
    run = bench_generate.Run(prompt_lens=(GENERATE["prompt_len"],), max_tokens=GENERATE["max_tokens"], dtype="float32")
    for _ in range(runs):
        theirs.append(bench_generate.transformers_process(checkpoint, run, QWEN3_VOCAB))
        run_cold_then_cached(trees, argv, results)
        loads.append(os.getloadavg()[0])
    hf = median([t.get("wall_s") for t in theirs])
    print(f"\n### jaxprep generate, {GENERATE['shape']} shape with {GENERATE['layers']} layers (float32), one "
          f"{GENERATE['prompt_len']}-token prompt, {GENERATE['max_tokens']} new tokens: whole processes, median of "
          f"{runs} (load {min(loads):.1f}-{max(loads):.1f}); transformers' generate {fmt(hf, 1)} s\n")
    print("| commit | wall s, empty cache | / transformers | wall s, cached | / transformers | warm-up s, empty | "
          "warm-up s, cached | executables |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        if any("process_wall_s" not in v for v in r["cold"] + r["cached"]):
            print(f"| {name} | {(r['cold'] + r['cached'])[0].get('error')} |")
            continue
        cold, cached = (median([v["process_wall_s"] for v in r[k]]) for k in ("cold", "cached"))
        warm_cold, warm_cached = (median([v["warmup"]["warmup_s"] for v in r[k]]) for k in ("cold", "cached"))
        print(f"| {name} | {cold:.1f} | {cold / hf:.2f} | {cached:.1f} | {cached / hf:.2f} | {warm_cold:.1f} | "
              f"{warm_cached:.1f} | {r['cold'][0]['warmup']['warmup_compiles']} |")
    sys.stdout.flush()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child_main(json.loads(argv[1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", nargs="*", default=["a0584b9", "89b68cf"], help="commits measured beside HEAD+")
    parser.add_argument("--parts", default="exe,warmup,simulate,generate")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="of the exe part")
    parser.add_argument("--warmup-workloads", default="vllm,readme", help="of the warmup part")
    parser.add_argument("--runs", type=int, default=3, help="processes per measurement (warmup, simulate, generate)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "jaxprep-bench-compile"))
    args = parser.parse_args(argv)
    from common import load_line

    trees = {commit: checkout(commit) for commit in args.against}
    trees[HERE] = ROOT
    parts, workloads = args.parts.split(","), args.workloads.split(",")
    checkpoint = None
    if "generate" in workloads or "generate" in parts:
        from bench_real_models import build_checkpoint

        checkpoint = build_checkpoint(GENERATE["shape"], GENERATE["layers"], "float32", args.workdir)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(f"bench_compile: HEAD+ = {head.strip()} and the working tree; {os.cpu_count()} cores; {load_line()}")
    if "exe" in parts:
        part_exe(trees, workloads, checkpoint)
    if "update" in parts:
        part_update(workloads, checkpoint, args.runs)
    if "warmup" in parts:
        part_warmup(trees, args.warmup_workloads.split(","), checkpoint, args.runs)
    if "simulate" in parts:
        part_simulate(trees, workloads, args.runs)
    if "generate" in parts:
        part_generate(trees, checkpoint, args.runs)
    print(f"\nend: {load_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
