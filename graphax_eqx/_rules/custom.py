"""`custom_jvp_call` and `custom_vjp_call`: derivatives from the user's rule.

The local Jacobian is the one the custom rule defines, exactly as `jax.jacfwd` /
`jax.jacrev` see it, whatever the primal body computes. When the *rule* is elementwise
(the tangent output depends on the tangent inputs only position by position, shown
structurally on the rule's jaxpr) one JVP (or VJP) with a ones tangent gives the
diagonal exactly. Otherwise the local Jacobian is computed densely through the rule:
by `jax.jacfwd` first for `custom_jvp`, by `jax.jacrev` for `custom_vjp`.

A rule that is not linear in its seed (gradient clipping, `clip(g)`) defines no
Jacobian: JAX applies it to whatever (co)tangent arrives, and a local Jacobian
combined with its neighbours' would differ silently. Where the traced rule shows the
seed flowing through a nonlinear primitive, the rule is refused with an error.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_private as jp
from .._sparse import diagonal, with_mask
from ._base import (
    Partials,
    active_indices,
    needed_outputs,
    outputs_needed,
    register,
    shape_of,
)
from .elementwise import (
    _broadcast_partial,
    dropped_entries,
    elementwise_primitives,
    elementwise_zero,
    nan_reaches,
    propagate_facts,
    selected_away,
)
from .fallback import dense_jacobian


class _Dep(enum.Enum):
    """How a variable of the linearised rule depends on the tangent (cotangent) seed."""

    NONE = 0  # not at all
    ELEMENTWISE = 1  # element k on element k of the seed only (full output shape)
    MIXED = 2  # anything else


# Identity on values when input and output shapes agree.
_SHAPE_ONLY = {
    lax.broadcast_in_dim_p,
    lax.reshape_p,
    lax.squeeze_p,
    lax.sharding_constraint_p,
}
_ELEMENTWISE_ANY = elementwise_primitives | elementwise_zero


def _sub_jaxpr(eqn):
    """The body a linearised rule evaluates for a call-like equation, or None."""
    inner = jp.inner_jaxpr(eqn)
    if inner is not None:
        return inner[0]
    if eqn.primitive in (jp.custom_jvp_call_p, jp.custom_vjp_call_p):
        # Evaluated (not differentiated) inside the rule: its primal body is what runs.
        return jp.custom_call_jaxpr(eqn)[0]
    return None


def _sub_closed(eqn):
    """`_sub_jaxpr` with its consts, as (open jaxpr, consts), or None."""
    inner = jp.inner_jaxpr(eqn)
    if inner is not None:
        return inner
    if eqn.primitive in (jp.custom_jvp_call_p, jp.custom_vjp_call_p):
        return jp.custom_call_jaxpr(eqn)
    return None


def _propagate(jaxpr, in_deps: list[_Dep], out_shape) -> list[_Dep]:
    """The dependence of each output of `jaxpr` on the seed, given its inputs'."""

    def transfer(eqn, deps):
        if _Dep.MIXED in deps:
            return [_Dep.MIXED] * len(eqn.outvars)
        ok = all(tuple(v.aval.shape) == out_shape for v in eqn.outvars)
        if eqn.primitive in _SHAPE_ONLY:
            ok = ok and tuple(eqn.invars[0].aval.shape) == out_shape
        elif eqn.primitive is lax.transpose_p:
            perm = tuple(eqn.params["permutation"])
            ok = ok and perm == tuple(range(len(perm)))
        elif eqn.primitive not in _ELEMENTWISE_ANY:
            ok = False
        return [_Dep.ELEMENTWISE if ok else _Dep.MIXED] * len(eqn.outvars)

    return propagate_facts(jaxpr, in_deps, transfer, _Dep.NONE, _sub_jaxpr)


# Primitives linear in each operand that depends on the seed, given which do: the
# seed may flow through them (and through data movement, sums and contractions with
# a seed-independent operand); through anything else in `elementwise_primitives` or
# `elementwise_zero`, through two operands of a product, or through an order
# statistic, it does not. Conversions between floating types and
# `reduce_precision` round; to bfloat16's 8 significant bits or more they count as
# the linear map they approximate, so that mixed-precision rules that cast their
# seed pass (`jacve` is then the more precise), and to fewer as rounding.
_LINEAR = {
    lax.add_p,
    jp.add_any_p,
    lax.sub_p,
    lax.neg_p,
    lax.copy_p,
    jp.compute_once_p,
    jp.write_apart_p,
}
_MIN_MANTISSA_BITS = 7  # bfloat16's, not counting the implicit one
# Nonlinear in any operand the seed reaches: they pick, order or multiply entries by
# their values.
_ORDER_STATISTICS = {
    lax.max_p,
    lax.min_p,
    lax.clamp_p,
    lax.reduce_max_p,
    lax.reduce_min_p,
    lax.reduce_prod_p,
    lax.argmax_p,
    lax.argmin_p,
    lax.sort_p,
    lax.top_k_p,
    lax.cummax_p,
    lax.cummin_p,
    lax.cumprod_p,
    lax.cumlogsumexp_p,
}
# The same, by name: windowed and scattered maxima, collectives that pick, and the
# matrix decompositions (nonlinear in the matrix they factor).
_NONLINEAR_NAMES = {
    "reduce_window_max",
    "reduce_window_min",
    "reduce_window",
    "scatter-max",
    "scatter-min",
    "pmax",
    "pmin",
    "approx_top_k",
    "nextafter",
    "lu",
    "qr",
    "geqrf",
    "geqp3",
    "householder_product",
    "svd",
    "eig",
    "eigh",
    "cholesky",
    "schur",
    "hessenberg",
    "tridiagonal",
}
# Operands (by position) that a primitive is nonlinear in, though linear in others:
# the matrix of a triangular solve, the diagonals of a tridiagonal one, the entries a
# windowed maximum compares, the factors a scattered product multiplies together.
_NONLINEAR_IN = {
    "triangular_solve": (0,),
    "tridiagonal_solve": (0, 1, 2),
    "select_and_scatter_add": (1,),
    "select_and_gather_add": (1,),
    "scatter-mul": (2,),
}
# Primitives that combine values additively or place them side by side: where the
# seed reaches one of these operands (by position; `None`: all), another that does not
# must be zero, or the result is affine, not linear, in the seed (`g + 1`,
# `where(mask, g, 1.0)`, `g.at[0].set(1.0)`).
_ADDITIVE: dict = {
    lax.add_p: None,
    jp.add_any_p: None,
    lax.sub_p: None,
    lax.select_n_p: slice(1, None),
    lax.pad_p: (0, 1),
    lax.dynamic_update_slice_p: (0, 1),
    lax.scatter_p: (0, 2),
    lax.scatter_add_p: (0, 2),
    lax.scatter_sub_p: (0, 2),
}
# Zero in, zero out: data movement and linear maps of one operand.
_KEEP_ZERO = {
    lax.broadcast_in_dim_p,
    lax.reshape_p,
    lax.squeeze_p,
    lax.transpose_p,
    lax.rev_p,
    lax.slice_p,
    lax.dynamic_slice_p,
    lax.gather_p,
    lax.copy_p,
    jp.compute_once_p,
    jp.write_apart_p,
    lax.convert_element_type_p,
    lax.reduce_precision_p,
    lax.neg_p,
    lax.reduce_sum_p,
    lax.cumsum_p,
    lax.real_p,
    lax.imag_p,
    lax.conj_p,
    lax.sharding_constraint_p,
    lax.reduce_window_sum_p,
}
# The same, by name: placement on devices.
_KEEP_ZERO_NAMES = {"reshard", "device_put", "mesh_cast", "pvary", "pcast"}
# Zero where any operand is.
_PRODUCTS = {lax.mul_p, lax.dot_general_p, lax.conv_general_dilated_p}
# Equality tests of the seed (against zero, or `g != g` for NaN) guard a rule
# (`eqx.error_if` raising on a NaN cotangent): their results hold `_GUARD`, which may
# pick between cases that are all linear in the seed, or steer a `cond` whose other
# branches raise (call back), and nothing else.
_GUARDS = {lax.eq_p, lax.ne_p, lax.is_finite_p}
_GUARD = "guard"  # the fact of a guard's result; any other string names a primitive
_CALLBACKS = {"pure_callback", "io_callback"}


