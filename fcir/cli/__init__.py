"""The ``fcir`` command line: the core's commands (``fcir.cli.commands``), to which each
backend adds its own through the ``fcir.commands`` entry points (``fcir.cli.plugins``)."""

from fcir.cli.commands import build_parser, main
