"""Pictures of a walkthrough step (`jaxprep.walkthrough.StepRecord`): the token table, the block
table, the KV-cache slots and the attention pattern, as matplotlib heatmaps.

Needs the ``notebooks`` extra (``pip install 'jaxprep[notebooks]'``); matplotlib is imported on
first use. Figures are built with ``matplotlib.figure.Figure`` (no pyplot, no global state, no GUI
backend): Jupyter shows one as a PNG when a cell ends with it (``_repr_png_``); or ``fig.savefig(path)``.

Colours: one per request; a light shade is K/V cached by earlier steps, the full colour is what this
step schedules or writes, grey is known but not yet scheduled, white is empty.
"""

from __future__ import annotations

import functools
import io
import sys

import numpy as np

from jaxprep.config import cdiv
from jaxprep.walkthrough import StepRecord, attention_pattern, kv_cache_view, token_table_states
from jaxprep.walkthrough.views import CACHED, CACHED_KEY, HIDDEN, SCHEDULED, WAITING

SCRIPT_NOTE = ("figures: run as a script, this notebook builds each figure and checks its values but shows none; "
               "open it in Jupyter to see them (jupyter notebook, with jupytext), or save one: "
               "plotting.plot_step(record).savefig('step.png')")
"""What a notebook run as a plain script says about its figures (`say_where_figures_go`)."""
LIGHT = 0.35
"""Alpha of the light shade (K/V cached before this step)."""
WAITING_RGBA = (0.82, 0.82, 0.82, 1.0)
NULL_RGBA = (0.55, 0.55, 0.55, 1.0)
EMPTY_RGBA = (1.0, 1.0, 1.0, 1.0)


def say_where_figures_go(out=None) -> None:
    """Prints `SCRIPT_NOTE` unless this runs in a Jupyter kernel, where each figure a cell ends with is shown:
    a notebook run as a script (``python notebooks/01_chunked_prefill.py``, the test suite) draws nothing and
    says so, once, before its first figure."""
    if not in_jupyter_kernel():
        print(SCRIPT_NOTE, file=out or sys.stdout)


