"""`jacve`, `value_and_jacve` and `make_graph`: the public entry points."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import logging
import math
import operator
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.extend.linear_util as jex_lu
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding, get_abstract_mesh

from . import _jax_private as jp
from ._band import BandTensor, to_result_coo
from ._eliminate import real_add, real_product, run_order, sim_edge, simulate
from ._graph import (
    EdgeGraph,
    Lit,
    Program,
    Structure,
    analyse,
    custom_couplings,
    evaluate,
    inline,
    shaping_vars,
)
from ._indexed import (
    CooPattern,
    CooTensor,
    plain_tensor,
    restore_exact,
    settle_known_blocks,
    sums_as_gathers,
)
from ._orders import graph_fingerprint, normalise_order, resolve
from ._rules._base import Same
from ._sparse import LinearMap, SparseTensor, compute_selected_once, to_sparse


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
        if nargs == 0:
            raise ValueError(
                f"`{name}` got `argnums={a}`, but the function was called without "
                "positional arguments, so there is nothing to differentiate. Pass "
                "the arguments to differentiate positionally."
            )
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
    elif jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        problem = "PRNG key"
        fix = (
            "Keys have no derivative: leave the key's argument out of `argnums` "
            "(it is then treated as a constant)."
        )
    elif dtype == jax.dtypes.float0:
        raise TypeError(
            f"`{name}` can only differentiate with respect to real floating-point "
            f"inputs, but argument {argnum} has a leaf of dtype float0, the type of "
            "the tangents of integer values, which holds no numbers to "
            "differentiate. Leave it out of `argnums`."
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
# inlined program in which closed-over arrays are variables, not values (and, for
# eager calls, a compiled run of the engine: see "Eager calls, compiled" below).
#


@dataclasses.dataclass
class _Analysis:
    structure: Structure
    orders: OrderedDict = dataclasses.field(default_factory=OrderedDict)
    plan: _Plan | None = None  # how a compiled eager run takes values, made once
    callbacks: bool | None = None  # whether the program calls back to Python
    on_arrays: bool | None = None  # whether any operation is on arrays, not scalars
    # (order, sparse) pairs that eager calls have come with, for this structure
    keyed: set[tuple[Any, bool]] = dataclasses.field(default_factory=set)


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
    # Aux leaves the trace did not touch (NumPy arrays, Python objects, arrays
    # computed outside `fun`), by position: returned as they are, as `jax.jacrev`
    # returns them outside `jit`.
    static_aux: dict[int, Any]
    # Output leaves the trace did not touch (a Python float, a NumPy scalar): the
    # values `value_and_jacve` returns as they are, as `jax.value_and_grad` does.
    static_out: dict[int, Any]

    @property
    def structure(self) -> Structure:
        return self.analysis.structure


def _param_key(value) -> Any:
    """A hashable stand-in for an equation parameter, equal across re-traces."""
    if isinstance(value, jp.ClosedJaxpr):
        return ("closed_jaxpr", jp.jaxpr_text(value.jaxpr), _avals_key(value.consts))
    if isinstance(value, jp.Jaxpr):
        return ("jaxpr", jp.jaxpr_text(value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_param_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _param_key(v)) for k, v in sorted(value.items())))
    if isinstance(value, np.ndarray):
        return ("ndarray", value.shape, str(value.dtype), value.tobytes())
    if isinstance(value, jex_lu.WrappedFun):
        # A custom rule as JAX wraps it, anew on every trace: its name stands for it.
        return ("wrapped", getattr(value.debug_info, "func_name", None))
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
    # What the custom rules say of their outputs shapes the graph too: two rules of
    # one name and body may route their tangents differently.
    couplings = None
    if any(e.prim in jp.CUSTOM_CALLS and len(e.outvars) > 1 for e in program.eqns):
        couplings = custom_couplings(program, diff_mask)
    try:
        key = (
            _fingerprint(program),
            tuple(diff_mask),
            num_out,
            () if couplings is None else tuple(sorted(couplings[1].items())),
        )
        hash(key)
    except TypeError:
        key = None
    found = _ANALYSES.get(key) if key is not None else None
    if found is not None:
        _ANALYSES.move_to_end(key)
        return found
    found = _Analysis(analyse(program, diff_mask, num_out, couplings))
    if key is not None:
        _remember(_ANALYSES, key, found, _MAX_ANALYSES)
    return found


def named_after(wrapper, fun) -> None:
    """Let JAX's tracing errors name `fun` (and where it is defined) instead of
    `wrapper`, an internal function that calls it."""
    target = fun
    if not hasattr(target, "__code__"):
        # A callable object (an Equinox module, say): its `__call__`.
        call = getattr(type(fun), "__call__", None)
        if hasattr(call, "__code__"):
            target = call
    wrapper.__wrapped__ = target


_LEAVES_SIGNATURE = inspect.Signature(
    [inspect.Parameter("leaves", inspect.Parameter.VAR_POSITIONAL)]
)


def _trace(fun, rebuild, leaves, has_aux, name) -> _Traced:
    """Trace `fun` on `leaves` (every one differentiated), keeping their dtypes, weak
    types and shardings; `rebuild(leaves)` gives `fun`'s positional and keyword
    arguments."""
    store = {}

    def flat_fun(*flat):
        args, kwargs = rebuild(flat)
        with jp.eager_constants() if eager else contextlib.nullcontext():
            res = fun(*args, **kwargs)
        store["returned"] = True
        out, aux = _split_result(res, has_aux, name)
        out_leaves, out_tree = jtu.tree_flatten(out)
        aux_leaves, aux_tree = jtu.tree_flatten(aux)
        static_out = {
            k: o for k, o in enumerate(out_leaves) if not isinstance(o, jp.Tracer)
        }
        out_leaves = _checked_outputs(out_leaves, name)
        static_aux = {
            k: a for k, a in enumerate(aux_leaves) if not isinstance(a, jp.Tracer)
        }
        aux_leaves = [a for a in aux_leaves if isinstance(a, jp.Tracer)]
        store.update(
            out_tree=out_tree,
            aux_tree=aux_tree,
            num_out=len(out_leaves),
            static_aux=static_aux,
            static_out=static_out,
        )
        return out_leaves + aux_leaves

    named_after(flat_fun, fun)
    # The differentiated leaves are then named `leaves[i]` (`jax.tree.leaves` order).
    flat_fun.__signature__ = _LEAVES_SIGNATURE  # pyright: ignore[reportFunctionMemberAccess]
    # Eager `jax.jacrev` computes what does not depend on the differentiated
    # arguments as it goes, so Python may read such values (`if y > 0`, `float(n *
    # 2)`), and `fun` runs once. Outside `jit` (eagerly, under `vmap`), `fun` is
    # traced that way: in `fun` itself, while the bodies of the `jit`, `cond`...
    # nested in it are staged, as eagerly. Under `jit` such values are staged, as
    # JAX stages them, and Python reading one raises JAX's own error.
    eager = not jp.staging()
    try:
        closed = jax.make_jaxpr(flat_fun)(*leaves)
    except _VALUE_DEPENDENT as e:
        # Raised inside `fun` (not by the checks of what it returned), outside
        # `jit`: possibly Python reading a value (`if x > 0`, `jnp.zeros(n)`).
        if not eager or store.get("returned"):
            raise
        raise _ValueDependent() from e
    program = inline(closed)
    return _Traced(
        program,
        _analysis(program, [True] * len(leaves), store["num_out"]),
        store["out_tree"],
        store["aux_tree"],
        store["num_out"],
        tuple(closed.out_avals),
        store["static_aux"],
        store["static_out"],
    )


# What tracing raises where Python needs the value of a differentiated argument:
# JAX's tracer errors (`ConcretizationTypeError`, `TracerArrayConversionError`,
# `NonConcreteBooleanIndexError`) and the plain errors of functions handed a tracer
# where they take a static value (`jnp.zeros(n)`, `x[: n]`, `jnp.tile(x, n)`) are
# all of these two kinds.
_VALUE_DEPENDENT = (TypeError, IndexError)


def _split_result(res, has_aux: bool, name: str):
    """`(output, aux)` of what `fun` returned."""
    if not has_aux:
        return res, None
    if not (isinstance(res, (tuple, list)) and len(res) == 2):
        raise TypeError(
            f"`{name}(..., has_aux=True)` expects the function to return a "
            f"pair `(output, aux)`, but it returned {_describe_value(res)}."
        )
    return res[0], res[1]


def _checked_outputs(out_leaves, name: str) -> list:
    """`fun`'s output leaves as arrays, which must be real floating point."""
    out_leaves = [_as_array(o, "an output", name, output=True) for o in out_leaves]
    for o in out_leaves:
        if not jnp.issubdtype(o.dtype, jnp.floating):
            if jnp.issubdtype(o.dtype, jnp.complexfloating):
                fix = (
                    "Return its real and imaginary parts (`jnp.real(y)`, "
                    "`jnp.imag(y)`) as separate outputs instead."
                )
            else:
                fix = "Return non-float results through `has_aux=True` instead."
            raise TypeError(
                f"`{name}` needs real floating-point outputs, but the function "
                f"returned an output of dtype {o.dtype}. {fix}"
            )
    return out_leaves


