"""What installed packages add to the ``fcir`` command: entry points, read by name.

The core CLI imports no backend. A backend (or library) declares in its package
metadata (``pyproject.toml``):

- in group ``fcir.commands``, a ``register(subparsers)`` that adds its subcommands;
- in group ``fcir.backends``, a module that ``fcir run --backend NAME`` runs programs
  with: ``run_program(module, args, clients_per_step)`` returns the outputs, ``STREAMS``
  says whether it takes ``--clients-per-step``; a backend that compiles also has
  ``compile_program(module, mesh, clients_per_step)`` (an executable with ``as_text``
  and ``cost``) and ``format_cost(cost)``, which ``fcir compile --emit hlo,cost`` use.

Entry points are package metadata: after editing them, reinstall (``pip install -e .``).
"""

from __future__ import annotations

from importlib import metadata

COMMANDS = "fcir.commands"
BACKENDS = "fcir.backends"


def register_commands(subparsers) -> None:
    """Adds every installed ``fcir.commands`` entry point's subcommands, in the order
    the metadata lists them; one whose module cannot be imported (a missing optional
    dependency) adds none."""
    for ep in metadata.entry_points(group=COMMANDS):
        try:
            register = ep.load()
        except ImportError:
            continue
        register(subparsers)


def backend_names() -> tuple[str, ...]:
    """The names ``--backend`` takes, sorted; reading them imports no backend."""
    return tuple(sorted({ep.name for ep in metadata.entry_points(group=BACKENDS)}))


def backend(name: str):
    """The module of backend ``name`` (imported now)."""
    (ep,) = [ep for ep in metadata.entry_points(group=BACKENDS) if ep.name == name][:1]
    return ep.load()


def streaming_backends() -> list[str]:
    """The backends that take ``--clients-per-step``."""
    return [n for n in backend_names() if getattr(backend(n), "STREAMS", False)]


def compiler():
    """The first backend (by name) that compiles, or None."""
    for name in backend_names():
        module = backend(name)
        if hasattr(module, "compile_program"):
            return module
    return None
