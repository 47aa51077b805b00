"""Every use of JAX internals, in one place.

Checked against JAX 0.10.2; the scan parameters also against JAX 0.11.2 (whose
`scan` packs its operand counts in `ft_in`). Everything else in the package uses
public API (`jax`, `jax.lax`, `jax.extend.core`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import types
from collections import OrderedDict
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.extend.linear_util as jex_lu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as _core, mesh as _mesh_lib, sharding_impls as _sharding_impls
from jax._src.interpreters import ad as _src_ad, partial_eval as _pe
from jax._src.lax import lax as _lax_internal
from jax._src.state.types import AbstractRef as _AbstractRef
from jax.core import Tracer as Tracer
from jax.extend.core import primitives as jex_prims
from jax.interpreters import ad as _ad, batching as _batching, mlir as _mlir
from jax.sharding import (
    AbstractMesh,
    AxisType,
    Mesh,
    NamedSharding,
    PartitionSpec,
    get_abstract_mesh,
    reshard,
    use_abstract_mesh,
)


try:  # private in JAX 0.10: matched by object, as every primitive here
    from jax._src.shard_map import shard_map_p
except ImportError:  # pragma: no cover
    shard_map_p = None


def is_concrete(x) -> bool:
    """Whether `x` is a value known now (not a tracer of some transformation)."""
    return not isinstance(x, Tracer)


def bind(primitive, params: dict[str, Any], *args) -> list:
    """Bind `primitive` as the equation with `params` did; always returns a list.

    Equations holding sub-jaxprs (`custom_jvp_call`, `custom_vjp_call`) store them in
    a form that differs from what `bind` takes, and `get_bind_params` converts. JAX
    0.10 returns the params dict; older JAX returned a `(subfuns, params)` pair.
    """
    converted = primitive.get_bind_params(params)
    if isinstance(converted, tuple):
        subfuns, kwargs = converted
        out = primitive.bind(*subfuns, *args, **kwargs)
    else:
        out = primitive.bind(*args, **converted)
    return list(out) if primitive.multiple_results else [out]


def _first(*names):
    for name in names:
        for mod in (lax, jex_prims):
            prim = getattr(mod, name, None)
            if prim is not None:
                return prim
    return None


# Call-like primitives whose body is inlined into the graph.
jit_p = _first("jit_p", "pjit_p")
closed_call_p = _first("closed_call_p")
call_p = _first("call_p")
remat_p = _first("remat_p")
custom_jvp_call_p = _first("custom_jvp_call_p")
custom_vjp_call_p = _first("custom_vjp_call_p")
# Calls of functions with custom derivative rules.
CUSTOM_CALLS = (custom_jvp_call_p, custom_vjp_call_p)
# A `custom_vjp` function's step in a linearisation (`jax.linearize`): linear in its
# tangents, and only transposed (by the function's backward rule), never run.
custom_lin_p = getattr(_src_ad, "custom_lin_p", None)
add_any_p = _first("add_jaxvals_p", "add_any_p")
split_p = _first("split_p")
stack_p = _first("stack_p")
unstack_p = _first("unstack_p")
optimization_barrier_p = _first("optimization_barrier_p")


def _collectives() -> frozenset:
    # Every primitive of `jax._src.lax.parallel` but `axis_index` communicates over
    # mapped axes; `pvary` (and its kin in `core`) marks a value as varying along
    # them, and transposes to a `psum`.
    from jax._src.lax import parallel as _parallel

    found = [
        getattr(_parallel, name)
        for name in dir(_parallel)
        if name.endswith("_p") and name != "axis_index_p"
    ]
    found += [getattr(_core, name, None) for name in ("pvary_p", "reduced_vary_cast_p")]
    return frozenset(p for p in found if isinstance(p, jex_core.Primitive))


# Collectives over the axes of `shard_map`, `pmap` or `vmap(axis_name=...)`.
COLLECTIVES = _collectives()


def _positional_reductions() -> dict:
    from jax._src.lax import parallel as _parallel

    pairs = {
        "psum_p": lax.reduce_sum_p,
        "pmax_p": lax.reduce_max_p,
        "pmin_p": lax.reduce_min_p,
    }
    return {
        getattr(_parallel, name): red
        for name, red in pairs.items()
        if isinstance(getattr(_parallel, name, None), jex_core.Primitive)
    }


_POSITIONAL_REDUCTIONS = _positional_reductions()


def positional_reduction(prim, params: dict):
    """The reduction (`reduce_sum`, `reduce_max`, `reduce_min`) that a `psum`,
    `pmax` or `pmin` is when every axis it reduces is positional, as after tracing
    `vmap(..., axis_name=...)` inside the function; else `None`."""
    red = _POSITIONAL_REDUCTIONS.get(prim)
    axes = params.get("axes")
    if (
        red is None
        or params.get("axis_index_groups") is not None
        or not isinstance(axes, tuple)
        or not all(isinstance(a, int) for a in axes)
    ):
        return None
    return red


@functools.lru_cache(maxsize=256)
def reduction_params(prim, axes: tuple[int, ...], shape: tuple, dtype) -> dict:
    """The params this JAX version gives `prim` (a reduction) over `axes`."""
    bound = {
        lax.reduce_sum_p: lax.reduce_sum,
        lax.reduce_max_p: lax.reduce_max,
        lax.reduce_min_p: lax.reduce_min,
    }[prim]
    jaxpr = jax.make_jaxpr(lambda x: bound(x, axes))(jax.ShapeDtypeStruct(shape, dtype))
    (eqn,) = jaxpr.jaxpr.eqns
    return dict(eqn.params)


# Primitives whose bodies bind their own mapped axes (`pmap` is a `shard_map` too).
MAPS = frozenset(p for p in (shard_map_p,) if p is not None)

Literal = jex_core.Literal
Var = jex_core.Var
DropVar = jex_core.DropVar
ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr


def inner_jaxpr(eqn) -> tuple[Any, list] | None:
    """For a call-like equation to inline: its (open jaxpr, consts); else None."""
    prim = eqn.primitive
    if prim is jit_p:
        closed = eqn.params["jaxpr"]
    elif prim is closed_call_p or prim is call_p:
        closed = eqn.params["call_jaxpr"]
    elif prim is remat_p:
        closed = eqn.params["jaxpr"]
    else:
        return None
    if isinstance(closed, ClosedJaxpr):
        return closed.jaxpr, list(closed.consts)
    return closed, []


def scan_counts(params: dict) -> tuple[int, int]:
    """How many of a `scan` equation's operands are consts and how many carries.

    JAX 0.10 names both counts in the params; JAX 0.11 replaces them with `ft_in`,
    the operands' structure packed as (consts, carries, scanned inputs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


