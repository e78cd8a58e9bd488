"""`jaxprep demo` prints example A (docs/semantics.md#example-a-step-1) values."""

from jaxprep.cli import main


def test_demo_prints_spec_values(capsys):
    assert main(["demo", "--check"]) == 0
    out = capsys.readouterr().out
    assert "slot_mapping     [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]" in out
    assert "slot_mapping     [5, 14, 13, 16, 17, -1, -1, -1]" in out
    assert "query_start_loc  [0, 1, 2, 5]" in out
