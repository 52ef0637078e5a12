"""``fcir ckpt``: the checkpoint tools as ``fcir`` subcommands (the ``fcir.commands``
entry point ``ckpt``)."""

from __future__ import annotations

from fcir.checkpoint import inspect as ckpt_inspect


def register(subparsers) -> None:
    """Adds ``fcir ckpt inspect``."""
    ckpt = subparsers.add_parser("ckpt", help="checkpoint tools",
                                 description="Inspect fcir checkpoints.")
    csub = ckpt.add_subparsers(dest="ckpt_command", metavar="COMMAND")
    csub.required = True
    p = csub.add_parser("inspect", help=ckpt_inspect.HELP,
                        description=ckpt_inspect.DESCRIPTION)
    ckpt_inspect.add_arguments(p, debug_flag=False)  # the top-level parser owns --debug
    p.set_defaults(func=ckpt_inspect.run)
