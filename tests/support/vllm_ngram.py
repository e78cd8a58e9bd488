"""vLLM's own n-gram matcher, run as plain Python: the body of
`vllm/v1/spec_decode/ngram_proposer.py::_find_longest_matched_ngram_and_propose_tokens`, read from
the installed vLLM without importing the module (it needs numba, which only compiles it)."""

from __future__ import annotations

import ast
import importlib.util
import pathlib

import numpy as np

FUNCTION = "_find_longest_matched_ngram_and_propose_tokens"


def load_vllm_ngram():
    """The function, or ``None`` when vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    path = pathlib.Path(spec.origin).parent / "v1" / "spec_decode" / "ngram_proposer.py"
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == FUNCTION)
    node.decorator_list = []  # @jit(nopython=True): numba's compile, not the semantics
    namespace = {"np": np}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[FUNCTION]