def in_jupyter_kernel() -> bool:
    """Whether this code runs in a Jupyter kernel (IPython with a kernel attached)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return getattr(shell, "kernel", None) is not None


def _matplotlib():
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("jaxprep.walkthrough.plotting needs matplotlib: pip install 'jaxprep[notebooks]'") from error
    return matplotlib, _shown_as_png(Figure)


@functools.cache
def _shown_as_png(base):
    """``Figure`` with ``_repr_png_``: Jupyter draws it when a cell ends with it, whatever the backend
    (a Figure built without pyplot has no display hook of its own and shows as ``<Figure size ...>``)."""

    class Figure(base):
        def _repr_png_(self) -> bytes:
            buffer = io.BytesIO()
            self.savefig(buffer, format="png", dpi=80)
            return buffer.getvalue()

    return Figure


def request_rgba(request: int, alpha: float = 1.0) -> tuple[float, float, float, float]:
    """Request ``request``'s colour (matplotlib's tab10 cycle)."""
    matplotlib, _ = _matplotlib()
    r, g, b, _ = matplotlib.colormaps["tab10"](request % 10)
    return (r, g, b, alpha)


def _shade(request: int, strong: bool) -> tuple[float, float, float, float]:
    return request_rgba(request, 1.0 if strong else LIGHT)


MAX_CELLS_WITH_LINES = 48
"""Grids wider or taller than this get no cell lines and sparse tick labels."""
MAX_FIGURE_INCHES = 14.0


def _axes(ax, size):
    if ax is not None:
        return ax.figure, ax
    _, Figure = _matplotlib()
    width, height = (min(float(x), MAX_FIGURE_INCHES) for x in size)
    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.add_subplot()


def _ticks(count: int):
    """(positions, labels): every cell, or about 12 evenly spaced ones on a dense axis."""
    step = 1 if count <= MAX_CELLS_WITH_LINES else max(1, count // 12)
    positions = list(range(0, count, step))
    return positions, [str(p) for p in positions]


def _grid(ax, image, title, xlabel, ylabel, xticks=None, yticks=None):
    """``image`` [rows, columns, 4] RGBA as cells; ``xticks``/``yticks``: (positions, labels)."""
    ax.imshow(image, aspect="auto", interpolation="nearest")
    rows, columns = image.shape[:2]
    if max(rows, columns) <= MAX_CELLS_WITH_LINES:
        ax.set_xticks(np.arange(-0.5, columns, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=1)
        ax.tick_params(which="minor", length=0)
    ax.set_xticks(*(xticks or _ticks(columns)))
    ax.set_yticks(*(yticks or _ticks(rows)))
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)


def _wants_labels(annotate: bool | None, shape) -> bool:
    """``annotate`` if given, else label cells only on a grid small enough to read them."""
    return annotate if annotate is not None else shape[0] * shape[1] <= 160 and shape[1] <= 24


def _annotate(ax, labels, strong, fontsize=8):
    for (row, column), text in np.ndenumerate(labels):
        if text:
            ax.text(column, row, text, ha="center", va="center", fontsize=fontsize,
                    fontweight="bold" if strong[row, column] else "normal")


def plot_token_table(record: StepRecord, ax=None, annotate: bool | None = None):
    """token_ids[row, position]: cached (light), scheduled this step (full), known (grey), empty."""
    fig, ax = _axes(ax, (8, 1 + 0.45 * len(record.request_ids)))
    states, tokens = token_table_states(record), record.state["token_ids"]
    annotate = _wants_labels(annotate, states.shape)
    image = np.empty(states.shape + (4,))
    labels = np.full(states.shape, "", object)
    for (row, position), state in np.ndenumerate(states):
        request = int(record.request_ids[row])
        image[row, position] = {CACHED: _shade(request, False), SCHEDULED: _shade(request, True),
                                WAITING: WAITING_RGBA}.get(int(state), EMPTY_RGBA)
        if state and annotate:
            labels[row, position] = str(tokens[row, position])
    _grid(ax, image, f"step {record.number}: token table (full: scheduled now, grey: known, not yet)", "position",
          "row")
    _annotate(ax, labels, states == SCHEDULED, fontsize=9)
    return fig


def plot_block_table(record: StepRecord, ax=None):
    """block_table[row, :cdiv(max_model_len, B)] by request: full colour where this step writes
    K/V, bold ids for blocks allocated this step."""
    config, table = record.config, record.state["block_table"]
    columns = cdiv(config.max_model_len, config.block_size)
    fig, ax = _axes(ax, (5, 1 + 0.45 * len(table)))
    image = np.tile(np.array(EMPTY_RGBA), (len(table), columns, 1))
    labels, new = np.full((len(table), columns), "", object), np.zeros((len(table), columns), bool)
    for row in np.flatnonzero(record.request_ids >= 0):
        request, computed = int(record.request_ids[row]), int(record.computed[row])
        allocated = set(record.new_blocks.get(request, []))
        used = cdiv(computed + int(record.scheduled[row]), config.block_size)
        for column in range(used):
            block = int(table[row, column])
            new[row, column] = block in allocated
            written = (column + 1) * config.block_size > computed
            image[row, column] = _shade(request, written)
            labels[row, column] = str(block)
    _grid(ax, image, f"step {record.number}: block table (bold: new block)", "block-table column", "row")
    _annotate(ax, labels, new, fontsize=10)
    return fig


def plot_kv_cache(record: StepRecord, ax=None, annotate: bool | None = None):
    """KV-cache slots [block, offset] after the step: whose K/V each holds; bold: written this step."""
    view = kv_cache_view(record)
    num_blocks, block_size = view.request.shape
    annotate = _wants_labels(annotate, view.request.shape)
    fig, ax = _axes(ax, (1.5 + 0.5 * block_size, 1 + 0.3 * num_blocks))
    image = np.tile(np.array(EMPTY_RGBA), (num_blocks, block_size, 1))
    image[0] = NULL_RGBA
    labels = np.full(view.request.shape, "", object)
    for (block, offset), request in np.ndenumerate(view.request):
        if request >= 0:
            image[block, offset] = _shade(int(request), bool(view.new[block, offset]))
            if annotate:
                labels[block, offset] = f"r{request} p{view.position[block, offset]}"
    _grid(ax, image, f"step {record.number}: KV cache", "offset in block", "block (0: null)")
    _annotate(ax, labels, view.new, fontsize=8)
    return fig


def plot_attention(record: StepRecord, ax=None):
    """Query tokens (rows) x keys grouped by request (columns): light keys come from the cache,
    full-colour keys were written by this step (docs/semantics.md#causal-mask: causal, bottom-right aligned, per
    request)."""
    pattern = attention_pattern(record)
    num_queries, num_keys = pattern.pattern.shape
    fig, ax = _axes(ax, (2 + 0.3 * num_keys, 1.5 + 0.3 * num_queries))
    image = np.tile(np.array(EMPTY_RGBA), (num_queries, num_keys, 1))
    for (query, key), entry in np.ndenumerate(pattern.pattern):
        if entry != HIDDEN:
            image[query, key] = _shade(int(pattern.key_requests[key]), entry != CACHED_KEY)
    keys = _request_ticks(pattern.key_requests, pattern.key_positions, num_keys)
    queries = _request_ticks(pattern.query_requests, pattern.query_positions, num_queries)
    _grid(ax, image, f"step {record.number}: attention", "key (request, position)",
          "query token", xticks=keys, yticks=queries)
    ax.tick_params(axis="x", labelrotation=90, labelsize=7)
    for boundary in np.flatnonzero(np.diff(pattern.key_requests)) + 0.5:
        ax.axvline(boundary, color="black", linewidth=1)
    return fig


def _request_ticks(requests, positions, count: int):
    """Every cell as "r0 p3" on a small axis; only each request's first cell ("r0") on a dense one."""
    if count <= MAX_CELLS_WITH_LINES:
        return list(range(count)), [f"r{r} p{p}" for r, p in zip(requests, positions)]
    starts = [i for i in range(count) if i == 0 or requests[i] != requests[i - 1]]
    return starts, [f"r{requests[i]}" for i in starts]


def plot_step(record: StepRecord):
    """The four pictures of one step in one figure."""
    _, Figure = _matplotlib()
    fig = Figure(figsize=(13, 7.5), layout="constrained")
    fig.suptitle(f"step {record.number}, one colour per request: light = K/V cached by earlier steps, "
                 "full = scheduled / written by this step, grey = known tokens not scheduled yet", fontsize=10)
    grid = fig.add_gridspec(2, 3, width_ratios=[3, 1.4, 1.2])
    plot_token_table(record, fig.add_subplot(grid[0, :2]))
    plot_block_table(record, fig.add_subplot(grid[1, 0]))
    plot_kv_cache(record, fig.add_subplot(grid[:, 2]))
    plot_attention(record, fig.add_subplot(grid[1, 1]))
    return fig
