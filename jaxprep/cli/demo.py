"""Prepare SPEC §4's example A (steps 1 and 2) and print every output."""

from __future__ import annotations

import argparse

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true", help="validate each state before preparing it")


def run(args: argparse.Namespace) -> int:
    from jaxprep import BatchState, prepare_inputs
    from jaxprep.walkthrough.examples import example_a_config, example_a_step1, example_a_step2

    config = example_a_config()
    print(f"config: {config}")
    for name, arrays in (("step 1", example_a_step1()), ("step 2", example_a_step2())):
        state = BatchState.from_numpy(**arrays)
        step = prepare_inputs(state, config, check=args.check)
        meta = step.attn_metadata
        print(f"\n== example A, {name}: num_scheduled_tokens={arrays['num_scheduled_tokens'].tolist()} "
              f"num_computed_tokens={arrays['num_computed_tokens'].tolist()} -> bucket {step.num_tokens_padded}")
        rows = {
            "input_ids": step.input_ids, "positions": step.positions, "slot_mapping": meta.slot_mapping,
            "query_start_loc": meta.query_start_loc, "seq_lens": meta.seq_lens,
            "logits_indices": step.logits_indices, "idx_mapping": step.idx_mapping,
        }
        for field, value in rows.items():
            print(f"  {field:16s} {np.asarray(value).tolist()}")
        print(f"  {'block_table':16s} {np.asarray(meta.block_table)[:, :4].tolist()} (first 4 columns)")
        print(f"  num_actual_tokens={int(meta.num_actual_tokens)} num_reqs={int(meta.num_reqs)} "
              f"max_query_len={int(meta.max_query_len)} max_seq_len={int(meta.max_seq_len)}")
    return 0
