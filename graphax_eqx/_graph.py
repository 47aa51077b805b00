"""From a jaxpr to the computational graph.

Call-like equations (`jit`, `closed_call`, `checkpoint`) are inlined recursively, so
the graph sees every primitive. Every variable is a vertex; an equation with several
outputs defines several vertices. Variables that do not depend differentiably on a
differentiated input, or that no output depends on, are pruned. Each output gets an
output vertex of its own, joined to its variable by an identity edge, so every
original variable is an intermediate that an order may eliminate. Complex variables
are split into pairs of real ones ([`graphax_eqx._complex.realify`][]), so every vertex
is real. Max, min and average pooling over windows that tile their input are split
into a reshape and a reduction over the split-off axes
([`graphax_eqx._graph.split_tiled_windows`][]).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
from jax import lax
from jax.experimental.sparse.bcoo import bcoo_transpose_p

from . import _jax_private as jp
from ._complex import realify
from ._indexed import densify_small_blocks
from ._rules import control, get_rule, zero_derivative
from ._rules._base import outputs_needed
from ._rules.custom import check_rules_inside, derivative_dependence
from ._rules.elementwise import computed_once
from ._sparse import LinearMap, add, diagonal, should_materialise, to_sparse


@dataclasses.dataclass(frozen=True)
class Lit:
    """A constant operand: a literal or a closed-over array."""

    value: Any


Atom = int | Lit  # variable id, or a constant


@dataclasses.dataclass(frozen=True)
class Eqn:
    prim: Any
    params: dict[str, Any]
    invars: tuple[Atom, ...]
    outvars: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Program:
    """A jaxpr with every call-like equation inlined; variables are integers.

    The arrays the function closed over (the jaxpr's consts, at every nesting level)
    are variables too, `constvars`, bound to `consts` when the program runs. So two
    traces of the same computation over different closed-over values have equal
    structure, and only `consts` differs.
    """

    eqns: tuple[Eqn, ...]
    invars: tuple[int, ...]
    outvars: tuple[Atom, ...]
    avals: dict[int, tuple[tuple[int, ...], Any]]  # id -> (shape, dtype)
    constvars: tuple[int, ...] = ()
    consts: tuple[Any, ...] = ()


def inline(closed_jaxpr) -> Program:
    """Flatten a `ClosedJaxpr`, inlining `jit` / `closed_call` / `checkpoint` bodies."""
    counter = iter(range(1 << 62))
    avals: dict[int, tuple[tuple[int, ...], Any]] = {}
    eqns: list[Eqn] = []
    constvars: list[int] = []
    consts: list[Any] = []

    def new_var(var) -> int:
        vid = next(counter)
        avals[vid] = (tuple(int(s) for s in var.aval.shape), var.aval.dtype)
        return vid

    def hoist(vars_, values) -> list[Atom]:
        atoms: list[Atom] = []
        for var, value in zip(vars_, values, strict=True):
            vid = new_var(var)
            constvars.append(vid)
            consts.append(value)
            atoms.append(vid)
        return atoms

    def visit(jaxpr, const_atoms: Sequence[Atom], in_atoms: Sequence[Atom]):
        env: dict[Any, Atom] = {}
        platform_branch: dict[Any, int] = {}  # `platform_index` results, resolved
        for var, atom in zip(jaxpr.constvars, const_atoms, strict=True):
            env[var] = atom
        for var, atom in zip(jaxpr.invars, in_atoms, strict=True):
            env[var] = atom

        def read(v) -> Atom:
            if isinstance(v, jp.Literal):
                return Lit(v.val)
            return env[v]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            if eqn.primitive.name == "platform_index":
                branch = _platform_branch(eqn.params)
                if branch is not None:
                    platform_branch[eqn.outvars[0]] = branch
            elif (
                eqn.primitive is lax.cond_p
                and not isinstance(eqn.invars[0], jp.Literal)
                and eqn.invars[0] in platform_branch
            ):
                # `lax.platform_dependent` (`jnp.diagonal`): the branch this
                # platform lowers, inlined (the other may hide its structure).
                closed = eqn.params["branches"][platform_branch[eqn.invars[0]]]
                outs = visit(
                    closed.jaxpr, hoist(closed.jaxpr.constvars, closed.consts), ins[1:]
                )
                for var, atom in zip(eqn.outvars, outs, strict=True):
                    if not isinstance(var, jp.DropVar):
                        env[var] = atom
                continue
            inner = jp.inner_jaxpr(eqn)
            if inner is None and eqn.primitive is lax.scan_p and unrolls(eqn):
                unrolled = _unrolled_scan(eqn)
                inner = unrolled.jaxpr, list(unrolled.consts)
            if inner is not None:
                sub_jaxpr, sub_consts = inner
                outs = visit(sub_jaxpr, hoist(sub_jaxpr.constvars, sub_consts), ins)
                for var, atom in zip(eqn.outvars, outs, strict=True):
                    if not isinstance(var, jp.DropVar):
                        env[var] = atom
                continue
            outs = []
            for var in eqn.outvars:
                vid = new_var(var)
                outs.append(vid)
                if not isinstance(var, jp.DropVar):
                    env[var] = vid
            reduction = jp.positional_reduction(eqn.primitive, eqn.params)
            if reduction is not None and not any(isinstance(a, Lit) for a in ins):
                # A collective over positional axes only (a `vmap` with an axis
                # name, traced): a plain reduction of each operand.
                axes = tuple(eqn.params["axes"])
                for atom, out, var in zip(ins, outs, eqn.invars, strict=True):
                    shape = tuple(int(d) for d in var.aval.shape)
                    params = jp.reduction_params(reduction, axes, shape, var.aval.dtype)
                    eqns.append(Eqn(reduction, params, (atom,), (out,)))
                continue
            # Update slices in loop bodies and branches that XLA CPU could apply
            # wrongly are applied to updates written apart (see `update_apart`).
            params = jp.protected_params(eqn.primitive, dict(eqn.params))
            if eqn.primitive is jp.custom_jvp_call_p:
                params = jp.remember_const_operands(params, eqn.invars)
            eqns.append(Eqn(eqn.primitive, params, tuple(ins), tuple(outs)))
        return [read(v) for v in jaxpr.outvars]

    jaxpr = closed_jaxpr.jaxpr
    invars = [new_var(v) for v in jaxpr.invars]
    const_atoms = hoist(jaxpr.constvars, closed_jaxpr.consts)
    outvars = visit(jaxpr, const_atoms, invars)
    program = Program(
        tuple(eqns),
        tuple(invars),
        tuple(outvars),
        avals,
        tuple(constvars),
        tuple(consts),
    )
    return split_tiled_windows(realify(program))


# A short loop of structured steps (an explicit time stepper: stencils, rolls,
# elementwise work) is unrolled into the graph, so that the structure of each step
# reaches the Jacobian: kept whole, a loop is one linear map, and wherever its
# Jacobian is stored that map is applied to every row or column (a dense block).
# Loops whose steps are dense (a product or convolution contracting over more than
# `_MAX_UNROLLED_CONTRACTION` entries, or over more than 1/`_SPREAD_PER_CONTRACTION`
# of a value that changes from step to step: a recurrent network's `W @ h`) gain no
# structure from it and stay loops, applied once to a loss's cotangent as JAX's
# reverse mode does; so do small ones (their dense Jacobian is cheap), long ones
# (compile time grows with the unrolled size: a band that widens at every step is
# multiplied out diagonal by diagonal), and loops holding a `while_loop`.
MAX_UNROLLED_STEPS = 8
MAX_UNROLLED_EQNS = 1024
_MAX_UNROLLED_CONTRACTION = 32
_SPREAD_PER_CONTRACTION = 8


def _var_size(var) -> int:
    return math.prod(getattr(var.aval, "shape", ()))


def _is_float_var(var) -> bool:
    dtype = getattr(var.aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _dense_step(eqn, varying) -> bool:
    """Whether a product or convolution contracts over much of an operand that
    changes from step to step (`varying`): then each step's Jacobian is dense."""
    prim = eqn.primitive
    if prim is lax.dot_general_p:
        (lc, rc), _ = eqn.params["dimension_numbers"]
        contracted = math.prod(eqn.invars[0].aval.shape[d] for d in lc)
    elif prim is lax.conv_general_dilated_p:
        rhs = eqn.invars[1].aval.shape
        out_feat = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
        contracted = math.prod(rhs) // max(out_feat, 1)
    else:
        return False
    if contracted > _MAX_UNROLLED_CONTRACTION:
        return True
    return any(
        varying(v) and _var_size(v) < _SPREAD_PER_CONTRACTION * contracted
        for v in eqn.invars
    )


def _varying_inside(eqn, sub, varying) -> list[bool]:
    """Which inputs of `sub`, a jaxpr inside `eqn`, change from step to step: those
    bound to changing operands where they are bound one to one (calls, custom
    derivatives, a `cond`'s branches); else all of them, if any operand changes."""
    operands = eqn.invars[1:] if eqn.primitive is lax.cond_p else eqn.invars
    if eqn.primitive is not lax.scan_p and len(operands) == len(sub.invars):
        return [varying(v) for v in operands]
    return [any(varying(v) for v in eqn.invars)] * len(sub.invars)


def _structured_size(jaxpr, varying_in: Sequence[bool]) -> int | None:
    """How many equations `jaxpr` runs unrolled (loops inside it counted once per
    step), or `None` where a step is dense (`_dense_step`) or holds a loop of
    unknown length. `varying_in` marks the inputs that change from step to step."""
    changing = {v for v, c in zip(jaxpr.invars, varying_in, strict=True) if c}

    def varying(v) -> bool:
        return not isinstance(v, jp.Literal) and v in changing

    total = 0
    for eqn in jaxpr.eqns:
        prim = eqn.primitive
        moved = any(varying(v) for v in eqn.invars)
        if prim is lax.while_p or (moved and _dense_step(eqn, varying)):
            return None
        steps = eqn.params["length"] if prim is lax.scan_p else 1
        inner = 0
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jp.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jp.Jaxpr):
                    size = _structured_size(sub, _varying_inside(eqn, sub, varying))
                    if size is None:
                        return None
                    inner = max(inner, size) if prim is lax.cond_p else inner + size
        total += 1 + steps * inner
        if total > MAX_UNROLLED_EQNS:
            return None
        if moved:
            changing.update(eqn.outvars)
    return total


