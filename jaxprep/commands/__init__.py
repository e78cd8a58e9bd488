"""Subcommands of the ``jaxprep`` console script (registered in `jaxprep.cli.COMMANDS`)."""
