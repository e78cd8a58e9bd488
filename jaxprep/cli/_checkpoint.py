"""Flags and loading shared by the subcommands that serve a checkpoint (``generate``, ``simulate --model``).

``--dtype``: ``float32`` (the exact mode: greedy tokens equal transformers' float32 ones) or ``bfloat16``
(bf16 weights, activations and KV cache, float32 where transformers computes in float32).
``--threads``: XLA's CPU threads. The CLI runs the tiny built-in model on one thread (its steps are
so small that thread hand-offs cost more than they save) and a checkpoint with XLA's default, one
thread per core, unless ``--threads`` says otherwise (docs/guides/real_models.md).

A broken checkpoint is one line and exit 2:

    jaxprep generate: error: --model ckpt: config.json: rms_norm_eps='abc' must be a positive number

The loader names the file and the field (`jaxprep.models.config`, `jaxprep.models.load`); errors the
safetensors reader raises itself are caught here too, never a traceback. The commands check the folder
(`check_model_folder`: the configs, every file header, every tensor's name and shape) with their other
flags, before any progress line is written.
"""

from __future__ import annotations

import argparse
import contextlib
import os

from jaxprep.cli._args import UsageError, int_in, require
from jaxprep.cli._progress import progress_bar

DTYPES = ("float32", "bfloat16")


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="with --model: float32 (exact, the default) or bfloat16 (bf16 weights and KV cache, "
                             "float32 norms, softmax and accumulation)")
    parser.add_argument("--threads", type=int_in(1), default=None, metavar="N",
                        help="XLA CPU threads (default: 1 for the tiny built-in model, XLA's default, one per core, "
                             "for a checkpoint)")


def single_thread_cpu(args: argparse.Namespace) -> bool:
    """One XLA thread only for the tiny built-in model with no ``--threads``."""
    return getattr(args, "model", None) is None and getattr(args, "threads", None) is None


def check_model_folder(args: argparse.Namespace):
    """The `DecoderConfig` of ``--model`` once its folder has passed every check that reads no weight
    (`jaxprep.models.load.check_checkpoint`); a broken folder raises `UsageError` naming the file and the
    field. Called from ``check_arguments``, so the error is the command's only output."""
    from jaxprep.models.load import check_checkpoint

    require(os.path.isdir(args.model), f"--model {args.model}: is not a folder")
    with _checkpoint_errors(args, _raise_usage_error):
        return check_checkpoint(args.model)


def load_checkpoint(args: argparse.Namespace):
    """``(config, params)`` of ``--model`` in ``--dtype``, with a progress bar of the bytes read; on a
    broken checkpoint calls ``args.error`` (one line, exit 2)."""
    with _checkpoint_errors(args, args.error):
        return _load(args)


def _raise_usage_error(message: str):
    raise UsageError(message)


@contextlib.contextmanager
def _checkpoint_errors(args: argparse.Namespace, report):
    """A broken checkpoint's error as one line, ``--model DIR: ...``, handed to ``report``."""
    from jaxprep.models import CheckpointError, UnsupportedConfigError

    try:
        yield
    except (UnsupportedConfigError, CheckpointError, OSError) as error:
        report(f"--model {args.model}: {_one_line(error)}")
    except _safetensors_errors() as error:
        report(f"--model {args.model}: a *.safetensors file cannot be read (corrupt or truncated?): "
               f"{_one_line(error)}")


def _load(args: argparse.Namespace):
    from jaxprep.models import load_model

    with progress_bar(args.progress, f"loading ({args.dtype})", "B", unit_scale=True, unit_divisor=1024) as bar:
        def on_progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        return load_model(args.model, dtype=args.dtype, on_progress=on_progress)


def _safetensors_errors() -> tuple[type[BaseException], ...]:
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - the loader itself needs the package
        return ()
    return (SafetensorError,)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