def unrolls(eqn) -> bool:
    """Whether `inline` unrolls this `lax.scan` equation (see `MAX_UNROLLED_EQNS`):
    its dense Jacobian would be large, and its steps are structured and few."""
    length = eqn.params["length"]
    if not 1 <= length <= MAX_UNROLLED_STEPS or eqn.effects:
        return False
    n_in = sum(_var_size(v) for v in eqn.invars if _is_float_var(v))
    n_out = sum(_var_size(v) for v in eqn.outvars if _is_float_var(v))
    if n_in * n_out <= control._MAX_DENSE_ENTRIES:
        return False
    if any(jp.has_mesh(v.aval) for v in (*eqn.invars, *eqn.outvars)):
        return False
    body = eqn.params["jaxpr"].jaxpr
    n_consts, _ = jp.scan_counts(eqn.params)
    varying_in = [k >= n_consts for k in range(len(body.invars))]
    size = _structured_size(body, varying_in)
    return size is not None and length * size <= MAX_UNROLLED_EQNS


def _unrolled_scan(eqn) -> jp.ClosedJaxpr:
    """A `lax.scan` equation as the jaxpr of its steps, one after another: each
    step's scanned inputs sliced out, its outputs stacked."""
    params = eqn.params
    body = jex_core.jaxpr_as_fun(params["jaxpr"])
    n_consts, n_carry = jp.scan_counts(params)
    length, reverse = params["length"], params["reverse"]

    def unrolled(*operands):
        consts = operands[:n_consts]
        carry = operands[n_consts : n_consts + n_carry]
        xs = operands[n_consts + n_carry :]
        ys = {}
        for i in reversed(range(length)) if reverse else range(length):
            x_i = [lax.index_in_dim(x, i, keepdims=False) for x in xs]
            outs = body(*consts, *carry, *x_i)
            carry, ys[i] = outs[:n_carry], outs[n_carry:]
        stacked = [
            jnp.stack([ys[i][k] for i in range(length)]) for k in range(len(ys[0]))
        ]
        return [*carry, *stacked]

    types = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
        for v in eqn.invars
    ]
    return jax.make_jaxpr(unrolled)(*types)


