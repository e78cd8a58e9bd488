"""Generate greedily from a local Hugging Face checkpoint: all prompts served together by the serving loop.

```bash
jaxprep generate --model DIR --prompt-ids "1 2 3" --prompt-ids "4 5" --max-tokens 8 --json
```

DIR holds config.json and *.safetensors (a Llama, Qwen2 or Qwen3 model). With a tokenizer.json in DIR
and the ``tokenizers`` package, ``--prompt "text"`` is accepted too and outputs are decoded. The
prompts go through the same scheduler and jitted serving step as ``jaxprep simulate`` (chunked
prefill, preemption, mixed batches) and are printed in the order given. Its step is compiled for the token
buckets its decodes use and for the budget (`generate_buckets`): a prompt's last, shorter chunk pads to the
budget instead of compiling a rung of its own.

Progress on stderr (``--progress``: bars on a terminal, a line per phase and per quarter of it
otherwise) follows the loading, the compiles, the prefill and the decode. The run ends with the
warm-up (every executable compiled, or loaded from JAX's persistent compilation cache, before the
first step: `jaxprep.cli._cache`), apart from the prefill and decode tokens/s, which exclude it
(`jaxprep.cli._phases`). ``--dtype bfloat16`` serves in bf16; ``--threads`` sets XLA's CPU threads
(default: one per core).
"""

from __future__ import annotations

import argparse
import json
import os

from jaxprep.cli._args import INT32_MAX, UsageError, int_in, require
from jaxprep.cli._cache import add_cache_arguments, check_cache_arguments
from jaxprep.cli._checkpoint import add_checkpoint_arguments, check_model_folder, load_checkpoint
from jaxprep.cli._dispatch import add_update_dispatch_argument, chosen, separate_updates
from jaxprep.cli._phases import PhaseClock, rates_line
from jaxprep.cli._progress import add_progress_argument, progress_bar, report_file, warm_up
from jaxprep.cli._sampling import add_sampling_arguments, sampling_params, with_sampling
from jaxprep.config import cdiv, default_token_buckets

SUMMARY = "generate from a local Hugging Face checkpoint"
DESCRIPTION = """\
Generate from a local Hugging Face checkpoint: a Llama, Qwen2 or Qwen3 model,
config.json and *.safetensors in DIR. All prompts are served together by the
scheduler and jitted serving step of simulate, and printed in the order given;
greedy unless a sampling flag (--temperature, --top-k, ...) says otherwise.
--prompt TEXT needs DIR/tokenizer.json and the tokenizers package.

example:
  jaxprep generate --model DIR --prompt-ids "1 2 3" --prompt-ids "4 5" --max-tokens 8"""
"""``jaxprep generate --help``: plain text for users (`jaxprep.cli.parse_args`)."""


def _token_ids(text: str) -> list[int]:
    """'1 2 3' (or '1,2,3') -> [1, 2, 3]; an id past int32 is told the bound (the model's vocabulary is
    checked once the checkpoint is read)."""
    parts = text.replace(",", " ").split()
    if not parts or not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: must be token ids >= 0 separated by spaces")
    too_big = next((part for part in parts if int(part) > INT32_MAX), None)
    if too_big is not None:
        raise argparse.ArgumentTypeError(f"{text!r}: token id {too_big} must be <= {INT32_MAX} (token ids are int32)")
    return [int(part) for part in parts]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    positive = int_in(1)
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="Hugging Face checkpoint directory: config.json + *.safetensors")
    parser.add_argument("--prompt-ids", dest="prompts", action="append", type=_token_ids, default=[],
                        metavar='"ID ID ..."', help="a prompt as token ids; repeat for more prompts")
    parser.add_argument("--prompt", dest="prompts", action="append", type=str, metavar="TEXT",
                        help="a prompt as text (needs DIR/tokenizer.json and the tokenizers package); repeatable")
    parser.add_argument("--max-tokens", type=positive, default=16, metavar="N",
                        help="tokens to generate per prompt (default 16)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS tokens")
    parser.add_argument("--budget", type=positive, default=256, metavar="N",
                        help="token budget per step (max_num_batched_tokens; default 256)")
    parser.add_argument("--block-size", type=positive, default=16, metavar="N",
                        help="KV-cache block size (default 16)")
    parser.add_argument("--max-num-reqs", type=positive, default=None, metavar="N",
                        help="rows of the batch (default: the number of prompts)")
    parser.add_argument("--num-blocks", type=int_in(2, why="block 0 is the null block"), default=None, metavar="N",
                        help="KV-cache blocks, the null block included (default: every prompt at once)")
    parser.add_argument("--max-model-len", type=int_in(2, why="one prompt token and one output token"), default=None,
                        metavar="N",
                        help="longest sequence (default: longest prompt + max tokens, rounded up to a block)")
    parser.add_argument("--decode-steps", type=positive, default=8, metavar="N",
                        help="decode steps per multi-step dispatch (default 8)")
    add_sampling_arguments(parser)
    add_checkpoint_arguments(parser)
    add_progress_argument(parser)
    add_cache_arguments(parser)
    add_update_dispatch_argument(parser)
    parser.add_argument("--json", action="store_true",
                        help='print {"outputs": [[ids...], ...], "rates": {...}, "warmup": {...}, "compiles": {...}} '
                             "as one JSON object, the only output on stdout (the text goes to stderr)")
    parser.set_defaults(error=parser.error)


