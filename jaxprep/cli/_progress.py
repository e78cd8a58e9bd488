"""Progress bars on stderr (tqdm) for the slow parts of a command: warm-up, serving, the check.

``--progress auto`` (the default) shows them only when stderr is a terminal, so logs, pipes and
CI output stay clean; ``always`` forces them (the tests use it), ``never`` hides them.
"""

from __future__ import annotations

import argparse

from tqdm import tqdm

DISABLE = {"auto": None, "always": False, "never": True}
"""``--progress`` -> tqdm's ``disable``: ``None`` turns the bar off when stderr is not a terminal."""


def add_progress_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--progress", choices=tuple(DISABLE), default="auto",
                        help="progress bars on stderr: auto (only when stderr is a terminal), always, never "
                             "(default auto)")
    parser.add_argument("--no-progress", dest="progress", action="store_const", const="never",
                        help="same as --progress never")


def progress_bar(when: str, description: str, unit: str, total: int | None = None, iterable=None, **options) -> tqdm:
    """A tqdm bar on stderr showing count of total, elapsed time and rate; ``when``: a ``--progress`` value;
    ``options``: more tqdm arguments (``unit_scale``, ``position``, ...)."""
    return tqdm(iterable, total=total, desc=description, unit=unit, disable=DISABLE[when], leave=True,
                dynamic_ncols=True, **options)
