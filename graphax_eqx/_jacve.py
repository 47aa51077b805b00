"""`jacve`, `value_and_jacve` and `make_graph`: the public entry points."""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding

from . import _jax_private as jp
from ._eliminate import real_add, real_product, run_order, sim_edge, simulate
from ._graph import EdgeGraph, Lit, Program, Structure, analyse, evaluate, inline
from ._indexed import CooTensor
from ._orders import normalise_order, resolve
from ._sparse import LinearMap, SparseTensor, from_labeled, to_sparse


#
# Argument handling.
#


def _normalise_argnums(argnums, name: str = "jacve") -> tuple[tuple[int, ...], bool]:
    """(argnums as a tuple, whether results get a tuple over them), as `jax.jacrev`.

    Like JAX: anything `operator.index` accepts is one index, and the result is a
    tuple over arguments unless `argnums` is a Python `int`; any other iterable is a
    sequence of indices.
    """
    try:
        return (operator.index(argnums),), not isinstance(argnums, int)
    except TypeError:
        pass
    try:
        nums = tuple(operator.index(a) for a in argnums)
    except TypeError:
        raise TypeError(
            f"`{name}` got `argnums={argnums!r}`; it must be an int or a sequence of "
            "ints, as for `jax.jacrev`."
        ) from None
    if len(nums) == 0:
        raise ValueError(
            f"`{name}` got `argnums=()`; pass at least one argument index."
        )
    return nums, True


def _check_argnums(argnums: tuple[int, ...], nargs: int, name: str) -> tuple[int, ...]:
    out = []
    for a in argnums:
        if not -nargs <= a < nargs:
            raise ValueError(
                f"`{name}` got `argnums={a}`, but the function was called with {nargs} "
                f"positional argument{'s' if nargs != 1 else ''}: valid indices are "
                f"0..{nargs - 1} (or negative ones counting from the end). Pass the "
                "arguments to differentiate positionally."
            )
        out.append(a % nargs)
    if len(set(out)) != len(out):
        raise ValueError(
            f"`{name}` got `argnums={argnums}`, which names the same argument more "
            "than once; list each argument to differentiate once."
        )
    return tuple(out)


def _as_array(x, where: str, name: str, *, output: bool = False):
    if isinstance(x, jax.Array) or isinstance(x, jp.Tracer):
        return x
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError):  # e.g. a string, which NumPy may parse
        if output:
            fix = (
                f" ({x!r:.60}) from the function, which is not an array. Return arrays "
                "(or pytrees of arrays) from the function, and other objects through "
                "`has_aux=True`."
            )
        else:
            fix = (
                ", which is not an array. Every leaf of the arguments must be a "
                "JAX/NumPy array or a Python scalar; close over other objects instead "
                "(or use `graphax_eqx.filter_jacve`)."
            )
        raise TypeError(
            f"`{name}` got {where} of type {type(x).__name__}{fix}"
        ) from None


def _check_differentiable(x, argnum: int, name: str):
    dtype = jnp.result_type(x)
    if jnp.issubdtype(dtype, jnp.floating):
        return
    if jnp.issubdtype(dtype, jnp.complexfloating):
        problem = "complex"
        fix = (
            "Split it into real and imaginary parts (`x.real`, `x.imag`) and "
            "differentiate with respect to those."
        )
    else:
        problem = "integer or boolean"
        fix = (
            "Leave it out of `argnums` (it is then treated as a constant), or convert "
            "it with `.astype(float)` if you want derivatives with respect to it."
        )
    raise TypeError(
        f"`{name}` can only differentiate with respect to real floating-point inputs, "
        f"but argument {argnum} has a leaf of {problem} dtype {dtype}. {fix}"
    )


#
# Tracing and caching.
#
# Every call traces `fun` afresh, as `jax.jacrev` does, so values the function closes
# over are read anew each time (under `jax.jit` they are fixed when `jit` traces, as
# usual). Only what is expensive and depends on the structure alone is cached: the
# vertex numbering and the resolved elimination orders, keyed on a fingerprint of the
# inlined program in which closed-over arrays are variables, not values.
#