class _ValueDependent(Exception):
    """Raised by `_trace` outside `jit` where `fun`'s Python reads the value of a
    differentiated argument (`if x.sum() > 0`); its cause is what tracing raised."""


def _describe_value(x) -> str:
    if isinstance(x, jp.Tracer):
        aval = jax.typeof(x)
        return f"a single array of shape {tuple(aval.shape)} and dtype {aval.dtype}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)} elements, not 2"
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
    """Check the arguments and trace `fun` on them.

    As in `jax.jacrev`, only the differentiated arguments are traced: the others and
    the keyword arguments reach `fun` as they were passed (a Python integer stays one,
    so it can size a loop or a shape), and arrays among them are closed over.
    """
    argnums = _check_argnums(argnums, len(args), name)
    arg_trees, arg_offsets = [], []
    leaves, offset = [], 0
    for k, arg in enumerate(args):
        arg_offsets.append(offset)
        if k not in argnums:
            arg_trees.append(None)
            continue
        arg_leaves, arg_tree = jtu.tree_flatten(arg)
        where = f"a leaf of argument {k}"
        arg_leaves = [_as_array(x, where, name) for x in arg_leaves]
        for x in arg_leaves:
            _check_differentiable(x, k, name)
        arg_trees.append(arg_tree)
        offset += len(arg_leaves)
        leaves.extend(arg_leaves)

    def rebuild(flat):
        rebuilt = list(args)
        for k in argnums:
            start = arg_offsets[k]
            stop = start + arg_trees[k].num_leaves
            rebuilt[k] = jtu.tree_unflatten(arg_trees[k], flat[start:stop])
        return rebuilt, kwargs

    traced = _trace(fun, rebuild, leaves, has_aux, name)
    return _Prepared(traced, leaves, argnums, arg_trees, arg_offsets)


#
# The engine.
#


