"""Progress on stderr for the slow parts of a command: loading, warm-up, serving, the check.

``--progress auto`` (the default) draws tqdm bars when stderr is a terminal and otherwise (a log, a
pipe, CI) writes plain lines: one when a phase starts, one at each quarter of its total, one when it
ends, with the count and the seconds, so a long run shows where it is without a bar's redraws.
``always`` forces the bars (the tests use it), ``never`` writes nothing.

With ``--json`` a command's stdout is the JSON object alone, so that ``jaxprep simulate --json | jq``
works: the human summary goes to stderr with the progress (`report_file`).

    compiling: 0/9 executable
    compiling: 3/9 executable, 4.1 s
    ...
    compiling: 9/9 executable in 11.8 s
"""

from __future__ import annotations

import argparse
import sys
import time

from tqdm import tqdm

DISABLE = {"auto": None, "always": False, "never": True}
"""``--progress`` -> tqdm's ``disable``: ``None`` turns the bar off when stderr is not a terminal
(`progress_bar` writes `LineProgress` lines then instead)."""


def report_file(as_json: bool):
    """Where a command prints its human summary: stdout, or stderr under ``--json`` (stdout then holds
    only the JSON object)."""
    return sys.stderr if as_json else sys.stdout


def warm_up(engine, when: str, description: str, unit: str, cache_dir: str | None) -> float:
    """``engine.warmup()`` with a progress bar (the last executable compiled as its postfix), after one line
    on stderr saying what it compiles, why, and where the compilation cache keeps it; returns its seconds."""
    if when != "never":
        cache = f"the cache in {cache_dir} keeps them for the next run" if cache_dir else \
            "no compilation cache (--no-compile-cache): the next run compiles them again"
        sys.stderr.write(f"warm-up: {engine.num_executables} executables to compile before the first step, so that "
                         f"no step compiles: {engine.warmup_plan()}; {cache}\n")
        sys.stderr.flush()
    with progress_bar(when, description, unit, total=engine.num_executables) as bar:
        def show(done: int, total: int, what: str) -> None:
            bar.set_postfix_str(what, refresh=False)
            bar.update(1)

        return engine.warmup(on_compiled=show)


def add_progress_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--progress", choices=tuple(DISABLE), default="auto",
                        help="progress on stderr: auto (bars on a terminal, otherwise a line per phase and per "
                             "quarter of it), always (bars), never (default auto)")
    parser.add_argument("--no-progress", dest="progress", action="store_const", const="never",
                        help="same as --progress never")


def progress_bar(when: str, description: str, unit: str, total: int | None = None, iterable=None, **options):
    """A tqdm bar on stderr showing count of total, elapsed time and rate, or, with ``when`` "auto" and
    stderr not a terminal, a `LineProgress` with the same calls; ``when``: a ``--progress`` value;
    ``options``: more tqdm arguments (``unit_scale``, ``position``, ...)."""
    if when == "auto" and not sys.stderr.isatty():
        return LineProgress(description, unit, total, iterable)
    return tqdm(iterable, total=total, desc=description, unit=unit, disable=DISABLE[when], leave=True,
                dynamic_ncols=True, **options)


class LineProgress:
    """The part of tqdm's interface the commands use (``update``, ``n``, ``total``, ``set_postfix``,
    iteration, ``len``, ``with``), written as plain lines: at the start, at each quarter of ``total`` (once
    it is known), and at the end."""

    QUARTERS = 4

    def __init__(self, description: str, unit: str, total: int | None = None, iterable=None):
        self.description, self.unit, self.total, self.iterable = description, unit, total, iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            self.total = len(iterable)
        self.n, self._quarter, self._closed = 0, 0, False
        self._start = time.perf_counter()
        self._write(f"{self.description}: {self._count()}")

    def _count(self) -> str:
        return f"{self.n}/{self.total} {self.unit}" if self.total else f"{self.n} {self.unit}"

    @staticmethod
    def _write(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.total:
            return
        quarter = self.n * self.QUARTERS // self.total
        if self._quarter < quarter < self.QUARTERS:  # the end has its own line
            self._quarter = quarter
            self._write(f"{self.description}: {self._count()}, {time.perf_counter() - self._start:.1f} s")

    def set_postfix(self, *args, **kwargs) -> None:
        """tqdm's extra fields: not written (the lines stay short)."""

    def set_postfix_str(self, *args, **kwargs) -> None:
        """tqdm's extra text: not written (the lines stay short)."""

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._write(f"{self.description}: {self._count()} in {time.perf_counter() - self._start:.1f} s")

    def __len__(self) -> int:
        return len(self.iterable) if self.iterable is not None else self.total or 0

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
