"""``export``: a round -> a Plan (its five parts and its federated_language Computation)."""

from __future__ import annotations

import functools
import pathlib

from fcir.errors import ExportError
from fcir.ir import Module

from . import computation, lowering
from . import wire_types as W
from .bundle import write
from .splitting import PARTS, Split, split


def export(module: Module, *, aggregate_with: str = "intrinsics") -> Plan:
    """Splits ``module`` (one round) into the DistributeAggregateForm and builds its
    federated_language Computation.

    ``aggregate_with``: ``"intrinsics"`` maps each reduction to its own intrinsic
    (``federated_sum``, ``federated_mean`` ...); ``"federated_aggregate"`` lowers sums,
    means and weighted means to ``federated_aggregate`` with Xla zero, accumulate,
    merge and report computations, for runtimes that implement only that. Raises
    ExportError naming the offending op when the round is not exportable.
    """
    if aggregate_with not in computation.AGGREGATE_WITH:
        raise ExportError(
            f"aggregate_with={aggregate_with!r}: choose one of "
            f"{', '.join(computation.AGGREGATE_WITH)}"
        )
    return Plan(split(module), aggregate_with)


class Plan:
    """A round ready for production: ``parts`` (five fcir Modules), the Computation
    (``to_computation_bytes``) and ``write(directory)`` for the whole bundle."""

    def __init__(self, split: Split, aggregate_with: str):
        self.split = split
        self.aggregate_with = aggregate_with
        self.computation = computation.round_computation(split, self.hlo_modules(), aggregate_with)

    @property
    def round(self) -> Module:
        return self.split.round

    @property
    def parts(self) -> dict[str, Module]:
        """The five parts by name, in DistributeAggregateForm order."""
        return {name: self.split.parts[name] for name in PARTS}

    def code(self, part: str) -> Module:
        """The module a part's XLA artifacts are compiled from: client work's is the
        member-level module (what one client runs), the others are the parts."""
        return self.split.client_member if part == "client_work" else self.split.parts[part]

    @functools.cache  # noqa: B019  (a Plan is immutable once built)
    def hlo_modules(self) -> dict[str, bytes]:
        """Serialized ``xla.HloModuleProto`` of each part's code."""
        out = {}
        for name in PARTS:
            fn, specs = lowering.flat_function(self.code(name))
            out[name] = lowering.hlo_module_proto(fn, specs)
        return out

    def stablehlo_artifacts(self) -> dict[str, tuple[bytes, tuple[str, ...]]]:
        """Serialized ``jax.export`` artifact (and its platforms) of each part's code."""
        out = {}
        for name in PARTS:
            fn, specs = lowering.flat_function(self.code(name))
            out[name] = lowering.stablehlo_artifact(fn, specs)
        return out

    def signature(self, part: str) -> str:
        """A part's type in federated_language notation, each leaf with its placement."""
        f = self.split.parts[part].main
        param = W.structure_type(f.arg_structure, [W.value_type(v.type) for v in f.body.params])
        result = W.structure_type(
            f.result_structure, [W.value_type(v.type) for v in f.body.results]
        )
        return W.format_type(W.function_type(param, result))

    def round_signature(self) -> str:
        return W.format_type(self.computation.type)

    def to_computation_bytes(self) -> bytes:
        """The round as a serialized federated_language ``Computation``."""
        return self.computation.SerializeToString(deterministic=True)

    def write(
        self, directory, *, device_runtime: str = "jax", device_targets=(), inputs=None
    ) -> pathlib.Path:
        """Writes the production bundle into ``directory`` (created if missing).

        ``device_runtime="iree"`` adds client work as IREE modules, one per
        ``device_targets`` entry (default the host's ``llvm-cpu``), each verified
        against XLA on seeded inputs and on ``inputs`` (the round's argument leaves)
        when given; ExportError when IREE does not match (interpreters/production/iree.py).
        """
        return write(
            self,
            directory,
            device_runtime=device_runtime,
            device_targets=device_targets,
            inputs=inputs,
        )

    def __repr__(self) -> str:
        return f"<production.Plan @{self.round.name}: {self.round_signature()}>"