_PLATFORM_NAMES = {"cpu": {"cpu"}, "gpu": {"gpu", "cuda", "rocm"}, "tpu": {"tpu"}}


def _platform_branch(params) -> int | None:
    """The index a `platform_index` equation gives on the default backend (where
    `jacve`'s program is lowered), or `None` where that is not clear."""
    names = _PLATFORM_NAMES.get(jax.default_backend())
    platforms = params.get("platforms")
    if names is None or platforms is None:
        return None
    default = None
    for k, group in enumerate(platforms):
        if group is None:
            default = k if default is None else default
        elif names & {str(p).lower() for p in group}:
            return k
    return default


_POOLINGS = (lax.reduce_window_max_p, lax.reduce_window_min_p, lax.reduce_window_sum_p)


def _tiling(eqn: Eqn, avals) -> tuple[int, ...] | None:
    """The window of a windowed maximum, minimum or sum whose windows tile its input
    (no padding or dilation, strides equal to the window, a remainder at the end of
    an axis dropped), if some axis then holds more than one window of more than one
    entry; else `None`."""
    if eqn.prim not in _POOLINGS or isinstance(eqn.invars[0], Lit):
        return None
    shape, dtype = avals[eqn.invars[0]]
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    params = eqn.params
    window = tuple(int(w) for w in params["window_dimensions"])
    if (
        any(tuple(p) != (0, 0) for p in params["padding"])
        or any(d != 1 for d in params["base_dilation"])
        or any(d != 1 for d in params["window_dilation"])
        or tuple(params["window_strides"]) != window
        or any(w > n for w, n in zip(window, shape, strict=True))
    ):
        return None
    if not any(w > 1 and n // w > 1 for w, n in zip(window, shape, strict=True)):
        return None
    return window


def _split_windows(prim, params, window, shape):
    """`x ↦ prim(x)` with tiling windows, as a slice dropping each axis's remainder,
    a reshape splitting every windowed axis into (windows, entries), the reduction
    over the entry axes alone, and a reshape dropping them."""
    counts = [n // w for n, w in zip(shape, window, strict=True)]
    split, new_window = [], []
    for n, w in zip(counts, window, strict=True):
        split += [n, w] if w > 1 else [n]
        new_window += [1, w] if w > 1 else [1]
    rank = len(new_window)
    new_params = dict(
        params,
        window_dimensions=tuple(new_window),
        window_strides=tuple(new_window),
        padding=((0, 0),) * rank,
        base_dilation=(1,) * rank,
        window_dilation=(1,) * rank,
    )

    def split_reduce(x):
        kept = [n * w for n, w in zip(counts, window, strict=True)]
        if kept != list(shape):
            x = lax.slice(x, (0,) * len(shape), kept)
        y = prim.bind(lax.reshape(x, tuple(split)), **new_params)
        return lax.reshape(y, tuple(counts))

    return split_reduce


def split_tiled_windows(program: Program) -> Program:
    """Max, min and average pooling over windows that tile the input, rewritten to
    reduce over axes split off the pooled ones (`(…, h, …)` → `(…, h / k, k, …)`).

    The pooled axes become ties of the local Jacobian: a product with it is a
    broadcast multiply along them instead of a gather per entry, and the splitting
    reshape is an index map that moves nothing. A maximum or minimum is the same,
    and so is the entry it takes (the window's row-major order is kept); a windowed
    sum may round differently in its last bit, as XLA may add a window's entries in
    another order.
    """
    avals = dict(program.avals)
    fresh = iter(range(max(avals, default=-1) + 1, 1 << 62))
    eqns: list[Eqn] = []
    for eqn in program.eqns:
        window = _tiling(eqn, avals)
        if window is None:
            eqns.append(eqn)
            continue
        (x,), (out,) = eqn.invars, eqn.outvars
        assert not isinstance(x, Lit)  # `_tiling` takes variables only
        shape, dtype = avals[x]
        fn = _split_windows(eqn.prim, eqn.params, window, shape)
        closed = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(shape, dtype))
        assert not closed.jaxpr.constvars
        env: dict[Any, Atom] = {closed.jaxpr.invars[0]: x}
        for sub in closed.jaxpr.eqns:
            ins = tuple(
                Lit(v.val) if isinstance(v, jp.Literal) else env[v] for v in sub.invars
            )
            outs = []
            for v in sub.outvars:
                vid = out if v is closed.jaxpr.outvars[0] else next(fresh)
                avals[vid] = (tuple(int(s) for s in v.aval.shape), v.aval.dtype)
                env[v] = vid
                outs.append(vid)
            eqns.append(Eqn(sub.primitive, dict(sub.params), ins, tuple(outs)))
    if len(eqns) == len(program.eqns):  # nothing split: every equation kept
        return program
    return dataclasses.replace(program, eqns=tuple(eqns), avals=avals)


@dataclasses.dataclass(frozen=True)
class Structure:
    """Which variables are vertices, and their numbering.

    - `vid`: variable id -> vertex id (inputs negative, intermediates `1..N`).
    - `inputs`: vertex ids of the differentiated flat inputs, in order.
    - `intermediates`: eliminable vertex ids, ascending.
    - `outputs`: for each flat output, its output vertex id or `None` (constant
      with respect to the differentiated inputs).
    - `output_sources`: for each output vertex, the vertex id feeding it.
    """

    vid: dict[int, int]
    inputs: tuple[int, ...]
    intermediates: tuple[int, ...]
    outputs: tuple[int | None, ...]
    output_sources: dict[int, int]
    primitive_of: dict[int, str]
    shape_of: dict[int, tuple[int, ...]]
    dtype_of: dict[int, Any]
    # Variables that depend differentiably on a differentiated input, needed or not.
    active: frozenset[int] = frozenset()


def custom_couplings(
    program: Program, diff_mask: Sequence[bool]
) -> tuple[set[int], dict[int, tuple[frozenset[int], ...]]]:
    """The variables that depend differentiably on a differentiated input, and for
    each custom-derivative call with several outputs that one reaches (by equation
    index), which operands each output's derivative depends on under its rule (see
    `derivative_dependence`). The second part shapes the graph as much as the
    program's text does, so cached analyses are keyed on it too."""
    avals = program.avals
    active: set[int] = set()
    for var, d in zip(program.invars, diff_mask, strict=True):
        if d:
            active.add(var)
    coupling: dict[int, tuple[frozenset[int], ...]] = {}
    for e, eqn in enumerate(program.eqns):
        if eqn.prim in zero_derivative:
            continue
        reached = [
            i for i, a in enumerate(eqn.invars) if isinstance(a, int) and a in active
        ]
        if not reached:
            continue
        deps = _custom_coupling(eqn, reached, avals)
        if deps is not None:
            coupling[e] = deps
        for k, v in enumerate(eqn.outvars):
            if jnp.issubdtype(avals[v][1], jnp.inexact) and (
                deps is None or any(i in deps[k] for i in reached)
            ):
                active.add(v)
    return active, coupling


def analyse(
    program: Program,
    diff_mask: Sequence[bool],
    num_diff_out: int | None = None,
    couplings=None,
) -> Structure:
    """Number the vertices: active (depend on a differentiated input) and needed.

    Only the first `num_diff_out` outputs are differentiated (the rest are auxiliary).
    `couplings` is `custom_couplings(program, diff_mask)`, if already computed.
    """
    avals = program.avals
    if num_diff_out is None:
        num_diff_out = len(program.outvars)
    if couplings is None:
        couplings = custom_couplings(program, diff_mask)
    active, coupling = couplings
    needed: set[int] = set()
    for atom in program.outvars[:num_diff_out]:
        if isinstance(atom, int) and atom in active:
            needed.add(atom)
    for e in reversed(range(len(program.eqns))):
        eqn = program.eqns[e]
        deps = coupling.get(e)
        used: set[int] = set()
        for k, v in enumerate(eqn.outvars):
            if v in needed:
                used.update(range(len(eqn.invars)) if deps is None else deps[k])
        for i in used:
            a = eqn.invars[i]
            if isinstance(a, int) and a in active:
                needed.add(a)
    vid: dict[int, int] = {}
    inputs = []
    k = 0
    for var, d in zip(program.invars, diff_mask, strict=True):
        if d:
            k += 1
            vid[var] = -k
            inputs.append(-k)
    n = 0
    primitive_of, shape_of, dtype_of = {}, {}, {}
    for eqn in program.eqns:
        for v in eqn.outvars:
            if v in needed:
                n += 1
                vid[v] = n
                primitive_of[n] = str(eqn.prim)
    for var, v in vid.items():
        shape_of[v], dtype_of[v] = avals[var]
        if v < 0:
            primitive_of[v] = "input"
    outputs: list[int | None] = []
    output_sources = {}
    m = n
    for k, atom in enumerate(program.outvars):
        if k < num_diff_out and isinstance(atom, int) and atom in needed:
            m += 1
            outputs.append(m)
            output_sources[m] = vid[atom]
            shape_of[m], dtype_of[m] = avals[atom]
            primitive_of[m] = "output"
        else:
            outputs.append(None)
    return Structure(
        vid,
        tuple(inputs),
        tuple(range(1, n + 1)),
        tuple(outputs),
        output_sources,
        primitive_of,
        shape_of,
        dtype_of,
        frozenset(active),
    )


def _custom_coupling(eqn: Eqn, reached: list[int], avals):
    """For a custom-derivative call with several outputs, the operands (among
    `reached`) each output has a derivative with respect to under its rule, or None
    (see `derivative_dependence`)."""
    if eqn.prim not in jp.CUSTOM_CALLS or len(eqn.outvars) < 2:
        return None
    operands = [
        a.value if isinstance(a, Lit) else jax.ShapeDtypeStruct(*avals[a])
        for a in eqn.invars
    ]
    found = derivative_dependence(eqn.prim, eqn.params, operands, reached)
    return None if found is None else found.operands


class EdgeGraph:
    """Edges `succ[u][w]` and `pred[w][u]` holding the same partial `∂w/∂u`."""

    def __init__(self):
        self.succ: dict[int, dict[int, Any]] = {}
        self.pred: dict[int, dict[int, Any]] = {}
        # Exact patterns of result blocks computed densely (`densify_small_blocks`).
        self.exact: dict[tuple[int, int], Any] = {}
        # Where `densify_small_blocks` stored the partials as dense blocks: the
        # entries per batch entry of all inputs and of all outputs.
        self.block_sizes: tuple[int, int] | None = None

    @property
    def densified(self) -> bool:
        """Whether `densify_small_blocks` stored the partials as dense blocks."""
        return self.block_sizes is not None

    def add_vertex(self, v: int):
        self.succ.setdefault(v, {})
        self.pred.setdefault(v, {})

    def set(self, u: int, w: int, edge):
        self.succ[u][w] = edge
        self.pred[w][u] = edge

    def copy_with(self, fn) -> EdgeGraph:
        out = EdgeGraph()
        out.block_sizes = self.block_sizes
        for v in self.succ:
            out.add_vertex(v)
        for u, row in self.succ.items():
            for w, e in row.items():
                out.set(u, w, fn(e))
        return out


# Integer results up to this many elements are computed at trace time when their
# operands are known (index arithmetic feeding gathers and scatters).
_FOLD_SIZE = 1 << 24


# Operations that only move entries: computed at trace time with their float values
# too when their integer results are (the indices of `K.T` for a constant sparse
# matrix `K`), as nothing is rounded.
_MOVES_ENTRIES = frozenset({bcoo_transpose_p})


def _foldable(
    eqn: Eqn, ins: Sequence[Any], avals, shaping: frozenset[int] = frozenset()
) -> bool:
    """Whether `eqn` is computed at trace time: its operands are known, and its
    results are integers (index arithmetic), or values that shape the graph (in
    `shaping`, see `shaping_vars`: a `jnp.linspace` grid that `jnp.interp`
    searches), or moved entries."""
    if "callback" in str(eqn.prim) or not all(jp.is_concrete(x) for x in ins):
        return False
    shapes = any(v in shaping for v in eqn.outvars)
    size = 0
    for v in eqn.outvars:
        shape, dtype = avals[v]
        exact = jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_)
        if not exact and not shapes and eqn.prim not in _MOVES_ENTRIES:
            return False
        size += math.prod(shape)
    return size <= _FOLD_SIZE