class _Fact(enum.Enum):
    """Facts of `_seed_facts` besides True, False and primitive names."""

    ZERO = "zero"  # independent of the seed, and zero everywhere
    OPAQUE = "opaque"  # out of a `while` loop the seed entered: not followed
    # Linear in the seed in some entries and independent of it (not zero) in others:
    # affine as a result, but may be sliced apart again (see `_Parts`).
    MIXED = "mixed"


_ZERO = _Fact.ZERO
_OPAQUE = _Fact.OPAQUE
_MIXED = _Fact.MIXED


def _dependent(fact) -> bool:
    return fact is True or fact is _MIXED


@dataclasses.dataclass(frozen=True)
class _Parts:
    """The facts of consecutive blocks of an array along `axis`: a concatenation of
    the seed with other values (`ravel_pytree` packing residuals and cotangent into
    one buffer), to be sliced apart again. `parts` holds (length, fact) pairs, facts
    among False, True and `_Fact`s."""

    axis: int
    parts: tuple[tuple[int, object], ...]


def _nonlinear_step(eqn, deps: list[bool]) -> bool:
    """Whether `eqn` is nonlinear in the seed, given which operands depend on it."""
    prim = eqn.primitive
    if prim in _LINEAR:
        return False
    if prim is lax.convert_element_type_p:  # rounding to an integer or a boolean
        dtype = eqn.params["new_dtype"]
        if not jnp.issubdtype(dtype, jnp.inexact):
            return True
        return jnp.finfo(dtype).nmant < _MIN_MANTISSA_BITS
    if prim is lax.reduce_precision_p:
        return eqn.params["mantissa_bits"] < _MIN_MANTISSA_BITS
    if prim in _PRODUCTS:
        return all(deps)
    if prim is lax.div_p:
        return deps[1]
    if prim is lax.select_n_p:
        return deps[0]
    if prim is lax.integer_pow_p:
        return eqn.params["y"] != 1
    if prim.name in _NONLINEAR_IN:
        return any(deps[k] for k in _NONLINEAR_IN[prim.name] if k < len(deps))
    if prim.name == "custom_linear_solve":  # linear in its right-hand side only
        return any(deps[: sum(eqn.params["const_lengths"])])
    return (
        prim in _ELEMENTWISE_ANY
        or prim in _ORDER_STATISTICS
        or prim.name in _NONLINEAR_NAMES
    )


def _combined(eqn, deps: list) -> list:
    """The facts of the operands `eqn` combines additively (see `_ADDITIVE`)."""
    positions = _ADDITIVE.get(eqn.primitive, ())
    if isinstance(positions, slice):
        return deps[positions]
    if positions is None:
        return deps
    return [deps[k] for k in positions if k < len(deps)]


def _affine(eqn, deps: list) -> bool:
    """Whether `eqn` adds (or places beside) the seed a value that is not zero."""
    facts = _combined(eqn, deps)
    return any(_dependent(f) for f in facts) and any(f is False for f in facts)


def _keeps_zero(eqn, deps: list) -> bool:
    """Whether `eqn`, none of whose operands depend on the seed, gives zeros."""
    prim = eqn.primitive
    if prim in _KEEP_ZERO or prim.name in _KEEP_ZERO_NAMES:
        return deps[0] is _ZERO
    if prim in _PRODUCTS:
        return any(d is _ZERO for d in deps)
    if prim is lax.div_p:
        return deps[0] is _ZERO
    if prim is lax.concatenate_p:
        return all(d is _ZERO for d in deps)
    if prim in _ADDITIVE:
        return all(d is _ZERO for d in _combined(eqn, deps))
    return False


_MAX_CONST_CHECKED = 1 << 16  # entries of a constant looked at for zeros