@dataclasses.dataclass
class _Analysis:
    structure: Structure
    orders: dict = dataclasses.field(default_factory=dict)


_ANALYSES: OrderedDict[Any, _Analysis] = OrderedDict()
_MAX_ANALYSES = 256


@dataclasses.dataclass
class _Traced:
    program: Program
    analysis: _Analysis
    out_tree: Any
    aux_tree: Any
    num_out: int
    out_avals: tuple

    @property
    def structure(self) -> Structure:
        return self.analysis.structure


def _param_key(value) -> Any:
    """A hashable stand-in for an equation parameter, equal across re-traces."""
    if isinstance(value, jp.ClosedJaxpr):
        return ("closed_jaxpr", str(value.jaxpr), _avals_key(value.consts))
    if isinstance(value, jp.Jaxpr):
        return ("jaxpr", str(value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_param_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _param_key(v)) for k, v in sorted(value.items())))
    if isinstance(value, np.ndarray):
        return ("ndarray", value.shape, str(value.dtype), value.tobytes())
    if callable(value) and not isinstance(value, type):
        # Rules of custom derivatives are re-created by every trace; the program
        # keeps the current ones, so only their kind matters for the structure.
        return ("callable", getattr(value, "__qualname__", type(value).__qualname__))
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return value


def _avals_key(values) -> tuple:
    return tuple((jnp.shape(v), str(jnp.result_type(v))) for v in values)


def _fingerprint(program: Program) -> tuple:
    """The structure of `program`: everything but its literal and const values."""

    def atom(a):
        if isinstance(a, Lit):
            return ("lit", jnp.shape(a.value), str(jnp.result_type(a.value)))
        return a

    eqns = tuple(
        (
            str(e.prim),
            e.prim,
            tuple(atom(a) for a in e.invars),
            e.outvars,
            tuple((k, _param_key(v)) for k, v in sorted(e.params.items())),
        )
        for e in program.eqns
    )
    avals = tuple((v, shape, str(dtype)) for v, (shape, dtype) in program.avals.items())
    return (
        eqns,
        program.invars,
        tuple(atom(a) for a in program.outvars),
        program.constvars,
        avals,
    )


def _analysis(program: Program, diff_mask, num_out: int) -> _Analysis:
    try:
        key = (_fingerprint(program), tuple(diff_mask), num_out)
        hash(key)
    except TypeError:
        key = None
    found = _ANALYSES.get(key) if key is not None else None
    if found is not None:
        _ANALYSES.move_to_end(key)
        return found
    found = _Analysis(analyse(program, diff_mask, num_out))
    if key is not None:
        _ANALYSES[key] = found
        if len(_ANALYSES) > _MAX_ANALYSES:
            _ANALYSES.popitem(last=False)
    return found


def _trace(fun, treedef, leaves, diff_mask, has_aux, name) -> _Traced:
    """Trace `fun` on `leaves`, keeping their dtypes, weak types and shardings."""
    store = {}

    def flat_fun(*flat):
        args, kwargs = jtu.tree_unflatten(treedef, flat)
        res = fun(*args, **kwargs)
        if has_aux:
            if not (isinstance(res, (tuple, list)) and len(res) == 2):
                raise TypeError(
                    f"`{name}(..., has_aux=True)` expects the function to return a "
                    "pair `(output, aux)`, but it returned "
                    f"{_describe_value(res)}."
                )
            out, aux = res
        else:
            out, aux = res, None
        out_leaves, out_tree = jtu.tree_flatten(out)
        aux_leaves, aux_tree = jtu.tree_flatten(aux)
        out_leaves = [_as_array(o, "an output", name, output=True) for o in out_leaves]
        for o in out_leaves:
            if not jnp.issubdtype(o.dtype, jnp.floating):
                raise TypeError(
                    f"`{name}` needs real floating-point outputs, but the function "
                    f"returned an output of dtype {o.dtype}. Return integer results "
                    "through `has_aux=True` instead."
                )
        aux_leaves = [
            _as_array(a, "an aux output", name, output=True) for a in aux_leaves
        ]
        store.update(out_tree=out_tree, aux_tree=aux_tree, num_out=len(out_leaves))
        return out_leaves + aux_leaves

    closed = jax.make_jaxpr(flat_fun)(*leaves)
    program = inline(closed)
    return _Traced(
        program,
        _analysis(program, diff_mask, store["num_out"]),
        store["out_tree"],
        store["aux_tree"],
        store["num_out"],
        tuple(closed.out_avals),
    )