def _eliminate(prep: _Prepared, order_spec, known: frozenset[int] = frozenset()):
    traced = prep.traced
    structure = traced.structure
    flat_out, graph, adds0 = evaluate(
        traced.program, structure, prep.leaves, known, _plan(traced).indices
    )
    orders = traced.analysis.orders
    key = _orders_key(prep, order_spec, known)
    order = None if key is None else orders.get(key)
    if order is None:
        sim_graph = graph.copy_with(sim_edge)
        order = resolve(
            order_spec,
            sim_graph,
            structure,
            abstract_fingerprint=functools.partial(_abstract_fingerprint, prep),
        )
        if key is not None:
            _remember(orders, key, order, _MAX_ORDERS)
    prepare = None
    if graph.densified:
        inter = list(structure.intermediates)
        if list(order) != inter and list(order) != inter[::-1]:
            settle_known_blocks(graph, masked=True)
        else:
            prepare = compute_selected_once
    with sums_as_gathers():
        muls, adds, per_vertex = run_order(
            graph, order, real_product, real_add, prepare
        )
    if graph.densified:
        settle_known_blocks(graph, masked=False)
    if graph.exact:
        restore_exact(graph)
    counts = {
        "num_muls": int(muls),
        "num_adds": int(adds + adds0),
        "order": [int(v) for v in order],
        "order_counts": [int(m) for m in per_vertex],
    }
    return flat_out, graph, counts


_MAX_ORDERS = 16


def _abstract_fingerprint(prep: _Prepared) -> str:
    """The fingerprint of `prep`'s graph built abstractly, as `search_order` builds
    it. An eager call whose differentiated inputs shape the graph (indices from an
    `argsort` of them) reads those index maps by value, so its own graph's patterns
    differ from the searched one's."""
    graph, _ = _abstract_evaluation(prep)
    return graph_fingerprint(graph.copy_with(sim_edge), prep.traced.structure)


def _abstract_evaluation(prep: _Prepared) -> tuple[EdgeGraph, int]:
    """`prep`'s graph of partials built abstractly (its partials hold abstract
    values: read only their static parts) and the additions made building it."""
    traced = prep.traced
    shaping = _plan(traced).indices
    captured = {}

    def abstract(*leaves):
        _, graph, adds = evaluate(
            traced.program, traced.structure, list(leaves), shaping=shaping
        )
        captured.update(graph=graph, adds=int(adds))
        return 0

    jax.eval_shape(abstract, *prep.leaves)
    return captured["graph"], captured["adds"]


def _orders_key(prep: _Prepared, order_spec, known: frozenset[int] = frozenset()):
    """What an order resolved on `prep`'s graph is cached under, beside the analysis:
    `order_spec` and the values the partials' patterns are computed from (literals,
    and the leaves and consts the plan bakes in: static indices, masks), which the
    analysis's fingerprint leaves out, and how the graph was evaluated (which inputs
    are traced, which variables `known`). `None` where they cannot be keyed."""
    program = prep.traced.program
    plan = _plan(prep.traced)
    parts = []

    def add(x) -> None:
        if isinstance(x, jp.Tracer):
            parts.append(("traced", jnp.shape(x), str(jnp.result_type(x))))
            return
        a, data = _value_bytes(x)
        parts.append((a.shape, a.dtype.str, data))

    try:
        for eqn in program.eqns:
            for a in eqn.invars:
                if isinstance(a, Lit):
                    add(a.value)
        for a in program.outvars:
            if isinstance(a, Lit):
                add(a.value)
        for j in sorted(plan.baked_leaves):
            add(prep.leaves[j])
        for k in sorted(plan.baked_consts):
            add(program.consts[k])
        # Which inputs are traced, and which variables the evaluation computes at
        # trace time: a value read concretely (an `argsort` of an eager call's
        # input, eagerly or in its compiled run) shapes an index map that, traced
        # under `jit`, is a lazy map, so the graphs differ where nothing is baked in.
        traced = tuple(
            isinstance(x, jp.Tracer) for x in (*prep.leaves, *program.consts)
        )
        key = (order_spec, traced, known, tuple(parts))
        hash(key)
    except (_Unkeyable, TypeError):
        return None
    return key


def _zero_block(out_shape, in_shape, dtype, sparse):
    if sparse:
        # No entries: `.to_bcoo()` stores none.
        none = np.zeros((0,), np.int64)
        pattern = CooPattern(tuple(out_shape), tuple(in_shape), (), (), none, none)
        return CooTensor(jnp.zeros((0,), dtype), pattern, jnp.dtype(dtype), None)
    return jnp.zeros(tuple(out_shape) + tuple(in_shape), dtype)


def _block(edge, dtype, sparse):
    """A Jacobian leaf from the edge `input → output`.

    A sparse leaf always stores its values, ones included: `jax.vmap` gives a
    batched result only to leaves holding arrays, and a pure index map, the same for
    every mapped element, would otherwise come out without the mapped axes that
    `jax.vmap(jax.jacfwd(f))` has.
    """
    if isinstance(edge, BandTensor):
        edge = to_result_coo(edge)
    edge = plain_tensor(edge)
    if isinstance(edge, CooTensor):
        if sparse:
            if edge.val is None:
                assert not any(edge.pattern.varying)
                val = jnp.ones((edge.pattern.nnz,), dtype)
            else:
                val = edge.val.astype(dtype)
            return CooTensor(val, edge.pattern, jnp.dtype(dtype), edge.mask)
        return edge.dense().astype(dtype)
    st = to_sparse(edge) if isinstance(edge, LinearMap) else edge
    assert isinstance(st, SparseTensor)
    if sparse:
        if st.val is None:
            assert not st.pattern.val_labels
            val = jnp.ones((), dtype)
        else:
            val = st.val.astype(dtype)
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