def check_arguments(args: argparse.Namespace) -> None:
    """Everything that can be refused before the first progress line: the flags, the checkpoint folder
    (configs, file headers, tensor shapes; no weight read), the prompts against its vocabulary and the
    sizes. Sets ``args.tokenizer``, ``args.decoder`` (the checkpoint's config), ``args.prompt_token_ids``
    and ``args.serving`` (the `ServingConfig`)."""
    require(os.path.isdir(args.model), f"--model {args.model}: is not a folder")
    require(bool(args.prompts), "--prompt-ids: give at least one prompt (--prompt-ids or --prompt)")
    if args.num_blocks is not None:
        require(args.num_blocks * args.block_size <= INT32_MAX, f"--num-blocks {args.num_blocks}: times "
                f"--block-size {args.block_size} must be <= {INT32_MAX} (slot ids are int32)")
    sampling_params(args, len(args.prompts) - 1)  # a bad value ends here, naming its flag (the last seed too)
    check_cache_arguments(args)
    args.tokenizer = _tokenizer(args)
    args.decoder = check_model_folder(args)  # the flags first: the checkpoint is read only once they pass
    prompts = [args.tokenizer.encode(p).ids if isinstance(p, str) else p for p in args.prompts]
    _check_token_ids(args, prompts, args.decoder.vocab_size)
    eos_ids = () if args.ignore_eos else args.decoder.eos_token_ids
    config = serving_config(args, prompts, eos_ids[0] if eos_ids else -1)
    _check_fit(args, prompts, config)
    if sampling_params(args) is not None:
        config = with_sampling(config, args.decoder.vocab_size)
    args.prompt_token_ids, args.eos_ids, args.serving = prompts, eos_ids, config


def run(args: argparse.Namespace) -> int:
    from jaxprep.compilation import count_compiles

    prompts = args.prompt_token_ids
    with count_compiles() as compiles:  # the whole run: loading, warm-up, serving
        model, params = load_checkpoint(args)
        sampling = [sampling_params(args, i) for i in range(len(prompts))]
        outputs, stats, rates, warmup = generate(model, params, prompts, args.serving, args.max_tokens, args.eos_ids,
                                                 sampling, progress=args.progress, cache_dir=args.compile_cache_dir,
                                                 separate_updates=separate_updates(args))
    warmup["compile_cache"] = args.compile_cache_dir
    _print(args, model, prompts, outputs, stats, args.tokenizer, rates,
           dict(warmup=warmup, compiles={"total": compiles.compiles, "cache_hits": compiles.cache_hits}))
    return 0


