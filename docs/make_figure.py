"""Draws the figures of the README and the guides, as the notebooks draw them.

    PYTHONPATH=. python docs/make_figure.py [path]      # default: docs/chunked_prefill_step2.png
    PYTHONPATH=. python docs/make_figure.py --mixed-batch [path]   # default: docs/mixed_batch.png

- chunked_prefill_step2.png: step 2 of the chunked-prefill walkthrough (docs/semantics.md#example-a-step-1),
  notebooks/01_chunked_prefill.py's second figure;
- mixed_batch.png: example B (docs/semantics.md#example-b), notebooks/02_mixed_batch.py's figure.

Needs the ``notebooks`` extra (matplotlib).
"""

from __future__ import annotations

import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PATH = os.path.join(DOCS, "chunked_prefill_step2.png")
MIXED_BATCH_PATH = os.path.join(DOCS, "mixed_batch.png")


def main(path: str = DEFAULT_PATH) -> str:
    from jaxprep.walkthrough import plotting, run_walkthrough

    step2 = run_walkthrough(max_steps=2)[1]
    plotting.plot_step(step2).savefig(path, dpi=90)
    return path


def mixed_batch(path: str = MIXED_BATCH_PATH) -> str:
    from jaxprep.walkthrough import plotting, prepare_record
    from jaxprep.walkthrough.examples import example_b, example_b_config

    record = prepare_record(example_b(), example_b_config(), prompt_lens=[40, 100, 93, 75, 120])
    plotting.plot_step(record).savefig(path, dpi=70)
    return path


if __name__ == "__main__":
    if sys.argv[1:2] == ["--mixed-batch"]:
        print(mixed_batch(*sys.argv[2:]))
    else:
        print(main(*sys.argv[1:]))
