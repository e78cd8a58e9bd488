"""Run the device-resident serving loop on a built-in workload and print a summary.

The tiny random-weight model serves random prompts through the host scheduler and the jitted,
donated serving step; ``--check`` recomputes every request densely (no cache) and checks that the
loop's greedy tokens are the dense ones.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

DEFAULTS = dict(requests=64, budget=64, block_size=16, max_num_reqs=16, max_model_len=256, num_blocks=64,
                layers=2, d_model=64, heads=4, vocab_size=512, decode_steps=8, max_prompt_len=96, max_tokens=64,
                arrival_spread=30, seed=0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags = {
        "requests": "number of requests", "budget": "token budget per step (max_num_batched_tokens)",
        "block_size": "KV-cache block size", "max_num_reqs": "rows of the batch (max_num_seqs)",
        "max_model_len": "longest sequence", "num_blocks": "KV-cache blocks, the null block included",
        "layers": "model layers", "d_model": "model width", "heads": "attention heads",
        "vocab_size": "vocabulary size", "decode_steps": "decode steps per multi-step dispatch (K)",
        "max_prompt_len": "longest prompt (prompts are 4..this long)",
        "max_tokens": "largest max_tokens (requests ask for 1..this many)",
        "arrival_spread": "requests arrive over this many steps", "seed": "seed of the workload and the weights",
    }
    for name, help_text in flags.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=DEFAULTS[name],
                            help=f"{help_text} (default {DEFAULTS[name]})")
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="serve a Hugging Face checkpoint (config.json + *.safetensors: Llama, Qwen2, Qwen3) "
                             "instead of the tiny random model; --layers, --d-model, --heads and --vocab-size are "
                             "then the checkpoint's")
    parser.add_argument("--devices", type=int, default=1,
                        help="data-parallel ranks, one per device, each with the sizes above (its own rows, "
                             "blocks and token budget); on CPU the CLI forces this many host devices (default 1)")
    parser.add_argument("--compile-cache", metavar="DIR", default=None,
                        help="JAX persistent compilation cache directory: a second run warms up from disk")
    parser.add_argument("--check", action="store_true",
                        help="check the greedy tokens against a dense recomputation; exit 1 if they differ "
                             "or anything compiled after warm-up")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    parser.set_defaults(error=parser.error)


def run(args: argparse.Namespace) -> int:
    from jaxprep.compilation import count_compiles, use_compile_cache
    from jaxprep.config import PrepConfig
    from jaxprep.serving import ModelConfig, ServingConfig, check_against_dense, random_workload

    prep = PrepConfig(max_num_reqs=args.max_num_reqs, max_model_len=args.max_model_len,
                      max_num_batched_tokens=args.budget, block_size=args.block_size, num_blocks=args.num_blocks)
    model, params, eos_token_id = _model(args, ModelConfig)
    config = ServingConfig(prep=prep, eos_token_id=eos_token_id, decode_steps=args.decode_steps)
    workload = random_workload(args.seed, num_requests=args.requests, vocab_size=model.vocab_size,
                               prompt_len=(4, min(args.max_prompt_len, args.max_model_len - 1)),
                               max_tokens=(1, args.max_tokens), arrival_spread=args.arrival_spread)
    if args.compile_cache:
        use_compile_cache(args.compile_cache)
    engine = _engine(config, model, args, params)
    warmup_s = engine.warmup()
    progress = None if args.no_progress else _Progress(len(workload.requests))
    with count_compiles() as compiles:
        start = time.perf_counter()
        finished = _serve(engine, workload, progress)
        wall_s = time.perf_counter() - start
    summary = _summary(engine, workload, finished, wall_s, warmup_s, compiles)
    summary["devices"] = args.devices
    summary["model"] = "tiny paged-KV model" if args.model is None else f"{model.model_type} from {args.model}"
    if args.check:
        check = check_against_dense(engine.params, model, finished, prep.max_model_len)
        summary.update(check_passed=check.passed and len(finished) == len(workload.requests),
                       check_tokens=check.num_tokens, check_mismatches=check.mismatches,
                       check_near_ties=check.near_ties)
    _print(summary, args.json)
    failed = args.check and (not summary["check_passed"] or summary["compiles_after_warmup"] > 0)
    return 1 if failed else 0


def _model(args, tiny_config):
    """``(model config, params, eos_token_id)``: the checkpoint in ``--model`` (params loaded, its first
    EOS id), or the tiny model from the size flags (params None: the engine draws them from the seed)."""
    if args.model is None:
        model = tiny_config(vocab_size=args.vocab_size, num_layers=args.layers, d_model=args.d_model,
                            num_heads=args.heads, d_ff=2 * args.d_model)
        return model, None, 1
    from jaxprep.models import CheckpointError, UnsupportedConfigError, load_model

    try:
        model, params = load_model(args.model)
    except (UnsupportedConfigError, CheckpointError, FileNotFoundError) as error:
        args.error(f"argument --model: {error}")
    return model, params, model.eos_token_ids[0] if model.eos_token_ids else -1


def _engine(config, model, args, params=None):
    """One `Engine`, or a `DataParallelEngine` over ``args.devices`` devices."""
    from jaxprep.serving import Engine

    if args.devices == 1:
        return Engine(config, model, seed=args.seed, time_prep=True, params=params)
    from jaxprep.serving.dp_engine import DataParallelEngine
    from jaxprep.sharding import data_mesh

    return DataParallelEngine(config, model, data_mesh(args.devices), seed=args.seed, time_prep=True,
                              params=params)


def _serve(engine, workload, progress):
    engine.submit(workload.requests, workload.arrival_steps)
    on_step = None if progress is None else (
        lambda engine: progress.update(engine.stats.model_steps, len(engine.finished)))
    finished = engine.run(on_step=on_step)
    if progress:
        progress.close()
    return finished


class _Progress:
    """A one-line progress display on stderr, redrawn at most every 0.1 s."""

    def __init__(self, total: int):
        self.total, self.last = total, 0.0

    def update(self, steps: int, done: int) -> None:
        now = time.perf_counter()
        if now - self.last >= 0.1 or done == self.total:
            self.last = now
            width = 30
            filled = width * done // max(self.total, 1)
            sys.stderr.write(f"\rsimulate [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} requests, "
                             f"{steps} steps")
            sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def _summary(engine, workload, finished, wall_s: float, warmup_s: float, compiles) -> dict:
    """``wall_s`` and the rates leave out the extra prep-timing calls, which a real loop would not make."""
    stats, prep_us = engine.stats, np.asarray(engine.stats.prep_us)
    wall_s -= prep_us.sum() / 1e6
    return {
        "steps": stats.model_steps,
        "dispatches": stats.dispatches,
        "multi_step_dispatches": stats.multi_step_dispatches,
        "requests": len(workload.requests),
        "finished": len(finished),
        "preemptions": stats.preemptions,
        "scheduled_tokens": stats.scheduled_tokens,
        "output_tokens": stats.output_tokens,
        "wall_s": round(wall_s, 3),
        "warmup_s": round(warmup_s, 3),
        "tokens_per_s": round(stats.scheduled_tokens / wall_s, 1),
        "output_tokens_per_s": round(stats.output_tokens / wall_s, 1),
        "prep_us_median": round(float(np.median(prep_us)), 1),
        "prep_us_p99": round(float(np.percentile(prep_us, 99)), 1),
        "prep_method": "separate non-donating jitted call (unpack + state updates + prepare_padded) on the "
                       "step's own state and packed updates, before the step, timed to block_until_ready",
        "padding_waste": round(stats.padding_waste, 4),
        "compiles_after_warmup": compiles.compiles,
        "traces_after_warmup": compiles.traces,
        "check_passed": None,
    }


def _print(summary: dict, as_json: bool) -> None:
    print(f"== jaxprep simulate: {summary['model']}, device-resident serving loop")
    for key, value in summary.items():
        if key != "prep_method":
            print(f"  {key:24s} {value}")
    print(f"  prep timing: {summary['prep_method']}")
    if as_json:
        print(json.dumps(summary))
