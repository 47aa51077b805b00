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

import enum
import math
from collections import OrderedDict
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .. import _jax_private as jp
from .._sparse import with_mask
from ._base import Partials, active_indices, register, shape_of
from .elementwise import (
    _broadcast_partial,
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
# seed may flow through them (and through data movement, sums, contractions and
# loops, which are not checked); through anything else in `elementwise_primitives`
# or `elementwise_zero`, or through two operands of a product, it does not.
_LINEAR = {
    lax.add_p,
    jp.add_any_p,
    lax.sub_p,
    lax.neg_p,
    lax.convert_element_type_p,
    lax.reduce_precision_p,
    lax.copy_p,
}


def _nonlinear_step(eqn, deps: list[bool]) -> bool:
    """Whether `eqn` is nonlinear in the seed, given which operands depend on it."""
    prim = eqn.primitive
    if prim in _LINEAR:
        return False
    if prim is lax.mul_p:
        return all(deps)
    if prim is lax.div_p:
        return deps[1]
    if prim is lax.select_n_p:
        return deps[0]
    if prim is lax.integer_pow_p:
        return eqn.params["y"] != 1
    return prim in _ELEMENTWISE_ANY or prim in (lax.max_p, lax.min_p, lax.clamp_p)


def _nonlinear_use(jaxpr, in_deps: list[bool]) -> str | None:
    """The name of a primitive through which the seed flows nonlinearly (a rule such
    as `clip(g)` that is not a linear map of its seed), or None."""
    found: list[str] = []

    def transfer(eqn, deps):
        if not found and _nonlinear_step(eqn, deps):
            found.append(eqn.primitive.name)
        return [True] * len(eqn.outvars)

    propagate_facts(jaxpr, in_deps, transfer, False, _sub_jaxpr)
    return found[0] if found else None


class _Decision(NamedTuple):
    """What the traced rule shows: whether it is elementwise, for each operand in
    `wrt` whether a NaN seed always reaches its diagonal (no selection to probe), and
    a primitive through which the seed flows nonlinearly, if any."""

    elementwise: bool
    reaches: tuple[bool, ...]
    nonlinear: str | None = None


# Decisions of `_rule_decision`, keyed on the functions defining the rule, the
# primal body and the operand types: re-tracing the rule is most of the cost of an
# eager call on a model with custom activations.
_DECISIONS: OrderedDict = OrderedDict()
_MAX_DECISIONS = 512


def _decision_key(prim, params, primals, wrt, use_vjp):
    functions = jp.custom_rule_functions(params)
    if not functions:
        return None
    closed = params.get("call_jaxpr")
    body = str(closed.jaxpr if hasattr(closed, "jaxpr") else closed)
    types = tuple(str(jax.typeof(x)) for x in primals)
    return (prim, functions, body, types, tuple(wrt), use_vjp)


def _rule_decision(prim, params, primals, wrt, out, use_vjp) -> _Decision:
    try:
        key = _decision_key(prim, params, primals, wrt, use_vjp)
        hash(key)
    except Exception:  # nothing stable to key on: decide afresh
        key = None
    if key is not None and key in _DECISIONS:
        _DECISIONS.move_to_end(key)
        return _DECISIONS[key]
    decision = _trace_rule(prim, params, primals, wrt, out, use_vjp)
    if key is not None:
        _DECISIONS[key] = decision
        if len(_DECISIONS) > _MAX_DECISIONS:
            _DECISIONS.popitem(last=False)
    return decision


def _trace_rule(prim, params, primals, wrt, out, use_vjp) -> _Decision:
    """Whether the custom rule maps tangents of `primals[i]`, `i in wrt`, to the output
    tangent (or the output cotangent back to theirs) elementwise, and whether a NaN
    seed reaches each diagonal (`seed_reaches`).

    The rule is traced as JAX runs it (`jax.jvp`, or `jax.vjp` and its pullback, of the
    rebound call) and the seed's dependence is followed through the jaxpr. This is
    structural, so it holds under `jit` where values are tracers; anything not shown
    elementwise (reductions, rolls, gathers, control flow) counts as mixing.
    """
    out_shape = shape_of(out)

    def f(xs, rest):
        args = list(rest)
        for i, x in zip(wrt, xs, strict=True):
            args[i] = x
        return jp.bind(prim, params, *args)[0]

    def pullback(xs, rest, seed):
        _, vjp = jax.vjp(lambda *xs: f(xs, rest), *xs)
        return vjp(seed)

    def pushforward(xs, rest, seed):
        return jax.jvp(lambda *xs: f(xs, rest), tuple(xs), tuple(seed))[1]

    xs = [primals[i] for i in wrt]
    # Only the avals of the seed matter: the output for a cotangent, `xs` for tangents.
    linear, seed = (pullback, out) if use_vjp else (pushforward, xs)
    try:
        # Every primal is an argument, so no value is closed over as a constant.
        closed = jax.make_jaxpr(linear)(xs, list(primals), seed)
    except Exception:  # the rule cannot be traced this way: use the dense path
        return _Decision(False, (False,) * len(wrt))
    jaxpr = closed.jaxpr
    n_seed = len(jax.tree.leaves(seed))
    n_other = len(jaxpr.invars) - n_seed
    in_deps = [_Dep.NONE] * n_other + [_Dep.ELEMENTWISE] * n_seed
    outs = _propagate(jaxpr, in_deps, out_shape)
    if use_vjp:  # one cotangent seed, one output per operand
        reaches = nan_reaches(jaxpr, [False] * n_other + [True])
    else:  # one tangent seed per operand, one output
        reaches = [
            nan_reaches(jaxpr, [False] * n_other + [j == k for j in range(n_seed)])[0]
            for k in range(n_seed)
        ]
    nonlinear = _nonlinear_use(jaxpr, [False] * n_other + [True] * n_seed)
    return _Decision(all(d is not _Dep.MIXED for d in outs), tuple(reaches), nonlinear)


def _nonlinear_error(prim, params, use_vjp: bool, name: str) -> ValueError:
    closed = params.get("call_jaxpr")
    debug = getattr(getattr(closed, "jaxpr", closed), "debug_info", None)
    where = getattr(debug, "func_src_info", None)  # "name at file:line"
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


def _custom_rule(prim, use_vjp):
    # Dense modes: JAX defines a custom_jvp's Jacobian by its JVP rule on basis
    # tangents (`jax.jacfwd`), and a custom_vjp has only its VJP.
    modes = ("rev",) if use_vjp else ("fwd", "rev")

    def rule(primals, active, **params):
        outs = jp.bind(prim, params, *primals)
        idx = active_indices(active)
        if len(outs) != 1:
            return outs, dense_jacobian(prim, params, primals, active, outs, modes)
        out = outs[0]
        out_shape = shape_of(out)
        if any(shape_of(primals[i]) not in (out_shape, ()) for i in idx):
            # Degenerate broadcasting: use the dense path.
            return outs, dense_jacobian(prim, params, primals, active, outs, modes)
        # Operands of the output's shape need an elementwise rule for a diagonal; a
        # scalar operand broadcast to a larger output has a single column, exact anyway.
        wrt = [i for i in idx if shape_of(primals[i]) == out_shape]
        decision = (
            _rule_decision(prim, params, primals, wrt, out, use_vjp)
            if wrt
            else _Decision(True, ())
        )
        if decision.nonlinear is not None:
            raise _nonlinear_error(prim, params, use_vjp, decision.nonlinear)
        if wrt and math.prod(out_shape) > 1 and not decision.elementwise:
            return outs, dense_jacobian(prim, params, primals, active, outs, modes)

        def f(xs, at):
            args = list(primals)
            for i, x in zip(at, xs, strict=True):
                args[i] = x
            return jp.bind(prim, params, *args)[0]

        # Diagonals, and where the rule selects its seed away (see `selected_away`).
        diags, masks = {}, {}
        if use_vjp and wrt:
            # One pullback gives every diagonal; the seeds are built from `out` so
            # that they carry its sharding.
            _, pullback = jax.vjp(lambda *xs: f(xs, wrt), *[primals[i] for i in wrt])
            ones = pullback(lax.full_like(out, 1))
            reaches = decision.reaches
            nans = None if all(reaches) else pullback(lax.full_like(out, jnp.nan))
            for k, (i, one) in enumerate(zip(wrt, ones, strict=True)):
                diags[i] = one
                if not reaches[k]:
                    assert nans is not None
                    masks[i] = lax.bitwise_not(lax.ne(nans[k], nans[k]))
        for i in idx:
            x = primals[i]
            if i in diags:
                continue
            if i in wrt:
                # Linearised once; the rule is then applied to two seeds.
                _, linear = jax.linearize(lambda x, i=i: f([x], [i]), x)
                reaches = decision.reaches[wrt.index(i)]
                diags[i], masks[i] = selected_away(linear, x, reaches)
            else:
                jacobian = jax.jacrev if use_vjp else jax.jacfwd
                diags[i] = jacobian(lambda x: f([x], [i]))(x)
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


register(jp.custom_jvp_call_p)(_custom_rule(jp.custom_jvp_call_p, use_vjp=False))
register(jp.custom_vjp_call_p)(_custom_rule(jp.custom_vjp_call_p, use_vjp=True))