# Operands that rules read as values only: however known, they never shape a pattern.
_VALUE_OPERANDS = {lax.select_n_p: (0,), lax.cond_p: (0,)}


def _calls_programs(eqn: Eqn) -> bool:
    """Whether `eqn` calls programs of its own (loops, conditionals, custom
    derivatives): its non-float operands are values passed along, not indices."""

    def program_like(p) -> bool:
        if isinstance(p, (tuple, list)):
            return any(program_like(q) for q in p)
        return isinstance(p, (jex_core.Jaxpr, jex_core.ClosedJaxpr))

    # A scatter's `update_jaxpr` only combines two entries.
    return any(program_like(p) for k, p in eqn.params.items() if k != "update_jaxpr")


def shaping_vars(
    program: Program, structure: Structure, indices_only: bool = False
) -> frozenset[int]:
    """The variables whose values can shape the graph, and all they are computed from.

    With `indices_only`, only the index operands of primitives that move entries
    (gathers, scatters, dynamic slices; not the values a loop or a custom rule
    passes along) computed from constants alone (no input of the program), and what
    they are computed from.

    A rule handed a known non-float operand (the indices of a gather, a scatter or a
    dynamic slice) reads a static index pattern off its value; the same operand under
    a trace gives a lazy map instead, with other counts. When every input is known
    (an eager call) those operands are known, so a compiled run that should give the
    same graph must know them too: it takes the leaves and consts they come from by
    value and computes them at trace time (`evaluate(..., known=...)`).
    """
    vid = structure.vid
    from_inputs: set[int] = set(program.invars)
    if indices_only:
        for eqn in program.eqns:
            if any(isinstance(a, int) and a in from_inputs for a in eqn.invars):
                from_inputs.update(eqn.outvars)
    found: set[int] = set()
    for eqn in program.eqns:
        if not any(v in vid for v in eqn.outvars):
            continue
        if not any(isinstance(a, int) and a in vid for a in eqn.invars):
            continue
        if indices_only and _calls_programs(eqn):
            continue
        skip = _VALUE_OPERANDS.get(eqn.prim, ())
        for i, a in enumerate(eqn.invars):
            if isinstance(a, int) and a not in vid and i not in skip:
                if indices_only and a in from_inputs:
                    continue
                if not jnp.issubdtype(program.avals[a][1], jnp.floating):
                    found.add(a)
    for eqn in reversed(program.eqns):
        if any(v in found for v in eqn.outvars):
            found.update(a for a in eqn.invars if isinstance(a, int))
    return frozenset(found)


