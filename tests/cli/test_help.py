"""``jaxprep --help`` and each subcommand's ``--help``: plain text for users. No reST or Markdown
markup (the module docstrings, written for the API reference, have it), the default command said,
one line per subcommand that fits an 80-column terminal, and a description on every subcommand's page."""

from __future__ import annotations

import os
import re

import pytest

from jaxprep import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MARKUP = re.compile(r"`|:(?:func|class|mod|meth|attr|ref):|^\s*\.\. |::$", re.M)
"""reST and Markdown markup: backticks (``x``, `x`), roles, directives, literal-block colons."""
WIDTH = 80


def help_text(capsys, monkeypatch, *argv: str) -> str:
    """What ``jaxprep *argv`` prints for --help on an 80-column terminal (it exits 0)."""
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(list(argv))
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def markup(text: str) -> list[str]:
    return MARKUP.findall(text)


def test_the_top_help_lists_every_command_on_one_line_and_says_the_default(capsys, monkeypatch):
    text = help_text(capsys, monkeypatch, "--help")
    assert not markup(text), markup(text)
    assert text.startswith("usage: jaxprep [-h] [COMMAND] [options]\n")
    assert 'With no command, jaxprep runs simulate: "jaxprep --check" is\n"jaxprep simulate --check".' in text
    section = text.split("commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[0] for line in section] == list(cli.COMMANDS)  # one line each, in order
    for line, (name, path) in zip(section, cli.COMMANDS.items()):
        summary = __import__(path, fromlist=["SUMMARY"]).SUMMARY
        assert line.split(None, 1)[1] == summary + (" (default)" if name == cli.DEFAULT_COMMAND else "")
        assert len(line) < WIDTH
    assert all(len(line) < WIDTH for line in text.splitlines())


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_each_command_help_is_plain_text_with_its_description(capsys, monkeypatch, command):
    text = help_text(capsys, monkeypatch, command, "--help")
    assert not markup(text), markup(text)
    assert text.startswith(f"usage: jaxprep {command} [-h]")
    module = __import__(cli.COMMANDS[command], fromlist=["DESCRIPTION"])
    assert module.DESCRIPTION in text and "options:\n  -h, --help" in text
    assert all(len(line) < WIDTH for line in module.DESCRIPTION.splitlines() if not line.startswith("  jaxprep "))
    if command == cli.DEFAULT_COMMAND:
        assert "simulate is the default command" in text


def test_the_markup_check_catches_the_docstrings_style():
    """Negative control: the text the help used to show (the package docstring's first line) and a
    subcommand's docstring, both written for the API reference, are caught."""
    assert markup(cli.__doc__.splitlines()[0]) == ["`", "`", "`", "`"]  # The ``jaxprep`` console script
    assert markup(__import__("jaxprep.cli.generate", fromlist=["x"]).__doc__)
    assert markup("a literal block follows::\n\n    code") == ["::"]
    assert not markup('With no command, jaxprep runs simulate: "jaxprep --check".')


def test_an_unknown_command_is_one_line_naming_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["simulat", "--check"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("jaxprep: error: simulat: not a command (one of simulate, generate, demo, walkthrough; "
                       "with no command, jaxprep runs simulate)")


def test_version_prints_the_package_and_vllm_versions(capsys):
    """``jaxprep --version``: one line, exit 0, the version pyproject.toml reads from ``jaxprep.__version__``."""
    import jaxprep

    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"jaxprep {jaxprep.__version__} (values of vLLM 0.33.0)\n"
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as file:
        assert 'version = { attr = "jaxprep.__version__" }' in file.read()
