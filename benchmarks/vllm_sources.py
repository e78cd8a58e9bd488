"""vLLM's model runner V2 input kernels, loaded from vLLM's own source files without importing vLLM.

A GPU machine lent for the runbook has torch and Triton but no vLLM and no package index. vLLM's
Triton kernels are plain Python, so the runbook brings them as files:

    python benchmarks/vllm_sources.py            # on a machine with vLLM installed: copies the sources

copies the Python files of `vllm/v1/worker/gpu/` (the V2 runner, about 1 MB; no compiled extension)
from the installed wheel into ``.vllm_src/`` (git-ignored) with the vLLM version beside them, and
`load_mrv2_kernels` reads them back: it parses each file, keeps the ``@triton.jit`` functions the
benchmark runs, and executes just those definitions, compiled under their own file name (Triton
reads a kernel's source back from its file). What their modules import is stubbed by the one
namespace they share: ``triton``, ``tl`` and ``PAD_SLOT_ID`` (-1, `vllm/v1/attention/backends/utils.py`).
Nothing else of vLLM runs, and nothing of it is changed.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENDOR_DIR = os.path.join(ROOT, ".vllm_src")
RUNNER_DIR = os.path.join("vllm", "v1", "worker", "gpu")
VERSION_FILE = "VLLM_VERSION"
KERNELS = {
    "buffer_utils.py": ("_load_ptr",),
    "input_batch.py": ("_prepare_prefill_inputs_kernel", "_prepare_pos_seq_lens_kernel",
                       "_combine_sampled_and_draft_tokens_kernel", "_expand_idx_mapping_kernel"),
    "block_table.py": ("_gather_block_tables_kernel", "_compute_slot_mappings_kernel"),
}
"""File of `vllm/v1/worker/gpu/` -> the functions taken from it (``_load_ptr`` first: the others call it)."""
PAD_SLOT_ID = -1


def installed_runner_dir() -> str:
    """`vllm/v1/worker/gpu` of the installed vLLM, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vLLM is not installed here: copy the sources on a machine that has it")
    return os.path.join(list(spec.submodule_search_locations)[0], "v1", "worker", "gpu")


def _not_python(folder: str, names: list[str]) -> list[str]:
    """What `vendor` leaves behind: caches and every file that is not Python source."""
    def is_data(name: str) -> bool:
        return os.path.isfile(os.path.join(folder, name)) and not name.endswith(".py")

    return [name for name in names if name == "__pycache__" or is_data(name)]


def vendor(dest: str = VENDOR_DIR) -> str:
    """Copies the V2 runner's Python files into ``dest``; returns the vLLM version copied."""
    source = installed_runner_dir()
    target = os.path.join(dest, RUNNER_DIR)
    if os.path.isdir(target):
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=_not_python)
    version = importlib.metadata.version("vllm")
    with open(os.path.join(dest, VERSION_FILE), "w") as out:
        out.write(version + "\n")
    return version


def vendored_version(src: str = VENDOR_DIR) -> str | None:
    try:
        with open(os.path.join(src, VERSION_FILE)) as version:
            return version.read().strip()
    except OSError:
        return None


def load_mrv2_kernels(src: str = VENDOR_DIR) -> types.SimpleNamespace:
    """The `KERNELS` as Triton JIT functions, defined from the copied files; raises if they are missing.

    Import triton (with ``TRITON_INTERPRET=1`` set first, to run them on the CPU) before calling.
    """
    import triton
    import triton.language as tl

    namespace = {"triton": triton, "tl": tl, "PAD_SLOT_ID": PAD_SLOT_ID, "__name__": "vllm_mrv2_kernels"}
    for file_name, names in KERNELS.items():
        path = os.path.join(src, RUNNER_DIR, file_name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: run `python benchmarks/vllm_sources.py` where vLLM is installed")
        with open(path) as source:
            tree = ast.parse(source.read(), filename=path)
        found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
        missing = set(names) - {node.name for node in found}
        if missing:
            raise LookupError(f"{path} has no {sorted(missing)}: not the vLLM these benchmarks were written for")
        exec(compile(ast.Module(body=found, type_ignores=[]), path, "exec"), namespace)
    return types.SimpleNamespace(**{name: namespace[name] for names in KERNELS.values() for name in names},
                                 version=vendored_version(src))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=VENDOR_DIR, help="where to copy the sources (default: .vllm_src)")
    args = parser.parse_args(argv)
    version = vendor(args.dest)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(args.dest) for f in files)
    print(f"copied vLLM {version}'s {RUNNER_DIR} ({size / 2**20:.1f} MiB of Python) to {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
