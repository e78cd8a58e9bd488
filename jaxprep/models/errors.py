"""Errors of the checkpoint loader; each message names the config field or tensor at fault."""


class UnsupportedConfigError(ValueError):
    """A config.json field (named in the message) has a value this loader does not implement."""


class CheckpointError(ValueError):
    """A checkpoint's tensors (named in the message) are missing, unexpected or of the wrong shape or dtype."""