def _leaf_blocks(
    prep: _Prepared, graph: EdgeGraph, sparse: bool
) -> dict[tuple[int, int], Any]:
    """`{(output, leaf): Jacobian leaf}` for every differentiated leaf."""
    traced = prep.traced
    structure = traced.structure
    diff = _diff_leaves(prep)
    # Input vertices are numbered in flat-leaf order, whatever the order of argnums.
    input_vid = dict(zip(diff, structure.inputs, strict=True))
    blocks = {}
    for o in range(traced.num_out):
        out_vid = structure.outputs[o]
        out_shape = tuple(traced.out_avals[o].shape)
        for j in diff:
            x = prep.leaves[j]
            dtype = jnp.result_type(x)
            edge = None
            if out_vid is not None:
                edge = graph.succ[input_vid[j]].get(out_vid)
            if edge is None:
                block = _zero_block(out_shape, jnp.shape(x), dtype, sparse)
            else:
                block = _block(edge, dtype, sparse)
            if _weak(x):
                # As `jax.jacrev`: the derivative w.r.t. a Python scalar is weak
                # (a structured block's `.dense()` is when its values are).
                if isinstance(block, (SparseTensor, CooTensor)):
                    if block.val is not None:
                        weak = jp.as_weak_type(block.val)
                        block = dataclasses.replace(block, val=weak)
                else:
                    block = jp.as_weak_type(block)
            blocks[(o, j)] = block
    return blocks


def _arrange(prep: _Prepared, blocks: dict[tuple[int, int], Any], as_tuple: bool):
    """The Jacobian leaves in `jax.jacrev`'s layout for `prep`'s argnums and trees."""
    traced = prep.traced
    per_output = []
    for o in range(traced.num_out):
        per_arg = []
        for k in prep.argnums:
            start = prep.arg_offsets[k]
            stop = start + prep.arg_trees[k].num_leaves
            leaves = [blocks[(o, j)] for j in range(start, stop)]
            per_arg.append(jtu.tree_unflatten(prep.arg_trees[k], leaves))
        per_output.append(tuple(per_arg) if as_tuple else per_arg[0])
    return jtu.tree_unflatten(traced.out_tree, per_output)


def _assemble(prep: _Prepared, graph: EdgeGraph, as_tuple: bool, sparse: bool):
    return _arrange(prep, _leaf_blocks(prep, graph, sparse), as_tuple)


def _output_values(flat_out, out_avals) -> list:
    """The primal outputs with the dtypes and weak types the function gave them."""
    return [
        jp.as_weak_type(jnp.asarray(v, dtype=aval.dtype))
        if getattr(aval, "weak_type", False)
        else jnp.asarray(v, dtype=aval.dtype)
        for v, aval in zip(flat_out, out_avals, strict=True)
    ]


def _split_outputs(prep: _Prepared, vals):
    traced = prep.traced
    out_leaves = [
        traced.static_out.get(k, v) for k, v in enumerate(vals[: traced.num_out])
    ]
    out = jtu.tree_unflatten(traced.out_tree, out_leaves)
    traced_aux = iter(vals[traced.num_out :])
    aux_leaves = [
        traced.static_aux[k] if k in traced.static_aux else next(traced_aux)
        for k in range(traced.aux_tree.num_leaves)
    ]
    aux = jtu.tree_unflatten(traced.aux_tree, aux_leaves)
    return out, aux


def _outputs(prep: _Prepared, flat_out):
    return _split_outputs(prep, _output_values(flat_out, prep.traced.out_avals))


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
    full = jp.spec_of(target, len(st.pattern.shape))
    # `.dense()` lays the block out as `jax.jacrev`'s leaf.
    st = dataclasses.replace(st, layout=jp.trimmed_spec(full))
    if isinstance(st, CooTensor):
        # Values laid out by entry: replicated, as no Jacobian axis indexes them.
        sharding = NamedSharding(axes.explicit, jp.trimmed_spec([]))
        return jtu.tree_map(lambda v: jp.from_auto(v, sharding, axes), st)
    p = st.pattern
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
    anchors = [x for x in prep.leaves if isinstance(x, jp.Tracer)]
    if anchors and axes.concrete is None and jp.staging():
        # Under `jit` without a concrete mesh, a program whose results are typed on
        # the mesh but use none of its arguments (a linear map's constant Jacobian)
        # loses them to dead-code elimination, and with them its devices: JAX then
        # refuses to lower it. Kept as an operand of a barrier, an argument stays.
        blocks, flat_out = jax.lax.optimization_barrier(
            ((blocks, flat_out), anchors[0])
        )[0]
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


#
# Eager calls, compiled.
#
# An eager call traces `fun` anew (above), but need not then run the engine one
# operation at a time, which dispatches hundreds of small operations. From the second
# eager call with the same key on, evaluation, elimination and assembly run as one
# `jax.jit`-compiled function whose arguments are the program's leaves and consts, so
# the values this call's trace read are the ones used. The key holds everything else
# the compiled function depends on:
#
# - the analysis, one per fingerprint of the program (equations, params up to values,
#   every variable's type), differentiated leaves and output count; the order and
#   `sparse`; the types, weak types and shardings of arguments and outputs;
# - the values the fingerprint leaves out, which the compiled function bakes in:
#   literals and consts in params at every nesting level, and every leaf or const
#   that can shape the graph (`graphax_eqx._graph.shaping_vars`), which it takes
#   by value and computes from at trace time, as an eager run knows them;
# - custom derivative rules as they are now: a rule may read globals or closures
#   that changed since the last call, and JAX runs it anew on every eager call, so
#   its JVP (VJP) is traced afresh and keyed by structure and values. Any other
#   callable in params (callbacks) is keyed by identity.
#
# The first call with a key runs eagerly, and so does every call with values too
# large to key, under a trace, or on several devices. Run one operation at a time,
# an array program compiles an XLA executable for every operation of new shapes, and
# compiling the whole function is 3-13x faster (`benchmarks/NOTES.md`); programs of
# scalars only reuse a few cached executables and run faster eagerly. So the first
# call compiles at once where the program has an operation on arrays and no call has
# come with its structure, order and output kind before (trying several orders on
# one function compiles each, rather than running all but the first one operation at
# a time). A loop that closes over a new Python float each time (an ODE's time) makes
# a new key on every call; it compiles on its first call only, and runs eagerly after
# that, as before.
# Tracing rules costs time, so they join the key only once the rest of it has come
# round before: a program with custom derivatives compiles on its third call (on its
# first where it compiles at once, as above).
#

