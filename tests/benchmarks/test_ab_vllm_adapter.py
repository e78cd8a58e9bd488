"""benchmarks/ab_vllm_adapter.py (run by tests/support/ab_adapter_worker.py in a process of its own): a revision's
package imports under its own name, apart from this tree's, and the paired replay times both sides on the same
steps and refuses two sides that prepare different buffers (the negative control)."""

from __future__ import annotations

import pytest

from support.vllm_workers import worker_report


@pytest.fixture(scope="module")
def report():
    return worker_report("ab_adapter_worker.py", timeout=600)


def test_import_lines_are_renamed_and_nothing_else(report):
    assert report["renamed"] == ("from jaxprep_base.serving import x\nimport jaxprep_base\n"
                                 "import jaxprep_base.cli as cli\nfrom jaxprep_base import y\nimport jaxprep_extra\n"
                                 "name = 'jaxprep.serving'\n")


def test_a_revision_imports_apart_from_this_tree(report):
    assert report["base"] == "jaxprep_base" and report["distinct"]
    assert report["batch_module"] == "jaxprep_base.serving.host.batch"  # its modules refer to each other
    assert report["modules"] > 10 and report["all_in_folder"]


def test_the_paired_replay_times_both_sides_and_refuses_different_buffers(report):
    assert report["times"] == {"jaxprep": [[1, 3], True], "other": [[1, 3], True]}
    assert report["shifted"] == "step 0: the two sides prepared different buffers"