def _describe_value(x) -> str:
    if isinstance(x, jp.Tracer):
        aval = jax.typeof(x)
        return f"a single array of shape {tuple(aval.shape)} and dtype {aval.dtype}"
    return f"an object of type {type(x).__name__}"


def _weak(x) -> bool:
    aval = jax.typeof(x)
    return bool(getattr(aval, "weak_type", False))


@dataclasses.dataclass
class _Prepared:
    traced: _Traced
    leaves: list
    argnums: tuple[int, ...]
    arg_trees: list
    arg_offsets: list[int]


def _prepare(fun, args, kwargs, argnums, has_aux, name) -> _Prepared:
    argnums = _check_argnums(argnums, len(args), name)
    arg_trees, arg_offsets = [], []
    leaves, offset = [], 0
    for k, arg in enumerate(args):
        arg_leaves, arg_tree = jtu.tree_flatten(arg)
        where = f"a leaf of argument {k}"
        arg_leaves = [_as_array(x, where, name) for x in arg_leaves]
        if k in argnums:
            for x in arg_leaves:
                _check_differentiable(x, k, name)
        arg_trees.append(arg_tree)
        arg_offsets.append(offset)
        offset += len(arg_leaves)
        leaves.extend(arg_leaves)
    kw_leaves, kw_tree = jtu.tree_flatten(kwargs)
    leaves.extend(_as_array(x, "a keyword argument", name) for x in kw_leaves)
    treedef = jtu.tree_structure((tuple(args), kwargs))
    diff_mask = [False] * len(leaves)
    for k in argnums:
        n = arg_trees[k].num_leaves
        for j in range(arg_offsets[k], arg_offsets[k] + n):
            diff_mask[j] = True
    traced = _trace(fun, treedef, leaves, diff_mask, has_aux, name)
    return _Prepared(traced, leaves, argnums, arg_trees, arg_offsets)


#
# The engine.
#


def _eliminate(prep: _Prepared, order_spec):
    traced = prep.traced
    structure = traced.structure
    flat_out, graph, adds0 = evaluate(traced.program, structure, prep.leaves)
    orders = traced.analysis.orders
    order = orders.get(order_spec)
    if order is None:
        sim_graph = graph.copy_with(sim_edge)
        order = resolve(order_spec, sim_graph, structure)
        orders[order_spec] = order
    muls, adds, per_vertex = run_order(graph, order, real_product, real_add)
    counts = {
        "num_muls": int(muls),
        "num_adds": int(adds + adds0),
        "order": [int(v) for v in order],
        "order_counts": [int(m) for m in per_vertex],
    }
    return flat_out, graph, counts


def _zero_block(out_shape, in_shape, dtype, sparse):
    if sparse:
        n = len(out_shape) + len(in_shape)
        return from_labeled(
            jnp.zeros((), dtype), (), out_shape, in_shape, tuple(range(n)), dtype
        )
    return jnp.zeros(tuple(out_shape) + tuple(in_shape), dtype)


def _block(edge, dtype, sparse):
    if isinstance(edge, CooTensor):
        if sparse:
            val = None if edge.val is None else edge.val.astype(dtype)
            return CooTensor(val, edge.pattern, jnp.dtype(dtype), edge.mask)
        return edge.dense().astype(dtype)
    st = to_sparse(edge) if isinstance(edge, LinearMap) else edge
    assert isinstance(st, SparseTensor)
    if sparse:
        val = None if st.val is None else st.val.astype(dtype)
        return SparseTensor(val, st.pattern, jnp.dtype(dtype))
    return st.dense().astype(dtype)


def _diff_leaves(prep: _Prepared) -> list[int]:
    return sorted(
        j
        for k in prep.argnums
        for j in range(
            prep.arg_offsets[k], prep.arg_offsets[k] + prep.arg_trees[k].num_leaves
        )
    )