def _update_apart(update):
    """A traced update of `lax.dynamic_update_slice`, written to memory before the
    update is applied.

    XLA CPU (jaxlib 0.10.2) applies a dynamic update slice in place, in a kernel that
    also computes the update. Where the update reads the operand's buffer through
    another view of it (a reshape that XLA turns into a bitcast), that kernel reads
    entries it has already overwritten: `lax.dynamic_update_slice(y, jnp.cos(y[:9]),
    (s,))`, with `y` reshaped from `(11, 1)`, is wrong for every `s > 0` under
    `jax.jit` alone. Written apart, the update is a buffer of its own."""
    if jp.is_concrete(update):
        return update
    return jp.write_apart(update)


def evaluate(
    program: Program,
    structure: Structure,
    flat_args: Sequence[Any],
    known: frozenset[int] = frozenset(),
    shaping: frozenset[int] = frozenset(),
) -> tuple[list[Any], EdgeGraph, int]:
    """Run the program, computing primal values and the partials of every edge.

    The variables in `known` (see `shaping_vars`) are computed now, whatever their
    type: their inputs must be known, as when everything is. Those in `shaping` (the
    program's `shaping_vars(..., indices_only=True)`) are computed now where their
    inputs happen to be known (computed from constants only), so that a graph traced
    under `jit` has the same static index maps as one traced eagerly.

    Returns the flat primal outputs, the graph and the additions spent accumulating
    partials of a variable used several times by one equation.
    """
    vid = structure.vid
    env: dict[int, Any] = dict(zip(program.constvars, program.consts, strict=True))
    for var, val in zip(program.invars, flat_args, strict=True):
        env[var] = val

    def read(atom):
        return atom.value if isinstance(atom, Lit) else env[atom]

    graph = EdgeGraph()
    for v in structure.inputs:
        graph.add_vertex(v)
    for v in structure.intermediates:
        graph.add_vertex(v)
    adds = 0
    for eqn in program.eqns:
        ins = [read(a) for a in eqn.invars]
        if eqn.prim is lax.dynamic_update_slice_p:
            ins[1] = _update_apart(ins[1])
        out_vertices = [vid.get(v) for v in eqn.outvars]
        need = [isinstance(a, int) and a in vid for a in eqn.invars]
        if any(o is not None for o in out_vertices) and any(need):
            # The rule differentiates every active operand, as JAX does, also those
            # no needed output depends on (a custom rule's zero tangents): a rule
            # with symbolic zeros sees the operands JAX's would see perturbed.
            active = [
                isinstance(a, int) and (a in vid or a in structure.active)
                for a in eqn.invars
            ]
            check_rules_inside(eqn.prim, eqn.params, active)
            with outputs_needed(eqn.prim, [o is not None for o in out_vertices]):
                outs, partials = get_rule(eqn.prim)(ins, active, **eqn.params)
            for (k, i), partial in partials.items():
                w = out_vertices[k]
                if w is None or not need[i] or 0 in partial.shape:
                    # An empty array carries no derivative.
                    continue
                if isinstance(partial, LinearMap) and should_materialise(
                    partial.pattern
                ):
                    partial = to_sparse(partial)
                u = vid[eqn.invars[i]]  # pyright: ignore
                old = graph.succ[u].get(w)
                if old is not None:
                    partial, n = add(old, partial)
                    adds += n
                graph.set(u, w, partial)
        elif any(v in known for v in eqn.outvars) or _foldable(
            eqn, ins, program.avals, shaping
        ):
            # Index arithmetic on constants is computed now, so that the index maps
            # it feeds have static patterns even under `jit`.
            with jax.ensure_compile_time_eval():
                outs = jp.bind(eqn.prim, eqn.params, *ins)
        else:
            outs = jp.bind(eqn.prim, eqn.params, *ins)
            if eqn.prim in computed_once:
                # A sine off the derivative's path (of an angle not differentiated)
                # is as shared by the products as one on it.
                outs = [jp.compute_once(o) for o in outs]
        for v, val in zip(eqn.outvars, outs, strict=True):
            env[v] = val
    flat_out = [read(a) for a in program.outvars]
    for o, src in structure.output_sources.items():
        graph.add_vertex(o)
        shape, dtype = structure.shape_of[o], structure.dtype_of[o]
        graph.set(src, o, diagonal(None, shape, dtype))
    densify_small_blocks(graph, structure)
    return flat_out, graph, adds
