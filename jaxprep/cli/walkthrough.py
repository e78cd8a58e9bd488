"""Walk requests through chunked prefill step by step and print every table of every step.

The default is example A (docs/semantics.md#example-a-step-1; block size 2, max_model_len 12, budget 10,
prompts of 3, 2 and 8 tokens) run until every request has finished; the options change the requests and the limits.
Each step shows the requests, the token table, the block table, the KV-cache slots in use and
every output, and checks the outputs against the NumPy reference (exit 1 if any differ).
"""

from __future__ import annotations

import argparse
import os

from jaxprep.cli._args import check_folder, check_matplotlib, flag, int_in, require
from jaxprep.cli._cache import add_cache_arguments, check_cache_arguments

SUMMARY = "walk requests through chunked prefill, step by step"
DESCRIPTION = """\
Walk requests through chunked prefill step by step and print every table of
every step: the requests, the token table, the block table, the KV-cache slots
in use and every output, each step checked against the NumPy reference (exit 1
if any output differs). The default is example A of the documentation (block
size 2, max_model_len 12, budget 10, prompts of 3, 2 and 8 tokens), run until
every request has finished; the options change the requests and the limits."""
"""``jaxprep walkthrough --help``: plain text for users (`jaxprep.cli.parse_args`)."""
DEFAULT_MAX_TOKENS = 4
"""Output tokens per request when the prompts are given and the output lengths are not."""
MIN_COLUMNS = 4
MAX_SIZE = 1 << 20
"""Largest --block-size, --max-model-len and --budget: the walkthrough prints every position."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxprep.walkthrough import WalkthroughOptions

    default = WalkthroughOptions()
    parser.add_argument("--prompt-lens", type=int_in(1), nargs="+", default=list(default.prompt_lens), metavar="N",
                        help=f"prompt tokens of each request (default {' '.join(map(str, default.prompt_lens))})")
    parser.add_argument("--max-tokens", type=int_in(1), nargs="+", default=None, metavar="N",
                        help="output tokens each request may sample; one value applies to all (default "
                             f"{' '.join(map(str, default.max_tokens))} for the default prompts, "
                             f"else {DEFAULT_MAX_TOKENS})")
    for name, minimum, help_text in (("block_size", 1, "KV-cache block size"),
                                     ("max_model_len", 2, "longest sequence"),
                                     ("budget", 1, "token budget per step (max_num_batched_tokens)")):
        parser.add_argument(flag(name), type=int_in(minimum, MAX_SIZE), default=getattr(default, name),
                            metavar="N",
                            help=f"{help_text} (default {getattr(default, name)})")
    parser.add_argument("--steps", type=int_in(1), default=None, metavar="N",
                        help="stop after this many steps (default: until every request has finished)")
    parser.add_argument("--max-columns", type=int_in(MIN_COLUMNS, why="the first and the last columns"), default=24,
                        metavar="N",
                        help="widest token and block tables before the middle is cut (default 24)")
    parser.add_argument("--plot-dir", metavar="DIR", default=None,
                        help="also draw every step (token table, block table, KV cache, attention) as "
                             "DIR/step_1.png, DIR/step_2.png, ... (needs matplotlib)")
    add_cache_arguments(parser)


def check_arguments(args: argparse.Namespace) -> None:
    """Combinations of flags that cannot work; fills --max-tokens."""
    from jaxprep.walkthrough import WalkthroughOptions

    default, prompts = WalkthroughOptions(), args.prompt_lens
    if args.max_tokens is None:
        args.max_tokens = list(default.max_tokens) if tuple(prompts) == default.prompt_lens else [DEFAULT_MAX_TOKENS]
    require(len(args.max_tokens) in (1, len(prompts)), f"--max-tokens {' '.join(map(str, args.max_tokens))}: "
            f"give one value or one per prompt ({len(prompts)})")
    for length in prompts:
        require(length < args.max_model_len, f"--prompt-lens {length}: must be < --max-model-len "
                f"{args.max_model_len} (a request needs room for one output token)")
    if args.plot_dir:
        check_folder("--plot-dir", args.plot_dir)
        check_matplotlib("--plot-dir", args.plot_dir)
    check_cache_arguments(args)


def run(args: argparse.Namespace) -> int:
    from jaxprep.walkthrough import WalkthroughOptions, format_step, walk

    options = WalkthroughOptions(prompt_lens=args.prompt_lens, max_tokens=args.max_tokens,
                                 block_size=args.block_size, max_model_len=args.max_model_len, budget=args.budget)
    print(f"jaxprep walkthrough: prompts {list(options.prompt_lens)}, max_tokens {list(options.max_tokens)}, "
          f"block_size {options.block_size}, max_model_len {options.max_model_len}, budget {options.budget}, "
          f"{options.num_blocks} KV blocks (block 0 null)")
    print(f"token ids: request i's token at position p is (i + 1) * {options.token_base} + p + 1 (a stand-in model)\n")
    all_match, records = True, 0
    for record in walk(options, args.steps):
        print(format_step(record, max_columns=args.max_columns) + "\n")
        if args.plot_dir:
            _save_figure(record, args.plot_dir)
        all_match &= record.matches_reference
        records += 1
    print(f"{records} steps; outputs {'match' if all_match else 'DIFFER FROM'} the NumPy reference in every step")
    if args.plot_dir:
        print(f"figures: {os.path.join(args.plot_dir, 'step_<n>.png')} for steps 1..{records}")
    return 0 if all_match else 1


def _save_figure(record, folder: str) -> None:
    from jaxprep.walkthrough import plotting

    plotting.plot_step(record).savefig(os.path.join(folder, f"step_{record.number}.png"), dpi=80)