_MAX_COMPILED = 64
_MAX_SIGHTINGS = 256
_COMPILE_AT = 2  # the call with a key that compiles
# Values keyed by value (literals, consts in params, values shaping the graph) up to
# this many bytes per call; beyond, the call runs eagerly. An eager trace computes
# index arrays built in `fun` (`jnp.arange(n)`) as eager JAX does, so they are keyed
# too: hashing 64 MB takes about 50 ms, running such a program one operation at a
# time far longer.
_MAX_KEY_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Which leaves and consts a compiled run takes by value, and the variables it
    computes at trace time from them; `compilable` is false when a differentiated
    leaf (or a callback) would be among them."""

    known: frozenset[int]
    baked_leaves: frozenset[int]
    baked_consts: frozenset[int]
    compilable: bool
    # Index operands and what they are computed from, computed at trace time in
    # any call where they come from constants only (`evaluate(..., shaping=...)`).
    indices: frozenset[int]


def _plan(traced: _Traced) -> _Plan:
    analysis = traced.analysis
    if analysis.plan is None:
        program = traced.program
        known = shaping_vars(program, analysis.structure)
        diff = {v for v, u in analysis.structure.vid.items() if u < 0}
        callbacks = any(
            "callback" in str(e.prim) and any(v in known for v in e.outvars)
            for e in program.eqns
        )
        analysis.plan = _Plan(
            known,
            frozenset(j for j, v in enumerate(program.invars) if v in known),
            frozenset(k for k, v in enumerate(program.constvars) if v in known),
            not callbacks and not (known & diff),
            shaping_vars(program, analysis.structure, indices_only=True),
        )
    return analysis.plan


class _Unkeyable(Exception):
    """The program holds something no key can stand for soundly."""


def _value_bytes(x) -> tuple[np.ndarray, bytes]:
    """`x` as a NumPy array, and its bytes to key on (a digest of large values, as
    keys are kept)."""
    try:
        a = np.asarray(x)
    except Exception:  # e.g. typed PRNG keys, which have no bytes to key on
        raise _Unkeyable from None
    if a.dtype == object:
        raise _Unkeyable
    if a.nbytes <= 64:
        return a, a.tobytes()
    # SHA-256 runs in hardware on most CPUs: 3x BLAKE2b here.
    data = np.ascontiguousarray(a).reshape(-1).view(np.uint8).data
    return a, hashlib.sha256(data).digest()


class _ValueKey:
    """The values a compiled run bakes in, collected into key parts; custom rules
    only `with_rules` (`has_rules` tells whether there are any)."""

    def __init__(self, with_rules: bool):
        self.parts: list = []
        self.size = 0
        self.with_rules = with_rules
        self.has_rules = False

    def value(self, x) -> None:
        a, data = _value_bytes(x)
        self.size += a.nbytes
        if self.size > _MAX_KEY_BYTES:
            raise _Unkeyable
        weak = bool(getattr(jax.typeof(x), "weak_type", False))
        self.parts.append((type(x).__name__, weak, a.shape, a.dtype.str, data))

    def jaxpr(self, jaxpr, differentiated: bool) -> None:
        for eqn in jaxpr.eqns:
            for a in eqn.invars:
                if isinstance(a, jp.Literal):
                    self.value(a.val)
            in_types = [(a.aval.shape, a.aval.dtype) for a in eqn.invars]
            self.params(eqn.primitive, eqn.params, in_types, differentiated)
        for a in jaxpr.outvars:
            if isinstance(a, jp.Literal):
                self.value(a.val)

    def params(self, prim, params, in_types, differentiated: bool) -> None:
        """`differentiated`: whether JAX may run the rules of custom derivatives in
        here (not inside a custom call's body, nor inside a rule, whose nested calls
        are only evaluated)."""
        custom = prim in (jp.custom_jvp_call_p, jp.custom_vjp_call_p)
        if custom and differentiated:
            self.has_rules = True
            if self.with_rules:
                self.rule(prim, params, in_types)
        for _, value in sorted(params.items()):
            self.param(value, differentiated and not custom, custom)

    def param(self, value, differentiated: bool, custom: bool) -> None:
        if isinstance(value, jp.ClosedJaxpr):
            for c in value.consts:
                self.value(c)
            self.jaxpr(value.jaxpr, differentiated)
        elif isinstance(value, jp.Jaxpr):
            self.jaxpr(value, differentiated)
        elif isinstance(value, (tuple, list)):
            for v in value:
                self.param(v, differentiated, custom)
        elif isinstance(value, dict):
            for v in value.values():
                self.param(v, differentiated, custom)
        elif isinstance(value, (np.ndarray, jax.Array)):
            self.value(value)
        elif isinstance(value, jex_lu.WrappedFun) or (
            callable(value) and not isinstance(value, type)
        ):
            if not custom:
                self.parts.append(Same(value))
        else:
            try:
                hash(value)
            except TypeError:  # the fingerprint has its `repr`, which may elide
                self.parts.append(Same(value))

    def rule(self, prim, params, in_types) -> None:
        """The custom rule as it is now: its JVP (or VJP) traced, by structure and
        values. The functions in `params` are wrapped anew by every trace, and the
        rule may read values that changed, so their identity says nothing."""
        structs = [jax.ShapeDtypeStruct(tuple(s), d) for s, d in in_types]
        floats = [
            i for i, t in enumerate(structs) if jnp.issubdtype(t.dtype, jnp.floating)
        ]

        def linearised(xs, args):
            def f(*xs):
                call = list(args)
                for i, x in zip(floats, xs, strict=True):
                    call[i] = x
                return jp.bind(prim, params, *call)

            if prim is jp.custom_vjp_call_p:
                out, pullback = jax.vjp(f, *xs)
                return out, pullback(out)
            return jax.jvp(f, tuple(xs), tuple(xs))

        try:
            closed = jax.make_jaxpr(linearised)([structs[i] for i in floats], structs)
        except Exception:  # the rule cannot be traced this way: run eagerly
            raise _Unkeyable from None
        self.parts.append(str(closed.jaxpr))
        for c in closed.consts:
            self.value(c)
        self.jaxpr(closed.jaxpr, differentiated=False)


def _arg_type(x) -> Any:
    if isinstance(x, jax.Array):
        return jax.typeof(x), x.sharding
    return type(x).__name__, jax.typeof(x)


def _compiled_key(
    prep: _Prepared, plan: _Plan, order_spec, sparse: bool, with_rules: bool
) -> tuple[tuple, bool]:
    """The key, and whether the program has custom rules (keyed `with_rules`)."""
    traced = prep.traced
    program = traced.program
    values = _ValueKey(with_rules)
    for eqn in program.eqns:
        in_types = []
        for a in eqn.invars:
            if isinstance(a, Lit):
                values.value(a.value)
                in_types.append((jnp.shape(a.value), jnp.result_type(a.value)))
            else:
                in_types.append(program.avals[a])
        values.params(eqn.prim, eqn.params, in_types, differentiated=True)
    for a in program.outvars:
        if isinstance(a, Lit):
            values.value(a.value)
    for j in sorted(plan.baked_leaves):
        values.value(prep.leaves[j])
    for k in sorted(plan.baked_consts):
        values.value(program.consts[k])
    types = tuple(
        _arg_type(x) for j, x in enumerate(prep.leaves) if j not in plan.baked_leaves
    ) + tuple(
        _arg_type(x) for k, x in enumerate(program.consts) if k not in plan.baked_consts
    )
    key = (
        Same(traced.analysis),
        order_spec,
        sparse,
        types,
        tuple(traced.out_avals),
        with_rules,
        tuple(values.parts),
    )
    return key, values.has_rules


@dataclasses.dataclass
class _Compiled:
    fn: Callable
    counts: dict


_COMPILED: OrderedDict[Any, _Compiled] = OrderedDict()
# Calls seen per key (None: compiling failed, always run eagerly).
_SIGHTINGS: OrderedDict[Any, int | None] = OrderedDict()


def _remember(cache: OrderedDict, key, value, limit: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    if len(cache) > limit:
        cache.popitem(last=False)


def _compile(prep: _Prepared, plan: _Plan, order_spec, sparse: bool) -> _Compiled:
    traced = prep.traced
    program = traced.program
    num_leaves, num_consts = len(prep.leaves), len(program.consts)
    baked_leaves = {j: prep.leaves[j] for j in plan.baked_leaves}
    baked_consts = {k: program.consts[k] for k in plan.baked_consts}
    # Only the structure of this call is kept (argnums, trees), not its leaves and
    # consts: those the compiled function needs by value are in the key.
    template = dataclasses.replace(
        prep,
        traced=dataclasses.replace(
            traced, program=dataclasses.replace(program, consts=())
        ),
        leaves=[],
    )

    def merge(dynamic, baked, n):
        dynamic = iter(dynamic)
        return [baked[i] if i in baked else next(dynamic) for i in range(n)]

    def run(dyn_leaves, dyn_consts):
        consts = tuple(merge(dyn_consts, baked_consts, num_consts))
        inner = dataclasses.replace(
            template,
            traced=dataclasses.replace(
                template.traced,
                program=dataclasses.replace(template.traced.program, consts=consts),
            ),
            leaves=merge(dyn_leaves, baked_leaves, num_leaves),
        )
        flat_out, graph, counts = _eliminate(inner, order_spec, plan.known)
        entry.counts = counts
        values = _output_values(flat_out, template.traced.out_avals)
        return values, _leaf_blocks(inner, graph, sparse)

    entry = _Compiled(jax.jit(run), {})
    return entry


def _array_program(traced: _Traced) -> bool:
    """Whether `traced` operates on arrays (not only scalars): run one operation at a
    time, its elimination would compile an executable for each new shape."""
    analysis = traced.analysis
    if analysis.on_arrays is None:
        program = traced.program

        def size(a) -> int:
            if isinstance(a, Lit):
                return math.prod(jnp.shape(a.value))
            return math.prod(program.avals[a][0])

        analysis.on_arrays = any(
            size(a) > 1 for e in program.eqns for a in (*e.invars, *e.outvars)
        )
    return analysis.on_arrays


def _on_one_device(values) -> bool:
    devices: set = set()
    for x in values:
        if isinstance(x, jp.Tracer):
            return False
        if isinstance(x, jax.Array):
            devices |= x.sharding.device_set
    return len(devices) <= 1


def _run_compiled(prep: _Prepared, order_spec, as_tuple: bool, sparse: bool):
    """`_run` as one compiled function; `None` where it does not apply: under a
    trace, on several devices, on the first call with a key (unless `first`, below),
    or with nothing sound to key on."""
    program = prep.traced.program
    if not get_abstract_mesh().empty:
        return None
    if not _on_one_device(list(prep.leaves) + list(program.consts)):
        return None
    plan = _plan(prep.traced)
    if not plan.compilable:
        return None
    analysis = prep.traced.analysis
    # A structure no eager call has come with yet in this order and output kind: an
    # array program compiles now.
    pair = (order_spec, sparse)
    first = pair not in analysis.keyed and _array_program(prep.traced)
    try:
        key, rules = _compiled_key(prep, plan, order_spec, sparse, False)
        hash(key)
        if rules:
            if not _SIGHTINGS.get(key):
                _remember(_SIGHTINGS, key, 1, _MAX_SIGHTINGS)
                if not first:
                    return None
            key, _ = _compiled_key(prep, plan, order_spec, sparse, True)
            hash(key)
    except (_Unkeyable, TypeError):
        return None
    entry = _COMPILED.get(key)
    new = entry is None
    if entry is None:
        seen = _SIGHTINGS.get(key, 0)
        if seen is None:
            return None
        _remember(_SIGHTINGS, key, seen + 1, _MAX_SIGHTINGS)
        if seen == 0:
            analysis.keyed.add(pair)
        if seen + 1 < _COMPILE_AT and not first:
            return None
        entry = _compile(prep, plan, order_spec, sparse)
    dyn_leaves = [x for j, x in enumerate(prep.leaves) if j not in plan.baked_leaves]
    dyn_consts = [x for k, x in enumerate(program.consts) if k not in plan.baked_consts]
    if new:
        try:
            values, blocks = entry.fn(dyn_leaves, dyn_consts)
        except Exception:  # what fails to compile runs eagerly (and raises there)
            _remember(_SIGHTINGS, key, None, _MAX_SIGHTINGS)
            return None
        _SIGHTINGS.pop(key, None)
        _remember(_COMPILED, key, entry, _MAX_COMPILED)
    else:
        _COMPILED.move_to_end(key)
        values, blocks = entry.fn(dyn_leaves, dyn_consts)
    jac = _arrange(prep, blocks, as_tuple)
    out, aux = _split_outputs(prep, values)
    counts = {k: list(v) if isinstance(v, list) else v for k, v in entry.counts.items()}
    return jac, out, aux, counts


_EQX_ERROR = "_EquinoxRuntimeError: "


@contextlib.contextmanager
def _equinox_errors():
    """An `eqx.error_if` that fires in an eager call raises `eqx.EquinoxRuntimeError`
    with its message, as it does eagerly or under `eqx.filter_jit`, rather than the
    runtime error of the callback it runs as. (Under `jax.jit` JAX raises that error
    after the call, as it does for `jax.jit(jax.jacfwd(f))`.)

    JAX also logs such an error of a callback with its traceback; that log, which
    says nothing the raised error does not, is left out as `eqx.filter_jit` leaves it
    out."""
    logger = logging.getLogger("jax._src.callback")
    logger.addFilter(_quiet_equinox_callback)
    try:
        yield
    except (jax.errors.JaxRuntimeError, ValueError) as e:
        # Run one operation at a time, the callback's error reaches here as JAX's
        # `ValueError`; compiled, as a `JaxRuntimeError`.
        text = str(e)
        if _EQX_ERROR not in text:
            raise
        message = text.split(_EQX_ERROR, 1)[1].split("\n\n\n", 1)[0].strip()
        error = getattr(eqx, "EquinoxRuntimeError", RuntimeError)
        raise error(message) from None
    finally:
        logger.removeFilter(_quiet_equinox_callback)


def _quiet_equinox_callback(record: logging.LogRecord) -> bool:
    """False for JAX's log of an `eqx.error_if` raising in a callback."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (exc is not None and type(exc).__name__ == "_EquinoxRuntimeError")


