"""README.md and the guides as an executable contract: every ``python`` block runs as written.

Each block is extracted and run on its own, as a reader would paste it: a plain block in a fresh
interpreter, a block marked ``<!-- run: npu-fake -->`` in this process against the fake torch_npu of
`support/fake_npu.py`, a block marked ``<!-- run: elsewhere (tests/FILE.py::test_name, ...) -->`` by that test
(which needs what this suite may lack, such as vllm). Every other block says what it is: ``text`` (a
transcript), or a ``bash`` block marked ``<!-- run: ci (...) -->`` (`.ci/run` runs it) or
``<!-- run: skip (reason) -->``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PAGES = ("README.md", "docs/index.md", "docs/tests.md", *(f"docs/guides/{name}.md" for name in (
    "getting-started", "padding", "serving", "torch", "vllm-backends", "checkpoints", "features", "scale",
    "notebooks", "gpu-runbook", "serving_updates", "vllm", "torch-model", "gpu")))
"""The pages whose blocks run here: the README and the docs pages written with it (a guide added later
joins the list once its blocks run or say why not)."""
FENCE = re.compile(r"^```(?P<lang>\S*)\n(?P<code>.*?)^```$", re.S | re.M)
MARKER = re.compile(r"<!-- run: (?P<mode>[\w-]+)(?: \((?P<reason>[^)]+)\))? -->\s*$")
BLOCK_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    mode: str | None  # the <!-- run: ... --> marker on the line before, if any
    reason: str | None


    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def page_blocks(page: str) -> list[Block]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as file:
        text = file.read()
    blocks = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        blocks.append(Block(page=page, line=text.count("\n", 0, match.start()) + 1, lang=match["lang"],
                            code=match["code"], mode=marker["mode"] if marker else None,
                            reason=marker["reason"] if marker else None))
    return blocks


BLOCKS = [block for page in PAGES for block in page_blocks(page)]
PYTHON = [b for i, b in enumerate(BLOCKS) if b.lang == "python" and b.mode is None
          and all(other.code != b.code for other in BLOCKS[:i])]
"""Every plain python block, once: a guide that repeats a README block word for word runs it once."""
NPU = [b for b in BLOCKS if b.lang == "python" and b.mode == "npu-fake"]


def test_every_block_is_run_or_says_why_not():
    assert len([b for b in PYTHON if b.page == "README.md"]) >= 3 and len(PYTHON) >= 5 and len(NPU) >= 1
    for block in BLOCKS:
        where = block.where
        assert block.lang in ("python", "bash", "text"), f"{where}: name the block's language"
        if block.lang == "python":
            assert block.mode in (None, "npu-fake", "elsewhere"), f"{where}: a python block must run"
        if block.mode == "elsewhere":
            path, test = re.match(r"(tests/\S+\.py)::(\w+)", block.reason).groups()
            with open(os.path.join(ROOT, path), encoding="utf-8") as file:
                assert f"def {test}(" in file.read(), f"{where}: {path} has no {test}"
        if block.lang == "bash":
            assert block.mode in ("ci", "skip") and block.reason, f"{where}: mark it run: ci or run: skip (reason)"


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    """Starts every plain python block at once, each in a fresh interpreter; {where: (status, output)}."""
    folder = tmp_path_factory.mktemp("readme")
    # HOME: a block's "~/.cache/jaxprep" (the README's warm-up cache) lands in the test's folder. XLA_FLAGS
    # stays the suite's (conftest: compiles for speed of compiling; the values the blocks check are the same);
    # a block that sets XLA_FLAGS itself (scale.md's forced CPU devices) replaces it, as a reader's would.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               HOME=str(folder))
    running = {}
    for block in (b for b in PYTHON if not missing_packages(b.code)):
        path = folder / f"{block.where.replace('/', '_').replace(':', '_line_')}.py"
        path.write_text(block.code, encoding="utf-8")
        running[block.where] = subprocess.Popen([sys.executable, str(path)], cwd=folder, env=env, text=True,
                                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return {line: (process.wait(BLOCK_TIMEOUT_S), process.stdout.read()) for line, process in running.items()}


def test_a_block_that_imports_a_missing_package_is_named():
    """What lets the README's vLLM block skip where vLLM is not installed, and nothing else skip."""
    assert missing_packages("import numpy as np\nfrom no_such_package_here import x\n") == ["no_such_package_here"]
    assert missing_packages("import numpy\nimport jax.numpy as jnp\nfrom jaxprep import PrepConfig\n") == []


IMPORTED = re.compile(r"^(?:from|import) (\w+)", re.M)


def missing_packages(code: str) -> list[str]:
    """The top-level packages a block imports that this machine lacks (a GPU machine has no vLLM)."""
    imported = set(IMPORTED.findall(code)) | ({"torch"} if "torch_bridge" in code else set())
    return sorted(name for name in imported if importlib.util.find_spec(name) is None)


@pytest.mark.parametrize("block", PYTHON, ids=[b.where for b in PYTHON])
def test_python_block_runs(block, cpu_runs):
    missing = missing_packages(block.code)
    if missing:
        pytest.skip(f"{block.where} imports {', '.join(missing)}, which this machine lacks")
    status, output = cpu_runs[block.where]
    assert status == 0, f"{block.where} failed:\n{output}"


@pytest.mark.parametrize("block", NPU, ids=[b.where for b in NPU])
def test_npu_block_runs_against_the_fake(block, monkeypatch):
    pytest.importorskip("torch")
    from support import fake_npu  # tests/ is on sys.path, as for the other NPU tests

    npu = fake_npu.install(fake_npu.FakeNpu(), monkeypatch)
    exec(compile(block.code, block.where, "exec"), {"__name__": "__readme__"})
    assert npu.copies and all(copy["device"] == "npu" for copy in npu.copies)


@pytest.mark.parametrize("name", ["chunked_prefill_step2.png", "simulate_steps.png"])
def test_readme_pictures_are_small_committed_pngs(name):
    with open(README, encoding="utf-8") as file:
        assert f"(docs/{name})" in file.read()
    with open(os.path.join(ROOT, "docs", name), "rb") as file:
        data = file.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(data) < 200_000