def _zero_value(value):
    """`_ZERO` for a concrete value that is zero everywhere, else False."""
    try:
        if isinstance(value, jp.Tracer) or np.size(value) > _MAX_CONST_CHECKED:
            return False
        return False if np.any(np.asarray(value)) else _ZERO
    except Exception:
        return False


def _zero_literal(atom):
    return _zero_value(atom.val)


def _collapse(fact):
    """The fact of a whole array (see `_Parts`); a block of the seed beside one of
    other values that are not zero is affine."""
    if not isinstance(fact, _Parts):
        return fact
    facts = [f for _, f in fact.parts]
    if any(_dependent(f) for f in facts):
        if any(f is _MIXED or f is False for f in facts):
            return _MIXED
        return True
    if _OPAQUE in facts:
        return _OPAQUE
    return _ZERO if all(f is _ZERO for f in facts) else False


def _parts(fact, length: int, axis: int) -> list | None:
    """`fact` as (length, fact) blocks along `axis`, or None where it has none."""
    if isinstance(fact, _Parts):
        return list(fact.parts) if fact.axis == axis else None
    if fact is True or fact is False or isinstance(fact, _Fact):
        return [(length, fact)]
    return None


def _as_parts(blocks: list, axis: int):
    merged: list = []
    for length, fact in blocks:
        if length == 0:
            continue
        if merged and merged[-1][1] is fact:
            merged[-1] = (merged[-1][0] + length, fact)
        else:
            merged.append((length, fact))
    if len(merged) == 1:
        return merged[0][1]
    parts = _Parts(axis, tuple(merged))
    return parts if any(_dependent(f) for _, f in merged) else _collapse(parts)


def _placed(eqn, deps: list):
    """The facts of a concatenation or a slice along one axis, block by block (see
    `_Parts`), or None for any other equation or where blocks are not followed."""
    prim = eqn.primitive
    if prim is lax.concatenate_p:
        axis = eqn.params["dimension"]
        blocks: list = []
        for v, d in zip(eqn.invars, deps, strict=True):
            found = _parts(d, v.aval.shape[axis], axis)
            if found is None:
                return None
            blocks.extend(found)
        return [_as_parts(blocks, axis)]
    if not isinstance(deps[0], _Parts):
        return None
    axis = deps[0].axis
    if prim is lax.slice_p:
        strides = eqn.params["strides"]
        if strides is not None and strides[axis] != 1:
            return None
        lo, hi = eqn.params["start_indices"][axis], eqn.params["limit_indices"][axis]
        return [_block(deps[0], lo, hi)]
    if prim is lax.split_p:
        if eqn.params["axis"] != axis:  # the blocks along `axis` stay as they are
            return [deps[0]] * len(eqn.outvars)
        outs, lo = [], 0
        for size in eqn.params["sizes"]:
            outs.append(_block(deps[0], lo, lo + int(size)))
            lo += int(size)
        return outs
    return None


def _block(fact: _Parts, lo: int, hi: int):
    """The facts of positions `lo:hi` along `fact.axis`."""
    blocks, at = [], 0
    for length, f in fact.parts:
        a, b = max(at, lo), min(at + length, hi)
        if a < b:
            blocks.append((b - a, f))
        at += length
    return _as_parts(blocks, fact.axis)


def _tainted(fact) -> bool:
    return isinstance(fact, str) and fact != _GUARD


def _merge(a, b):
    """The join of two facts of `_seed_facts`: a nonlinear primitive's name wins."""
    a, b = _collapse(a), _collapse(b)
    for f in (a, b):
        if _tainted(f):
            return f
    for f in (a, b):
        if f is _MIXED:
            return f
    for f in (a, b):
        if f is True or f == _GUARD:
            return f
    if _OPAQUE in (a, b):
        return _OPAQUE
    return _ZERO if a is _ZERO and b is _ZERO else False


def _raises(branch) -> bool:
    """Whether a `cond` branch calls back to the host (`eqx.error_if`'s raising
    branch): what it returns is never used."""
    return any(e.primitive.name in _CALLBACKS for e in branch.jaxpr.eqns)


def _nonlinear_use(jaxpr, in_deps: list, consts: Sequence = ()) -> str | None:
    """The name of a primitive through which the seed flows nonlinearly into the
    rule's results (a rule such as `clip(g)`, or `g + 1`, not a linear map of its
    seed), or None. See `_seed_facts`; `consts` are the values of the jaxpr's
    constants."""
    outs = [_collapse(d) for d in _seed_facts(jaxpr, in_deps, consts)]
    found = next((d for d in outs if isinstance(d, str) and _tainted(d)), None)
    if found is None and _MIXED in outs:
        return "concatenate"  # a result with a constant block beside the seed
    return found