# The text of jaxprs, by identity: a jitted function's body is one object from trace
# to trace (JAX caches it), and printing a large one takes milliseconds every call.
# Jaxprs are immutable; each entry keeps its jaxpr alive, so its `id` is not reused.
_TEXTS: OrderedDict = OrderedDict()
_MAX_TEXTS = 1024


def jaxpr_text(jaxpr) -> str:
    """`str(jaxpr)`, remembered for the same object."""
    found = _TEXTS.get(id(jaxpr))
    if found is not None and found[0] is jaxpr:
        _TEXTS.move_to_end(id(jaxpr))
        return found[1]
    text = str(jaxpr)
    _TEXTS[id(jaxpr)] = (jaxpr, text)
    if len(_TEXTS) > _MAX_TEXTS:
        _TEXTS.popitem(last=False)
    return text


def custom_call_jaxpr(eqn):
    """The primal body of a custom-derivative call, as (open jaxpr, consts)."""
    closed = eqn.params["call_jaxpr"]
    if isinstance(closed, ClosedJaxpr):
        return closed.jaxpr, list(closed.consts)
    return closed, []


def as_weak_type(x):
    """`x` with a weak type, as JAX gives derivatives w.r.t. Python scalars.

    No public API sets `weak_type`; `jax.jacrev` results carry it for weak inputs.
    """
    return _lax_internal._convert_element_type(x, x.dtype, weak_type=True)


#
# Sharding (the `jax.make_mesh` default in JAX 0.10 is Explicit axes).
#
# `_jacve.py` runs the engine with the explicit mesh axes turned auto (see there why).
# The equations of the traced program were typed on the explicit mesh and carry it in
# their params: meshes and shardings, sub-jaxprs typed on it, and custom-derivative
# rules that JAX traces lazily on the original avals. To re-bind them on the auto mesh
# those are converted here. Private names used: `shard_map_p`, the param names of
# `shard_map`, `custom_jvp_call` and `custom_vjp_call`, and the concrete-mesh context
# (JAX 0.10.2).
#


def _mesh_of_value(x):
    try:
        return _mesh_of_aval(jax.typeof(x))
    except TypeError:  # not an array: no mesh
        return None


def _nonempty(mesh):
    return None if mesh is None or mesh.empty else mesh


def _mesh_of_aval(aval):
    return _nonempty(getattr(getattr(aval, "sharding", None), "mesh", None))


def has_mesh(aval) -> bool:
    """Whether an abstract value is placed on a (non-empty) mesh."""
    return _mesh_of_aval(aval) is not None


def _has_explicit(mesh) -> bool:
    return mesh is not None and AxisType.Explicit in tuple(mesh.axis_types)


