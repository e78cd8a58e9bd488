"""``--update-dispatch`` (`jaxprep simulate`, `jaxprep generate`): whether a step's updates travel with it.

``fused``: one dispatch per step, the update program compiled into every token bucket's step; ``separate``: the
updates applied first by one executable every bucket shares, the step compiled without them
(``Engine(..., separate_updates=True)``); ``auto``: separate on one CPU device, where the warm-up's compile is
most of a run of the built-in workloads, fused on an accelerator (docs/guides/serving.md, "One dispatch or
three").
"""

from __future__ import annotations

import argparse

UPDATE_DISPATCH = ("auto", "fused", "separate")
"""--update-dispatch's choices."""


def add_update_dispatch_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--update-dispatch", choices=UPDATE_DISPATCH, default="auto",
                        help="fused: each step's updates travel with the step in one dispatch, and every bucket's "
                             "step compiles the update program; separate: they go in dispatches of their own before "
                             "the step, which compiles without them (about half the warm-up; two more dispatches a "
                             "step, ~0.2 ms on a CPU; one device); auto: separate on the CPU, where the compile is "
                             "most of a run of the built-in workloads, fused on an accelerator (default auto)")


def separate_updates(args: argparse.Namespace) -> bool:
    """--update-dispatch resolved: separate, or auto on one CPU device (docs/benchmarks-history.md, "One dispatch
    or three": ~6 s less warm-up, ~0.2 ms more per step on the default workload)."""
    if args.update_dispatch != "auto":
        return args.update_dispatch == "separate"
    import jax

    return getattr(args, "devices", 1) == 1 and jax.default_backend() == "cpu"


def chosen(engine) -> str:
    """What an engine was built with, as the summaries name it: ``separate`` or ``fused``."""
    return "separate" if engine.batch.separate_updates else "fused"