def _seed_facts(jaxpr, facts: list, consts: Sequence = ()) -> list:
    """For each output of `jaxpr`: False (independent of the seed), `_ZERO` (that,
    and zero), True (a linear function of it, as far as is checked), `_OPAQUE` (out
    of a `while` loop, below) or the name of the nonlinear primitive it passed, given
    the same facts of its inputs.

    A seed-independent value that is not zero added to the seed (or selected, padded
    or scattered beside it) makes the result affine, which counts as nonlinear;
    concatenations are followed block by block (see `_Parts`), so that a buffer
    packing residuals beside the seed may be sliced apart again. `cond` branches and
    `scan` bodies are followed (a `cond` whose branch depends on the seed selects
    nonlinearly). The seed is not followed past a `while` loop: an adaptive solver
    (an ODE adjoint with step-size control, an iterative linear solve) chooses its
    steps, their number and its final time from the seed (its first step from norms
    of the seed, before the loop), and is linear in it only up to its tolerance;
    what is done with those after the loop is bookkeeping (reading the last saved
    step), which would look nonlinear here.
    """

    def transfer(eqn, deps):
        prim = eqn.primitive
        n_out = len(eqn.outvars)
        placed = _placed(eqn, deps)
        if placed is not None:
            return placed
        deps = [_collapse(d) for d in deps]
        independent = all(d is False or d is _ZERO for d in deps)
        if prim is lax.while_p and not independent:
            # Not followed, nor are the values it steps by (a first step size from
            # norms of the seed, computed before the loop).
            return [_OPAQUE] * n_out
        if prim is lax.scan_p:  # followed inside, to the loops there
            return _scan_facts(eqn, deps)
        tainted = next((d for d in deps if _tainted(d)), None)
        if tainted is not None and not (prim is lax.cond_p and deps[0] is not tainted):
            return [tainted] * n_out
        if independent:
            return [_ZERO if _keeps_zero(eqn, deps) else False] * n_out
        if all(d is False or d is _ZERO or d is _OPAQUE for d in deps):
            return [_OPAQUE] * n_out
        if prim in _GUARDS:
            return [_GUARD] * n_out
        if prim is lax.select_n_p and deps[0] == _GUARD:
            # Linear only where every case is: a constant case would not be.
            ok = all(d is True for d in deps[1:])
            return [True if ok else prim.name] * n_out
        if prim is lax.cond_p:
            branches = eqn.params["branches"]
            if _dependent(deps[0]):
                return ["cond"] * n_out
            if deps[0] == _GUARD or deps[0] is False or deps[0] is _ZERO:
                # A branch that raises (`eqx.error_if`, on a guard of the seed or
                # on the residuals) returns nothing that is used.
                kept = [b for b in branches if not _raises(b)]
                branches = kept or branches
            found = [
                [_collapse(f) for f in _seed_facts(b.jaxpr, deps[1:], b.consts)]
                for b in branches
            ]
            outs: list = [_ZERO] * n_out
            for k in range(n_out):
                for facts in found:
                    outs[k] = _merge(outs[k], facts[k])
                if _tainted(outs[k]) or not _dependent(outs[k]):
                    continue
                if deps[0] == _GUARD:
                    if any(facts[k] is not True for facts in found):
                        outs[k] = "cond"
                elif any(facts[k] is False for facts in found):
                    outs[k] = "cond"  # one branch linear, another a constant
            return outs
        if _GUARD in deps:
            # Guards combine into guards (`any`, `all`, an index); anything else
            # that takes one in is a value chosen by the seed.
            if all(not jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.outvars):
                return [_GUARD] * n_out
            return [prim.name] * n_out
        if _affine(eqn, deps):
            return [prim.name] * n_out
        if _nonlinear_step(eqn, [_dependent(d) for d in deps]):
            return [prim.name] * n_out
        return [_MIXED if _MIXED in deps else True] * n_out

    return propagate_facts(
        jaxpr, facts, transfer, False, _sub_closed, _zero_literal, _zero_value, consts
    )


def _scan_facts(eqn, deps: list) -> list:
    """`_seed_facts` through a scan: its body, with the carries' facts joined with
    what the body gives them until they settle."""
    closed = eqn.params["jaxpr"]
    n_consts, n_carry = jp.scan_counts(eqn.params)
    facts = list(deps)
    while True:
        outs = _seed_facts(closed.jaxpr, facts, closed.consts)
        carry = facts[n_consts : n_consts + n_carry]
        joined = [_merge(a, b) for a, b in zip(carry, outs[:n_carry], strict=True)]
        if joined == carry:
            return outs
        facts[n_consts : n_consts + n_carry] = joined


class _Decision(NamedTuple):
    """What the traced rule shows: whether it is elementwise, and for each operand in
    `wrt` whether a NaN seed reaches its diagonal (see `seed_reaches`)."""

    elementwise: bool
    reaches: tuple[bool, ...]


# Results of tracing a rule (`_Decision`s, nonlinear primitives), keyed on the
# functions defining the rule, the primal body, the operand types and what is asked:
# re-tracing the rule is most of the cost of an eager call on a model with custom
# activations.
_TRACED: OrderedDict = OrderedDict()
_MAX_TRACED = 512


_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def _flags(value) -> tuple | None:
    """The contents of a small list, tuple, set or dict of Python scalars and
    strings (its items, sorted for a set), or None for anything else."""
    if not isinstance(value, (list, tuple, dict, set, frozenset)) or len(value) > 64:
        return None
    items = list(value.items()) if isinstance(value, dict) else list(value)
    flat = [v for item in items for v in (item if isinstance(value, dict) else [item])]
    if not all(isinstance(v, _SCALARS) for v in flat):
        return None
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(map(repr, flat)))
    return tuple(flat)


def _state_read(functions: tuple) -> tuple:
    """What the rule's Python functions read besides their arguments: the globals
    their code names and the cells they close over, by value for Python scalars and
    strings (a flag that switches the rule) and by identity otherwise, following the
    functions among them two levels down. A rule is traced again when any of these
    changes, as eager `jax.jacrev` would trace it."""
    found: list = []
    seen: set[int] = set()

    def token(value):
        if isinstance(value, _SCALARS):
            return value
        contents = _flags(value)
        if contents is not None:
            # A container of flags is read by value: mutating it switches the rule.
            return ("items", id(value), contents)
        return ("id", id(value))

    def names(code) -> list[str]:
        out = list(code.co_names)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                out.extend(names(c))
        return out

    def visit(fn, depth: int) -> None:
        if id(fn) in seen or depth > 2:
            return
        seen.add(id(fn))
        scope = fn.__globals__
        read = [(n, scope[n]) for n in names(fn.__code__) if n in scope]
        for cell in fn.__closure__ or ():
            try:
                read.append(("", cell.cell_contents))
            except ValueError:  # an empty cell
                pass
        for name, value in read:
            found.append((name, token(value)))
            if isinstance(value, types.FunctionType):
                visit(value, depth + 1)

    for fn in functions:
        if isinstance(fn, types.FunctionType):
            visit(fn, 0)
    return tuple(found)


# The custom rules nested in a jaxpr, by identity (see `jp.jaxpr_text`).
_NESTED: OrderedDict = OrderedDict()