def _block_keys(prep: _Prepared) -> list[tuple[int, int]]:
    """`(output, leaf)` of each Jacobian leaf, in the order `_assemble` makes them."""
    return [
        (o, j)
        for o in range(prep.traced.num_out)
        for k in prep.argnums
        for j in range(
            prep.arg_offsets[k], prep.arg_offsets[k] + prep.arg_trees[k].num_leaves
        )
    ]


def _assemble(prep: _Prepared, graph: EdgeGraph, as_tuple: bool, sparse: bool):
    traced = prep.traced
    structure = traced.structure
    # Input vertices are numbered in flat-leaf order, whatever the order of argnums.
    input_vid = dict(zip(_diff_leaves(prep), structure.inputs, strict=True))
    per_output = []
    for o in range(traced.num_out):
        out_vid = structure.outputs[o]
        out_shape = tuple(traced.out_avals[o].shape)
        per_arg = []
        for k in prep.argnums:
            blocks = []
            start = prep.arg_offsets[k]
            for j in range(start, start + prep.arg_trees[k].num_leaves):
                x = prep.leaves[j]
                dtype = jnp.result_type(x)
                edge = None
                if out_vid is not None:
                    edge = graph.succ[input_vid[j]].get(out_vid)
                if edge is None:
                    block = _zero_block(out_shape, jnp.shape(x), dtype, sparse)
                else:
                    block = _block(edge, dtype, sparse)
                if not sparse and _weak(x):
                    # As `jax.jacrev`: the derivative w.r.t. a Python scalar is weak.
                    block = jp.as_weak_type(block)
                blocks.append(block)
            per_arg.append(jtu.tree_unflatten(prep.arg_trees[k], blocks))
        per_output.append(tuple(per_arg) if as_tuple else per_arg[0])
    return jtu.tree_unflatten(traced.out_tree, per_output)


def _outputs(prep: _Prepared, flat_out):
    traced = prep.traced
    vals = [
        jp.as_weak_type(jnp.asarray(v, dtype=aval.dtype))
        if getattr(aval, "weak_type", False)
        else jnp.asarray(v, dtype=aval.dtype)
        for v, aval in zip(flat_out, traced.out_avals, strict=True)
    ]
    out = jtu.tree_unflatten(traced.out_tree, vals[: traced.num_out])
    aux = jtu.tree_unflatten(traced.aux_tree, vals[traced.num_out :])
    return out, aux


def _run(prep: _Prepared, order_spec, as_tuple: bool, sparse: bool):
    flat_out, graph, counts = _eliminate(prep, order_spec)
    jac = _assemble(prep, graph, as_tuple, sparse)
    out, aux = _outputs(prep, flat_out)
    return jac, out, aux, counts


#
# Sharded inputs.
#
# On a mesh with explicit axes every operation's sharding is type-checked. The
# engine's products, masks and identity blocks combine an input's sharding with new
# axes in ways that check refuses (a diagonal's value sharded on one axis meets an
# iota sharded on another; a contraction over axes sharded on both sides), while the
# partitioner places them well by itself. So, rather than make every emitted operation
# sharding-aware, the engine runs with the explicit axes turned auto (the equations of
# the traced program converted to that mesh), and its results are resharded to the
# types `jax.jacrev` gives: values as the function's outputs, Jacobian leaves as
# `jax.jacrev`'s, read from an abstract `jax.jacrev` of the traced program.
#


