"""Elementwise primitives.

Linear ones (add, sub, neg, conversions) are pure ties with no stored values. For the
others the diagonal comes from one forward-mode probe per operand: `jax.jvp` with a
tangent of ones gives exactly `∂out/∂operand` on the diagonal, with JAX's own
conventions at kinks (`max` at ties, `abs` at 0, ...).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from .. import _jax_private as jp
from .._sparse import diagonal, from_labeled, with_mask
from ._base import register, register_zero, shape_of


def _broadcast_partial(val, out_shape, in_shape, dtype):
    """Partial of an elementwise op w.r.t. an operand broadcast to `out_shape`.

    The operand is a scalar or has `out_shape` with some axes of size 1 (lax's
    degenerate broadcasting). `val` is `None` (ones), a scalar, or an array of
    `out_shape` holding `∂out[k]/∂operand[k broadcast]`.
    """
    if in_shape == out_shape:
        return diagonal(val, out_shape, dtype)
    n = len(out_shape)
    out_labels = tuple(range(n))
    if in_shape == ():
        in_labels = ()
    else:
        assert len(in_shape) == n, (in_shape, out_shape)
        in_labels = tuple(
            k if in_shape[k] == out_shape[k] else ("b", k) for k in range(n)
        )
        assert all(in_shape[k] in (1, out_shape[k]) for k in range(n))
    labels = out_labels + in_labels
    if val is None or jnp.ndim(val) == 0:
        return from_labeled(val, (), out_shape, in_shape, labels, dtype)
    return from_labeled(val, out_labels, out_shape, in_shape, labels, dtype)


def _probe(prim, primals, i, params):
    """`∂out/∂operand_i` of an elementwise primitive, as an out-shaped array, and
    the mask of entries its JVP rule selects away (see `selected_away`)."""
    x = primals[i]

    def f(xi):
        args = list(primals)
        args[i] = xi
        return prim.bind(*args, **params)

    _, linear = jax.linearize(f, x)  # traced once, applied to two seeds
    try:
        key = (prim, tuple(sorted(params.items())), _types(primals), i)
        hash(key)
    except Exception:  # nothing stable to key on: decide afresh
        key = None
    reaches = _REACHES.get(key) if key is not None else None
    if reaches is None:
        reaches = all(seed_reaches(linear, x) or [False])
        if key is not None:
            _REACHES[key] = reaches
            if len(_REACHES) > 1024:
                _REACHES.pop(next(iter(_REACHES)))
    return selected_away(linear, x, reaches)


# `seed_reaches` decisions of the probed primitives, by primitive, params and operand
# types: the rule's jaxpr depends on nothing else.
_REACHES: dict = {}


def _types(primals) -> tuple:
    return tuple((jnp.shape(p), jnp.result_type(p)) for p in primals)


def selected_away(linear, x, reaches: bool | None = None):
    """An elementwise linear map's diagonal, and where it discards its input.

    `linear` maps a tangent shaped like `x` to an out-shaped array, elementwise. A
    ones tangent gives the diagonal. A NaN tangent shows where the rule does not use
    its input at all (JAX's `select`-based rules, e.g. `relu` or `clamp`): those
    entries, where the diagonal is zero too, are selected away, and a product with
    them must stay zero even against an infinite factor, as it does in JAX. Returns
    `(diagonal, mask or None)`.

    `reaches`: whether a NaN seed is known to reach every output (`seed_reaches`);
    found from `linear`'s jaxpr when `None`.
    """
    diag = linear(lax.full_like(x, 1))
    if reaches is None:
        reaches = all(seed_reaches(linear, x) or [False])
    if reaches:
        return diag, None  # shown on the rule's jaxpr: no select to probe for
    return diag, dropped_entries(diag, linear(lax.full_like(x, jnp.nan)))


def dropped_entries(diag, nan_probe):
    """Where a rule selects its seed away: its diagonal is zero and a NaN seed does
    not come out. (A rule that replaces a NaN seed, `where(isnan(t), 0, t)`, has a
    nonzero diagonal there: it uses its seed.)"""
    return lax.bitwise_and(
        lax.eq(nan_probe, nan_probe), lax.eq(diag, lax.full_like(diag, 0))
    )


# Primitives whose every output element is NaN when one (non-empty) operand is NaN
# everywhere. (Not `pow` or `integer_pow`: `1 ** nan` and `nan ** 0` are 1.)
_NAN_PROPAGATING = frozenset(
    """add sub mul div neg add_any atan2 exp exp2 log log1p expm1 sin cos tan tanh
    asin acos atan sinh cosh asinh acosh atanh sqrt rsqrt cbrt abs square logistic
    erf erfc erf_inv lgamma digamma rem copy copy_p reduce_precision
    broadcast_in_dim reshape squeeze expand_dims transpose rev dot_general reduce_sum
    sharding_constraint""".split()
)


def seed_reaches(linear, *seeds) -> list[bool] | None:
    """For each output of `linear`, whether a NaN seed always reaches all of it.

    Shown on the jaxpr of `linear` (applied to arguments shaped like `seeds`): a NaN
    reaches an output element through arithmetic, shape changes and sums, and through
    a `select_n` only when every case carries it. Where this returns true, the rule
    never selects its seed away, whatever the values, and no NaN probe is needed.
    Anything not shown (a select with a constant case, gathers, control flow) counts
    as possibly selecting away. `None` when `linear` cannot be traced this way.
    """
    try:
        closed = jax.make_jaxpr(linear)(*seeds)
    except Exception:  # probe with values instead
        return None
    jaxpr = closed.jaxpr
    return nan_reaches(jaxpr, [True] * len(jaxpr.invars))


def propagate_facts(
    jaxpr,
    facts: list,
    transfer,
    default,
    sub_jaxpr=None,
    literal=None,
    const=None,
    consts: Sequence = (),
) -> list:
    """Forward dataflow over `jaxpr`: a fact per variable, from the facts of its
    inputs (`facts`) to those of its outputs.

    Literals hold `literal(atom)` and the jaxpr's constants (values `consts`) hold
    `const(value)`, both `default` when not given; an equation whose inputs all hold
    `default` gives `default`; a call-like one is followed into its body
    (`sub_jaxpr(eqn)`, an open jaxpr or a pair of one and its consts, by default the
    inlined calls); any other gets `transfer(eqn, input_facts)`.
    """
    env: dict = {}
    if const is not None:
        env.update((v, const(c)) for v, c in zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, facts, strict=True))

    def read(atom):
        if isinstance(atom, jp.Literal):
            return default if literal is None else literal(atom)
        return env.get(atom, default)

    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        if all(f == default for f in ins):
            outs = [default] * len(eqn.outvars)
        elif (
            sub := _inner_body(eqn) if sub_jaxpr is None else sub_jaxpr(eqn)
        ) is not None:
            sub, sub_consts = sub if isinstance(sub, tuple) else (sub, ())
            outs = propagate_facts(
                sub, ins, transfer, default, sub_jaxpr, literal, const, sub_consts
            )
        else:
            outs = transfer(eqn, ins)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(a) for a in jaxpr.outvars]


def _inner_body(eqn):
    inner = jp.inner_jaxpr(eqn)
    return None if inner is None else inner[0]


def nan_reaches(jaxpr, carried: list[bool]) -> list[bool]:
    """For each output of `jaxpr`, whether it is NaN everywhere when the inputs
    marked in `carried` are (see `seed_reaches`)."""
    return propagate_facts(jaxpr, carried, _carries, False)


def _carries(eqn, ins: list[bool]) -> list[bool]:
    """Whether each output of `eqn` is NaN everywhere, given which inputs are."""
    if eqn.primitive is lax.select_n_p:
        return [all(ins[1:])]
    if eqn.primitive is lax.convert_element_type_p:
        return [ins[0] and jnp.issubdtype(eqn.params["new_dtype"], jnp.inexact)]
    if eqn.primitive.name in _NAN_PROPAGATING:
        # An empty operand (a sum over no terms) gives zeros, not NaN.
        empty = any(0 in tuple(getattr(a.aval, "shape", ())) for a in eqn.invars)
        return [not empty] * len(eqn.outvars)
    return [False] * len(eqn.outvars)


def _full(val, out):
    """`val` as an out-shaped array, or left a scalar when it is one."""
    val = jnp.asarray(val)  # literals arrive as Python / NumPy scalars
    if jnp.ndim(val) == 0 or shape_of(val) == shape_of(out):
        return val.astype(out.dtype)
    return jnp.broadcast_to(val, shape_of(out)).astype(out.dtype)


# Direct formulas for the commonest primitives (fewer operations than a probe),
# `(primals, out, i, params) -> ∂out/∂x_i`, each following JAX's own JVP rule.
def _integer_pow_derivative(primals, out, i, params):
    (x,), y = primals, params["y"]
    if y == 0:
        return jnp.zeros_like(x)
    if y == 1:
        return jnp.ones_like(x)
    return y * lax.integer_pow(x, y - 1)


def _chooser_derivative(first):
    """`∂max(x, y)/∂x_i` (`first`: `x > y` picks `x`, for `max`) or `min`'s: one
    where operand `i` is chosen, one half at a tie, zero where the other is chosen or
    either is NaN, as JAX's rule gives.

    JAX's rule finds the chosen operand by comparing each operand with the result.
    XLA may compute an operand anew inside every kernel that reads it, contracting
    `a * b + c` into a fused multiply-add in one kernel and not in another, so the
    operand it compares can differ from the one the result was taken from by a
    rounding, far from any tie, and the derivative would vanish. Comparing the
    operands with each other needs no result.
    """

    def derivative(primals, out, i, params):
        x, y = primals[i], primals[1 - i]
        wins = first(x, y)
        val = jnp.where(wins, 1.0, jnp.where(x == y, 0.5, 0.0))
        return _full(val.astype(out.dtype), out)

    return derivative


_formulas = {
    lax.max_p: _chooser_derivative(lambda x, y: x > y),
    lax.min_p: _chooser_derivative(lambda x, y: x < y),
    lax.mul_p: lambda p, out, i, _: _full(p[1 - i], out),
    lax.div_p: lambda p, out, i, _: _full(
        1 / p[1] if i == 0 else -out * (1 / p[1]), out
    ),
    lax.sin_p: lambda p, out, i, _: jp.compute_once(jnp.cos(p[0])),
    lax.cos_p: lambda p, out, i, _: -jp.compute_once(jnp.sin(p[0])),
    lax.tan_p: lambda p, out, i, _: 1 + out * out,
    lax.exp_p: lambda p, out, i, _: out,
    lax.log_p: lambda p, out, i, _: 1 / p[0],
    lax.tanh_p: lambda p, out, i, _: (1 + out) * (1 - out),
    lax.logistic_p: lambda p, out, i, _: out * (1 - out),
    lax.sqrt_p: lambda p, out, i, _: 0.5 / out,
    lax.square_p: lambda p, out, i, _: 2 * p[0],
    lax.integer_pow_p: _integer_pow_derivative,
}


# Sines, cosines and tangents are read by many products; XLA CPU would compute them
# anew in each (see `_jax_private.compute_once`).
computed_once = {lax.sin_p, lax.cos_p, lax.tan_p}


def elementwise_rule_for(prim):
    formula = _formulas.get(prim)
    shared = prim in computed_once

    def rule(primals, active, **params):
        out = prim.bind(*primals, **params)
        if shared:
            out = jp.compute_once(out)
        out_shape = shape_of(out)
        partials = {}
        for i, a in enumerate(active):
            if not a:
                continue
            mask = None
            if formula is not None:
                val = formula(primals, out, i, params)
            else:
                val, mask = _probe(prim, primals, i, params)
            in_shape = shape_of(primals[i])
            partial = _broadcast_partial(val, out_shape, in_shape, out.dtype)
            partials[(0, i)] = with_mask(partial, mask)
        return [out], partials

    return rule


_ELEMENTWISE = [
    "exp",
    "exp2",
    "expm1",
    "log",
    "log1p",
    "sin",
    "cos",
    "tan",
    "asin",
    "acos",
    "atan",
    "sinh",
    "cosh",
    "tanh",
    "asinh",
    "acosh",
    "atanh",
    "sqrt",
    "rsqrt",
    "cbrt",
    "logistic",
    "erf",
    "erfc",
    "erf_inv",
    "abs",
    "integer_pow",
    "square",
    "lgamma",
    "digamma",
    "polygamma",
    "igamma",
    "igammac",
    "bessel_i0e",
    "bessel_i1e",
    "zeta",
    "regularized_incomplete_beta",
    "random_gamma_grad",
    "mul",
    "div",
    "pow",
    "max",
    "min",
    "atan2",
    "rem",
    "clamp",
]

# Every elementwise primitive, for recognising elementwise custom-derivative calls.
elementwise_primitives: set = set()

for _name in _ELEMENTWISE:
    _prim = getattr(lax, _name + "_p", None)
    if _prim is not None:
        register(_prim)(elementwise_rule_for(_prim))
        elementwise_primitives.add(_prim)


def _linear_rule(prim, scales):
    """Rule for `out = sum_i scales[i] * operand_i` (a scale of None means 1)."""

    def rule(primals, active, **params):
        out = prim.bind(*primals, **params)
        out_shape = shape_of(out)
        partials = {}
        for i, a in enumerate(active):
            if a:
                scale = scales[i] if i < len(scales) else None
                val = None if scale is None else jnp.asarray(scale, out.dtype)
                partials[(0, i)] = _broadcast_partial(
                    val, out_shape, shape_of(primals[i]), out.dtype
                )
        return [out], partials

    return rule


for _prim, _scales in [
    (lax.add_p, (None, None)),
    (jp.add_any_p, (None, None)),
    (lax.sub_p, (None, -1)),
    (lax.neg_p, (-1,)),
    (lax.convert_element_type_p, (None,)),
    (lax.reduce_precision_p, (None,)),
    (lax.copy_p, (None,)),
    (jp.compute_once_p, (None,)),
    (jp.write_apart_p, (None,)),
]:
    if _prim is not None:
        register(_prim)(_linear_rule(_prim, _scales))
        elementwise_primitives.add(_prim)


@register(lax.select_n_p)
def _select_n(primals, active, **params):
    pred, *cases = primals
    pred = jnp.asarray(pred)  # a literal predicate arrives as a Python bool or int
    out = lax.select_n(pred, *cases)
    out_shape = shape_of(out)
    partials = {}
    which = pred.astype(jnp.int32) if pred.dtype == jnp.bool_ else pred
    for i, a in enumerate(active):
        if a and i > 0:
            chosen = which == (i - 1)
            partial = _broadcast_partial(
                chosen.astype(out.dtype), out_shape, shape_of(primals[i]), out.dtype
            )
            # The other cases' derivatives are discarded, not multiplied by zero.
            partials[(0, i)] = with_mask(partial, lax.bitwise_not(chosen))
    return [out], partials


elementwise_primitives.add(lax.select_n_p)

# Elementwise primitives with no derivative of their own: on a tangent path they still
# map element k to element k (e.g. `where(t > 0, t, 0)`).
elementwise_zero = {
    lax.eq_p,
    lax.ne_p,
    lax.lt_p,
    lax.le_p,
    lax.gt_p,
    lax.ge_p,
    lax.floor_p,
    lax.ceil_p,
    lax.round_p,
    lax.sign_p,
    lax.is_finite_p,
    lax.and_p,
    lax.or_p,
    lax.not_p,
    lax.xor_p,
}

register_zero(
    *elementwise_zero,
    lax.stop_gradient_p if hasattr(lax, "stop_gradient_p") else None,
    lax.iota_p,
    lax.argmax_p,
    lax.argmin_p,
    lax.and_p,
    lax.or_p,
    lax.not_p,
    lax.xor_p,
    lax.population_count_p,
    lax.clz_p,
    lax.shift_left_p,
    lax.shift_right_arithmetic_p,
    lax.shift_right_logical_p,
)
