"""Run the device-resident serving loop on a built-in workload and print a summary.

The tiny random-weight model serves random prompts through the host scheduler and the jitted,
donated serving step; ``--check`` recomputes every request densely (no cache) and checks that the
loop's greedy tokens are the dense ones.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from jaxprep.cli._args import INT32_MAX, check_plot_path, flag, int_in, require
from jaxprep.cli._cache import add_cache_arguments, check_cache_arguments
from jaxprep.cli._checkpoint import add_checkpoint_arguments, check_model_folder, load_checkpoint
from jaxprep.cli._dispatch import add_update_dispatch_argument, chosen, separate_updates
from jaxprep.cli._phases import PhaseClock
from jaxprep.cli._progress import add_progress_argument, progress_bar, report_file, warm_up
from jaxprep.cli._sampling import add_sampling_arguments, sampling_params, with_sampling
from jaxprep.config import cdiv

SUMMARY = "serve a built-in workload and print what it measured"
DESCRIPTION = """\
Serve a built-in workload (by default 64 random prompts arriving over 30 steps)
with a tiny random-weight transformer through jaxprep's device-resident serving
loop, and print a summary: steps, tokens, rates (each beside the tokens and the
seconds it divides), latencies and compiles. --model DIR serves a Hugging Face
checkpoint instead. --check recomputes every request densely and exits 1 unless
the loop's greedy tokens are the dense ones and nothing compiled after warm-up.

simulate is the default command: "jaxprep --check" is the same as
"jaxprep simulate --check"."""
"""``jaxprep simulate --help``: plain text for users (`jaxprep.cli.parse_args`)."""
DEFAULTS = dict(requests=64, budget=64, block_size=16, max_num_reqs=16, max_model_len=256, num_blocks=64,
                layers=2, d_model=64, heads=4, vocab_size=512, decode_steps=8, max_prompt_len=96, max_tokens=64,
                arrival_spread=30, seed=0)
SPEC_DEFAULTS = dict(k=3, lookup=5)
"""--num-speculative-tokens, and vLLM's prompt_lookup_min = max when neither is given."""
MIN_PROMPT_LEN = 4
"""Prompts are MIN_PROMPT_LEN..--max-prompt-len tokens long (or all --max-prompt-len, if shorter)."""

