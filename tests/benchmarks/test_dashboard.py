"""benchmarks/dashboard.py, the table of today's numbers at the top of BENCHMARKS.md: its dry run measures every
row at tiny shapes and prints the table; the table is rewritten between its markers and nowhere else; the
GPU rows come from the latest loan's record (committed, or written by the runbook)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import dashboard  # noqa: E402


@pytest.fixture(scope="module")
def dry_run() -> subprocess.CompletedProcess:
    pytest.importorskip("vllm")  # the door's row drives vLLM's scheduler
    pytest.importorskip("transformers")  # the real-model row saves its checkpoint with transformers
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "dashboard.py"), "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.cpu_only("the dry run's tiny shapes and its CPU baselines")
def test_the_dry_run_measures_every_row_and_writes_nothing(dry_run):
    assert dry_run.returncode == 0, dry_run.stderr[-3000:]
    rows = [line for line in dry_run.stdout.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    assert len(rows) == len(dashboard.MEASURES) + 3, rows  # every CPU row, then the loan's three
    for measure, row in zip(dashboard.MEASURES, rows, strict=False):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 5 and cells[4] == measure.command and "failed" not in cells[1], row
    assert "(dry run: tiny shapes, one round)" in dry_run.stdout
    with open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8") as page:
        assert "(dry run" not in page.read()  # a dry run never writes the page


def test_the_full_run_measures_the_benchmarks_shapes(monkeypatch):
    """Without --dry-run every row runs at its benchmark's own shapes, each in a process of its own (a dry
    run's flag once reached the full run: its table showed the tiny shapes)."""
    programs = []

    def fake_run(argv, **kwargs):
        programs.append(argv[2])
        keys = re.findall(r"^key = '(\w+)'$", argv[2], re.M)
        return subprocess.CompletedProcess(argv, 0, stdout="".join(f'RESULT ["{k}", {{}}]\n' for k in keys), stderr="")

    monkeypatch.setattr(dashboard.subprocess, "run", fake_run)
    assert set(dashboard.run_children(list(dashboard.MEASURES), dry=False)) == {m.key for m in dashboard.MEASURES}
    assert len(programs) == len(dashboard.MEASURES) and all("dry = False" in p for p in programs)
    programs.clear()
    dashboard.run_children(list(dashboard.MEASURES), dry=True)
    assert len(programs) == 1 and "dry = True" in programs[0]


def test_the_table_is_rewritten_between_its_markers_only(tmp_path):
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(f"# Benchmarks\n\nbefore\n\n{dashboard.START}\nold table\n{dashboard.END}\n\nafter\n",
                    encoding="utf-8")
    for text in ("| new | table |", "| newer | table |"):
        dashboard.write_table(text, str(page))
        assert page.read_text(encoding="utf-8") == (f"# Benchmarks\n\nbefore\n\n{dashboard.START}\n{text}\n"
                                                    f"{dashboard.END}\n\nafter\n")
    page.write_text("# Benchmarks\n\nno markers\n", encoding="utf-8")
    with pytest.raises(RuntimeError, match="no dashboard markers"):
        dashboard.write_table("| x |", str(page))


def test_benchmarks_md_holds_a_table_of_today_between_the_markers():
    with open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8") as page:
        text = page.read()
    table = text.split(dashboard.START, 1)[1].split(dashboard.END, 1)[0]
    assert text.index(dashboard.START) < text.index("## How the numbers are taken")  # today's numbers first
    assert table.strip().startswith("Measured at commit `")
    assert "| what | jaxprep | the peer | ratio | command |" in table
    assert "benchmarks-history.md" in text


def test_the_gpu_rows_come_from_the_latest_loans_record():
    """The committed record (the H200 loan): the fused step's device time and launches at decode, its end to
    end time against vLLM V1 with its copies, the door not measured yet; the record's own date and commit."""
    with open(dashboard.GPU_RECORD, encoding="utf-8") as file:
        record = json.load(file)
    fused, end_to_end, door = dashboard.gpu_cells(record)
    assert fused[1:] == ("4.5 µs, 2 launches", "MRV2's real Triton kernels: 9.7 µs, 7 launches", "0.46x")
    assert end_to_end[1] == "127, 142, 113" and end_to_end[3] == "vs V1 1.05x, 0.68x"
    assert door[1] == "not measured yet"
    text = dashboard.table({}, record, dry=True)
    assert "NVIDIA H200, 2026-11-26, `623418f`: The fused step at 256 decode" in text
