"""The interpreter base class: run a Module op by op.

A subclass overrides single ops with ``@fcir.impl(fcir.fed.Sum)`` (or
``@fcir.impl("fed.sum")``, the same op by name) methods; ops it does not override fall
back to the base class. The base class gives every op its JAX meaning by binding the
op's primitive (a fed op through its class, ``FedOp.bind``), so it runs eagerly and
equally under ``jax.jit`` tracing (``fcir.interpreters.xla`` is exactly that). An impl
receives the op and its operand values and returns the result value (or a sequence,
for several results)::

    class CountTraffic(fcir.Interpreter):
        @fcir.impl("fed.broadcast")
        def broadcast(self, op, x):
            self.bytes += x.nbytes
            return super().broadcast(op, x)
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import numpy as np

from fcir import jaxcompat as jc
from fcir.checker.opnames import FCIR_OPS, closest_op
from fcir.errors import FcirError, InterpreterError, UnsupportedError
from fcir.fed import FedOp, Unsupported
from fcir.frontend import pytrees
from fcir.ir import Module, Op, Region, control_flow, describe, expect_module, value_numbering, walk
from fcir.ir import attrs as A
from fcir.ir.types import PlacedType, TensorType, dtype_name, runtime_type
from fcir.jaxcompat import core, pe, schema
from fcir.opkit import sharding

_log = logging.getLogger("fcir.interpreter")


def impl(*ops) -> Callable:
    """Marks an Interpreter method as the implementation of ``ops``: fed op classes
    (``fcir.fed.Sum``; a typo is then an error, not dead code) or op names
    (``"fed.sum"``, resolved to its class; ``"jax.scan"``)."""
    if not ops:
        raise TypeError("impl() needs at least one op (a fed op class or an op name)")
    keys: list = []
    for op in ops:
        if isinstance(op, type) and issubclass(op, FedOp) and "name" in vars(op):
            keys.append(op)
        elif isinstance(op, str):
            name = _checked_op_name(op)
            keys.append(FedOp.registry.get(name, name))
        else:
            raise TypeError(f"impl({op!r}): give fed op classes (fcir.fed.Sum) or op names")

    def mark(fn):
        fn.fcir_ops = tuple(keys)
        return fn

    return mark


#: What the text format reads as a primitive's name (scatter-add has a hyphen).
_PRIMITIVE_NAME = re.compile(r"[A-Za-z_]\w*(?:-\w+)*")


def _checked_op_name(name: str) -> str:
    """``name`` if an IR op can carry it, else an FcirError naming the closest real op.

    ``fed.*`` and ``fcir.*`` are closed sets (the fed op registry, ``fcir.constant``):
    a misspelt one would make the method dead code, so it is refused here, where the
    decorator line is. ``jax.*`` is an open set, JAX's primitives, which differ between
    the JAX versions an IR file may come from; an interpreter may implement a primitive
    the running JAX lacks (to run IR written under another), so any ``jax.<identifier>``
    (the shape the text format reads) is taken. A name with no prefix is no IR op (the checker refuses it, op/C0)."""
    fed_names = sorted(FedOp.registry)
    if name.startswith("fed."):
        if name in FedOp.registry:
            return name
        raise FcirError(
            f"impl({name!r}): no federated op is named {name!r}{closest_op(name)}; the "
            f"fed ops are {', '.join(fed_names)}. Naming one by its class "
            "(@fcir.impl(fcir.fed.Broadcast)) makes a typo a Python AttributeError"
        )
    if name.startswith("fcir."):
        if name in FCIR_OPS:
            return name
        raise FcirError(
            f"impl({name!r}): no op is named {name!r}{closest_op(name)}; fcir's own ops "
            f"outside fed.* and jax.* are {', '.join(FCIR_OPS)}"
        )
    if name.startswith("jax.") and _PRIMITIVE_NAME.fullmatch(name.removeprefix("jax.")):
        return name
    try:
        more: tuple[str, ...] = (f"jax.{jax_primitive(name).name}",)
    except UnsupportedError:
        more = ()
    raise FcirError(
        f"impl({name!r}): no IR op has this name{closest_op(name, more)}; an op name is "
        "fed.<op> (fcir.fed.ops()), jax.<JAX primitive name> or fcir.constant"
    )


def own_rules(cls) -> dict[object, object]:
    """The rules ``cls`` itself declares (not inherited): op -> the method implementing
    it, or the ``Unsupported`` entry of its ``unsupported`` table (a dict fed op class ->
    ``fcir.fed.Unsupported``). A fed op is keyed by its class, any other op by its name
    (``"jax.scan"``). The op-coverage test reads this for every backend."""
    return {key: entry for key, _, entry in _own_entries(cls)}


def _own_entries(cls):
    """(op key, attribute name or None, method or Unsupported) for each rule of ``cls``."""
    table: list = []
    for attr, fn in vars(cls).items():
        for key in getattr(fn, "fcir_ops", ()):
            table.append((key, attr, fn))
    unsupported = vars(cls).get("unsupported", {})
    if not isinstance(unsupported, dict):
        raise FcirError(
            f"{cls.__name__}.unsupported must be a dict fed op class -> "
            f"fcir.fed.Unsupported(reason), got {type(unsupported).__name__}"
        )
    for op_cls, entry in unsupported.items():
        if not (isinstance(op_cls, type) and issubclass(op_cls, FedOp) and "name" in vars(op_cls)):
            raise FcirError(
                f"{cls.__name__}.unsupported: key {op_cls!r} is not a fed op class; write "
                "{fcir.fed.Median: fcir.fed.Unsupported(reason)} (fcir.fed.ops() lists them)"
            )
        if not isinstance(entry, Unsupported):
            # A plain string would be taken for a method name and fail only when run.
            raise FcirError(
                f"{cls.__name__}.unsupported[fcir.fed.{op_cls.__name__}] is {entry!r}; "
                f"write fcir.fed.Unsupported({entry!r}) so running {op_cls.name} is an "
                "error giving that reason"
            )
        table.append((op_cls, None, entry))
    return table


_PRIMITIVES: dict[str, core.Primitive] = {}


def jax_primitive(name: str) -> core.Primitive:
    """The JAX primitive an op named ``jax.<name>`` stands for."""
    if not _PRIMITIVES:
        import sys

        import jax.numpy  # noqa: F401  (make sure lax, random, nn are loaded)

        for modname, mod in sorted(sys.modules.items()):
            if mod is None or not (modname.startswith("jax") or modname.startswith("fcir")):
                continue
            for value in list(vars(mod).values()):
                if isinstance(value, core.Primitive):
                    _PRIMITIVES.setdefault(value.name, value)
    prim = _PRIMITIVES.get(name)
    if prim is None:
        raise UnsupportedError(f"jax.{name} names no JAX primitive known to this JAX version")
    return prim


def as_input(x):
    """An argument leaf as ``jax.jit`` takes it: Python scalars become arrays, and host
    (numpy) arrays of a 64-bit dtype the 32-bit one while JAX's x64 mode is off
    (``jax.dtypes.canonicalize_dtype``: float64 -> float32, int64 -> int32). The one
    input rule of every backend (reference, xla, production bundles), so a float64
    numpy array runs on each alike, as under ``jax.jit``."""
    if not hasattr(x, "dtype"):
        return jax.numpy.asarray(x)
    if isinstance(x, (jax.Array, core.Tracer)):
        return x
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)
    return x if dtype == x.dtype else np.asarray(x, dtype)


def check_leaf(
    module: Module,
    i: int,
    v,
    t: TensorType,
    shape: tuple,
    dtype,
    placed: type[FcirError] = InterpreterError,
) -> None:
    """Raises the clear error for argument leaf ``i`` (parameter ``v`` of runtime type
    ``t``) given as ``dtype[shape]``: the one message of every backend (the
    interpreters, ``xla.compile``'s executables). When only the members per placement
    differ it says so and what to do, as error class ``placed`` (``xla.compile`` has
    always raised PlacementError there, the interpreters InterpreterError)."""
    if shape == t.shape and dtype_name(dtype) == t.dtype:
        return
    got = f"{dtype_name(dtype)}[{','.join(map(str, shape))}]"  # the IR's type syntax
    problem = f"@{module.name} argument leaf {i} (%{i}: {v.type}) needs an array of {t}, got {got}"
    levels = []
    member = v.type
    while isinstance(member, PlacedType):
        if member.placement != "server":
            levels.append(member.placement)
        member = member.member
    if levels and dtype_name(dtype) == t.dtype and shape[len(levels) :] == t.shape[len(levels) :]:
        wanted = ", ".join(f"{module.cardinality(p)} {p}" for p in levels)
        raise placed(
            f"{problem}: it is placed, one member per {' per '.join(levels)} ({wanted}); "
            "capture the program again for the new number of members"
        )
    raise InterpreterError(problem)


class Interpreter:
    """Runs a Module. ``verbose=True`` logs each op; ``run(..., intermediates=True)``
    also returns every value computed, keyed by the printer's value number."""

    # op (fed op class, or the name of any other op) -> method name or Unsupported
    _impls: ClassVar[dict[object, object]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _collect_impls(cls)

    def __init__(self, *, verbose: bool = False):
        self.verbose = verbose
        self.module: Module | None = None
        self._jaxpr_cache: dict[tuple, jc.ClosedJaxpr] = {}
        self._record: dict | None = None

    # -- entry points -----------------------------------------------------------------------

    def run(self, module: Module, *args, intermediates: bool = False, **kwargs):
        """Runs ``main`` on pytree ``args`` (and the keyword arguments it was captured
        with); returns the result pytree (and, when ``intermediates``, a dict
        value-number -> value)."""
        expect_module(module, f"{type(self).__name__}.run")
        if not isinstance(intermediates, (bool, np.bool_)):
            # Not the flag: a program keyword named ``intermediates`` (or a mistake).
            if "intermediates" not in pytrees.captured_keyword_names(module):
                raise InterpreterError(
                    f"{type(self).__name__}.run: intermediates= asks for every computed "
                    f"value and takes True or False, got {type(intermediates).__name__}; "
                    f"@{module.name} has no keyword argument of that name"
                )
            kwargs["intermediates"], intermediates = intermediates, False
        self.module = module
        func = module.main
        called = pytrees.call_arguments(module, args, kwargs, f"{type(self).__name__}.run")
        pytrees.check_arguments(module, called, f"{type(self).__name__}.run")
        leaves = jax.tree_util.tree_leaves(called)
        params = func.body.params
        if len(leaves) != len(params):
            raise InterpreterError(
                f"@{module.name} takes {len(params)} array leaves, got {len(leaves)}"
            )
        leaves = [as_input(x) for x in leaves]
        for i, (x, v) in enumerate(zip(leaves, params)):
            expected = runtime_type(v.type, module.cardinality)
            check_leaf(module, i, v, expected, tuple(np.shape(x)), x.dtype)
        self._record = {} if intermediates else None
        outs = self.run_region(func.body, leaves)
        result = pytrees.unflatten_results(func, outs)
        if intermediates:
            names = value_numbering(func)
            return result, {names[v]: val for v, val in self._record.items()}
        return result

    def run_region(self, region: Region, args: Sequence) -> list:
        env: dict = dict(zip(region.params, args))
        record = self._record
        if record is not None:
            record.update(env)
        for op in region.ops:
            try:
                vals = [env[v] for v in op.operands]
            except KeyError:
                raise InterpreterError(f"{op.name}: operand used before definition") from None
            outs = self.run_op(op, vals)
            env.update(zip(op.results, outs))
            if record is not None:
                record.update(zip(op.results, outs))
        return [env[v] for v in region.results]

    def run_op(self, op: Op, args: Sequence) -> list:
        fed = FedOp.registry.get(op.name)
        method = self._impls.get(fed or op.name)
        if self.verbose:
            _log.info("%s", op.name)
        try:
            if isinstance(method, str):
                out = getattr(self, method)(op, *args)
            elif method is not None:  # an Unsupported entry
                raise UnsupportedError(f"{type(self).__name__}: {op.name}: {method.reason}")
            elif op.name.startswith("jax."):
                method = "local"
                out = self.local(op, *args)
            elif fed is not None:
                out = self.fed_op(op, *args)
            else:
                raise UnsupportedError(f"{type(self).__name__} has no implementation of {op.name}")
            multiple = fed.multiple_results if fed is not None else _multiple(op)
            if op.results and (
                out is None or isinstance(out, (list, tuple)) and any(o is None for o in out)
            ):
                # Blamed on the method here: else on the op that reads the None.
                raise InterpreterError(_returned_none(type(self), method, op))
            if len(op.results) == 1 and not multiple and isinstance(out, (list, tuple)):
                # Else the list becomes the value: jnp.asarray restacks it where it is
                # read (a (1, n) value, or n values sliced from the result and stacked
                # again, other work than the program's and, on JAX 0.12, an unstack that
                # refuses a member axis split over a mesh).
                raise InterpreterError(_returned_list(type(self), method, op, out))
        except FcirError as e:
            if getattr(e, "fcir_located", False):
                raise
            raise self._locate(e, op) from e
        except Exception as e:  # an op failed while running: attach the op, like torch.fx
            raise self._locate(InterpreterError(f"{type(e).__name__}: {e}"), op) from e
        if len(op.results) == 1 and not multiple:
            return [out]
        return list(out)

    def _locate(self, err: FcirError, op: Op) -> FcirError:
        where = op.name
        if self.module is not None:
            for path, o in walk(self.module.main.body):
                if o is op:
                    where = describe(self.module, path, op)
                    break
        new = type(err)(f"while running {where}: {err}")
        new.fcir_located = True
        return new

    # -- base semantics ---------------------------------------------------------------------

    @impl("fcir.constant")
    def constant(self, op: Op):
        return op.attrs["value"].value()

    def fed_op(self, op: Op, *args):
        """Any fed op: its class binds its primitive (its module in ``fcir.fed`` holds the
        primitive's rules), with the op's regions traced by this interpreter."""
        regions = [self.region_jaxpr(r) for r in op.regions]
        return FedOp.registry[op.name].bind(op, args, self.module.cardinality, regions)

    @impl("jax.scan")
    def scan(self, op: Op, *args):
        """JAX's scan, with placed ``xs``/``ys`` moved between the IR layout (member axis
        first, ``fcir.ir.control_flow``) and JAX's (scan axis first)."""
        xs, ys = control_flow.scan_slices(op.attrs, len(op.operands), len(op.results))
        axis = control_flow.scan_axis
        args = [
            jax.numpy.moveaxis(a, axis(op.operands[i].type), 0) if i in xs else a
            for i, a in enumerate(args)
        ]
        outs = self.local(op, *args)
        return [
            jax.numpy.moveaxis(o, 0, axis(op.results[j].type)) if j in ys else o
            for j, o in enumerate(outs)
        ]

    @impl("jax.custom_jvp_call")
    def custom_jvp_call(self, op, *args):
        # Derivative rules are not kept in the IR; the primal is the region, inlined as
        # JAX's own lowering of custom_jvp_call inlines it.
        return self.run_region(op.regions[0], args)

    @impl("jax.custom_vjp_call")
    def custom_vjp_call(self, op, *args):
        return self.run_region(op.regions[0], args)

    @impl("jax.shard_map")
    def shard_map(self, op: Op, *args):
        """JAX's shard_map, its region run by this interpreter inside ``jax.shard_map``.

        The region is typed per shard and its collectives (``psum`` over ``"model"``)
        name mesh axes that only shard_map binds: traced on its own, as ``local`` traces
        other regions, it fails with "unbound axis name". ``jax.shard_map`` traces it
        with those axes bound, the shards' types and the manual mesh, as it did when
        the program was captured, so it binds the same equation."""
        mesh, in_specs, out_specs, check_vma, manual = (
            A.decode(op.attrs[k], None)
            for k in ("mesh", "in_specs", "out_specs", "check_vma", "newly_manual_axes")
        )
        region = op.regions[op.attrs["jaxpr"].index]

        def body(*shards):
            return tuple(self.run_region(region, list(shards)))

        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=tuple(in_specs),
            out_specs=tuple(out_specs),
            axis_names=frozenset(manual),
            check_vma=bool(check_vma),
        )
        return list(mapped(*args))

    def local(self, op: Op, *args):
        """Any ``jax.*`` op: bind its primitive with the params its attributes stand for."""
        prim = jax_primitive(op.name.removeprefix("jax."))
        params = self.params(op)
        if prim.name in _REMAT:
            # remat takes an open jaxpr; constants of the retraced region become operands.
            closed = self.region_jaxpr(op.regions[0])
            params["jaxpr"] = pe.convert_constvars_jaxpr(closed.jaxpr)
            args = (*closed.consts, *args)
        bind_params = prim.get_bind_params(params)
        if isinstance(bind_params, tuple):  # (subfuns, params) in some JAX versions
            subfuns, bind_params = bind_params
            return prim.bind(*subfuns, *args, **bind_params)
        return self.bind(prim, args, bind_params)

    def bind(self, prim, args, params: dict[str, Any]):
        """``prim.bind(*args, **params)``: where a backend binds a ``jax.*`` op its way."""
        return prim.bind(*args, **params)

    def params(self, op: Op) -> dict[str, Any]:
        """JAX params of a ``jax.*`` op, with regions turned back into jaxprs."""

        def region(ref: A.RegionRef):
            if ref.index >= len(op.regions):
                raise UnsupportedError(f"{op.name}: attribute names missing region ^{ref.index}")
            if not ref.closed and op.name.removeprefix("jax.") in _REMAT:
                return None  # filled in by local()
            closed = self.region_jaxpr(op.regions[ref.index])
            if ref.closed:
                return closed
            if closed.consts:
                raise UnsupportedError(f"{op.name}: open region ^{ref.index} needs constants")
            return closed.jaxpr

        params = {k: A.decode(v, region) for k, v in op.attrs.items()}
        if "donated_invars" in params:
            # A nested jax.jit's donation is ignored by the jax.jit around the program
            # (nested calls lower without it). Bound eagerly, op by op (the reference),
            # it would delete an array the rest of the program or the caller still reads.
            params["donated_invars"] = (False,) * len(params["donated_invars"])
        # Layouts captured over the empty mesh, on the mesh this run is traced on.
        return sharding.on_context_mesh(
            op.name, schema.to_jax(op.name.removeprefix("jax."), params)
        )

    def region_jaxpr(self, region: Region, specs: list | None = None) -> jc.ClosedJaxpr:
        """Traces a region with this interpreter into a ClosedJaxpr (cached). ``specs``
        (ShapeDtypeStructs, e.g. with shardings) default to the parameters' IR types."""
        if specs is None:
            specs = [
                jax.ShapeDtypeStruct(t.shape, t.np_dtype)
                for t in (runtime_type(v.type, self.module.cardinality) for v in region.params)
            ]
        key = (
            id(region),
            tuple((s.shape, str(s.dtype), s.weak_type, s.sharding) for s in specs),
        )
        cached = self._jaxpr_cache.get(key)
        if cached is not None and cached[0] is region:
            return cached[1]
        saved, self._record = self._record, None
        try:
            closed = jax.make_jaxpr(lambda *a: self.run_region(region, a))(*specs)
        finally:
            self._record = saved
        self._jaxpr_cache[key] = (region, closed)
        return closed


_REMAT = ("remat2", "checkpoint")


def _returned_none(cls: type, method: str, op: Op) -> str:
    """The message for a rule that returned no value: the method, the op, and the call
    that gives the inherited value (a ``jax.*`` op without a method of its own in the
    base classes has it from ``local``)."""
    mro = cls.__mro__
    defined = next(i for i, k in enumerate(mro) if method in vars(k))
    if any(method in vars(k) for k in mro[defined + 1 :]):
        base = f"super().{method}(op, ...)"
    else:
        base = "super().local(op, ...), the JAX meaning of every jax.* op"
    return (
        f"{cls.__name__}.{method} returned None for {op.name}, which has {len(op.results)} "
        f"result(s): return its value (the inherited one is {base})"
    )


def _returned_list(cls: type, method: str, op: Op, out) -> str:
    """The message for a rule that returned a list where its op has one result."""
    return (
        f"{cls.__name__}.{method} returned a {type(out).__name__} of {len(out)} for {op.name}, "
        "which has one result: return the value itself (the interpreter puts it in the "
        "op's result list)"
    )


def _collect_impls(cls) -> None:
    """op -> method name (or Unsupported), subclasses overriding their bases (no
    registration call to forget: it runs for every subclass)."""
    table: dict[object, object] = {}
    for klass in reversed(cls.__mro__):
        for key, attr, entry in _own_entries(klass):
            table[key] = entry if attr is None else attr
    cls._impls = table


def _base_method(op_cls: type[FedOp]):
    def run(self, op: Op, *args):
        return self.fed_op(op, *args)

    run.__name__ = run.__qualname__ = _method_name(op_cls)
    run.__doc__ = f"``{op_cls.name}`` as the base class runs it (``fed_op``): for ``super()``."
    return run


def _method_name(op_cls: type[FedOp]) -> str:
    return op_cls.primitive.name.removeprefix("fed_")


# ``super().<op>(op, *args)`` in an override (``super().broadcast(op, x)``) reaches the
# base behaviour of every fed op, whose one definition is ``fed_op``.
for _op_cls in FedOp.registry.values():
    setattr(Interpreter, _method_name(_op_cls), _base_method(_op_cls))
_collect_impls(Interpreter)


def _multiple(op: Op) -> bool:
    if not op.name.startswith("jax."):
        return False
    try:
        return jax_primitive(op.name.removeprefix("jax.")).multiple_results
    except UnsupportedError:
        return False


def is_placed(t) -> bool:
    return isinstance(t, PlacedType) and t.placement != "server"