def _nested_rules(jaxpr) -> tuple:
    """The params of every custom-derivative call in `jaxpr`, at any depth."""
    found = _NESTED.get(id(jaxpr))
    if found is not None and found[0] is jaxpr:
        return found[1]
    rules = []
    for eqn in jaxpr.eqns:
        if eqn.primitive in jp.CUSTOM_CALLS:
            rules.append(eqn.params)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jp.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jp.Jaxpr):
                    rules.extend(_nested_rules(sub))
    _NESTED[id(jaxpr)] = (jaxpr, tuple(rules))
    if len(_NESTED) > _MAX_TRACED:
        _NESTED.popitem(last=False)
    return tuple(rules)


def rules_state(prim, params) -> tuple:
    """What the custom rules of a `prim` equation (itself, or nested in its bodies)
    read besides their arguments (see `_state_read`), for keying what was computed
    with them."""
    rules = [params] if prim in jp.CUSTOM_CALLS else []
    for value in params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(sub, jp.ClosedJaxpr):
                sub = sub.jaxpr
            if isinstance(sub, jp.Jaxpr):
                rules.extend(_nested_rules(sub))
    return tuple(_state_read(jp.custom_rule_functions(r)) for r in rules)


def _cached(what: str, prim, params, operands, wrt, use_vjp, compute):
    try:
        functions = jp.custom_rule_functions(params)
        closed = params.get("call_jaxpr")
        body = jp.jaxpr_text(closed.jaxpr if hasattr(closed, "jaxpr") else closed)
        types_ = tuple(str(jax.typeof(x)) for x in operands)
        state = _state_read(functions)
        key = (what, prim, functions, state, body, types_, tuple(wrt), use_vjp)
        hash(key)
    except Exception:  # nothing stable to key on: decide afresh
        return compute()
    if not key[2]:
        return compute()
    if key in _TRACED:
        _TRACED.move_to_end(key)
        return _TRACED[key]
    result = _TRACED[key] = compute()
    if len(_TRACED) > _MAX_TRACED:
        _TRACED.popitem(last=False)
    return result


def _rule_jaxpr(prim, params, operands, wrt, use_vjp):
    """`_trace_rule`, traced once for the questions asked of it."""
    return _cached(
        "jaxpr",
        prim,
        params,
        operands,
        wrt,
        use_vjp,
        lambda: _trace_rule(prim, params, operands, wrt, use_vjp),
    )


def _trace_rule(prim, params, operands, wrt, use_vjp):
    """The rule as JAX applies it to a seed, traced: `jax.jvp` of the rebound call
    with tangents for `operands[i]`, `i in wrt`, or `jax.vjp`'s pullback with a
    cotangent for every floating output. Every operand is an argument, so no value is
    closed over as a constant, and only the operands' types matter.

    Returns the jaxpr, its number of seed inputs (its last ones) and the values of
    its constants, or None where the rule cannot be traced this way.
    """

    def f(xs, rest):
        args = list(rest)
        for i, x in zip(wrt, xs, strict=True):
            args[i] = x
        outs = jp.bind(prim, params, *args)
        return [o for o in outs if jnp.issubdtype(o.dtype, jnp.inexact)]

    def pullback(xs, rest, seed):
        _, vjp = jax.vjp(lambda *xs: f(xs, rest), *xs)
        return vjp(seed)

    def pushforward(xs, rest, seed):
        return jax.jvp(lambda *xs: f(xs, rest), tuple(xs), tuple(seed))[1]

    xs = [operands[i] for i in wrt]
    try:
        if use_vjp:
            seed = jax.eval_shape(lambda *xs: f(xs, operands), *xs)
            if not seed:
                return None
            closed = jax.make_jaxpr(pullback)(xs, list(operands), seed)
        else:
            seed = xs
            closed = jax.make_jaxpr(pushforward)(xs, list(operands), seed)
    except Exception:  # the rule cannot be traced this way: use the dense path
        return None
    return closed.jaxpr, len(jax.tree.leaves(seed)), list(closed.consts)


def _rule_decision(prim, params, primals, idx, wrt, out, use_vjp) -> _Decision:
    """Whether the custom rule maps tangents of `primals[i]`, `i in wrt`, to the output
    tangent (or the output cotangent back to theirs) elementwise, and whether a NaN
    seed reaches each diagonal (`seed_reaches`).

    The rule is traced with a seed for every active operand (`idx`, of which `wrt`
    are some), as JAX differentiates it: a rule with symbolic zeros sees the operands
    JAX perturbs. The seed's dependence is followed through the traced rule
    (`_rule_jaxpr`). This is structural, so it holds under `jit` where values are
    tracers; anything not shown elementwise (reductions, rolls, gathers, control
    flow) counts as mixing.
    """
    at = [idx.index(i) for i in wrt]

    def compute():
        traced = _rule_jaxpr(prim, params, primals, idx, use_vjp)
        if traced is None:
            return _Decision(False, (False,) * len(wrt))
        jaxpr, n_seed, _ = traced
        n_other = len(jaxpr.invars) - n_seed
        if use_vjp:  # one cotangent seed, one output per operand
            in_deps = [_Dep.NONE] * n_other + [_Dep.ELEMENTWISE] * n_seed
            outs = _propagate(jaxpr, in_deps, shape_of(out))
            outs = [outs[k] for k in at]
            carried = nan_reaches(jaxpr, [False] * n_other + [True])
            reaches = [carried[k] for k in at]
        else:  # one tangent seed per operand, one output
            in_deps = [_Dep.NONE] * n_other + [
                _Dep.ELEMENTWISE if k in at else _Dep.NONE for k in range(n_seed)
            ]
            outs = _propagate(jaxpr, in_deps, shape_of(out))
            reaches = [
                nan_reaches(jaxpr, [False] * n_other + [j == k for j in range(n_seed)])[
                    0
                ]
                for k in at
            ]
        elementwise = all(d is not _Dep.MIXED for d in outs)
        return _Decision(elementwise, tuple(reaches))

    return _cached(
        "decision", prim, params, primals, (tuple(idx), tuple(wrt)), use_vjp, compute
    )


