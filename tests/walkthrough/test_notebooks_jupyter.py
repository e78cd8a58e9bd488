"""A notebook executed by a real Jupyter kernel (nbclient) shows its figures as PNG images.

`test_notebooks.py` runs the notebooks as scripts, where nothing is displayed; here the first one
goes through jupytext and a kernel as `jupytext --to notebook` + `jupyter nbconvert --execute` would,
and each `plotting.plot_step(...)` cell must come back with an ``image/png`` output, not only the
``<Figure size ...>`` text a Figure built without pyplot gets by default.
"""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(ROOT, "notebooks", "01_chunked_prefill.py")
KERNEL_TIMEOUT_S = 600


def _execute(path: str, monkeypatch):
    for module in ("nbclient", "ipykernel", "jupytext", "matplotlib"):
        pytest.importorskip(module, reason=f"{module} is missing: pip install -e '.[test]' (or '.[notebooks]')")
    import jupytext
    import nbclient

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel picks its own (inline) backend
    notebook = jupytext.read(path)
    nbclient.NotebookClient(notebook, kernel_name="python3", timeout=KERNEL_TIMEOUT_S,
                            resources={"metadata": {"path": os.path.dirname(path)}}).execute()
    return notebook


def _outputs(cell) -> list[dict]:
    return [output.get("data", {}) for output in cell.get("outputs", [])]


def test_figures_render_as_png_in_a_kernel(monkeypatch):
    notebook = _execute(NOTEBOOK, monkeypatch)
    plot_cells = [cell for cell in notebook.cells
                  if cell.cell_type == "code" and cell.source.rstrip().splitlines()[-1].startswith("plotting.plot_")]
    assert len(plot_cells) == 3
    for cell in plot_cells:
        images = [data["image/png"] for data in _outputs(cell) if "image/png" in data]
        assert len(images) == 1, cell.source
        assert len(images[0]) > 10_000  # base64 of a real picture, not an empty canvas
    errors = [output for cell in notebook.cells for output in cell.get("outputs", []) if output.output_type == "error"]
    assert not errors
    streams = "".join(output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", []))
    assert "figures: run as a script" not in streams  # in a kernel the figures show: nothing to say
