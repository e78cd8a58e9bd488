"""The sampling flags of ``simulate`` and ``generate``: --temperature, --top-k, --top-p, --min-p,
--repetition-penalty, --sampling-seed. Their defaults sample greedily with the loop unchanged; any
other value turns on `FeatureConfig.sampling` and gives every request these parameters (request i
gets seed ``--sampling-seed + i``; without it, seeds are drawn at admission as vLLM does)."""

from __future__ import annotations

import argparse
import dataclasses

from jaxprep.cli._args import UsageError, int_in

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FIELD_FLAGS = {"seed": "--sampling-seed"}
"""`SamplingParams` fields whose flag is not ``--`` + the field's name."""

FLAGS = (  # flag, type, default, help
    ("--temperature", float, 0.0, "sampling temperature; 0 is greedy (default 0)"),
    ("--top-k", int, 0, "keep the k most likely tokens; 0 or -1: all (default 0)"),
    ("--top-p", float, 1.0, "keep the smallest set of tokens with this much probability (default 1)"),
    ("--min-p", float, 0.0, "drop tokens below min-p times the likeliest (default 0)"),
    ("--repetition-penalty", float, 1.0, "vLLM's repetition penalty; 1 is none (default 1)"),
    ("--sampling-seed", int_in(INT64_MIN, INT64_MAX), None,
     "seed of request 0's sampling; request i uses seed + i (default: drawn)"),
)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    for name, kind, default, help_text in FLAGS:
        parser.add_argument(name, type=kind, default=default, metavar="X", help=help_text)


def sampling_params(args: argparse.Namespace, request_index: int = 0):
    """The `SamplingParams` the flags give request ``request_index``; None when they leave the loop greedy."""
    from jaxprep.features.sampling_params import SamplingParams

    values = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                  repetition_penalty=args.repetition_penalty)
    defaults = {name.lstrip("-").replace("-", "_"): default for name, _, default, _ in FLAGS}
    if all(values[name] == defaults[name] for name in values):
        return None
    seed = None if args.sampling_seed is None else args.sampling_seed + request_index
    if seed is not None and seed > INT64_MAX:
        raise UsageError(f"--sampling-seed {args.sampling_seed}: request {request_index} would get seed {seed}; "
                         f"must be <= {INT64_MAX} - {request_index}")
    try:
        return SamplingParams(**values, seed=seed)
    except ValueError as error:  # "SamplingParams.top_p=1.5 must be in (0, 1]" -> "--top-p 1.5: must be in (0, 1]"
        field, rest = str(error).removeprefix("SamplingParams.").split("=", 1)
        value, bound = rest.split(" ", 1)
        raise UsageError(f"{FIELD_FLAGS.get(field, '--' + field.replace('_', '-'))} {value}: {bound}") from None


def with_sampling(config, vocab_size: int):
    """``config`` (a `ServingConfig`) with `FeatureConfig.sampling` on for ``vocab_size``."""
    from jaxprep.features.sampling_params import SamplingConfig

    prep = config.prep
    features = dataclasses.replace(prep.features, sampling=SamplingConfig(vocab_size=vocab_size))
    return dataclasses.replace(config, prep=dataclasses.replace(prep, features=features))