def _check_linear(prim, params, operands, wrt, use_vjp) -> None:
    """Refuse the custom rule of `prim` if the seed for `operands[i]`, `i in wrt`
    (or for its outputs), flows through a nonlinear primitive: see `_nonlinear_use`."""

    def compute():
        traced = _rule_jaxpr(prim, params, operands, wrt, use_vjp)
        if traced is None:
            return None
        jaxpr, n_seed, consts = traced
        n_other = len(jaxpr.invars) - n_seed
        return _nonlinear_use(jaxpr, [False] * n_other + [True] * n_seed, consts)

    name = _cached("linear", prim, params, operands, wrt, use_vjp, compute)
    if name is not None:
        raise _nonlinear_error(prim, params, use_vjp, name)


class Dependence(NamedTuple):
    """Which operands each output of a custom-derivative call has a derivative with
    respect to, under its rule (see `derivative_dependence`)."""

    # For each output, the positions (among those asked about) its tangent depends
    # on; empty for integer outputs and for those the rule gives zero tangents.
    operands: tuple[frozenset[int], ...]
    # (output, operand) pairs whose derivative is the identity: the rule passes the
    # operand's tangent (the output's cotangent) through unchanged.
    identities: frozenset[tuple[int, int]]


def _union(eqn, deps: list) -> list:
    found = frozenset().union(*deps)
    return [found] * len(eqn.outvars)


def _dependence(jaxpr, n_seed: int) -> list[frozenset[int]]:
    """For each output of `jaxpr`, which of its last `n_seed` inputs (numbered from
    0) its value depends on, following data flow (conservatively through loops)."""
    n_other = len(jaxpr.invars) - n_seed
    facts = [frozenset()] * n_other + [frozenset({s}) for s in range(n_seed)]
    return propagate_facts(jaxpr, facts, _union, frozenset())


def _call_outvars(params) -> list:
    closed = params["call_jaxpr"]
    return list(getattr(closed, "jaxpr", closed).outvars)


def _same_type(var, operand) -> bool:
    """Whether the seed `var` has the type (shape and dtype) of `operand`."""
    t = jax.typeof(operand)
    return tuple(var.aval.shape) == tuple(t.shape) and var.aval.dtype == t.dtype


def derivative_dependence(prim, params, operands, wrt) -> Dependence | None:
    """The structure of the local Jacobian a custom rule defines, read off the traced
    rule: for each output of the `prim` call, the operands `operands[i]`, `i in wrt`,
    it depends on, and the pairs it passes through unchanged; None where the rule
    cannot be traced.

    A rule may give some outputs no tangent at all (Equinox's checkpointed loops
    return their bookkeeping that way), or pass tangents through untouched: those
    parts of the Jacobian are zeros and identities, with nothing to compute, and
    the values that reach the result only through zeros are not needed. `operands`
    may be arrays or `jax.ShapeDtypeStruct`s; only their types matter.
    """
    use_vjp = prim is jp.custom_vjp_call_p
    wrt = [i for i in wrt if jnp.issubdtype(jax.typeof(operands[i]).dtype, jnp.inexact)]

    def compute():
        traced = _rule_jaxpr(prim, params, operands, wrt, use_vjp) if wrt else None
        if traced is None:
            return None
        jaxpr, n_seed, _ = traced
        n_other = len(jaxpr.invars) - n_seed
        outvars = _call_outvars(params)
        float_outs = [
            k
            for k, v in enumerate(outvars)
            if jnp.issubdtype(v.aval.dtype, jnp.inexact)
        ]
        found = _dependence(jaxpr, n_seed)
        seeds = jaxpr.invars[n_other:]
        n_outs = len(outvars)
        deps = [set() for _ in range(n_outs)]
        identities = set()
        if use_vjp:  # seeds: output cotangents; results: the operands' cotangents
            if len(seeds) != len(float_outs) or len(found) != len(wrt):
                return None
            for a, i in enumerate(wrt):
                for s in found[a]:
                    deps[float_outs[s]].add(i)
                out = jaxpr.outvars[a]
                if (
                    not isinstance(out, jp.Literal)
                    and out in seeds
                    and _same_type(out, operands[i])
                ):
                    identities.add((float_outs[seeds.index(out)], i))
        else:  # seeds: the operands' tangents; results: the outputs' tangents
            if len(seeds) != len(wrt) or len(found) != len(float_outs):
                return None
            for pos, k in enumerate(float_outs):
                deps[k].update(wrt[s] for s in found[pos])
                out = jaxpr.outvars[pos]
                if not isinstance(out, jp.Literal) and out in seeds:
                    i = wrt[seeds.index(out)]
                    if _same_type(out, operands[i]):
                        identities.add((k, i))
        return Dependence(tuple(frozenset(d) for d in deps), frozenset(identities))

    return _cached("dependence", prim, params, operands, wrt, use_vjp, compute)


def check_rules_inside(prim, params, active: Sequence[bool]) -> None:
    """Refuse a custom rule nested in the bodies of `prim` (a loop, a branch) that an
    active operand reaches and that is not linear in its seed.

    A loop's derivative applies the rules inside it to whatever (co)tangents its
    linearisation carries, which differs from `jax.grad` exactly as a rule outside a
    loop does (see `_custom_rule`).

    Also refuse a collective over mapped axes that an active operand reaches, here or
    in a body, unless a nested `shard_map` binds those axes (see `_collective_error`).
    """
    if prim in jp.COLLECTIVES and jp.positional_reduction(prim, params) is None:
        raise _collective_error(prim)
    if (
        prim in jp.CUSTOM_CALLS
    ):  # checked by `_custom_rule`; its body is not differentiated
        return
    for body, body_active in _bodies_reached(prim, params, list(active)):
        _reach(body, body_active, check=True, collectives=prim not in jp.MAPS)


def _collective_error(prim) -> TypeError:
    return TypeError(
        f"`jacve` cannot differentiate through the collective `{prim}` over the "
        "mapped axes of a `shard_map`, `pmap` or `vmap(..., axis_name=...)` it runs "
        "inside. There each device (or batch element) holds its own piece of the "
        "function, and its Jacobian is not defined piece by piece: `jax.jacfwd` and "
        "`jax.jacrev` give different results. Take the Jacobian of the whole mapped "
        "function instead (`jacve(jax.shard_map(f, ...))`, or `jax.jit(jacve(f))` on "
        "sharded inputs, which XLA partitions), or differentiate the local "
        "computation and apply the collective to its Jacobian: for a data-parallel "
        "loss, `jax.lax.psum(jacve(local_loss)(params, batch), axis_name)`, with "
        "replicated `params` first made varying by "
        "`jax.lax.pcast(params, axis_name, to='varying')`."
    )