def _jaxprs_in(value):
    if isinstance(value, jp.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jp.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _jaxprs_in(v)


def _calls_back(eqns) -> bool:
    """Whether any equation, at any nesting level, is a host callback."""
    for e in eqns:
        prim = e.prim if hasattr(e, "prim") else e.primitive
        if "callback" in str(prim):
            return True
        for value in e.params.values():
            if any(_calls_back(j.eqns) for j in _jaxprs_in(value)):
                return True
    return False


def _block_if_calling_back(prep: _Prepared, results) -> None:
    """Wait for the results of an eager call whose program calls back to Python, so
    that an error raised there (`eqx.error_if`) is raised by the call, as eager JAX
    and `eqx.filter_jit` raise it, not by whatever next waits on a result."""
    leaves = [
        x
        for x in jtu.tree_leaves(results)
        if isinstance(x, jax.Array) and not isinstance(x, jp.Tracer)
    ]
    if not leaves:
        return
    analysis = prep.traced.analysis
    if analysis.callbacks is None:
        analysis.callbacks = _calls_back(prep.traced.program.eqns)
    if analysis.callbacks:
        jax.block_until_ready(leaves)


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
        try:
            prep = _prepare(
                self.fun, args, kwargs, self.argnums, self.has_aux, self.name
            )
        except _ValueDependent as e:
            return self._linearised(args, kwargs, e.__cause__)
        program = prep.traced.program
        axes = jp.explicit_axes(
            list(prep.leaves) + list(program.consts), [e.params for e in program.eqns]
        )
        with _equinox_errors():
            if axes is None:
                done = _run_compiled(prep, self.order_spec, self.as_tuple, self.sparse)
                if done is None:
                    done = _run(prep, self.order_spec, self.as_tuple, self.sparse)
                jac, out, aux, counts = done
                if not self.sparse:
                    jac = _eager_layout(prep, jac)
            else:
                jac, out, aux, counts = _run_auto(
                    prep, axes, self.order_spec, self.as_tuple, self.sparse
                )
            _block_if_calling_back(prep, (jac, out, aux))
        return self._result(jac, out, aux, counts)

    def _result(self, jac, out, aux, counts):
        """What the call returns, by `with_value`, `has_aux` and `count_ops`."""
        if self.with_value:
            result = ((out, aux) if self.has_aux else out), jac
        else:
            result = (jac, aux) if self.has_aux else jac
        if self.count_ops:
            return result, counts
        return result

    def _linearised(self, args, kwargs, cause) -> Any:
        """The call where `fun`'s Python reads the value of a differentiated argument
        (`if x.sum() > 0`, `x[: int(n)]`), outside `jit`.

        Eager `jax.jacrev` runs such Python on the values, and so does this:
        `jax.linearize` runs `fun` at `args` and stages its linearisation there, a
        linear function whose Jacobian is `fun`'s at `args`. The graph eliminated is
        the linearisation's (its partials are the values the linearisation computed),
        so an explicit order, whose vertex ids name `fun`'s graph, does not apply.
        """
        if not isinstance(self.order_spec, str):
            raise ValueError(
                f"`{self.name}` got an explicit order, but the function's Python "
                "depends on the values of the differentiated arguments (see the "
                "error above), so it has no graph of its own to number: outside "
                "`jit` its linearisation at these values is eliminated instead. Use "
                "a named order such as 'auto', 'rev' or 'markowitz', or write the "
                "branches with `jax.lax.cond` / `jnp.where`."
            ) from cause
        argnums, name = self.argnums, self.name

        def at(diff):
            full = list(args)
            for k, d in zip(argnums, diff, strict=True):
                full[k] = d
            return full

        def partial_fun(*diff):
            out, aux = _split_result(self.fun(*at(diff), **kwargs), self.has_aux, name)
            _checked_outputs(jtu.tree_leaves(out), name)
            return (out, aux) if self.has_aux else out

        diff = [args[k] for k in argnums]
        if self.has_aux:
            out, linear, aux = jax.linearize(partial_fun, *diff, has_aux=True)
        else:
            (out, linear), aux = jax.linearize(partial_fun, *diff), None

        def tangent_fun(*a, **kw):
            del kw
            return linear(*[a[k] for k in argnums])

        named_after(tangent_fun, self.fun)
        inner = _JacVE(
            tangent_fun,
            self.order_spec,
            tuple(argnums) if self.as_tuple else argnums[0],
            False,
            self.count_ops,
            self.sparse,
            False,
            self.name,
        )
        jac, counts = (
            inner(*args, **kwargs) if self.count_ops else (inner(*args, **kwargs), None)
        )
        return self._result(jac, out, aux, counts)


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

    Called outside `jax.jit`, every call traces `fun` afresh, as `jax.jacrev` does, so
    values it closes over are read anew each time; when calls repeat the same
    program, the elimination runs as one compiled function rather than operation by
    operation.

    **Arguments:**

    - `fun`: a function of arrays / pytrees of arrays returning a pytree of
        floating-point arrays. Under `jax.jit` its Python control flow must not
        depend on the values of the differentiated arguments (use `jax.lax.cond`
        and friends). Called eagerly it may, as with `jax.jacrev`: `fun` is then
        linearised at `args` (`jax.linearize`) and that linear function's graph is
        eliminated (named orders only).
    - `order`: `"fwd"` (or `"forward"`), `"rev"` (or `"reverse"`), one of the
        greedy heuristics `"markowitz"` (eliminate the currently cheapest vertex),
        `"relative_markowitz"` or `"min_fill"` (see `docs/orders.md`), `"auto"`
        (the better of fwd and rev, unless a heuristic is predicted at least 15%
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
        1-tuple). The other positional arguments and the keyword arguments reach
        `fun` as they were passed, as with `jax.jacrev`: a Python integer can size a
        loop or a shape, and any object can be passed.
    - `has_aux`: if `True`, `fun` returns `(output, aux)`; the result is
        `(jacobian, aux)`.
    - `count_ops`: if `True`, the result becomes `(result, counts)`, with `counts` a
        dict of Python ints: `"num_muls"`, `"num_adds"`, `"order"` (vertex ids in
        elimination order) and `"order_counts"` (multiplications per eliminated
        vertex). Returned from a `jax.jit`-compiled function, they become integer
        arrays, as every output of `jit` does; `graphax_eqx.elimination_cost`
        gives the same counts without running anything.
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
        ids = resolve(spec, self._sim, self._structure, "Graph.counts")
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


def abstract_graph(
    fun: Callable,
    args: tuple,
    kwargs: dict,
    argnums: tuple[int, ...],
    has_aux: bool,
    name: str,
) -> tuple[Structure, EdgeGraph, int]:
    """Trace `fun` at `args` and build its graph of partials abstractly (no FLOPs).

    Returns the structure, the graph (its partials hold abstract values: read only
    their static parts) and the additions made while building it.
    """
    try:
        prep = _prepare(fun, args, kwargs, argnums, has_aux, name)
    except _ValueDependent as e:
        raise TypeError(
            f"`{name}` needs the graph of the function, but its Python depends on "
            "the values of the differentiated arguments (see the error above), so "
            "it has none independent of them. Write such branches with "
            "`jax.lax.cond` / `jnp.where`, or give sizes as static arguments. "
            "(`jacve` called outside `jit` accepts such functions: it eliminates "
            "their linearisation at the given values.)"
        ) from e.__cause__
    graph, adds = _abstract_evaluation(prep)
    return prep.traced.structure, graph, adds


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
    if not callable(fun):
        raise TypeError(f"`make_graph` expects a callable, got {type(fun).__name__}.")
    argnums_t, _ = _normalise_argnums(argnums, "make_graph")

    def build(*args, **kwargs) -> Graph:
        structure, graph, _ = abstract_graph(
            fun, args, kwargs, argnums_t, has_aux, "make_graph"
        )
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
