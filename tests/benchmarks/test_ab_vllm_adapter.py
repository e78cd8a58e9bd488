"""benchmarks/ab_vllm_adapter.py: a revision's package imports under its own name, apart from this tree's, and the
paired replay times both sides on the same steps and refuses two sides that prepare different buffers."""

from __future__ import annotations

import dataclasses
import importlib
import sys

import pytest

import jaxprep
from jaxprep.serving.host.vllm import VllmAdapter
from support.benchmark_modules import import_benchmark


@pytest.fixture(scope="module")
def ab():
    return import_benchmark("ab_vllm_adapter")


def test_import_lines_are_renamed_and_nothing_else(ab):
    source = ("from jaxprep.serving import x\nimport jaxprep\nimport jaxprep.cli as cli\nfrom jaxprep import y\n"
              "import jaxprep_extra\nname = 'jaxprep.serving'\n")
    assert ab.IMPORTS.sub(rf"\1 {ab.BASE_PACKAGE}", source) == (
        "from jaxprep_base.serving import x\nimport jaxprep_base\nimport jaxprep_base.cli as cli\n"
        "from jaxprep_base import y\nimport jaxprep_extra\nname = 'jaxprep.serving'\n")


def test_a_revision_imports_apart_from_this_tree(ab, tmp_path):
    from jaxprep.serving.host import vllm as ours

    try:
        base = ab.import_revision("HEAD", str(tmp_path))
        theirs = importlib.import_module(f"{ab.BASE_PACKAGE}.serving.host.vllm")
        assert base.__name__ == ab.BASE_PACKAGE and theirs.VllmAdapter is not ours.VllmAdapter
        loaded = [m for name, m in sys.modules.items() if name.split(".")[0] == ab.BASE_PACKAGE]
        assert len(loaded) > 10 and all(m.__file__.startswith(str(tmp_path)) for m in loaded)
        # the revision's modules refer to each other, never to this tree's
        assert theirs.ServingBatch.__module__.startswith(ab.BASE_PACKAGE)
        assert theirs.ServingBatch is not ours.ServingBatch
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == ab.BASE_PACKAGE]:
            del sys.modules[name]
        sys.path.remove(str(tmp_path))


class Shifted(VllmAdapter):
    """An adapter whose first prepared buffer is off by one word: the replay's check must refuse it."""

    def step(self, scheduler_output, *args):
        step = super().step(scheduler_output, *args)
        if step.buffer is None or getattr(self, "shifted", False):
            return step
        self.shifted = True
        return dataclasses.replace(step, buffer=dataclasses.replace(step.buffer, words=step.buffer.words + 1))


def test_the_paired_replay_times_both_sides_and_refuses_different_buffers(ab):
    work = ab.workload(4, 3)
    recorded = ab.record_outputs(work)
    config = ab.serving_config(work, jaxprep)
    times = ab.paired_replay({"jaxprep": (VllmAdapter, config), "other": (VllmAdapter, config)}, recorded, rounds=1)
    assert sorted(times) == ["jaxprep", "other"] and all(t.shape == (1, 3) and (t > 0).all() for t in times.values())
    with pytest.raises(AssertionError, match="step 0: the two sides prepared different buffers"):
        ab.paired_replay({"jaxprep": (VllmAdapter, config), "other": (Shifted, config)}, recorded, rounds=1)
