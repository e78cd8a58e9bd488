"""Every notebook runs as a script and asserts the values of docs/semantics.md, so a notebook cannot rot.

Notebooks are jupytext percent-format files (`notebooks/*.py`); each runs in this process (sharing
compiled executables with the rest of the suite) with matplotlib's Agg backend.
"""

from __future__ import annotations

import io
import os
import runpy

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK_DIR = os.path.join(ROOT, "notebooks")
NOTEBOOKS = sorted(name for name in os.listdir(NOTEBOOK_DIR) if name.endswith(".py") and not name.startswith("_"))


def test_there_are_four_notebooks():
    assert NOTEBOOKS == ["01_chunked_prefill.py", "02_mixed_batch.py", "03_spec_decode_and_kv_groups.py",
                         "04_torch_bridge.py"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    path = os.path.join(NOTEBOOK_DIR, name)
    with open(path, encoding="utf-8") as file:
        if "import torch" in file.read():
            pytest.importorskip("torch")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    runpy.run_path(path, run_name="__main__")
    out = capsys.readouterr().out
    assert "DIFFER" not in out
    # run as a script, a notebook with figures says once that it shows none (they appear in Jupyter)
    from jaxprep.walkthrough.plotting import SCRIPT_NOTE

    with open(path, encoding="utf-8") as file:
        draws = "\nplotting.plot_" in file.read()
    assert out.count(SCRIPT_NOTE) == (1 if draws else 0), out[:2000]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_jupytext_percent_format(name):
    jupytext = pytest.importorskip("jupytext")
    notebook = jupytext.read(os.path.join(NOTEBOOK_DIR, name))
    kinds = [cell.cell_type for cell in notebook.cells]
    assert kinds[0] == "markdown" and kinds.count("code") >= 3 and kinds.count("markdown") >= 3
    assert notebook.metadata["jupytext"]["text_representation"]["format_name"] == "percent"


def test_readme_links_every_notebook_and_the_figure():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as file:
        readme = file.read()
    section = readme[readme.index("## Notebooks"):]
    for name in NOTEBOOKS:
        assert f"(notebooks/{name})" in section
    assert "![" in section and "(docs/chunked_prefill_step2.png)" in section
    size = os.path.getsize(os.path.join(ROOT, "docs", "chunked_prefill_step2.png"))
    assert 0 < size < 200_000


def test_docs_figure_script_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    script = runpy.run_path(os.path.join(ROOT, "docs", "make_figure.py"))
    path = script["main"](str(tmp_path / "figure.png"))
    with open(path, "rb") as file:
        assert file.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plotting_names_the_extra_without_matplotlib(monkeypatch):
    import sys

    from jaxprep.walkthrough import plotting

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"jaxprep\[notebooks\]"):
        plotting.request_rgba(0)


def test_plot_step_draws_four_panels():
    pytest.importorskip("matplotlib")
    from jaxprep.walkthrough import plotting, run_walkthrough

    figure = plotting.plot_step(run_walkthrough(max_steps=1)[0])
    assert len(figure.axes) == 4
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=40)
    assert buffer.getvalue()[:4] == b"\x89PNG"
