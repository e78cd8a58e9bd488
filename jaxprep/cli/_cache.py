"""JAX's persistent compilation cache for every subcommand: ``--compile-cache DIR`` / ``--no-compile-cache``.

Every subcommand compiles (``demo`` and ``walkthrough`` the prepared step per bucket, ``simulate`` and
``generate`` the serving loop's executables), so every one keeps its executables on disk and a second
identical run loads them instead of compiling: the CLI turns the cache on (`cli.main`, before the
command runs), the library never does on its own (`jaxprep.use_compile_cache`). The folder is
``--compile-cache DIR``, else ``$JAXPREP_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxprep``, else
``~/.cache/jaxprep`` (created private to the user; skipped if it cannot be made).
"""

from __future__ import annotations

import argparse
import os

from jaxprep.cli._args import check_folder

CACHE_DIR_VARIABLE = "JAXPREP_CACHE_DIR"
"""Environment variable naming the default compilation-cache folder (the test suite sets it)."""


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--compile-cache", metavar="DIR", default=None,
                       help="JAX persistent compilation cache directory: a second run loads its executables "
                            f"from disk (default ${CACHE_DIR_VARIABLE}, else $XDG_CACHE_HOME/jaxprep, else "
                            "~/.cache/jaxprep)")
    cache.add_argument("--no-compile-cache", action="store_true",
                       help="compile every executable in this process (no persistent cache)")


def check_cache_arguments(args: argparse.Namespace) -> None:
    """``--compile-cache DIR`` is a folder the command can write (created if missing)."""
    if args.compile_cache:
        check_folder("--compile-cache", args.compile_cache)


def default_cache_dir() -> str:
    """Where the CLI keeps JAX's persistent compilation cache unless told otherwise: $JAXPREP_CACHE_DIR,
    else $XDG_CACHE_HOME/jaxprep, else ~/.cache/jaxprep."""
    if os.environ.get(CACHE_DIR_VARIABLE):
        return os.environ[CACHE_DIR_VARIABLE]
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "jaxprep")


def turn_on_compile_cache(args: argparse.Namespace) -> str | None:
    """Turns on the persistent compilation cache the flags name (process-wide: `use_compile_cache`);
    returns its folder, or None with ``--no-compile-cache`` or when the default folder cannot be made."""
    from jaxprep.compilation import use_compile_cache

    if args.no_compile_cache:
        return None
    folder = args.compile_cache or os.path.expanduser(default_cache_dir())
    if args.compile_cache is None:
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        except OSError:
            return None
    use_compile_cache(folder)
    return folder
