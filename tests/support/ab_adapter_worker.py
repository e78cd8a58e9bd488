"""Runs benchmarks/ab_vllm_adapter.py's parts on a tiny workload and prints a JSON report of what they did.

Started by tests/benchmarks/test_ab_vllm_adapter.py in a subprocess: the benchmark imports vLLM's runner modules
after `support.vllm_scheduler.no_pinned_memory`, which must come first in a process (a test worker has imported
vLLM already). The report: the import renaming of a sample; what importing this checkout's HEAD as the base
package loaded; the paired replay's timings with two equal sides; and its error with a side whose first buffer
is off by one word (the negative control).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import ab_vllm_adapter as ab  # noqa: E402

import jaxprep  # noqa: E402
from jaxprep.serving.host.vllm import VllmAdapter  # noqa: E402

SAMPLE = ("from jaxprep.serving import x\nimport jaxprep\nimport jaxprep.cli as cli\nfrom jaxprep import y\n"
          "import jaxprep_extra\nname = 'jaxprep.serving'\n")


class Shifted(VllmAdapter):
    """An adapter whose first prepared buffer is off by one word."""

    def step(self, scheduler_output, *args):
        step = super().step(scheduler_output, *args)
        if step.buffer is None or getattr(self, "shifted", False):
            return step
        self.shifted = True
        return dataclasses.replace(step, buffer=dataclasses.replace(step.buffer, words=step.buffer.words + 1))


def main() -> None:
    report = dict(renamed=ab.IMPORTS.sub(rf"\1 {ab.BASE_PACKAGE}", SAMPLE))
    with tempfile.TemporaryDirectory() as folder:
        base = ab.import_revision("HEAD", folder)
        theirs = importlib.import_module(f"{ab.BASE_PACKAGE}.serving.host.vllm")
        loaded = [m for name, m in sys.modules.items() if name.split(".")[0] == ab.BASE_PACKAGE]
        report.update(base=base.__name__, distinct=theirs.VllmAdapter is not VllmAdapter,
                      batch_module=theirs.ServingBatch.__module__, modules=len(loaded),
                      all_in_folder=all(m.__file__.startswith(folder) for m in loaded))
    work = ab.workload(4, 3)
    recorded = ab.record_outputs(work)
    config = ab.serving_config(work, jaxprep)
    times = ab.paired_replay({"jaxprep": (VllmAdapter, config), "other": (VllmAdapter, config)}, recorded, rounds=1)
    report["times"] = {name: [list(t.shape), bool((t > 0).all())] for name, t in times.items()}
    try:
        ab.paired_replay({"jaxprep": (VllmAdapter, config), "other": (Shifted, config)}, recorded, rounds=1)
        report["shifted"] = None
    except AssertionError as error:
        report["shifted"] = str(error)
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
