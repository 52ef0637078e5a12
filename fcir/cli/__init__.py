"""The ``fcir`` command line: the core's commands (``fcir.cli.main``), to which each
backend adds its own through the ``fcir.commands`` entry points (``fcir.cli.plugins``)."""

from fcir.cli.main import build_parser, main
