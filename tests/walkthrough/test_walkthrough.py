"""`jaxprep.walkthrough` and `jaxprep walkthrough`: example A (docs/semantics.md#example-a-step-1) driven to the end,
other
requests and limits, and the tables the command prints."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxprep import cli
from jaxprep.config import cdiv
from jaxprep.walkthrough import (
    WalkthroughOptions,
    attention_pattern,
    kv_cache_view,
    run_walkthrough,
    token_table_states,
)
from jaxprep.walkthrough.views import CACHED, SCHEDULED, WAITING


def test_example_a_steps_1_and_2_are_spec_values():
    step1, step2 = run_walkthrough(max_steps=2)
    assert step1.unpadded("positions").tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
    assert step1.token_indices.tolist() == [0, 1, 2, 12, 13, 24, 25, 26, 27, 28]
    assert step1.unpadded("slot_mapping").tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    assert step1.unpadded("query_start_loc").tolist() == [0, 3, 5, 10]
    assert step1.unpadded("logits_indices").tolist() == [2, 4, 9]
    assert step2.unpadded("positions").tolist() == [3, 2, 5, 6, 7]
    assert step2.token_indices.tolist() == [3, 14, 29, 30, 31]
    assert step2.unpadded("slot_mapping").tolist() == [5, 14, 13, 16, 17]
    assert step2.unpadded("seq_lens").tolist() == [4, 3, 8]
    assert step2.state["block_table"][:, :4].tolist() == [[1, 2, 0, 0], [3, 7, 0, 0], [4, 5, 6, 8]]
    assert step1.sampled == {0: 104, 1: 203} and step2.sampled == {0: 105, 1: 204, 2: 309}


def test_views_of_example_a_step2():
    step2 = run_walkthrough(max_steps=2)[1]
    states = token_table_states(step2)
    assert states[2, :8].tolist() == [CACHED] * 5 + [SCHEDULED] * 3
    assert states[0, :4].tolist() == [CACHED] * 3 + [SCHEDULED]
    view = kv_cache_view(step2)
    assert view.num_used == 4 + 3 + 8
    assert sorted(view.new.nonzero()[0] * 2 + view.new.nonzero()[1]) == [5, 13, 14, 16, 17]  # the step's slots
    pattern = attention_pattern(step2).pattern
    assert pattern.astype(bool).sum(axis=1).tolist() == [4, 3, 6, 7, 8]


def test_first_chunk_leaves_the_rest_of_the_prompt_waiting():
    step1 = run_walkthrough(max_steps=1)[0]
    assert token_table_states(step1)[2, :9].tolist() == [SCHEDULED] * 5 + [WAITING] * 3 + [0]
    assert "chunked prefill (5 of 8" in step1.kind(2)


@pytest.mark.parametrize("options", [
    WalkthroughOptions(prompt_lens=(20, 5, 30), max_tokens=(3,), block_size=4, max_model_len=40, budget=16),
    WalkthroughOptions(prompt_lens=(7, 1, 9, 2), max_tokens=(5, 1, 40, 2), block_size=3, max_model_len=20, budget=6),
    WalkthroughOptions(prompt_lens=(15,), max_tokens=(1,), block_size=1, max_model_len=16, budget=4),
])
def test_every_request_finishes_and_every_step_matches_reference(options):
    records = run_walkthrough(options)
    assert all(r.matches_reference for r in records)
    assert all(0 < r.num_actual_tokens <= options.budget for r in records)
    outputs = {i: [] for i in range(len(options.prompt_lens))}
    for record in records:
        for request, token in record.sampled.items():
            outputs[request].append(token)
    for i, (prompt, max_tokens) in enumerate(zip(options.prompt_lens, options.max_tokens)):
        expected = min(max_tokens, options.max_model_len - prompt)
        assert outputs[i] == [options.token_id(i, prompt + k) for k in range(expected)]
    finished = [request for record in records for request in record.finished]
    assert sorted(finished) == list(range(len(options.prompt_lens)))
    # a request's prefill is done in order, chunk after chunk: each step starts where the last ended
    for record in records:
        for row in record.batch_rows:
            block_ids = record.state["block_table"][row, :cdiv(int(record.computed[row] + record.scheduled[row]),
                                                                options.block_size)]
            assert (block_ids > 0).all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_lens=(3, 12), max_tokens=(1,)), r"prompt_lens\[1\]=12 must lie in \[1, max_model_len=12\)"),
    (dict(prompt_lens=(3, 2), max_tokens=(1, 2, 3)), "max_tokens has 3 values for 2 prompts"),
    (dict(max_tokens=(0,)), r"max_tokens\[0\]=0 must be >= 1"),
    (dict(prompt_lens=()), "at least one request"),
])
def test_bad_options_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WalkthroughOptions(**kwargs)


def test_command_is_registered_and_simulate_stays_default():
    assert cli.COMMANDS["walkthrough"] == "jaxprep.cli.walkthrough"
    assert cli.DEFAULT_COMMAND == "simulate"


def test_command_prints_spec_values(capsys):
    assert cli.main(["walkthrough"]) == 0
    out = capsys.readouterr().out
    for line in ("positions        [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]",
                 "token_indices    [0, 1, 2, 12, 13, 24, 25, 26, 27, 28]",
                 "slot_mapping     [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]",
                 "query_start_loc  [0, 3, 5, 10]",
                 "logits_indices   [2, 4, 9]",
                 "token_indices    [3, 14, 29, 30, 31]",
                 "slot_mapping     [5, 14, 13, 16, 17 | -1, -1, -1]",
                 "seq_lens         [4, 3, 8]",
                 "4  5  6 8*  0  0",
                 "chunked prefill (5 of 8, sample discarded)",
                 "5 steps; outputs match the NumPy reference in every step"):
        assert line in out, line
    assert out.count("== step ") == 5


def test_command_takes_options(capsys):
    args = ["walkthrough", "--prompt-lens", "20", "5", "--max-tokens", "2", "--block-size", "4", "--max-model-len",
            "40", "--budget", "16", "--steps", "2"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert out.count("== step ") == 2
    assert "chunked prefill (16 of 20, sample discarded)" in out
    assert "last prefill chunk (16..19)" in out


def test_command_rejects_bad_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["walkthrough", "--prompt-lens", "3", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "jaxprep walkthrough: error: --prompt-lens 0: must be >= 1\n"


def test_command_draws_every_step(tmp_path, capsys):
    assert cli.main(["walkthrough", "--steps", "2", "--plot-dir", str(tmp_path / "figures")]) == 0
    assert "figures: " in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "figures")) == ["step_1.png", "step_2.png"]
    for name in ("step_1.png", "step_2.png"):
        with open(tmp_path / "figures" / name, "rb") as file:
            data = file.read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_free_rows_are_empty_in_the_token_table():
    step3 = run_walkthrough(max_steps=3)[2]
    assert step3.freed == {1: [3, 7]}
    assert (token_table_states(step3)[1] == 0).all()
    assert np.array_equal(step3.batch_rows, [0, 2])