def generate(model, params, prompts: list[list[int]], config, max_tokens: int, eos_ids: tuple[int, ...],
             sampling=None, progress: str = "never", cache_dir: str | None = None, separate_updates: bool = False
             ) -> tuple[list[list[int]], object, dict, dict]:
    """Serves ``prompts`` together; returns each one's generated ids (in prompt order, cut after the
    first of ``eos_ids``), the loop stats, the prefill and decode rates (`PhaseClock.rates`,
    compiles excluded: every executable is compiled first) and that warm-up: ``warmup_s``,
    ``warmup_compiles`` (executables) and ``warmup_cache_hits`` (of them, loaded from the persistent
    compilation cache). ``sampling``: each prompt's `SamplingParams` (None: greedy). ``progress``: a
    ``--progress`` value; ``cache_dir``: the compilation cache in force (named in the warm-up's line);
    ``separate_updates``: the `Engine`'s option (--update-dispatch)."""
    from jaxprep.compilation import count_compiles
    from jaxprep.serving import Engine, Request

    engine = Engine(config, model, params=params, keep_history=True, separate_updates=separate_updates)
    with count_compiles() as compiles:
        warmup_s = warm_up(engine, progress, "compiling", "executable", cache_dir)
    warmup = dict(warmup_s=round(warmup_s, 3), warmup_compiles=compiles.compiles, warmup_cache_hits=compiles.cache_hits,
                  update_dispatch=chosen(engine))
    sampling = sampling or [None] * len(prompts)
    engine.submit([Request(request_id=i, prompt_token_ids=list(p), max_tokens=max_tokens, sampling_params=s)
                   for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))])
    with progress_bar(progress, "prefill", "token", total=sum(map(len, prompts)), position=0) as prefill, \
            progress_bar(progress, "decode", "token", total=max_tokens * len(prompts), position=1) as decode:
        def show(engine) -> None:
            record = engine.stats.dispatches_log[-1]
            prefill.update(min(record.prefill_tokens, prefill.total - prefill.n))
            decode.update(engine.stats.output_tokens - decode.n)

        clock = PhaseClock(then=show)
        finished = sorted(engine.run(on_step=clock), key=lambda request: request.request_id)
    outputs = [_stop_at_eos(request.output_token_ids, eos_ids) for request in finished]
    return outputs, engine.stats, clock.rates(engine.stats), warmup


def serving_config(args, prompts: list[list[int]], eos_token_id: int):
    """Sizes from the flags; unset ones fit every prompt at once (no preemption)."""
    from jaxprep.config import PrepConfig
    from jaxprep.serving import ServingConfig

    block, rows = args.block_size, args.max_num_reqs or len(prompts)
    lengths = [min(len(p) + args.max_tokens, args.max_model_len or len(p) + args.max_tokens) for p in prompts]
    try:
        prep = PrepConfig(max_num_reqs=rows, max_model_len=args.max_model_len or cdiv(max(lengths), block) * block,
                          max_num_batched_tokens=args.budget, block_size=block,
                          token_buckets=generate_buckets(rows, args.budget),
                          num_blocks=args.num_blocks or 1 + sum(cdiv(length, block) for length in lengths))
        return ServingConfig(prep=prep, eos_token_id=eos_token_id, decode_steps=args.decode_steps)
    except ValueError as error:  # the message names the field and its bound
        raise UsageError(str(error)) from None


def generate_buckets(max_num_reqs: int, budget: int) -> tuple[int, ...]:
    """The token ladder of a generate run: the default rungs a decode step can use (up to the first that holds
    a token for every row) and the budget. Every rung is an executable compiled before the first step, and a
    run of known prompts is mostly full prefill chunks and decodes: a shorter chunk (a prompt's last) pads to
    the budget instead, one padded step per prompt at most, where each rung left out saves a compile
    (BENCHMARKS.md, "Compile time").

    ```
    # 1 prompt, budget 256 -> (8, 256); 16 prompts -> (8, 16, 256); 300 prompts -> the whole default ladder
    ```
    """
    ladder = default_token_buckets(budget)
    decodes = next(b for b in ladder if b >= min(max_num_reqs, budget))
    return tuple(b for b in ladder if b <= decodes) + ((budget,) if decodes < budget else ())


def _stop_at_eos(tokens: list[int], eos_ids: tuple[int, ...]) -> list[int]:
    """The tokens up to and including the first EOS: the loop stops only at the first EOS id, so a
    model with several (Llama 3 instruct) may decode past another one.

    ```
    # eos (2, 7), [5, 7, 9, 2] -> [5, 7]
    ```
    """
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


