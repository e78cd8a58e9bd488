"""A chart of a serving run (``jaxprep simulate --plot FILE.png``): one bar per forward pass.

Top: the tokens each pass ran, prefill and decode stacked, up to the bucket it was padded to (the
grey rest is padding). Bottom: the input-preparation time of each dispatch, when it was timed
(``Engine(..., time_prep=True)``). Needs matplotlib (the ``notebooks`` extra).
"""

from __future__ import annotations

import numpy as np

from jaxprep.serving.host.engine import LoopStats
from jaxprep.walkthrough.plotting import _matplotlib

PREFILL, DECODE, PADDING, PREP = "#1f77b4", "#ff7f0e", "#d9d9d9", "#2ca02c"


def pass_columns(stats: LoopStats) -> dict[str, np.ndarray]:
    """Per forward pass: ``prefill``, ``decode`` and ``padded`` tokens, and ``first`` (the pass starts
    a dispatch). A multi-step dispatch's later passes only decode.

    ```
    # records (prefill 5, decode 2, later (2,), padded 8) -> prefill [5, 0], decode [2, 2], padded [8, 8]
    ```
    """
    prefill, decode, padded, first = [], [], [], []
    for record in stats.dispatches_log:
        passes = 1 + len(record.later_tokens)
        prefill += [record.prefill_tokens] + [0] * (passes - 1)
        decode += [record.decode_tokens, *record.later_tokens]
        padded += [record.padded_tokens] * passes
        first += [True] + [False] * (passes - 1)
    return {name: np.asarray(values) for name, values in
            dict(prefill=prefill, decode=decode, padded=padded, first=first).items()}


def plot_dispatches(stats: LoopStats, title: str = "jaxprep simulate"):
    """Tokens per forward pass against the bucket, and prep time per dispatch (a matplotlib Figure)."""
    _, Figure = _matplotlib()
    columns = pass_columns(stats)
    steps = np.arange(len(columns["padded"]))
    fig = Figure(figsize=(10, 5.5), layout="constrained")
    tokens, prep = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    real = columns["prefill"] + columns["decode"]
    tokens.bar(steps, columns["prefill"], width=1.0, color=PREFILL, label="prefill tokens")
    tokens.bar(steps, columns["decode"], width=1.0, bottom=columns["prefill"], color=DECODE, label="decode tokens")
    tokens.bar(steps, columns["padded"] - real, width=1.0, bottom=real, color=PADDING, label="padding (to the bucket)")
    waste = 1 - real.sum() / max(columns["padded"].sum(), 1)
    tokens.set(ylabel="tokens", title=f"{title}: tokens of each forward pass, padded to its bucket "
                                      f"({waste:.1%} of the slots are padding)")
    tokens.legend(loc="upper right", fontsize=8)
    _plot_prep(prep, steps[columns["first"]], np.asarray(stats.prep_us))
    prep.set_xlabel("forward pass")
    return fig


def _plot_prep(ax, dispatch_steps: np.ndarray, prep_us: np.ndarray) -> None:
    if len(prep_us) != len(dispatch_steps):
        ax.text(0.5, 0.5, "prep time not measured", ha="center", va="center", transform=ax.transAxes)
        return
    ax.plot(dispatch_steps, prep_us, ".", color=PREP, markersize=3)
    ax.axhline(np.median(prep_us), color=PREP, linewidth=1, label=f"median {np.median(prep_us):.0f} us")
    _prep_axis(ax, prep_us)
    ax.set(ylabel="us", title="input preparation per dispatch (unpack + state updates + prepare_padded, "
                              "replayed with the state donated)")
    ax.legend(loc="upper right", fontsize=8)


LOG_SPREAD = 20
"""A prep-time axis is logarithmic only when its times spread over more than this factor (a first
dispatch far above the rest); a narrower spread on a log axis shows one or two ticks."""


def _prep_axis(ax, prep_us: np.ndarray) -> None:
    """A linear axis from 0 with at least four labelled ticks, or, when the times spread over more than
    `LOG_SPREAD`x, a log axis labelled at 1, 2 and 5 of every decade (plain numbers, not 10^k)."""
    from matplotlib.ticker import LogLocator, MaxNLocator, ScalarFormatter

    low, high = float(np.min(prep_us)), float(np.max(prep_us))
    if low > 0 and high / low > LOG_SPREAD:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.yaxis.get_minor_formatter().set_scientific(False)
        return
    ax.set_ylim(0, high * 1.1 if high > 0 else 1)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5, min_n_ticks=4))
