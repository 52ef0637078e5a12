"""Command lines as tables: a subcommand's name, words and options written as data, and
the one function that adds such a table to argparse.

A backend's ``register(subparsers)`` (its ``fcir.commands`` entry point) is then
``argtable.add(subparsers, COMMAND)``: what the command takes reads as a list, not as
a hundred lines of ``add_argument`` calls.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

__all__ = ["Command", "add", "option"]


def option(*flags: str, **kwargs) -> tuple[tuple[str, ...], dict]:
    """One option of a Command: ``add_argument``'s flags and keyword arguments."""
    return flags, kwargs


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: ``func(args)`` runs it; ``commands``, its own subcommands, whose
    name goes to ``args.<dest>`` (``fcir flower up``: ``flower`` holds ``up``)."""

    name: str
    help: str
    description: str
    epilog: str | None = None
    options: tuple = ()
    func: Callable | None = None
    commands: tuple[Command, ...] = ()
    dest: str | None = None


def add(subparsers, command: Command) -> argparse.ArgumentParser:
    """Adds ``command`` (and its subcommands) to ``subparsers``."""
    p = subparsers.add_parser(
        command.name, help=command.help, description=command.description, epilog=command.epilog
    )
    for flags, kwargs in command.options:
        p.add_argument(*flags, **kwargs)
    if command.commands:
        sub = p.add_subparsers(dest=command.dest, metavar="COMMAND")
        sub.required = True
        for c in command.commands:
            add(sub, c)
    if command.func is not None:
        p.set_defaults(func=command.func)
    return p
