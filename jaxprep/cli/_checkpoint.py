"""Loading ``--model DIR`` for ``simulate`` and ``generate``: a broken checkpoint is one line and exit 2.

    jaxprep generate: error: --model ckpt: config.json: rms_norm_eps='abc' must be a positive number

The loader names the file and the field (`jaxprep.models.config`, `jaxprep.models.load`); errors the
safetensors reader raises itself (a corrupt or truncated file) are caught here too, never a traceback.
"""

from __future__ import annotations


def load_checkpoint(args):
    """``(model config, params)`` of ``args.model``; on a broken checkpoint calls ``args.error`` (exit 2)."""
    from jaxprep.models import CheckpointError, UnsupportedConfigError, load_model

    try:
        return load_model(args.model)
    except (UnsupportedConfigError, CheckpointError, OSError) as error:
        args.error(f"--model {args.model}: {_one_line(error)}")
    except _safetensors_errors() as error:
        args.error(f"--model {args.model}: a *.safetensors file cannot be read (corrupt or truncated?): "
                   f"{_one_line(error)}")


def _safetensors_errors() -> tuple[type[BaseException], ...]:
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - the loader itself needs the package
        return ()
    return (SafetensorError,)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