def _check_token_ids(args, prompts: list[list[int]], vocab_size: int) -> None:
    for i, prompt in enumerate(prompts):
        require(bool(prompt), f"--prompt {args.prompts[i]!r}: encodes to no tokens")
        require(max(prompt) < vocab_size, f"--prompt-ids {' '.join(map(str, prompt))}: token id {max(prompt)} is "
                f"outside the model's vocabulary [0, vocab_size={vocab_size})")


def _check_fit(args, prompts: list[list[int]], config) -> None:
    """Every prompt is shorter than max_model_len, and the cache holds its longest sequence
    (the scheduler's admission bounds, as flag errors)."""
    prep = config.prep
    for i, prompt in enumerate(prompts):
        require(len(prompt) < prep.max_model_len, f"--max-model-len {prep.max_model_len}: must exceed every "
                f"prompt's length (prompt {i} has {len(prompt)} tokens)")
        needed = cdiv(min(len(prompt) + args.max_tokens, prep.max_model_len), prep.block_size)
        require(needed <= prep.num_blocks - 1, f"--num-blocks {prep.num_blocks}: must be >= {needed + 1}: blocks of "
                f"{prep.block_size} (one is the null block) for prompt {i}: {len(prompt)} tokens + up to "
                f"{args.max_tokens} generated need {needed}")


def _tokenizer(args):
    """The tokenizer of DIR if it has one and ``tokenizers`` is installed; an error if a text prompt needs it."""
    path = os.path.join(args.model, "tokenizer.json")
    text = next((p for p in args.prompts if isinstance(p, str)), None)
    try:
        import tokenizers
    except ImportError:
        require(text is None, f"--prompt {text!r}: needs the tokenizers package (pip install 'jaxprep[models]')")
        return None
    if not os.path.exists(path):
        require(text is None, f"--prompt {text!r}: needs a tokenizer, and {path} does not exist (use --prompt-ids)")
        return None
    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as error:  # the tokenizers package raises a bare Exception on a file it cannot parse
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UsageError(f"--model {args.model}: tokenizer.json cannot be read by the tokenizers package ({first}); "
                         "fix or remove it (--prompt-ids needs none)") from None


def _print(args, model, prompts, outputs, stats, tokenizer, rates: dict, compiling: dict) -> None:
    out = report_file(args.json)  # stderr under --json: stdout then holds the JSON object alone
    print(f"== jaxprep generate: {model.model_type} ({model.num_layers} layers, vocab {model.vocab_size}, "
          f"{model.dtype}) from {args.model}: {len(prompts)} prompts served together in {stats.dispatches} "
          f"dispatches, {stats.preemptions} preemptions", file=out)
    texts = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        print(f"[{i}] prompt ({len(prompt)} ids): {' '.join(map(str, prompt))}", file=out)
        print(f"    output ({len(output)} ids): {' '.join(map(str, output))}", file=out)
        if tokenizer is not None:
            texts.append(tokenizer.decode(output, skip_special_tokens=True))
            print(f"    text: {texts[-1]!r}", file=out)
    print(f"== {warmup_line(**compiling)}", file=out)
    print(f"== {rates_line(rates)}", file=out)
    if args.json:
        print(json.dumps({"outputs": outputs, **({"texts": texts} if tokenizer is not None else {}), "rates": rates,
                          **compiling}))


def warmup_line(warmup: dict, compiles: dict) -> str:
    """``warm-up 11.8 s: 9 executables, 0 of them from the compilation cache in DIR; the run compiled 31
    (0 from the cache)``: the warm-up apart from the rates, and every compile of the run (loading included)."""
    cache = f"the compilation cache in {warmup['compile_cache']}" if warmup["compile_cache"] else "no compilation cache"
    return (f"warm-up {warmup['warmup_s']} s: {warmup['warmup_compiles']} executables, "
            f"{warmup['warmup_cache_hits']} of them from {cache}; the run compiled {compiles['total']} "
            f"({compiles['cache_hits']} from the cache)")