# flag -> (lowest value, why that bound, help)
FLAGS = {
    "requests": (1, "", "number of requests"),
    "budget": (1, "", "token budget per step (max_num_batched_tokens)"),
    "block_size": (1, "", "KV-cache block size"),
    "max_num_reqs": (1, "", "rows of the batch (max_num_seqs)"),
    "max_model_len": (2, "one prompt token and one output token", "longest sequence"),
    "num_blocks": (2, "block 0 is the null block", "KV-cache blocks, the null block included"),
    "layers": (1, "", "model layers"),
    "d_model": (2, "RoPE rotates pairs", "model width"),
    "heads": (1, "", "attention heads"),
    "vocab_size": (3, "0 pads, 1 is EOS, prompts use 2 and up", "vocabulary size"),
    "decode_steps": (1, "", "decode steps per multi-step dispatch (K)"),
    "max_prompt_len": (1, "", f"longest prompt (prompts are {MIN_PROMPT_LEN}..this long; all this long if shorter)"),
    "max_tokens": (1, "", "largest max_tokens (requests ask for 1..this many)"),
    "arrival_spread": (0, "", "requests arrive over this many steps"),
    "seed": (0, "", "seed of the workload and the weights"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name, (minimum, why, help_text) in FLAGS.items():
        default = DEFAULTS[name]
        if name == "max_prompt_len":  # resolved in check_arguments, once --max-model-len is known
            help_text, default = f"{help_text} (default {default}, or --max-model-len - 1 if smaller)", None
        else:
            help_text = f"{help_text} (default {default})"
        parser.add_argument(flag(name), type=int_in(minimum, why=why), default=default, metavar="N", help=help_text)
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="serve a Hugging Face checkpoint (config.json + *.safetensors: Llama, Qwen2, Qwen3) "
                             "instead of the tiny random model; --layers, --d-model, --heads and --vocab-size are "
                             "then the checkpoint's")
    add_checkpoint_arguments(parser)
    parser.add_argument("--devices", type=int_in(1), default=1, metavar="N",
                        help="data-parallel ranks, one per device, each with the sizes above (its own rows, "
                             "blocks and token budget); on CPU the CLI forces this many host devices (default 1)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="schedule step N+1 while the device runs step N (tokens reach the host one step "
                             "late; single steps, one device) and report the share of host time that overlaps "
                             "device work")
    add_cache_arguments(parser)
    _add_spec_decode_arguments(parser)
    parser.add_argument("--check", action="store_true",
                        help="check the greedy tokens against a dense recomputation; exit 1 if they differ "
                             "or anything compiled after warm-up")
    parser.add_argument("--json", action="store_true",
                        help="print the summary as one JSON object, the only output on stdout (the text summary "
                             "goes to stderr)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="save a chart of every forward pass: tokens run vs the bucket (the padding), "
                             "prefill and decode tokens, and the prep time (needs matplotlib; implies "
                             "--time-prepare)")
    add_update_dispatch_argument(parser)
    parser.add_argument("--time-prepare", action="store_true",
                        help="also time the prepare part of each dispatch alone (prepare_us): replayed after "
                             "the loop, which compiles one more executable per token bucket the loop used "
                             "(with an empty compile cache, seconds each)")
    add_sampling_arguments(parser)
    add_progress_argument(parser)
    parser.set_defaults(error=parser.error)


def _add_spec_decode_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec-decode", choices=["ngram"], default=None,
                        help="speculative decoding: the n-gram (prompt-lookup) drafter proposes drafts on the "
                             "device, the step verifies them; the summary reports the acceptance rate")
    parser.add_argument("--num-speculative-tokens", type=int_in(1), default=None, metavar="K",
                        help=f"drafts per request and step with --spec-decode (default {SPEC_DEFAULTS['k']})")
    for bound in ("min", "max"):
        parser.add_argument(f"--prompt-lookup-{bound}", type=int_in(1), default=None, metavar="N",
                            help=f"{'shortest' if bound == 'min' else 'longest'} n-gram the drafter matches "
                                 f"(vLLM's rule: {SPEC_DEFAULTS['lookup']} when neither is given, else the other one)")
    parser.add_argument("--workload", choices=["random", "repetitive"], default="random",
                        help="random: uniform prompt tokens; repetitive: each prompt repeats a short random "
                             "phrase, which n-gram drafting can match (default random)")


def _check_spec_decode(args: argparse.Namespace) -> None:
    """--spec-decode's companions need it; the lookup sizes follow vLLM's defaults
    (`vllm/config/speculative.py::SpeculativeConfig.__post_init__`)."""
    for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        value = getattr(args, name)
        require(value is None or args.spec_decode, f"{flag(name)} {value}: needs --spec-decode ngram")
    if not args.spec_decode:
        return
    if args.num_speculative_tokens is None:
        args.num_speculative_tokens = SPEC_DEFAULTS["k"]
    low, high = args.prompt_lookup_min, args.prompt_lookup_max
    low = high if low is None else low
    high = low if high is None else high
    args.prompt_lookup_min = args.prompt_lookup_max = SPEC_DEFAULTS["lookup"]
    if low is not None:
        require(low <= high, f"--prompt-lookup-min {low}: must be <= --prompt-lookup-max {high}")
        args.prompt_lookup_min, args.prompt_lookup_max = low, high


def check_arguments(args: argparse.Namespace) -> None:
    """Combinations of flags that cannot work, before anything is compiled; fills --max-prompt-len."""
    _check_spec_decode(args)
    require(not (args.async_scheduling and args.spec_decode), "--async-scheduling: runs without speculative "
            f"decoding, not --spec-decode {args.spec_decode}")
    require(not (args.async_scheduling and args.devices > 1), f"--async-scheduling: runs on one device, "
            f"not --devices {args.devices}")
    require(not (args.update_dispatch == "separate" and args.devices > 1), "--update-dispatch separate: runs on "
            f"one device, not --devices {args.devices}")
    if args.max_prompt_len is None:
        args.max_prompt_len = min(DEFAULTS["max_prompt_len"], args.max_model_len - 1)
    require(args.max_prompt_len < args.max_model_len, f"--max-prompt-len {args.max_prompt_len}: must be < "
            f"--max-model-len {args.max_model_len} (a request needs room for one output token)")
    require(args.model is not None or args.dtype == "float32",
            f"--dtype {args.dtype}: needs --model (the tiny built-in model computes in float32)")
    if args.model is None:
        require(args.d_model % args.heads == 0 and args.d_model // args.heads % 2 == 0,
                f"--d-model {args.d_model}: must split into --heads {args.heads} heads of an even size "
                "(RoPE rotates pairs)")
    else:
        require(os.path.isdir(args.model), f"--model {args.model}: is not a folder")
    longest = min(args.max_prompt_len + args.max_tokens, args.max_model_len)
    needed = 1 + cdiv(longest, args.block_size)
    require(args.num_blocks >= needed, f"--num-blocks {args.num_blocks}: must be >= {needed} (the null block "
            f"and the longest request: {longest} tokens in blocks of --block-size {args.block_size})")
    require(args.num_blocks * args.block_size <= INT32_MAX, f"--num-blocks {args.num_blocks}: times --block-size "
            f"{args.block_size} must be <= {INT32_MAX} (slot ids are int32)")
    import jax

    if args.async_scheduling:  # before the CPU client starts: a dispatch returns before its step is done
        jax.config.update("jax_cpu_enable_async_dispatch", True)
    visible = jax.device_count()
    require(args.devices <= visible, f"--devices {args.devices}: must be <= {visible}, the "
            f"{jax.default_backend()} devices JAX sees")
    sampled = sampling_params(args, args.requests - 1) is not None  # the last request's seed fits too
    require(not (sampled and args.check), "--check: compares greedy tokens; drop it with --temperature and friends")
    check_cache_arguments(args)
    if args.plot:
        check_plot_path("--plot", args.plot)
    if args.model is not None:  # the flags first: a folder is read only once they pass
        check_model_folder(args)


def run(args: argparse.Namespace) -> int:
    from jaxprep.compilation import count_compiles
    from jaxprep.serving import check_against_dense
    from jaxprep.serving.host.prep_timing import time_prepare

    config, model, params, workload = _setup(args)
    engine = _engine(config, model, args, params)
    with count_compiles() as warmup_compiles:
        warmup_s = _warmup(engine, args)
    with count_compiles() as compiles:
        start = time.perf_counter()
        finished, clock = _serve(engine, workload, args.progress)
        wall_s = time.perf_counter() - start
    if engine.time_prep:  # after the loop, on a donated copy of the state: the loop never waits for it
        time_prepare(engine)
    warmup = dict(warmup_s=round(warmup_s, 3), warmup_compiles=warmup_compiles.compiles,
                  warmup_cache_hits=warmup_compiles.cache_hits, compile_cache=args.compile_cache_dir)
    summary = _summary(engine, workload, finished, wall_s, warmup, compiles, clock.phases(engine.stats))
    summary["devices"] = args.devices
    summary["update_dispatch"] = chosen(engine)
    summary.update(_spec_decode_summary(engine.stats, args))
    if args.async_scheduling:
        summary.update(async_overlap=round(engine.stats.overlap, 4),
                       host_us_per_dispatch=round(engine.stats.host_s / engine.stats.dispatches * 1e6, 1))
    summary["model"] = "tiny paged-KV model" if args.model is None else f"{model.model_type} from {args.model}"
    if args.check:
        requests = progress_bar(args.progress, "check: dense recompute", "req", iterable=finished)
        check = check_against_dense(engine.params, model, requests, config.max_model_len)
        summary.update(check_passed=check.passed and len(finished) == len(workload.requests),
                       check_tokens=check.num_tokens, check_mismatches=check.mismatches,
                       check_near_ties=check.near_ties)
    if args.plot:
        _plot(engine, args.plot, report_file(args.json))
    _print(summary, args.json)
    failed = args.check and (not summary["check_passed"] or summary["compiles_after_warmup"] > 0)
    return 1 if failed else 0


def _setup(args: argparse.Namespace):
    """(ServingConfig, model config, params or None, Workload) from checked arguments."""
    from jaxprep.config import PrepConfig
    from jaxprep.serving import ModelConfig, ServingConfig, random_workload

    prep = PrepConfig(max_num_reqs=args.max_num_reqs, max_model_len=args.max_model_len,
                      max_num_batched_tokens=args.budget, block_size=args.block_size, num_blocks=args.num_blocks)
    model, params, eos_token_id = _model(args, ModelConfig)
    config = ServingConfig(prep=prep, eos_token_id=eos_token_id, decode_steps=args.decode_steps,
                           **_spec_decode_config(args))
    workload = random_workload(args.seed, num_requests=args.requests, vocab_size=model.vocab_size,
                               prompt_len=(min(MIN_PROMPT_LEN, args.max_prompt_len), args.max_prompt_len),
                               max_tokens=(1, args.max_tokens), arrival_spread=args.arrival_spread,
                               repetitive=args.workload == "repetitive")
    if sampling_params(args) is not None:
        config = with_sampling(config, model.vocab_size)
        for i, request in enumerate(workload.requests):
            request.sampling_params = sampling_params(args, i)
    return config, model, params, workload


def _spec_decode_config(args) -> dict:
    """The `ServingConfig` fields of --spec-decode."""
    if not args.spec_decode:
        return {}
    from jaxprep.serving.spec_decode.ngram import NgramConfig

    return dict(num_speculative_tokens=args.num_speculative_tokens,
                ngram=NgramConfig(prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max))


def _model(args, tiny_config):
    """``(model config, params, eos_token_id)``: the checkpoint in ``--model`` (params loaded, its first
    EOS id), or the tiny model from the size flags (params None: the engine draws them from the seed)."""
    if args.model is None:
        model = tiny_config(vocab_size=args.vocab_size, num_layers=args.layers, d_model=args.d_model,
                            num_heads=args.heads, d_ff=2 * args.d_model)
        return model, None, 1
    model, params = load_checkpoint(args)
    return model, params, model.eos_token_ids[0] if model.eos_token_ids else -1


def _engine(config, model, args, params=None):
    """One `Engine`, or a `DataParallelEngine` over ``args.devices`` devices."""
    from jaxprep.serving import Engine

    if args.async_scheduling:
        from jaxprep.serving.host.overlap import AsyncEngine

        return AsyncEngine(config, model, seed=args.seed, params=params, keep_history=True,
                           separate_updates=separate_updates(args))
    if args.devices == 1:
        return Engine(config, model, seed=args.seed, time_prep=_times_prepare(args), params=params,
                      keep_history=True, separate_updates=separate_updates(args))
    from jaxprep.serving.host.dp_engine import DataParallelEngine
    from jaxprep.sharding import data_mesh

    return DataParallelEngine(config, model, data_mesh(args.devices), seed=args.seed, time_prep=_times_prepare(args),
                              params=params, keep_history=True)


def _times_prepare(args) -> bool:
    """Whether the loop keeps each dispatch's updates for `time_prepare` (--time-prepare, or --plot's chart)."""
    return args.time_prepare or args.plot is not None


def _warmup(engine, args) -> float:
    buckets = len(engine.config.prep.token_buckets)
    return warm_up(engine, args.progress, f"warm-up: {buckets} buckets", "compile", args.compile_cache_dir)


def _serve(engine, workload, when: str):
    engine.submit(workload.requests, workload.arrival_steps)
    with progress_bar(when, "serving", "req", total=len(workload.requests)) as bar:
        def on_step(engine) -> None:
            bar.set_postfix(steps=engine.stats.model_steps, refresh=False)
            bar.update(len(engine.finished) - bar.n)

        clock = PhaseClock(then=on_step)  # prefill and decode tokens/s (`jaxprep.cli._phases`)
        return engine.run(on_step=clock), clock


def _plot(engine, path: str, out) -> None:
    from jaxprep.cli.chart import plot_dispatches

    plot_dispatches(engine.stats).savefig(path, dpi=80)
    print(f"jaxprep simulate: wrote {path}", file=out)


FIGURES = {
    "step_us": "one host iteration of the loop as it runs: schedule, pack the updates, dispatch the fused step, "
               "read its tokens back, update the scheduler",
    "dispatch_us": "of step_us, the fused step's call until its tokens are host arrays (on CPU, with synchronous "
                   "dispatch, the device's work: prepare, model forward, sampling)",
    "prepare_us": "the prepare part alone (unpack + apply the updates + prepare_padded), replayed after the loop "
                  "with the state donated (updated in place, no table copied), to block_until_ready; per "
                  "dispatch the best of several replays (with --time-prepare or --plot; None without)",
    "tokens_per_s": "scheduled_tokens over the loop's wall_s (prefill_tokens: tokens of requests running > 1 "
                    "token in a pass; decode_tokens: 1-token runs, in any dispatch); output_tokens_per_s: "
                    "output_tokens over wall_s",
    "prefill_tokens_per_s": "prefill_tokens over prefill_s, the seconds of the prefill_dispatches (those that "
                            "run prompt tokens; the decodes riding in them count to neither phase rate)",
    "decode_tokens_per_s": "decode_dispatch_tokens, the tokens of the decode_dispatches (those with no prompt "
                           "token: each token a generated one), over their seconds, decode_s",
    "warmup_s": "compiling every executable the loop uses before the first step (warmup_compiles of them; "
                "warmup_cache_hits came from the persistent compilation cache)",
}
"""What each timing figure of the summary includes, printed under it (and as ``figures`` in --json)."""
RATES = {
    "tokens_per_s": ("scheduled_tokens", "wall_s"),
    "output_tokens_per_s": ("output_tokens", "wall_s"),
    "prefill_tokens_per_s": ("prefill_tokens", "prefill_s"),
    "decode_tokens_per_s": ("decode_dispatch_tokens", "decode_s"),
}
"""Each rate of the summary: (its tokens, its seconds), both figures of the summary; the CLI prints them
beside the rate (and --json carries this as ``rates``)."""


def _summary(engine, workload, finished, wall_s: float, warmup: dict, compiles, phases: dict | None) -> dict:
    """The summary, in print order. Every rate is two of its figures divided (`RATES`), as printed: the
    seconds to the microsecond, so that the division gives the printed rate."""
    stats = engine.stats
    prefill, decode = (phases["prefill"], phases["decode"]) if phases else ((None,) * 3, (None,) * 3)
    prefill_s, decode_s = (None if s is None else round(s, 6) for s in (prefill[2], decode[2]))
    summary = {
        "steps": stats.model_steps,
        "dispatches": stats.dispatches,
        "multi_step_dispatches": stats.multi_step_dispatches,
        "requests": len(workload.requests),
        "finished": len(finished),
        "preemptions": stats.preemptions,
        "scheduled_tokens": stats.scheduled_tokens,
        "prefill_tokens": stats.prefill_tokens,
        "decode_tokens": stats.decode_tokens,
        "output_tokens": stats.output_tokens,
        "wall_s": round(wall_s, 6),
        "tokens_per_s": None,
        "output_tokens_per_s": None,
        "prefill_dispatches": prefill[0],
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": None,
        "decode_dispatches": decode[0],
        "decode_dispatch_tokens": decode[1],
        "decode_s": decode_s,
        "decode_tokens_per_s": None,
    }
    for rate, (tokens, seconds) in RATES.items():
        if summary[tokens] is not None and summary[seconds]:
            summary[rate] = round(summary[tokens] / summary[seconds], 1)
    return {
        **summary,
        **warmup,
        **_percentiles("step_us", stats.step_us),
        **_percentiles("dispatch_us", stats.dispatch_us),
        **_percentiles("prepare_us", stats.prep_us),
        "padding_waste": round(stats.padding_waste, 4),
        "h2d_bytes_per_dispatch": round(stats.h2d_bytes / max(stats.dispatches, 1), 1),  # update buffers sent
        "changed_bytes_per_dispatch": round(4 * stats.changed_words / max(stats.dispatches, 1), 1),
        "compiles_after_warmup": compiles.compiles,
        "traces_after_warmup": compiles.traces,
        "check_passed": None,
    }


def _percentiles(name: str, values) -> dict:
    """``{name_median, name_p99}`` of a per-dispatch list (None when it was not measured: async)."""
    values = np.asarray(values)
    if not len(values):
        return {f"{name}_median": None, f"{name}_p99": None}
    return {f"{name}_median": round(float(np.median(values)), 1),
            f"{name}_p99": round(float(np.percentile(values, 99)), 1)}


def _spec_decode_summary(stats, args) -> dict:
    if not args.spec_decode:
        return {"spec_decode": None}
    return {"spec_decode": f"{args.spec_decode} (k {args.num_speculative_tokens}, lookup "
                           f"{args.prompt_lookup_min}..{args.prompt_lookup_max})",
            "workload": args.workload,
            "draft_tokens": stats.draft_tokens,
            "accepted_draft_tokens": stats.accepted_draft_tokens,
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "mean_acceptance_length": round(stats.mean_acceptance_length, 3)}


def _print(summary: dict, as_json: bool) -> None:
    """The summary as text (on stderr under ``--json``: stdout then holds the JSON object alone)."""
    out = report_file(as_json)
    print(f"== jaxprep simulate: {summary['model']}, device-resident serving loop", file=out)
    for key, value in summary.items():
        print(f"  {key:26s} {value}{_formula(summary, key)}", file=out)
    print("what the figures include:", file=out)
    for name, line in FIGURES.items():
        print(f"  {name}: {line}", file=out)
    if as_json:
        print(json.dumps(dict(summary, figures=FIGURES, rates=RATES)))


def _formula(summary: dict, key: str) -> str:
    """``  = decode_dispatch_tokens 1123 / decode_s 0.104`` after a rate, "" after anything else."""
    if key not in RATES or summary[key] is None:
        return ""
    tokens, seconds = RATES[key]
    return f"  = {tokens} {summary[tokens]} / {seconds} {summary[seconds]}"
