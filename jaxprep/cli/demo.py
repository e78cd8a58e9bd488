"""Prepare example A (docs/semantics.md#example-a-step-1; steps 1 and 2) and print every output."""

from __future__ import annotations

import argparse

import numpy as np

from jaxprep.cli._cache import add_cache_arguments, check_cache_arguments

SUMMARY = "prepare one worked example and print every output"
DESCRIPTION = """\
Prepare example A of the documentation (three requests in two steps of chunked
prefill: block size 2, max_model_len 12, budget 10, prompts of 3, 2 and 8
tokens) with jaxprep.prepare_inputs, and print every output of each step."""
"""``jaxprep demo --help``: plain text for users (`jaxprep.cli.parse_args`)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true", help="validate each state before preparing it")
    add_cache_arguments(parser)


def check_arguments(args: argparse.Namespace) -> None:
    check_cache_arguments(args)


def run(args: argparse.Namespace) -> int:
    from jaxprep import BatchState, prepare_inputs
    from jaxprep.metadata import SCALAR_FIELDS, step_fields
    from jaxprep.walkthrough.examples import example_a_config, example_a_step1, example_a_step2

    config = example_a_config()
    print(f"config: {config}")
    for name, arrays in (("step 1", example_a_step1()), ("step 2", example_a_step2())):
        state = BatchState.from_numpy(**arrays)
        step = prepare_inputs(state, config, check=args.check)
        print(f"\n== example A, {name}: num_scheduled_tokens={arrays['num_scheduled_tokens'].tolist()} "
              f"num_computed_tokens={arrays['num_computed_tokens'].tolist()} -> bucket {step.num_tokens_padded}")
        fields = {field: np.asarray(value) for field, value in step_fields(step).items()}
        for field, value in fields.items():
            if field == "block_table":
                print(f"  {field:16s} {value[:, :4].tolist()} (first 4 columns)")
            elif field not in SCALAR_FIELDS:
                print(f"  {field:16s} {value.tolist()}")
        print("  " + " ".join(f"{field}={int(fields[field])}" for field in SCALAR_FIELDS))
    return 0