def _reach(
    jaxpr, active: list[bool], check: bool, collectives: bool = False
) -> list[bool]:
    """Which outputs of `jaxpr` depend on its `active` inputs; with `check`, refuse
    every reached custom rule not linear in its seed, at any depth, and with
    `collectives` every reached collective outside a nested map."""
    env = dict(zip(jaxpr.invars, active, strict=True))
    for eqn in jaxpr.eqns:
        deps = [not isinstance(v, jp.Literal) and env.get(v, False) for v in eqn.invars]
        if check and any(deps):
            if (
                collectives
                and eqn.primitive in jp.COLLECTIVES
                and jp.positional_reduction(eqn.primitive, eqn.params) is None
            ):
                raise _collective_error(eqn.primitive)
            if eqn.primitive in jp.CUSTOM_CALLS:
                types = [
                    jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars
                ]
                wrt = [
                    i
                    for i, (d, t) in enumerate(zip(deps, types, strict=True))
                    if d and jnp.issubdtype(t.dtype, jnp.inexact)
                ]
                if wrt:
                    use_vjp = eqn.primitive is jp.custom_vjp_call_p
                    _check_linear(eqn.primitive, eqn.params, types, wrt, use_vjp)
            else:
                inner = collectives and eqn.primitive not in jp.MAPS
                for body, body_active in _bodies_reached(
                    eqn.primitive, eqn.params, deps
                ):
                    _reach(body, body_active, check=True, collectives=inner)
        env.update((v, any(deps)) for v in eqn.outvars)
    return [not isinstance(v, jp.Literal) and env.get(v, False) for v in jaxpr.outvars]


def _bodies_reached(prim, params, active: list[bool]) -> list:
    """The differentiated bodies of `prim` (open jaxprs), with which of their inputs
    the `active` operands reach: a loop's carries to a fixed point."""
    if prim is lax.scan_p:
        body = params["jaxpr"].jaxpr
        return [(body, _carried(body, active, *jp.scan_counts(params)))]
    if prim is lax.while_p:  # the predicate has no derivative
        body = params["body_jaxpr"].jaxpr
        operands = active[params["cond_nconsts"] :]
        n_carry = len(operands) - params["body_nconsts"]
        return [(body, _carried(body, operands, params["body_nconsts"], n_carry))]
    if prim is lax.cond_p:
        return [(b.jaxpr, active[1:]) for b in params["branches"]]
    found = []
    for value in params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(sub, jp.ClosedJaxpr):
                sub = sub.jaxpr
            if isinstance(sub, jp.Jaxpr):
                n = len(sub.invars)
                reached = active if len(active) == n else [any(active)] * n
                found.append((sub, reached))
    return found


def _carried(body, active: list[bool], n_consts: int, n_carry: int) -> list[bool]:
    """`active` for a loop body whose outputs start with its carries, with a carry
    active wherever an earlier iteration makes it so."""
    active = list(active)
    while True:
        outs = _reach(body, active, check=False)
        carry = active[n_consts : n_consts + n_carry]
        new = [a or o for a, o in zip(carry, outs[:n_carry], strict=True)]
        if new == carry:
            return active
        active[n_consts : n_consts + n_carry] = new


def _rule_location(params) -> str | None:
    """Where the function of a custom-derivative call is defined: "name at
    file:line"."""
    closed = params.get("call_jaxpr")
    debug = getattr(getattr(closed, "jaxpr", closed), "debug_info", None)
    return getattr(debug, "func_src_info", None)


def _nonlinear_error(prim, params, use_vjp: bool, name: str) -> ValueError:
    where = _rule_location(params)
    kind = "custom_vjp" if use_vjp else "custom_jvp"
    seed = "cotangent" if use_vjp else "tangent"
    which = f"`{where}`" if where else "a function"
    return ValueError(
        f"The {kind} rule of {which} is not linear in its {seed}: it applies "
        f"`{name}` to it (gradient clipping is such a rule). A Jacobian is a linear "
        f"map, and vertex elimination combines the rule's local Jacobian with its "
        f"neighbours', where `jax.grad` would apply the rule to the {seed} that "
        f"arrives: the results would differ silently. Make the rule linear in its "
        f"{seed} (clip or rescale the gradients after computing them, e.g. with "
        f"`optax.clip`), or differentiate this function with JAX's own transforms."
    )


def _stale_value_error(params, use_vjp: bool) -> TypeError:
    where = _rule_location(params)
    which = f"`{where}`" if where else "a function"
    kind = "custom_vjp" if use_vjp else "custom_jvp"
    return TypeError(
        f"The {kind} rule of {which} closes over a value computed while the "
        "function was traced: one the function is not passed, or one that depends "
        "on the differentiated inputs (a custom rule gives no derivative through "
        "the values it closes over). Vertex elimination runs custom rules after "
        "tracing, when such a value no longer exists, and JAX's own transforms "
        "reject such rules too. Pass the value to the function as an argument "
        "(listed in `nondiff_argnums` if it is not to be differentiated) instead of "
        "closing over it."
    )


def _custom_rule(prim, use_vjp):
    rule = _custom_rule_body(prim, use_vjp)

    def checked(primals, active, **params):
        # Constants may arrive as NumPy arrays; the rule's code expects JAX's (it
        # may index them with traced values, as `jax.experimental.ode` does).
        primals = [
            jnp.asarray(p) if isinstance(p, (np.ndarray, np.generic)) else p
            for p in primals
        ]
        if not use_vjp and jp.stale_closure(
            params, len(primals) - params.get("num_consts", 0)
        ):
            # The rule reads values the function computed (`nondiff_argnums` arrays):
            # where they are the equation's const operands, it reads them there. Not
            # where one depends on the differentiated inputs: the rule gives no
            # derivative through it (JAX raises there too).
            rebound = jp.rebind_const_operands(params)
            if (
                rebound is None
                or any(active[: params.get("num_consts", 0)])
                or jp.stale_closure(rebound, len(primals))
            ):
                raise _stale_value_error(params, use_vjp)
            params = rebound
        try:
            return rule(primals, active, **params)
        except jax.errors.UnexpectedTracerError as e:
            raise _stale_value_error(params, use_vjp) from e

    return checked


