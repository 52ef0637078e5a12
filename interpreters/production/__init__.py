"""Export to production cross-device systems: the DistributeAggregateForm split and a
federated_language ``Computation`` wire-compatible with TFF's runtimes.

::

    from fcir.interpreters import production

    plan = production.export(module)            # ExportError naming the op if not exportable
    plan.parts["client_work"]                   # the five parts, each a checked fcir Module
    plan.to_computation_bytes()                 # the round as a federated_language Computation
    plan.write("bundle/")                       # Computation, parts (StableHLO, HLO, IR), manifest
    production.run_bundle("bundle/", *args)     # runs a bundle with nothing but the bundle

See docs/production.md for one round end to end.
"""

from fcir.errors import ExportError

from .bundle import Bundle, BundleError, run_bundle
from .plan import Plan, export
from .splitting import PARTS, Split, split

__all__ = [
    "PARTS",
    "Bundle",
    "BundleError",
    "ExportError",
    "Plan",
    "Split",
    "export",
    "run_bundle",
    "split",
]
