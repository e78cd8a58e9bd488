"""Walk requests through chunked prefill step by step and print every table of every step.

The default is SPEC §4's example A (block size 2, max_model_len 12, budget 10, prompts of 3, 2 and
8 tokens) run until every request has finished; the options change the requests and the limits.
Each step shows the requests, the token table, the block table, the KV-cache slots in use and
every output, and checks the outputs against the NumPy reference (exit 1 if any differ).
"""

from __future__ import annotations

import argparse
import sys

DEFAULT_MAX_TOKENS = 4
"""Output tokens per request when the prompts are given and the output lengths are not."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxprep.walkthrough import WalkthroughOptions

    default = WalkthroughOptions()
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=list(default.prompt_lens), metavar="N",
                        help=f"prompt tokens of each request (default {' '.join(map(str, default.prompt_lens))})")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=None, metavar="N",
                        help="output tokens each request may sample; one value applies to all (default "
                             f"{' '.join(map(str, default.max_tokens))} for the default prompts, "
                             f"else {DEFAULT_MAX_TOKENS})")
    for name, help_text in (("block_size", "KV-cache block size"), ("max_model_len", "longest sequence"),
                            ("budget", "token budget per step (max_num_batched_tokens)")):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(default, name),
                            help=f"{help_text} (default {getattr(default, name)})")
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: until "
                                                                 "every request has finished)")
    parser.add_argument("--max-columns", type=int, default=24,
                        help="widest token and block tables before the middle is cut (default 24)")


def run(args: argparse.Namespace) -> int:
    from jaxprep.walkthrough import WalkthroughOptions, format_step, walk

    default = WalkthroughOptions()
    max_tokens = args.max_tokens
    if max_tokens is None:
        max_tokens = default.max_tokens if tuple(args.prompt_lens) == default.prompt_lens else [DEFAULT_MAX_TOKENS]
    try:
        options = WalkthroughOptions(prompt_lens=args.prompt_lens, max_tokens=max_tokens,
                                     block_size=args.block_size, max_model_len=args.max_model_len, budget=args.budget)
        options.prep_config()
    except ValueError as error:
        print(f"jaxprep walkthrough: {error}", file=sys.stderr)
        return 2
    print(f"jaxprep walkthrough: prompts {list(options.prompt_lens)}, max_tokens {list(options.max_tokens)}, "
          f"block_size {options.block_size}, max_model_len {options.max_model_len}, budget {options.budget}, "
          f"{options.num_blocks} KV blocks (block 0 null)")
    print(f"token ids: request i's token at position p is (i + 1) * {options.token_base} + p + 1 (a stand-in model)\n")
    all_match, records = True, 0
    for record in walk(options, args.steps):
        print(format_step(record, max_columns=args.max_columns) + "\n")
        all_match &= record.matches_reference
        records += 1
    print(f"{records} steps; outputs {'match' if all_match else 'DIFFER FROM'} the NumPy reference in every step")
    return 0 if all_match else 1