def _custom_rule_body(prim, use_vjp):
    # Dense modes: JAX defines a custom_jvp's Jacobian by its JVP rule on basis
    # tangents (`jax.jacfwd`), and a custom_vjp has only its VJP.
    modes = ("rev",) if use_vjp else ("fwd", "rev")

    def rule(primals, active, **params):
        outs = jp.bind(prim, params, *primals)
        idx = active_indices(active)
        # Every path below uses a local Jacobian, which exists for a linear rule only.
        _check_linear(prim, params, primals, idx, use_vjp)
        if len(outs) != 1:
            return outs, _coupled_partials(prim, params, primals, idx, outs, modes)
        out = outs[0]
        out_shape = shape_of(out)
        if any(shape_of(primals[i]) not in (out_shape, ()) for i in idx):
            # Degenerate broadcasting: use the dense path.
            return outs, dense_jacobian(prim, params, primals, active, outs, modes)
        # Operands of the output's shape need an elementwise rule for a diagonal; a
        # scalar operand broadcast to a larger output has a single column, exact anyway.
        wrt = [i for i in idx if shape_of(primals[i]) == out_shape]
        decision = (
            _rule_decision(prim, params, primals, idx, wrt, out, use_vjp)
            if wrt
            else _Decision(True, ())
        )
        if wrt and math.prod(out_shape) > 1 and not decision.elementwise:
            return outs, dense_jacobian(prim, params, primals, active, outs, modes)

        def f(xs, at):
            args = list(primals)
            for i, x in zip(at, xs, strict=True):
                args[i] = x
            return jp.bind(prim, params, *args)[0]

        # Diagonals (columns, for scalar operands), and where the rule selects its
        # seed away (see `selected_away`). The rule is differentiated with respect
        # to every active operand at once, as JAX differentiates the function: a
        # rule with symbolic zeros is then given one only where JAX gives one.
        at = [primals[i] for i in idx]
        diags, masks = {}, {}
        if use_vjp:
            # One pullback gives every diagonal; the seeds are built from `out` so
            # that they carry its sharding.
            _, pullback = jax.vjp(lambda *xs: f(xs, idx), *at)
            if wrt:
                ones = pullback(lax.full_like(out, 1))
                nans = None
                if not all(decision.reaches):
                    nans = pullback(lax.full_like(out, jnp.nan))
                for k, i in enumerate(wrt):
                    diags[i] = ones[idx.index(i)]
                    if not decision.reaches[k]:
                        assert nans is not None
                        masks[i] = dropped_entries(diags[i], nans[idx.index(i)])
            scalars = [i for i in idx if i not in wrt]
            if scalars:
                # A column per scalar operand: one pullback per output entry.
                size = math.prod(out_shape)

                def column(m):
                    seed = (lax.iota(np.int32, size) == m).reshape(out_shape)
                    cts = pullback(seed.astype(out.dtype))
                    return [cts[idx.index(i)] for i in scalars]

                for i, col in zip(
                    scalars, jax.vmap(column)(jnp.arange(size)), strict=True
                ):
                    diags[i] = col.reshape(out_shape)
        else:
            # Linearised once; the rule is then applied to two seeds per operand.
            _, linear = jax.linearize(lambda *xs: f(xs, idx), *at)
            for i in idx:
                x = primals[i]

                def along(t, i=i):
                    # `t` for operand `i`, zeros for the others.
                    return linear(
                        *[
                            t if j == i else lax.full_like(at[k], 0)
                            for k, j in enumerate(idx)
                        ]
                    )

                if i in wrt:
                    reaches = decision.reaches[wrt.index(i)]
                    diags[i], masks[i] = selected_away(along, x, reaches)
                else:
                    diags[i] = along(lax.full_like(x, 1))
        partials: Partials = {
            (0, i): with_mask(
                _broadcast_partial(
                    diags[i].astype(out.dtype),
                    out_shape,
                    shape_of(primals[i]),
                    out.dtype,
                ),
                masks.get(i),
            )
            for i in idx
        }
        return outs, partials

    return rule


def _coupled_partials(prim, params, primals, idx, outs, modes) -> Partials:
    """The partials of a call with several outputs: identities and zeros where the
    rule passes a (co)tangent through or gives none (see `derivative_dependence`),
    the rest dense, by differentiating only the outputs left."""
    active = [i in idx for i in range(len(primals))]
    found = derivative_dependence(prim, params, primals, idx)
    if found is None:
        return dense_jacobian(prim, params, primals, active, outs, modes)
    needed = needed_outputs(prim, len(outs))
    partials: Partials = {}
    rest: dict[int, set[int]] = {}
    for k, deps in enumerate(found.operands):
        if not needed[k]:
            continue
        for i in deps:
            if (k, i) in found.identities:
                shape = shape_of(outs[k])
                partials[(k, i)] = diagonal(None, shape, outs[k].dtype)
            else:
                rest.setdefault(k, set()).add(i)
    if rest:
        # With respect to every active operand, as JAX differentiates: a rule with
        # symbolic zeros sees the same operands perturbed.
        with outputs_needed(prim, [k in rest for k in range(len(outs))]):
            dense = dense_jacobian(prim, params, primals, active, outs, modes)
        partials.update((key, p) for key, p in dense.items() if key[1] in rest[key[0]])
    return partials


register(jp.custom_jvp_call_p)(_custom_rule(jp.custom_jvp_call_p, use_vjp=False))
register(jp.custom_vjp_call_p)(_custom_rule(jp.custom_vjp_call_p, use_vjp=True))