def _run_program(program: Program, leaves) -> list:
    """The primal outputs of `program` (its equations bound as traced)."""
    env: dict[int, Any] = dict(zip(program.constvars, program.consts, strict=True))
    env.update(zip(program.invars, leaves, strict=True))

    def read(atom):
        return atom.value if isinstance(atom, Lit) else env[atom]

    for eqn in program.eqns:
        outs = jp.bind(eqn.prim, eqn.params, *[read(a) for a in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(a) for a in program.outvars]


def _jacrev_shardings(prep: _Prepared, axes: jp.AutoAxes) -> dict[tuple[int, int], Any]:
    """`{(output, leaf): sharding}` of the leaves `jax.jacrev` would return."""
    traced = prep.traced
    diff = _diff_leaves(prep)

    def primal(*leaves):
        return _run_program(traced.program, leaves)[: traced.num_out]

    try:
        types = jax.eval_shape(jax.jacrev(primal, argnums=tuple(diff)), *prep.leaves)
    except Exception:  # where `jax.jacrev` fails, its usual layout, below
        types = None
    out = {}
    for o in range(traced.num_out):
        out_ndim = len(traced.out_avals[o].shape)
        for pos, j in enumerate(diff):
            sharding = None if types is None else types[o][pos].sharding
            if sharding is None:
                # `jax.jacrev` maps the pullback over an unsharded basis: the output
                # axes are unsharded, the input axes sharded as the cotangent, which
                # is the input's sharding unless the function moves it.
                leaf = jax.typeof(prep.leaves[j])
                spec = jp.spec_of(leaf.sharding, leaf.ndim)
                sharding = NamedSharding(
                    axes.explicit, jp.trimmed_spec((None,) * out_ndim + spec)
                )
            out[(o, j)] = sharding
    return out


def _auto_prep(prep: _Prepared, axes: jp.AutoAxes) -> _Prepared:
    """`prep` on the auto mesh (call inside `jp.auto_mesh(axes)`)."""
    program = prep.traced.program
    program = dataclasses.replace(
        program,
        eqns=tuple(
            dataclasses.replace(e, params=jp.auto_params(e.params, axes, e.prim))
            for e in program.eqns
        ),
        consts=tuple(jp.to_auto(c, axes) for c in program.consts),
    )
    traced = dataclasses.replace(prep.traced, program=program)
    leaves = [jp.to_auto(x, axes) for x in prep.leaves]
    return dataclasses.replace(prep, traced=traced, leaves=leaves)


def _sparse_from_auto(
    st: SparseTensor | CooTensor, target, axes: jp.AutoAxes
) -> SparseTensor:
    """`st` with its value (and mask) sharded as the dense leaf would be on its axes.

    Each value axis takes the sharding of the last Jacobian axis it indexes (an input
    axis where it has one, as in `jax.jacrev`'s layout), each mesh axis used once.
    """
    if isinstance(st, CooTensor):
        # Values laid out by entry: replicated, as no Jacobian axis indexes them.
        sharding = NamedSharding(axes.explicit, jp.trimmed_spec([]))
        return jtu.tree_map(lambda v: jp.from_auto(v, sharding, axes), st)
    p = st.pattern
    full = jp.spec_of(target, len(p.shape))
    used: set = set()
    entries = []
    for label in p.val_labels:
        entry = full[max(k for k, c in enumerate(p.labels) if c == label)]
        names = set(entry if isinstance(entry, tuple) else (entry,)) - {None}
        if used & names:
            entry = None
        used |= names
        entries.append(entry)
    sharding = NamedSharding(axes.explicit, jp.trimmed_spec(entries))
    return jtu.tree_map(lambda v: jp.from_auto(v, sharding, axes), st)


def _run_auto(prep: _Prepared, axes: jp.AutoAxes, order_spec, as_tuple, sparse):
    """`_run` with `axes` turned auto, results resharded as `jax.jacrev`'s."""
    targets = _jacrev_shardings(prep, axes)
    with jp.auto_mesh(axes):
        auto = _auto_prep(prep, axes)
        flat_out, graph, counts = _eliminate(auto, order_spec)
        jac = _assemble(auto, graph, as_tuple, sparse)
    blocks, jac_tree = jtu.tree_flatten(
        jac, is_leaf=lambda x: isinstance(x, (SparseTensor, CooTensor))
    )
    keys = _block_keys(prep)
    assert len(blocks) == len(keys)
    if sparse:
        blocks = [_sparse_from_auto(b, targets[k], axes) for b, k in zip(blocks, keys)]
    else:
        blocks = [jp.from_auto(b, targets[k], axes) for b, k in zip(blocks, keys)]
    flat_out = [
        jp.from_auto(v, getattr(aval, "sharding", None), axes)
        for v, aval in zip(flat_out, prep.traced.out_avals, strict=True)
    ]
    out, aux = _outputs(prep, flat_out)
    return jtu.tree_unflatten(jac_tree, blocks), out, aux, counts


def _eager_layout(prep: _Prepared, jac):
    """Eager calls on a mesh with auto axes: Jacobian leaves laid out as `jax.jacrev`'s.

    There, shardings are not part of types and the partitioner places results. Eager
    `jax.jacrev` leaves come out with the output axes unsharded and the input axes
    sharded as the input, and the engine's, left to itself, often the other way
    round; under a trace nothing is known about the inputs' placement, so only eager
    results are moved.
    """
    mesh = jp.eager_auto_mesh(prep.leaves)
    if mesh is None:
        return jac
    blocks, tree = jtu.tree_flatten(jac)
    keys = _block_keys(prep)
    assert len(blocks) == len(keys)
    moved = []
    for block, (o, j) in zip(blocks, keys, strict=True):
        out_ndim = len(prep.traced.out_avals[o].shape)
        spec = (None,) * out_ndim + jp.concrete_spec(prep.leaves[j], mesh)
        moved.append(jax.device_put(block, NamedSharding(mesh, jp.trimmed_spec(spec))))
    return jtu.tree_unflatten(tree, moved)


class _JacVE:
    """The callable returned by `jacve` / `value_and_jacve`."""

    def __init__(
        self, fun, order, argnums, has_aux, count_ops, sparse, with_value, name
    ):
        if not callable(fun):
            raise TypeError(f"`{name}` expects a callable, got {type(fun).__name__}.")
        self.fun = fun
        self.order_spec = normalise_order(order, name)
        self.argnums, self.as_tuple = _normalise_argnums(argnums, name)
        self.has_aux = has_aux
        self.count_ops = count_ops
        self.sparse = sparse
        self.with_value = with_value
        self.name = name
        functools.update_wrapper(self, fun, updated=())

    def __call__(self, *args, **kwargs):
        prep = _prepare(self.fun, args, kwargs, self.argnums, self.has_aux, self.name)
        program = prep.traced.program
        axes = jp.explicit_axes(
            list(prep.leaves) + list(program.consts), [e.params for e in program.eqns]
        )
        if axes is None:
            jac, out, aux, counts = _run(
                prep, self.order_spec, self.as_tuple, self.sparse
            )
            if not self.sparse:
                jac = _eager_layout(prep, jac)
        else:
            jac, out, aux, counts = _run_auto(
                prep, axes, self.order_spec, self.as_tuple, self.sparse
            )
        if self.with_value:
            result = ((out, aux) if self.has_aux else out), jac
        else:
            result = (jac, aux) if self.has_aux else jac
        if self.count_ops:
            return result, counts
        return result


def jacve(
    fun: Callable,
    order: str | Sequence[int] = "auto",
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    count_ops: bool = False,
    sparse_representation: bool = False,
) -> Callable:
    """The Jacobian of `fun`, computed by vertex elimination.

    `fun` is traced to a jaxpr; every variable becomes a vertex of a computational
    graph whose edges carry structured local partial Jacobians. Eliminating the
    intermediate vertices in `order` leaves the Jacobian on the edges from inputs to
    outputs. Forward and reverse mode are two particular orders; others can need far
    fewer multiplications.

    The result is laid out exactly like `jax.jacrev(fun, argnums=argnums)(*args)`:
    output pytree outermost, then a tuple over `argnums` if `argnums` is a tuple,
    then each argument's pytree, with leaves of shape `out.shape + in.shape`.

    **Arguments:**

    - `fun`: a function of arrays / pytrees of arrays returning a pytree of
        floating-point arrays. It is traced like under `jax.jit`, so Python control
        flow must not depend on array values (use `jax.lax.cond` and friends).
    - `order`: `"fwd"` (or `"forward"`), `"rev"` (or `"reverse"`), one of the
        greedy heuristics `"markowitz"` (eliminate the currently cheapest vertex),
        `"relative_markowitz"` or `"min_fill"` (see `docs/orders.md`), `"auto"`
        (the better of fwd and rev, unless a heuristic is predicted at least 10%
        cheaper; decided from the graph's structure alone), a sequence of vertex
        ids as listed by `graphax_eqx.make_graph`, or a `graphax_eqx.Order` from
        `graphax_eqx.search_order` / `graphax_eqx.load_order`. Names are
        case-insensitive (`"Markowitz"` works). An explicit sequence lists every
        intermediate vertex once, except that vertices whose values are outputs
        may be left out (as in orders written for the original graphax and
        AlphaGrad): those are eliminated last, in ascending order. Sets and dicts
        are refused, having no order.
    - `argnums`: an int or a sequence of ints (tuple, list, `range`): which
        positional arguments to differentiate. Their leaves must be real
        floating-point arrays. As for `jax.jacrev`, the result holds a tuple over
        arguments unless `argnums` is a Python `int` (a NumPy integer gives a
        1-tuple).
    - `has_aux`: if `True`, `fun` returns `(output, aux)`; the result is
        `(jacobian, aux)`.
    - `count_ops`: if `True`, the result becomes `(result, counts)`, with `counts` a
        dict of Python ints: `"num_muls"`, `"num_adds"`, `"order"` (vertex ids in
        elimination order) and `"order_counts"` (multiplications per eliminated
        vertex).
    - `sparse_representation`: if `True`, Jacobian leaves keep their structure
        instead of being dense arrays: `graphax_eqx.SparseTensor`s (diagonals,
        ties, broadcasts) or, where slices, pads, rolls, gathers, scatter-adds or
        convolutions with indices known at trace time shaped the block,
        `graphax_eqx.CooTensor`s (ties plus static coordinates). Both have
        `.dense()` and `.to_bcoo()`.

    **Returns:**

    A function taking the same arguments as `fun` and returning its Jacobian.

    **Example:**

    ```python
    import jax.numpy as jnp
    import graphax_eqx as gx

    def f(x, y):
        return jnp.sin(x) * y, jnp.sum(x**2)

    jac = gx.jacve(f, order="markowitz", argnums=(0, 1))(jnp.ones(3), 2.0)
    ```
    """
    return _JacVE(
        fun, order, argnums, has_aux, count_ops, sparse_representation, False, "jacve"
    )


def value_and_jacve(
    fun: Callable,
    order: str | Sequence[int] = "auto",
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    count_ops: bool = False,
    sparse_representation: bool = False,
) -> Callable:
    """The value of `fun` and its Jacobian, computed in one pass.

    Same arguments as `graphax_eqx.jacve`. The primal outputs are a by-product of
    building the graph, so this costs no more than `jacve`.

    **Returns:**

    A function returning `(value, jacobian)`, or `((value, aux), jacobian)` when
    `has_aux=True` (and `(that, counts)` when `count_ops=True`).
    """
    return _JacVE(
        fun,
        order,
        argnums,
        has_aux,
        count_ops,
        sparse_representation,
        True,
        "value_and_jacve",
    )


#
# Graph inspection.
#


@dataclasses.dataclass(frozen=True)
class Vertex:
    """A vertex of the computational graph.

    `kind` is `"input"` (negative ids), `"intermediate"` (ids `1..N`, the ones an
    order eliminates) or `"output"` (ids above `N`). `primitive` names the JAX
    primitive defining an intermediate.
    """

    id: int
    kind: str
    primitive: str | None
    shape: tuple[int, ...]
    dtype: Any


@dataclasses.dataclass(frozen=True)
class Edge:
    """An edge `src → dst` carrying `∂dst/∂src`; `structure` describes its pattern."""

    src: int
    dst: int
    structure: str


@dataclasses.dataclass(frozen=True)
class Graph:
    """The computational graph of a function, after inlining and pruning.

    **Attributes:**

    - `vertices`: every `graphax_eqx.Vertex`, inputs first.
    - `edges`: every `graphax_eqx.Edge` with its partial's structure.
    - `intermediates`: the ids an explicit order must list, each exactly once.
    - `outputs`: the output vertex ids.
    """

    vertices: tuple[Vertex, ...]
    edges: tuple[Edge, ...]
    intermediates: tuple[int, ...]
    outputs: tuple[int, ...]
    _sim: EdgeGraph = dataclasses.field(repr=False, compare=False)
    _structure: Structure = dataclasses.field(repr=False, compare=False)

    def counts(self, order: str | Sequence[int] = "auto") -> dict[str, Any]:
        """The operation counts `jacve(..., count_ops=True)` would report for `order`.

        Computed from the structure alone, without any arithmetic.
        """
        spec = normalise_order(order, "Graph.counts")
        ids = resolve(spec, self._sim, self._structure)
        muls, adds, per = simulate(self._sim, ids)
        return {"num_muls": muls, "num_adds": adds, "order": ids, "order_counts": per}

    def __str__(self) -> str:
        lines = [
            f"Graph: {sum(v.kind == 'input' for v in self.vertices)} inputs, "
            f"{len(self.intermediates)} intermediates, {len(self.outputs)} outputs, "
            f"{len(self.edges)} edges"
        ]
        incoming: dict[int, list[Edge]] = {}
        for e in self.edges:
            incoming.setdefault(e.dst, []).append(e)
        for v in self.vertices:
            shape = "x".join(map(str, v.shape)) or "scalar"
            head = f"  {v.id:>4} {v.kind:<12} {v.primitive or '':<22} {shape} {v.dtype}"
            lines.append(head.rstrip())
            for e in incoming.get(v.id, []):
                lines.append(f"         <- {e.src:>4}  {e.structure}")
        return "\n".join(lines)


def _describe(edge) -> str:
    if isinstance(edge, LinearMap):
        p = edge.pattern
        return f"LinearMap({p.out_shape} <- {p.in_shape}, {p.muls} muls per use)"
    return repr(edge)


def make_graph(
    fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., Graph]:
    """The computational graph `graphax_eqx.jacve` would eliminate.

    Nothing is computed: the graph is built abstractly (`jax.eval_shape`). Use it to
    find vertex ids for an explicit order, or to see why an order is expensive.

    **Arguments:**

    - `fun`: the function, as for `graphax_eqx.jacve`.
    - `argnums`: which positional arguments are differentiated.
    - `has_aux`: as for `graphax_eqx.jacve`: `fun` returns `(output, aux)` and
        only `output` is differentiated, so work that feeds only `aux` is not part
        of the graph.

    **Returns:**

    A function taking `fun`'s arguments and returning a `graphax_eqx.Graph`.
    Its `str()` is a readable summary; `graph.counts(order)` gives the operation counts
    of an order.

    **Example:**

    ```python
    graph = gx.make_graph(f)(x)
    summary = str(graph)  # one line per vertex, with its incoming edges
    order = list(reversed(graph.intermediates))
    ```
    """
    argnums_t, _ = _normalise_argnums(argnums, "make_graph")

    def build(*args, **kwargs) -> Graph:
        prep = _prepare(fun, args, kwargs, argnums_t, has_aux, "make_graph")
        traced = prep.traced
        structure = traced.structure
        captured = {}

        def abstract(*leaves):
            _, graph, _ = evaluate(traced.program, structure, list(leaves))
            captured["graph"] = graph
            return 0

        jax.eval_shape(abstract, *prep.leaves)
        graph = captured["graph"]
        vertices = []
        for v in sorted(
            structure.shape_of, key=lambda v: (v >= 0, abs(v) if v < 0 else v)
        ):
            if v < 0:
                kind = "input"
            elif v in structure.output_sources:
                kind = "output"
            else:
                kind = "intermediate"
            prim = structure.primitive_of.get(v)
            vertices.append(
                Vertex(
                    v,
                    kind,
                    None if kind != "intermediate" else prim,
                    structure.shape_of[v],
                    jnp.dtype(structure.dtype_of[v]),
                )
            )
        edges = tuple(
            Edge(u, w, _describe(e))
            for u, row in sorted(graph.succ.items())
            for w, e in sorted(row.items())
        )
        outputs = tuple(o for o in structure.outputs if o is not None)
        return Graph(
            tuple(vertices),
            edges,
            structure.intermediates,
            outputs,
            graph.copy_with(sim_edge),
            structure,
        )

    return build
