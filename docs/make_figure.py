"""Draws the README's figure: step 2 of the chunked-prefill walkthrough (docs/semantics.md#example-a-step-1).

    PYTHONPATH=. python docs/make_figure.py [path]      # default: docs/chunked_prefill_step2.png

Needs the ``notebooks`` extra (matplotlib).
"""

from __future__ import annotations

import os
import sys

DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chunked_prefill_step2.png")


def main(path: str = DEFAULT_PATH) -> str:
    from jaxprep.walkthrough import plotting, run_walkthrough

    step2 = run_walkthrough(max_steps=2)[1]
    plotting.plot_step(step2).savefig(path, dpi=90)
    return path


if __name__ == "__main__":
    print(main(*sys.argv[1:]))