def _full_spec(spec, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def _names(entry) -> tuple:
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def spec_of(sharding, ndim: int) -> tuple:
    """The partition spec of `sharding` for `ndim` axes, one entry per axis."""
    if getattr(sharding, "spec", None) is None or _nonempty(sharding.mesh) is None:
        return (None,) * ndim
    return _full_spec(sharding.spec, ndim)


def trimmed_spec(entries) -> PartitionSpec:
    """A `PartitionSpec` of `entries` without trailing `None`s, as JAX writes specs."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


@dataclasses.dataclass(frozen=True)
class AutoAxes:
    """An explicit mesh, and the same mesh with its explicit `axes` made auto."""

    explicit: AbstractMesh
    auto: AbstractMesh
    axes: tuple[str, ...]
    # The concrete mesh of `explicit` (from the arrays or the context), if known.
    concrete: Mesh | None = None

    def spec(self, spec) -> PartitionSpec:
        """`spec` without the converted axes: a type on the auto mesh."""
        kept = [tuple(a for a in _names(e) if a not in self.axes) for e in spec]
        return PartitionSpec(*(k[0] if len(k) == 1 else (k or None) for k in kept))

    def mesh(self, mesh):
        """`mesh` (abstract or concrete) with the converted axes auto."""
        if _nonempty(mesh) is None or not set(self.axes) & set(mesh.axis_names):
            return mesh
        types = tuple(
            AxisType.Auto if n in self.axes and t == AxisType.Explicit else t
            for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        )
        return mesh.update(axis_types=types)


def explicit_axes(values, params_list) -> AutoAxes | None:
    """The explicit mesh that `values` (arrays, tracers), the context or `params_list`
    (equation params) use; `None` if there is none, or several (left as they are).
    """
    meshes = [_mesh_of_value(x) for x in values]
    meshes.append(get_abstract_mesh())
    meshes.extend(_param_meshes(params_list))
    found = {m.abstract_mesh for m in meshes if m is not None and _has_explicit(m)}
    if len(found) != 1:
        return None
    (mesh,) = found
    axes = tuple(
        n
        for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t == AxisType.Explicit
    )
    auto = mesh.update_axis_types({a: AxisType.Auto for a in axes})
    concrete = [_mesh_lib.get_concrete_mesh()]
    concrete += [
        getattr(getattr(x, "sharding", None), "mesh", None)
        for x in values
        if isinstance(x, jax.Array) and not isinstance(x, Tracer)
    ]
    concrete = [m for m in concrete if isinstance(m, Mesh) and m.abstract_mesh == mesh]
    return AutoAxes(mesh, auto, axes, concrete[0] if concrete else None)


def _param_meshes(params_list) -> list:
    """Meshes named by equation params (those inside sub-jaxprs are typed on the
    meshes of the equation's operands, or named by its own params)."""
    out = []

    def visit(v):
        if isinstance(v, (Mesh, AbstractMesh)):
            out.append(v)
        elif isinstance(v, NamedSharding):
            out.append(v.mesh)
        elif isinstance(v, (tuple, list)):
            for x in v:
                visit(x)

    for params in params_list:
        for v in params.values():
            visit(v)
    return out


@contextlib.contextmanager
def auto_mesh(axes: AutoAxes):
    """Work on the auto mesh: the abstract mesh, and the concrete one that eager
    operations place (and type) new arrays on, which `jax.set_mesh` may have set.

    `jax.set_mesh` itself refuses to run under any transformation (`vmap` included),
    hence JAX's internal setter (JAX 0.10.2).
    """
    concrete = _mesh_lib.get_concrete_mesh()
    with use_abstract_mesh(axes.auto):
        if _nonempty(concrete) is None or not _has_explicit(concrete):
            yield
        else:
            with _sharding_impls._internal_use_concrete_mesh(axes.mesh(concrete)):
                yield


def to_auto(x, axes: AutoAxes):
    """`x` typed on the auto mesh; call inside `auto_mesh(axes)`."""
    aval = jax.typeof(x)
    if _mesh_of_aval(aval) is None:
        return x
    return reshard(x, axes.spec(spec_of(aval.sharding, aval.ndim)))


def from_auto(x, sharding, axes: AutoAxes):
    """`x`, computed on the auto mesh, resharded to `sharding` on the explicit one."""
    if _nonempty(getattr(sharding, "mesh", None)) is None:
        if _mesh_of_aval(jax.typeof(x)) is None:
            return x
        sharding = NamedSharding(axes.explicit, PartitionSpec())
    if (
        isinstance(x, jax.Array)
        and not isinstance(x, Tracer)
        and len(x.sharding.device_set) != axes.explicit.size
    ):
        # A value computed from constants alone (the Jacobian of a linear map) sits
        # on one device, where `reshard` cannot take it from: placed on the mesh
        # where it is known, else handed over as a constant of the trace.
        if axes.concrete is not None:
            return jax.device_put(x, NamedSharding(axes.concrete, sharding.spec))
        x = jnp.asarray(np.asarray(x))
    return reshard(x, sharding)


def laid_out(x, spec, like):
    """`x` resharded to `spec` on the explicit mesh `like`'s type is placed on; `x`
    itself where `spec` is `None` or `like` is on no mesh with explicit axes."""
    if spec is None or like is None:
        return x
    mesh = _mesh_of_aval(jax.typeof(like))
    if mesh is None or not _has_explicit(mesh):
        return x
    return reshard(x, NamedSharding(mesh, spec))


def auto_params(params: dict[str, Any], axes: AutoAxes, prim=None) -> dict[str, Any]:
    """Equation params with their meshes, shardings and sub-jaxprs on the auto mesh."""
    if shard_map_p is not None and prim is shard_map_p:
        return _shard_map_params(params, axes)
    constraint = prim is lax.sharding_constraint_p

    def convert(v):
        if isinstance(v, (Mesh, AbstractMesh)):
            return axes.mesh(v)
        if isinstance(v, NamedSharding):
            mesh = axes.mesh(v.mesh)
            if mesh is v.mesh:
                return v
            # Types (`sharding`, `out_sharding`, ...) name explicit axes only; a
            # constraint keeps its spec, a placement hint on auto axes.
            return NamedSharding(mesh, v.spec if constraint else axes.spec(v.spec))
        if isinstance(v, ClosedJaxpr):
            return _retype(v, axes)
        if isinstance(v, Jaxpr) and not v.constvars:
            return _retype(ClosedJaxpr(v, []), axes, allow_consts=False).jaxpr
        if isinstance(v, (tuple, list)):
            items = [convert(x) for x in v]
            if all(x is y for x, y in zip(items, v, strict=True)):
                return v  # unchanged, with its type (e.g. a NamedTuple of dims)
            if hasattr(v, "_fields"):
                return type(v)(*items)
            return type(v)(items)
        return v

    out = {k: convert(v) for k, v in params.items()}
    for name in ("jvp_jaxpr_fun", "fwd_jaxpr_thunk"):
        if isinstance(out.get(name), jex_lu.WrappedFun):
            out[name] = _auto_thunk(out[name], axes)
    return out


def _auto_thunk(thunk, axes: AutoAxes):
    """A custom rule's jaxpr thunk whose jaxprs are converted when made.

    JAX traces the rule on the avals of the original trace, so on the explicit mesh.
    """

    def made(*zeros):
        with use_abstract_mesh(axes.explicit):
            jaxpr, consts, *rest = thunk.call_wrapped(*zeros)
        closed = _retype(ClosedJaxpr(jaxpr, consts), axes)
        return (closed.jaxpr, closed.consts, *rest)

    return jex_lu.wrap_init(made, debug_info=thunk.debug_info)


def _shard_map_params(params: dict[str, Any], axes: AutoAxes) -> dict[str, Any]:
    """`shard_map` params on the auto mesh.

    Its body is typed on the mesh with the mapped axes manual and the others as they
    were, so `jax.shard_map` re-traces it (converted) on the converted mesh.
    """
    mesh = params["mesh"]
    new_mesh = axes.mesh(mesh)
    body = params["jaxpr"]
    if new_mesh is mesh or body.constvars:
        return params
    in_specs, out_specs = tuple(params["in_specs"]), tuple(params["out_specs"])

    def mapped(*args):
        return tuple(eval_auto(body, (), args, axes))

    def global_struct(var, spec):
        aval = var.aval
        shape = [
            size * math.prod(mesh.shape[a] for a in _names(entry))
            for size, entry in zip(aval.shape, _full_spec(spec, aval.ndim), strict=True)
        ]
        return jax.ShapeDtypeStruct(tuple(shape), aval.dtype, weak_type=aval.weak_type)

    fn = jax.shard_map(
        mapped,
        mesh=new_mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=set(params["newly_manual_axes"]),
        check_vma=params["check_vma"],
    )
    with use_abstract_mesh(axes.auto):
        structs = [
            global_struct(v, s) for v, s in zip(body.invars, in_specs, strict=True)
        ]
        eqns = [
            e
            for e in jax.make_jaxpr(fn)(*structs).jaxpr.eqns
            if e.primitive is shard_map_p
        ]
    return dict(eqns[0].params) if len(eqns) == 1 else params


def _retype(closed, axes: AutoAxes, allow_consts: bool = True):
    """`closed` re-traced on the auto mesh, its equations converted recursively."""
    jaxpr = closed.jaxpr
    variables = [*jaxpr.invars, *jaxpr.constvars]
    variables += [v for e in jaxpr.eqns for v in e.outvars]
    if not any(_has_explicit(_mesh_of_aval(v.aval)) for v in variables) and not any(
        _has_explicit(m) for m in _param_meshes(e.params for e in jaxpr.eqns)
    ):
        return closed

    def auto_struct(aval):
        sharding = None
        if _mesh_of_aval(aval) is not None:
            spec = axes.spec(spec_of(aval.sharding, aval.ndim))
            sharding = NamedSharding(axes.mesh(aval.sharding.mesh), spec)
        return jax.ShapeDtypeStruct(
            aval.shape, aval.dtype, sharding=sharding, weak_type=aval.weak_type
        )

    with use_abstract_mesh(axes.auto):
        structs = [auto_struct(v.aval) for v in jaxpr.invars]
        out = jax.make_jaxpr(lambda *a: eval_auto(jaxpr, closed.consts, a, axes))(
            *structs
        )
    return closed if out.consts and not allow_consts else out


def interpret(jaxpr, consts, args, bind_eqn) -> list:
    """Evaluate an open `jaxpr` equation by equation on the current trace;
    `bind_eqn(k, eqn, operands)` binds equation `k` and returns its outputs."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(a):
        return a.val if isinstance(a, Literal) else env[a]

    for k, eqn in enumerate(jaxpr.eqns):
        outs = bind_eqn(k, eqn, [read(a) for a in eqn.invars])
        for var, val in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, DropVar):
                env[var] = val
    return [read(a) for a in jaxpr.outvars]


def eval_auto(jaxpr, consts, args, axes: AutoAxes) -> list:
    """Evaluate an open `jaxpr` on auto-typed `args`, converting every equation."""

    def bind_auto(k, eqn, ins):
        return bind(eqn.primitive, auto_params(eqn.params, axes, eqn.primitive), *ins)

    return interpret(jaxpr, [to_auto(x, axes) for x in consts], args, bind_auto)


def eager_auto_mesh(values):
    """The one concrete mesh with auto axes that concrete `values` are sharded over.

    `None` if any value is a tracer, or if there is no such mesh, or several.
    """
    meshes = set()
    for x in values:
        if isinstance(x, Tracer) or not isinstance(x, jax.Array):
            return None
        if isinstance(x.sharding, NamedSharding) and not x.sharding.mesh.empty:
            meshes.add(x.sharding.mesh)
    if len(meshes) != 1:
        return None
    (mesh,) = meshes
    return None if not isinstance(mesh, Mesh) or _has_explicit(mesh) else mesh


def concrete_spec(x, mesh) -> tuple:
    """The partition spec of concrete `x` on `mesh`, one entry per axis (unsharded
    where `x` lives elsewhere, e.g. on one device)."""
    if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh:
        return _full_spec(x.sharding.spec, x.ndim)
    return (None,) * x.ndim


# Files of JAX's own wrappers around a custom rule (checked against JAX 0.10.2).
_RULE_WRAPPERS = (
    "custom_derivatives.py",
    "linear_util.py",
    "partial_eval.py",
    "api_util.py",
    "core.py",
    "api.py",
)


_STATIC = (bool, int, float, complex, str, type(None))


def _static_values(obj, depth: int = 0) -> list:
    """The Python scalars and strings in `obj` (nested in tuples, lists, dicts and
    the fields of dataclasses such as Equinox modules, which wrap the static
    arguments of `eqx.filter_custom_jvp`), tagged, for a key: the static arguments
    of a rule."""
    if isinstance(obj, _STATIC):
        return [("static", type(obj).__name__, obj)]
    if depth > 8:
        return []
    if type(obj).__name__ in ("Unhashable", "Hashable"):  # JAX's wrappers of them
        return _static_values(getattr(obj, "val", None), depth + 1)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    if isinstance(obj, dict):
        obj = list(obj.items())
    if isinstance(obj, (tuple, list)):
        return [v for item in obj for v in _static_values(item, depth + 1)]
    return []


def custom_rule_functions(params: dict[str, Any]) -> tuple:
    """The Python functions defining the rule of a custom-derivative equation.

    Every trace wraps the rule anew (`WrappedFun`s, memoised closures), but the
    functions the user (or JAX's `nn` module) wrote are the same objects from trace
    to trace, so they identify the rule. Empty when none can be found.
    """
    found: list = []
    seen: set[int] = set()

    def walk(obj, depth: int) -> None:
        if depth > 8 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, _ConstOperands):
            walk(obj.thunk, depth + 1)
        elif hasattr(obj, "f") and hasattr(obj, "transforms"):  # a WrappedFun
            walk(obj.f, depth + 1)
            # Static arguments bound to the rule (`nondiff_argnums`) change what it
            # computes without changing its functions.
            for transform in obj.transforms:
                found.extend(_static_values(transform[1:]))
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                walk(item, depth + 1)
        elif isinstance(obj, functools.partial):
            walk(obj.func, depth + 1)
            found.extend(_static_values((obj.args, obj.keywords)))
        elif isinstance(obj, types.FunctionType):
            if obj.__code__.co_filename.endswith(_RULE_WRAPPERS):
                for cell in obj.__closure__ or ():
                    try:
                        walk(cell.cell_contents, depth + 1)
                    except ValueError:  # an empty cell
                        pass
            else:
                found.append(obj)

    for name in ("jvp_jaxpr_fun", "jvp_jaxpr_thunk", "fwd_jaxpr_thunk", "bwd"):
        if name in params:
            walk(params[name], 0)
    return tuple(found)


class _ConstOperands:
    """The JVP-rule thunk of a `custom_jvp_call` equation, with the variables that
    its const operands (the values the function closes over, `nondiff_argnums`
    among them) had in the jaxpr it was traced into."""

    def __init__(self, thunk, const_vars: tuple):
        self.thunk = thunk
        self.const_vars = const_vars

    def __call__(self, *zeros):
        return self.thunk.call_wrapped(*zeros)


def remember_const_operands(params: dict, invars) -> dict:
    """`params` of a `custom_jvp_call` equation whose operands are `invars` (jaxpr
    variables), remembering which variables its const operands were, for
    `rebind_const_operands`."""
    num_consts = params.get("num_consts", 0)
    thunk = params.get("jvp_jaxpr_fun")
    if not num_consts or not isinstance(thunk, jex_lu.WrappedFun):
        return params
    const_vars = tuple(
        None if isinstance(v, _core.Literal) else v for v in invars[:num_consts]
    )
    wrapped = _ConstOperands(thunk, const_vars)
    return dict(
        params, jvp_jaxpr_fun=jex_lu.wrap_init(wrapped, debug_info=thunk.debug_info)
    )


def rebind_const_operands(params: dict) -> dict | None:
    """`params` of a `custom_jvp_call` equation whose JVP rule closes over tracers of
    the trace the equation was recorded in (an array in `nondiff_argnums`, traced
    with the function), rewritten to read those values from the equation's operands.

    The const operands become ordinary ones (`num_consts = 0`) whose tangents the
    rule ignores, as JAX ignores the tangents of `nondiff_argnums`. `None` when the
    thunk did not come through `remember_const_operands`."""
    thunk = params.get("jvp_jaxpr_fun")
    remembered = getattr(thunk, "f", None)
    if not isinstance(remembered, _ConstOperands):
        return None
    const_vars = remembered.const_vars
    num_consts = len(const_vars)
    position = {id(v): k for k, v in enumerate(const_vars) if v is not None}

    def made(*zeros):
        jaxpr, consts, out_zeros = remembered.thunk.call_wrapped(*zeros[num_consts:])
        # The rule's jaxpr reads `consts` through its first inputs: its `constvars`
        # on JAX 0.10, leading `invars` (consts not attached) on JAX 0.11.
        inputs = [*jaxpr.constvars, *jaxpr.invars]
        num_args = len(zeros) - num_consts
        num_tangents = sum(not zero for zero in zeros[num_consts:])
        if len(inputs) != len(consts) + num_args + num_tangents:
            raise TypeError(
                "The JVP rule of a `jax.custom_jvp` function reads an array passed in "
                "its `nondiff_argnums` that was computed inside the differentiated "
                f"function, and JAX {jax.__version__} records that rule in a form "
                "vertex elimination cannot re-read. Pass the array as an ordinary "
                "argument of the `custom_jvp` function instead (JAX recommends "
                "`nondiff_argnums` for non-array values only) and ignore its tangent "
                "in the rule."
            )
        const_inputs, invars = inputs[: len(consts)], inputs[len(consts) :]
        binders: list = [None] * num_consts
        constvars, kept = [], []
        for var, value in zip(const_inputs, consts, strict=True):
            k = position.get(id(getattr(value, "val", None)))
            if isinstance(value, Tracer) and k is not None and binders[k] is None:
                binders[k] = var  # the closed-over value is this operand
            else:
                constvars.append(var)
                kept.append(value)
        for k, var in enumerate(const_vars):
            if binders[k] is None:
                aval = var.aval if var is not None else None
                if aval is None:
                    aval = params["call_jaxpr"].in_avals[k]
                binders[k] = _core.Var(aval)
        tangents = [
            _core.Var(b.aval.to_tangent_aval())
            for b, zero in zip(binders, zeros[:num_consts], strict=True)
            if not zero
        ]
        debug_info = jaxpr.debug_info
        new = jaxpr.replace(
            constvars=constvars,
            invars=[*binders, *invars[:num_args], *tangents, *invars[num_args:]],
            debug_info=debug_info and debug_info.with_unknown_names(),
        )
        return new, kept, out_zeros

    return dict(
        params,
        num_consts=0,
        jvp_jaxpr_fun=jex_lu.wrap_init(made, debug_info=remembered.thunk.debug_info),
    )


def stale_closure(params: dict, num_tangents: int) -> bool:
    """Whether the JVP rule of a `custom_jvp_call` with `params` closes over a tracer
    of a trace that has ended (an argument in `nondiff_argnums` computed while the
    function was traced). Traces the rule (JAX memoises it)."""
    thunk = params.get("jvp_jaxpr_fun")
    if thunk is None:
        return False
    try:
        _, consts, _ = thunk.call_wrapped(*([False] * num_tangents))
    except jax.errors.UnexpectedTracerError:
        return True
    except Exception:  # the rule fails on its own; leave that to its caller
        return False
    live = set()
    trace = _core.trace_ctx.trace
    while trace is not None:
        live.add(id(trace))
        trace = getattr(trace, "parent_trace", None)
    return any(
        isinstance(c, Tracer) and id(getattr(c, "_trace", None)) not in live
        for c in consts
    )


# A value that XLA CPU should compute once. Its fusion pass counts `sin`, `cos` and
# `tan` of real numbers among the cheap operations, which it recomputes inside every
# kernel that reads them rather than write them to memory once: a kinematic chain's
# dozen sines became over a hundred, and most of the run time. Division is not
# cheap to it, so on the CPU `compute_once(x)` is `x` divided by a one XLA cannot
# fold, which it does not duplicate. That is `x` exactly, infinities and NaNs
# included, but for subnormal `x`, which XLA CPU's arithmetic flushes to zero (a sine
# or tangent is subnormal only where its argument is). Elsewhere, and in eager calls,
# it is `x` itself. Its derivative passes tangents through untouched.
def _identity_primitive(name: str) -> jex_core.Primitive:
    """A primitive that is `x` itself, in eager calls and lowered anywhere but where
    a platform lowering is registered for it; its derivative passes tangents through
    untouched, and under `vmap` it takes the batched value whole."""
    prim = jex_core.Primitive(name)
    prim.def_impl(lambda x: x)
    prim.def_abstract_eval(lambda aval: aval)
    _ad.primitive_jvps[prim] = lambda primals, tangents: (
        prim.bind(*primals),
        tangents[0],
    )
    _batching.defvectorized(prim)
    _mlir.register_lowering(prim, lambda ctx, x: [x])
    return prim


compute_once_p = _identity_primitive("compute_once")


def _divide_by_one(x):
    # `x == x` or `x != x` is true for every float, NaN included, but XLA does not
    # fold it, so the division stays.
    one = lax.convert_element_type((x == x) | (x != x), x.dtype)
    return x / one


def _compute_once_cpu(ctx, x):
    if not jax.numpy.issubdtype(ctx.avals_in[0].dtype, jax.numpy.floating):
        return [x]
    return _mlir.lower_fun(_divide_by_one, multiple_results=False)(ctx, x)


_mlir.register_lowering(compute_once_p, _compute_once_cpu, platform="cpu")


def compute_once(x):
    """`x`, computed once by XLA CPU rather than inside each kernel that reads it."""
    return compute_once_p.bind(x)


# A value that XLA CPU should write to memory in a kernel of its own, even where one
# kernel reads it. `compute_once` keeps XLA from copying a computation into several
# readers, but XLA still fuses it into a single reader, and a reader that gathers
# (the structural nonzeros of a batch's dense blocks, say) then evaluates the whole
# computation entry by entry, where written apart it runs vectorised along the
# blocks' last axis: 4x faster on a heart-dipole model's Jacobian blocks. On the CPU
# the value passes through a `cond` whose two branches return it unchanged: XLA
# computes the operands of a conditional before it, into memory. The predicate (the
# value's first entry is NaN; for complex numbers, NaN in both parts; for integers,
# the least integer; for booleans, true) is not known to the compiler; where it
# holds, that entry is written again (a NaN loses its sign and payload). Other
# dtypes (float0, say) pass unchanged. Elsewhere,
# and in eager calls, it is `x` itself; under `vmap`, one `cond` takes the batched
# value whole.
write_apart_p = _identity_primitive("write_apart")


def _through_cond(x):
    corner = lax.slice(x, (0,) * x.ndim, (1,) * x.ndim)
    first = lax.reshape(corner, ())
    dtype = np.dtype(x.dtype)
    # The branch below is taken when the first entry is `marker`, and then writes
    # it again: NaN for floats (whose NaN it replaces, sign and payload lost), NaN
    # in both parts for complex numbers, the least value for integers, true for
    # booleans.
    if jax.numpy.issubdtype(dtype, jax.numpy.floating):
        taken, marker = first != first, np.nan
    elif jax.numpy.issubdtype(dtype, jax.numpy.complexfloating):
        real, imag = lax.real(first), lax.imag(first)
        taken, marker = (real != real) & (imag != imag), complex(np.nan, np.nan)
    elif dtype == np.bool_:
        taken, marker = first, True
    else:
        marker = jax.numpy.iinfo(dtype).min
        taken = first == lax.full_like(first, marker)

    def rewrite_first(a):
        # `a` itself. Two branches XLA can prove equal are merged, and the
        # conditional with them.
        return lax.dynamic_update_slice(a, lax.full_like(corner, marker), (0,) * a.ndim)

    return lax.cond(taken, rewrite_first, lambda a: a, x)


def _write_apart_cpu(ctx, x):
    aval = ctx.avals_in[0]
    numbers = (
        jax.numpy.floating,
        jax.numpy.complexfloating,
        jax.numpy.integer,
        jax.numpy.bool_,
    )
    if aval.size == 0 or not any(jax.numpy.issubdtype(aval.dtype, t) for t in numbers):
        return [x]
    return _mlir.lower_fun(_through_cond, multiple_results=False)(ctx, x)


_mlir.register_lowering(write_apart_p, _write_apart_cpu, platform="cpu")


def write_apart(x):
    """`x`, written to memory by XLA CPU in a kernel of its own."""
    return write_apart_p.bind(x)


# An update slice that XLA CPU (jaxlib 0.10.2) would apply wrongly. XLA applies
# `lax.dynamic_update_slice` in place, in a kernel that also computes the update;
# where the update reads the operand's buffer through another view of it (a reshape
# that XLA turns into a bitcast), that kernel reads entries it has already
# overwritten. Inside a loop body (compiled even in eager calls) the function's own
# values are then wrong, and so are its derivatives by `jax.jacfwd`, since the
# tangents are updated the same way. `update_apart` writes an update to memory in a
# kernel of its own (as `write_apart`), and its tangents and cotangents too.
update_apart_p = jex_core.Primitive("update_apart")
update_apart_p.def_impl(lambda x: x)
update_apart_p.def_abstract_eval(lambda aval: aval)
_ad.deflinear2(update_apart_p, lambda ct, x: [update_apart_p.bind(ct)])
_batching.defvectorized(update_apart_p)
_mlir.register_lowering(update_apart_p, lambda ctx, x: [x])
_mlir.register_lowering(update_apart_p, _write_apart_cpu, platform="cpu")


def _risky_updates(jaxpr) -> frozenset[int]:
    """Positions of the update slices in `jaxpr` whose update is computed from a
    value of the operand's size that the operand is computed from too (the operand
    itself, or a value it may be a view of): XLA may read that value's buffer while
    writing the result into it."""
    updates = [
        k
        for k, eqn in enumerate(jaxpr.eqns)
        if eqn.primitive is lax.dynamic_update_slice_p
        and not isinstance(eqn.invars[1], Literal)
    ]
    if not updates:
        return frozenset()
    sizes = {math.prod(jaxpr.eqns[k].invars[0].aval.shape) for k in updates}
    # Each variable's ancestors of those sizes (itself included), as bits of an
    # integer: one pass over the equations, where sets of variables would take a
    # walk per update (quadratic in a body of thousands of updates).
    bits: dict[int, int] = {}  # size -> bits of the variables of that size
    ancestry: dict[Any, int] = {}

    def own(var) -> int:
        size = math.prod(var.aval.shape)
        if size not in sizes:
            return 0
        bit = 1 << len(ancestry)
        bits[size] = bits.get(size, 0) | bit
        return bit

    def of(atom) -> int:
        return 0 if isinstance(atom, Literal) else ancestry[atom]

    for var in (*jaxpr.constvars, *jaxpr.invars):
        ancestry[var] = own(var)
    for eqn in jaxpr.eqns:
        inherited = 0
        for atom in eqn.invars:
            inherited |= of(atom)
        for var in eqn.outvars:
            ancestry[var] = inherited | own(var)
    risky = set()
    for k in updates:
        operand, update = jaxpr.eqns[k].invars[:2]
        size = math.prod(operand.aval.shape)
        if of(operand) & of(update) & bits.get(size, 0):
            risky.add(k)
    return frozenset(risky)


# Primitives whose bodies `protected_params` rewrites, and the params holding them.
_BODY_PARAMS = {
    lax.scan_p: ("jaxpr",),
    lax.cond_p: ("branches",),
    lax.while_p: ("cond_jaxpr", "body_jaxpr"),
    jit_p: ("jaxpr",),
    closed_call_p: ("call_jaxpr",),
    remat_p: ("jaxpr",),
}


def _bodies_of(eqn) -> list:
    names = _BODY_PARAMS.get(eqn.primitive, ())
    found = []
    for name in names:
        value = eqn.params.get(name)
        found.extend(value if isinstance(value, (tuple, list)) else [value])
    return found


def _needs_protection(jaxpr) -> bool:
    if _risky_updates(jaxpr):
        return True
    for eqn in jaxpr.eqns:
        for body in _bodies_of(eqn):
            inner = body.jaxpr if isinstance(body, ClosedJaxpr) else body
            if isinstance(inner, Jaxpr) and _needs_protection(inner):
                return True
    return False


def _protected_closed(closed):
    jaxpr = closed.jaxpr
    if not _needs_protection(jaxpr):
        return closed
    meshes = {v.aval.sharding.mesh for v in jaxpr.invars if has_mesh(v.aval)}
    if len(meshes) > 1:
        return closed  # pragma: no cover (not re-traced: types on several meshes)
    structs = [
        jax.ShapeDtypeStruct(
            v.aval.shape,
            v.aval.dtype,
            weak_type=v.aval.weak_type,
            sharding=v.aval.sharding if has_mesh(v.aval) else None,
        )
        for v in jaxpr.invars
    ]
    # Typed on the mesh the body's values are on, as they were traced.
    on_mesh = use_abstract_mesh(*meshes) if meshes else contextlib.nullcontext()
    with on_mesh:
        out = jax.make_jaxpr(lambda *a: _eval_protected(jaxpr, closed.consts, a))(
            *structs
        )
    if [v.aval for v in out.jaxpr.outvars] != [v.aval for v in jaxpr.outvars]:
        return closed  # pragma: no cover (re-traced with other types: left as it was)
    return out


def protected_params(prim, params: dict[str, Any]) -> dict[str, Any]:
    """Equation params whose bodies (loops, branches, calls) apply every update
    slice XLA CPU could apply wrongly to an update written apart (`update_apart`),
    recursively; unchanged where there is none."""
    names = _BODY_PARAMS.get(prim, ())
    out = dict(params)
    for name in names:
        value = params.get(name)
        if isinstance(value, ClosedJaxpr):
            out[name] = _protected_closed(value)
        elif isinstance(value, (tuple, list)) and all(
            isinstance(b, ClosedJaxpr) for b in value
        ):
            out[name] = type(value)(_protected_closed(b) for b in value)
        elif isinstance(value, Jaxpr) and not value.constvars:
            closed = _protected_closed(ClosedJaxpr(value, []))
            if not closed.consts:
                out[name] = closed.jaxpr
    return out


def _eval_protected(jaxpr, consts, args) -> list:
    risky = _risky_updates(jaxpr)

    def bind_protected(k, eqn, ins):
        if k in risky:
            ins[1] = update_apart_p.bind(ins[1])
        params = protected_params(eqn.primitive, eqn.params)
        return bind(eqn.primitive, params, *ins)

    return interpret(jaxpr, consts, args, bind_protected)


# Eager constants. Eager JAX computes every operation none of whose operands is
# traced as it goes, so Python may read such values (`if flag > 0` with a closed-over
# array); a jaxpr trace stages them. `jax.ensure_compile_time_eval()` computes them,
# but in every trace nested in it too: the bodies of `jit`, `cond` and `scan` then run
# their constant operations while they are traced, the untaken branch of a `cond`
# included (an `eqx.error_if` raises whatever its predicate). This trace hands them
# to the trace it runs under, as JAX's JVP trace hands on what has no tangent (so
# eagerly they are computed, under `vmap` they meet its named axes), in the traced
# function only, and stages the nested bodies as usual. Operations with effects
# (ordered prints and callbacks) and on mutable references stay staged, in program
# order with the rest. Mirrors `JVPTrace.process_primitive` (JAX 0.10.2).


def _handed_on(primitive, tracers, params) -> tuple | None:
    """The operands' types where the operation is handed on, else `None`."""
    if any(isinstance(x, Tracer) for x in tracers):
        return None
    if getattr(primitive, "ref_primitive", False):
        return None
    avals = tuple(_core.typeof(x) for x in tracers)
    if any(isinstance(a, _AbstractRef) for a in avals):
        return None
    try:
        _, effects = primitive.abstract_eval(*avals, **params)
    except Exception:  # computed as JAX computes it
        return avals
    return None if effects else avals


class _EagerConstantsTrace(_pe.DynamicJaxprTrace):
    __slots__ = ()

    @property
    def _outer(self):
        parent = self.parent_trace
        return _core.eval_trace if parent is None else parent

    def stage_value(self, val):
        if isinstance(val, Tracer):
            return super().stage_value(val)
        return self._outer.stage_value(val)

    def process_primitive(self, primitive, tracers, params, /):
        avals = _handed_on(primitive, tracers, params)
        if avals is None:
            return super().process_primitive(primitive, tracers, params)
        return primitive.bind_with_trace(self._outer, tracers, avals, params)

    def process_custom_jvp_call(self, prim, fun, jvp, tracers, /, *, symbolic_zeros):
        if self.requires_low or any(isinstance(x, Tracer) for x in tracers):
            return super().process_custom_jvp_call(
                prim, fun, jvp, tracers, symbolic_zeros=symbolic_zeros
            )
        avals = tuple(_core.typeof(x) for x in tracers)
        params = dict(subfuns=(fun, jvp), symbolic_zeros=symbolic_zeros)
        return prim.bind_with_trace(self._outer, tuple(tracers), avals, params)

    def process_custom_vjp_call(
        self, prim, fun, fwd, bwd, tracers, /, *, out_trees, symbolic_zeros
    ):
        if self.requires_low or any(isinstance(x, Tracer) for x in tracers):
            return super().process_custom_vjp_call(
                prim,
                fun,
                fwd,
                bwd,
                tracers,
                out_trees=out_trees,
                symbolic_zeros=symbolic_zeros,
            )
        avals = tuple(_core.typeof(x) for x in tracers)
        params = dict(
            subfuns=(fun, fwd, bwd), out_trees=out_trees, symbolic_zeros=symbolic_zeros
        )
        return prim.bind_with_trace(self._outer, tuple(tracers), avals, params)


def staging() -> bool:
    """Whether a trace that stages operations into a jaxpr (`jit`, `make_jaxpr`, the
    body of a loop) is running now, under any others (`vmap`, `jvp`, an eager
    `jacve`'s own trace), which compute what does not depend on their inputs on the
    spot."""
    trace = _core.trace_ctx.trace
    while trace is not None:
        if isinstance(trace, _pe.DynamicJaxprTrace) and not isinstance(
            trace, _EagerConstantsTrace
        ):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


@contextlib.contextmanager
def eager_constants():
    """Within a `jax.make_jaxpr` trace (its traced function calls this), compute
    operations with no traced operand on the spot, as eager JAX does, in the traced
    function only (see `_EagerConstantsTrace`)."""
    trace = _core.trace_ctx.trace
    if type(trace) is not _pe.DynamicJaxprTrace:  # pragma: no cover
        yield
        return
    trace.__class__ = _EagerConstantsTrace
    try:
        yield
    finally:
        trace.__class__ = _pe.DynamicJaxprTrace
