"""Argument checks shared by the subcommands: every bad flag ends in one line and exit status 2.

A flag's own bound is checked by its ``type=`` (`int_in`); a bound that involves two flags is
checked after parsing by the subcommand's ``check_arguments(args)``, which raises `UsageError`.
Either way the parser prints one line, names the flag, the value and the bound, and exits 2
before anything is compiled:

    jaxprep simulate: error: --requests 0: must be >= 1
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re

from jaxprep._constants import INT32_MAX  # sizes end up in int32 device arrays

PLOT_SUFFIXES = (".png", ".svg", ".pdf")


class UsageError(ValueError):
    """A flag value, or a combination of flags, that cannot work; the message names the flag."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with one-line errors: ``prog: error: --flag value: bound`` and exit status 2."""

    def error(self, message: str):
        # argparse writes "argument --flag: <what the type said>"; the type already quotes the value
        message = re.sub(r"^argument ([^:]+): ", r"\1 ", message)
        # "--progress invalid choice: 'x' (choose from 'a', 'b')" -> "--progress x: must be one of a, b"
        message = re.sub(r"^(\S+) invalid choice: '(.*)' \(choose from (.*)\)$",
                         lambda m: f"{m[1]} {m[2]}: must be one of {m[3].replace(chr(39), '')}", message)
        # "the following arguments are required: --model" -> "--model: required"
        message = re.sub(r"^the following arguments are required: (.*)$", r"\1: required", message)
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_in(minimum: int, maximum: int = INT32_MAX, why: str = ""):
    """An argparse ``type=``: an integer in [minimum, maximum]; ``why`` explains the lower bound."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text}: must be an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be >= {minimum}{f' ({why})' if why else ''}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{value}: must be <= {maximum}")
        return value

    parse.__name__ = f"int_in_{minimum}_{maximum}"
    return parse


def flag(name: str) -> str:
    """``max_model_len`` -> ``--max-model-len``."""
    return "--" + name.replace("_", "-")


def require(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)


def check_plot_path(option: str, path: str) -> None:
    """A figure file the command can write: a known suffix, an existing folder, matplotlib present."""
    suffix = os.path.splitext(path)[1].lower()
    require(suffix in PLOT_SUFFIXES, f"{option} {path}: must end in {', '.join(PLOT_SUFFIXES)}")
    folder = os.path.dirname(os.path.abspath(path))
    require(os.path.isdir(folder), f"{option} {path}: folder {folder} does not exist")
    require(not os.path.isdir(path), f"{option} {path}: is a folder, not a file")
    check_matplotlib(option, path)


def check_folder(option: str, path: str) -> None:
    """A folder the command can write into: created if missing, refused if it is a file."""
    require(not os.path.exists(path) or os.path.isdir(path), f"{option} {path}: exists and is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise UsageError(f"{option} {path}: cannot create it ({error.strerror})") from None
    require(os.access(path, os.W_OK), f"{option} {path}: is not writable")


def check_matplotlib(option: str, value: str) -> None:
    require(importlib.util.find_spec("matplotlib") is not None,
            f"{option} {value}: drawing needs matplotlib: pip install 'jaxprep[notebooks]'")
