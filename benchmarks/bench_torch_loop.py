"""The torch-side loop of examples/torch_llama_loop.py on a tiny checkpoint: seconds per loop and per step,
with torch on one thread and on its default thread count (warm: the loop runs once first).

    PYTHONPATH=. python benchmarks/bench_torch_loop.py [--repeats 3]

Not a goal, a guide: the forward is the readable plain-torch one (`torch_bridge.model.TorchDecoder`),
and on a small host torch's default threads contend with everything else on the machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from benchmarks.common import load_line, machine_line  # noqa: E402
from support.hf_checkpoints import SPECS, save_checkpoint  # noqa: E402
from torch_bridge.model import TorchDecoder  # noqa: E402


def _example():
    spec = importlib.util.spec_from_file_location("torch_llama_loop", os.path.join(ROOT, "examples",
                                                                                   "torch_llama_loop.py"))
    sys.modules["torch_llama_loop"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    loop = _example()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 320, size=n).tolist() for n in (5, 13, 9, 20)]
    with tempfile.TemporaryDirectory() as directory:
        save_checkpoint(SPECS["llama-llama3-rope"], directory)
        model = TorchDecoder.from_pretrained(directory)
    print(machine_line())
    print(load_line())
    default_threads = torch.get_num_threads()
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        _, stats = loop.serve_greedy(model, prompts, 6, num_blocks=12)  # warm: compiles every bucket
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            loop.serve_greedy(model, prompts, 6, num_blocks=12)
            times.append(time.perf_counter() - start)
        best = min(times)
        print(f"torch threads {threads}: loop {best:.3f} s (best of {args.repeats}), {stats.steps} steps, "
              f"{best / stats.steps * 1e3:.1f} ms a step; {stats.preemptions} preemptions")
    torch.set_num_threads(default_threads)


if __name__ == "__main__":
    main()
