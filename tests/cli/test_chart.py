"""`jaxprep simulate --plot`'s prep-time axis is readable: a narrow spread of times (the usual run) gets
a linear axis with several labelled ticks (on a log axis it showed one or two), a wide one a log axis
labelled at 1, 2 and 5 of each decade."""

from __future__ import annotations

import types

import pytest

from jaxprep.serving.host.dispatch_log import DispatchRecord

pytest.importorskip("matplotlib")


def prep_axis(prep_us: list[float]):
    from jaxprep.cli.chart import plot_dispatches

    stats = types.SimpleNamespace(dispatches_log=[DispatchRecord(5, 2, (), 8)] * len(prep_us), prep_us=prep_us)
    axis = plot_dispatches(stats).axes[1]
    low, high = axis.get_ylim()
    return axis.get_yscale(), [tick for tick in axis.get_yticks() if low <= tick <= high]


def test_a_narrow_spread_of_prep_times_gets_a_linear_axis_with_ticks():
    scale, ticks = prep_axis([80, 95, 110, 130, 100, 90])
    assert scale == "linear" and len(ticks) >= 4, ticks


def test_a_wide_spread_gets_a_log_axis_labelled_at_1_2_5():
    scale, ticks = prep_axis([80, 95, 3000, 100, 90, 85])
    assert scale == "log" and {100, 200, 500, 1000, 2000} <= set(ticks), ticks
