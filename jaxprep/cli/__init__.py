"""The ``jaxprep`` console script: one subcommand per module of this package.

Performance switches that are process-wide (XLA's CPU thread count, async dispatch) are set here,
for the command-line process only, never by the library on import.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> module with SUMMARY, DESCRIPTION (its --help, plain text), add_arguments(parser) and run(args) -> int
COMMANDS = {
    "simulate": "jaxprep.cli.simulate",
    "generate": "jaxprep.cli.generate",
    "demo": "jaxprep.cli.demo",
    "walkthrough": "jaxprep.cli.walkthrough",
}
DEFAULT_COMMAND = "simulate"
DESCRIPTION = """\
jaxprep turns an LLM scheduler's decision into the model's inputs (positions,
slot mapping, block tables, ...) with jitted JAX functions. These commands show
it at work."""
EPILOG = """\
With no command, jaxprep runs simulate: "jaxprep --check" is
"jaxprep simulate --check". "jaxprep COMMAND --help" lists a command's options."""
"""``jaxprep --help``: plain text for users, wrapped by hand (tests/cli/test_help.py)."""


SEQUENTIAL_CPU_SCHEDULE = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
"""The XLA flag `configure_runtime` adds for one XLA:CPU thread: programs scheduled depth first, run in order."""


def configure_runtime(single_thread_cpu: bool = True, host_devices: int | None = None,
                      threads: int | None = None) -> None:
    """Process-wide settings for a CLI or benchmark process; call before JAX starts.

    On small CPU hosts XLA's CPU client is fastest with one thread (``PJRT_NPROC=1``) and
    synchronous dispatch for the tiny model's small steps: thread hand-offs otherwise cost several
    times a call (BENCHMARKS.md). With one thread XLA:CPU also compiles each program in its
    depth-first schedule (`SEQUENTIAL_CPU_SCHEDULE`): the default, ordered for concurrency, makes a
    program's runtime hand its independent kernels to the pool's one thread and wait for them
    (docs/benchmarks-history.md, "XLA:CPU's schedule with one thread"). A real checkpoint's steps are
    large enough to use every core: the CLI passes ``single_thread_cpu=False`` for them
    (`jaxprep.cli._checkpoint.single_thread_cpu`). ``threads``: this many XLA CPU threads
    (``PJRT_NPROC``) instead. An explicit ``PJRT_NPROC`` wins, and so does a schedule ``XLA_FLAGS``
    names. ``host_devices``: split the CPU into this many JAX devices (data parallelism on CPU) unless
    ``XLA_FLAGS`` already says how many; it only affects the CPU platform.
    """
    if threads is not None:
        os.environ.setdefault("PJRT_NPROC", str(threads))
    elif single_thread_cpu:
        os.environ.setdefault("PJRT_NPROC", "1")
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("PJRT_NPROC") == "1" and SEQUENTIAL_CPU_SCHEDULE.split("=")[0] not in flags:
        flags = f"{flags} {SEQUENTIAL_CPU_SCHEDULE}".strip()
    if host_devices and host_devices > 1 and "xla_force_host_platform_device_count" not in flags:
        flags = f"{flags} --xla_force_host_platform_device_count={host_devices}".strip()
    if flags:
        os.environ["XLA_FLAGS"] = flags
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", not single_thread_cpu and threads != 1)


def main(argv: list[str] | None = None) -> int:
    """Parses the flags, turns on the persistent compilation cache (`jaxprep.cli._cache`: every
    subcommand compiles, so a second identical run loads its executables from disk), runs the command."""
    from jaxprep.cli._cache import turn_on_compile_cache

    module, args = parse_args(argv)
    args.compile_cache_dir = turn_on_compile_cache(args)
    try:
        return module.run(args)
    except MemoryError as error:  # sizes the flags allowed but this host cannot hold: one line, exit 2
        _out_of_memory(args, error)
    except Exception as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        _out_of_memory(args, error)


def _out_of_memory(args, error: BaseException):
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    message = f"out of memory with these sizes ({first}): lower --max-model-len, --num-blocks or --max-num-reqs"
    if getattr(args, "error", None) is not None:
        args.error(message)
    sys.stderr.write(f"jaxprep {args.command}: error: {message}\n")
    sys.exit(2)


def commands_help(modules: dict) -> str:
    """The ``commands:`` section of ``jaxprep --help``: a line per subcommand (argparse's own listing
    wraps a long name onto two lines and adds a ``COMMAND`` line)."""
    width = max(map(len, modules)) + 3
    lines = [f"  {name:<{width}}{module.SUMMARY}{' (default)' if name == DEFAULT_COMMAND else ''}"
             for name, module in modules.items()]
    return "\n".join(["commands:", *lines])


def version_line() -> str:
    """``jaxprep --version``: ``jaxprep 0.1.0 (values of vLLM 0.33.0)``."""
    from jaxprep import VLLM_VERSION, __version__

    return f"jaxprep {__version__} (values of vLLM {VLLM_VERSION})"


def parse_args(argv: list[str] | None = None):
    """(subcommand module, checked arguments); a bad flag exits 2 with one line naming it, before
    anything is compiled (`jaxprep.cli._args`)."""
    from jaxprep.cli._args import ArgumentParser, UsageError

    argv = list(sys.argv[1:] if argv is None else argv)
    modules = {name: importlib.import_module(path) for name, path in COMMANDS.items()}
    text = argparse.RawDescriptionHelpFormatter  # the descriptions keep their own lines
    parser = ArgumentParser(prog="jaxprep", usage="%(prog)s [-h] [COMMAND] [options]", epilog=EPILOG,
                            description=f"{DESCRIPTION}\n\n{commands_help(modules)}", formatter_class=text)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", help=argparse.SUPPRESS, prog="jaxprep")
    parsers = {}
    for name, module in modules.items():
        parsers[name] = subparsers.add_parser(name, help=module.SUMMARY, description=module.DESCRIPTION,
                                              formatter_class=text)
        module.add_arguments(parsers[name])
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print jaxprep's version and the vLLM version its values follow, and exit")
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        parser.error(f"{argv[0]}: not a command (one of {', '.join(COMMANDS)}; with no command, jaxprep runs "
                     f"{DEFAULT_COMMAND})")
    if not argv or argv[0] not in COMMANDS and argv[0] not in ("-h", "--help", "--version"):
        argv.insert(0, DEFAULT_COMMAND)
    args = parser.parse_args(argv)
    from jaxprep.cli._checkpoint import single_thread_cpu

    configure_runtime(single_thread_cpu=single_thread_cpu(args), host_devices=getattr(args, "devices", None),
                      threads=getattr(args, "threads", None))
    check = getattr(modules[args.command], "check_arguments", None)
    try:
        if check is not None:
            check(args)
    except UsageError as error:
        parsers[args.command].error(str(error))
    return modules[args.command], args


if __name__ == "__main__":
    sys.exit(main())
