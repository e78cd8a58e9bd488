"""The float32 greedy-equality check of the GPU runbook (benchmarks/bench_generate.py --part equality)
can fail: its comparison against transformers finds a changed token and a short output."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("transformers", reason="the check runs transformers' generate (test extra)")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))

from bench_generate import NEAR_TIE, compare_tokens

from support.hf_checkpoints import SPECS, reference_model, save_checkpoint


def test_the_comparison_passes_transformers_own_tokens_and_catches_a_changed_one(tmp_path):
    """transformers' own greedy tokens compare equal; one token changed is a difference at its place
    with a gap past the near-tie bound (and the tokens before it counted); a short output is one too."""
    import torch

    save_checkpoint(SPECS["qwen3"], str(tmp_path))
    model = reference_model(str(tmp_path))
    model.generation_config.eos_token_id = None  # EOS ignored, as the benchmark does
    prompts = [[5, 17, 300, 42], [7, 7, 100, 31, 8, 250]]
    greedy = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                 pad_token_id=0)
        greedy.append(out[0, len(prompt):].tolist())
    assert compare_tokens(model, prompts, greedy, 6, "cpu") == dict(compared=12, total=12, differences=[])

    changed = [list(tokens) for tokens in greedy]
    changed[1][2] = (changed[1][2] + 1) % 320
    result = compare_tokens(model, prompts, changed, 6, "cpu")
    [difference] = result["differences"]
    assert (difference["prompt"], difference["token"], result["compared"]) == (1, 2, 6 + 3)
    assert difference["gap"] > NEAR_TIE
    short = compare_tokens(model, prompts, [greedy[0][:4], greedy[1]], 6, "cpu")
    assert short["differences"][0]["gap"] == float("inf")
