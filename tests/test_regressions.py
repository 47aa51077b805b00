"""Regression tests for defects of the original graphax implementation."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import graphax_eqx

from .helpers import (
    ORDERS,
    assert_tree_matches,
    check_jacve,
    is_sparse_block,
    resolve_order,
)


# --------------------------------------------------------------------------------------
# (1) A variable used twice by one equation.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
def test_x_times_x_is_two_x(order):
    x = jnp.array([0.5, -1.5, 2.0])
    result = check_jacve(lambda v: v * v, (x,), order)
    assert_tree_matches(result, jnp.diag(2.0 * x))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    "fun",
    [
        lambda v: lax.mul(v, v),
        lambda v: v + v,
        lambda v: v * v * v,
        lambda v: jnp.dot(v, v),
        lambda v: jnp.maximum(v, v),
        lambda v: jnp.arctan2(v, v),
        lambda v: jnp.concatenate([v, v]),
    ],
    ids=["lax_mul", "add", "cube", "dot", "max", "atan2", "concatenate"],
)
def test_operand_used_twice(fun, order):
    check_jacve(fun, (jnp.array([0.5, -1.5, 2.0]),), order)


# --------------------------------------------------------------------------------------
# (2) Python floats outside jit; pytree arguments.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
def test_python_float_argument(order):
    f = lambda x: 3.0 * x**2 + jnp.sin(x)
    order = resolve_order(order, f, (2.0,))
    result = graphax_eqx.jacve(f, order=order)(2.0)
    expected = 12.0 + np.cos(2.0)
    assert float(result) == pytest.approx(expected, rel=1e-6)
    assert float(result) != 0.0


@pytest.mark.parametrize("order", ORDERS)
def test_two_python_float_arguments(order):
    f = lambda x, y: x * y + jnp.exp(x)
    order = resolve_order(order, f, (1.5, -0.5), argnums=(0, 1))
    dx, dy = graphax_eqx.jacve(f, order=order, argnums=(0, 1))(1.5, -0.5)
    assert float(dx) == pytest.approx(-0.5 + np.exp(1.5), rel=1e-6)
    assert float(dy) == pytest.approx(1.5, rel=1e-6)


@pytest.mark.parametrize("order", ORDERS)
def test_pytree_argument(order):
    params = {"w": jnp.array([[0.5, -0.2], [0.1, 0.3]]), "b": (jnp.array(0.7), 2.0)}

    def f(p, x):
        return jnp.tanh(p["w"] @ x + p["b"][0]) * p["b"][1]

    check_jacve(f, (params, jnp.array([1.0, -2.0])), order, argnums=(0, 1))


# --------------------------------------------------------------------------------------
# (3) Individual rules that were wrong or missing.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
def test_asinh_derivative(order):
    x = jnp.array([-2.0, -0.3, 0.0, 0.4, 3.0])
    result = check_jacve(jnp.arcsinh, (x,), order)
    assert_tree_matches(result, jnp.diag(1.0 / jnp.sqrt(1.0 + x**2)))


_STRUCTURAL = {
    "select_n": (
        lambda x, y: lax.select_n(x > 0, x * 2.0, jnp.sin(y)),
        (jnp.array([0.5, -1.0, 2.0]), jnp.array([0.1, 0.2, 0.3])),
        (0, 1),
    ),
    "concatenate_input": (
        lambda x: jnp.concatenate([x, jnp.sin(x)]),
        (jnp.array([0.5, -1.0, 2.0]),),
        0,
    ),
    "int_index": (lambda x: x[2] * x, (jnp.array([0.5, -1.0, 2.0, 0.3]),), 0),
    "int_array_index": (
        lambda x: x[jnp.array([3, 0, 3])],
        (jnp.array([0.5, -1.0, 2.0, 0.3]),),
        0,
    ),
    "split": (
        lambda x: jnp.split(jnp.exp(x), 3),
        (jnp.array([0.5, -1.0, 2.0, 0.3, 0.1, 0.2]),),
        0,
    ),
    "squeeze": (lambda x: jnp.squeeze(jnp.sin(x)), (jnp.array([[0.5, -1.0]]),), 0),
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", sorted(_STRUCTURAL))
def test_structural_rules(name, order):
    fun, args, argnums = _STRUCTURAL[name]
    result = check_jacve(fun, args, order, argnums=argnums)
    leaves = jax.tree_util.tree_leaves(result)
    assert any(bool(jnp.any(leaf != 0)) for leaf in leaves)


# --------------------------------------------------------------------------------------
# (4) Control flow, custom rules and index-moving primitives.
# --------------------------------------------------------------------------------------


@jax.custom_jvp
def _clipped_identity(x):
    return x


@_clipped_identity.defjvp
def _clipped_identity_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return x, jnp.clip(x, 0.0, 1.0) * t


@jax.custom_vjp
def _halved_grad(x):
    return jnp.sin(x)


def _halved_grad_fwd(x):
    return jnp.sin(x), x


def _halved_grad_bwd(x, g):
    return (0.5 * jnp.cos(x) * g,)


_halved_grad.defvjp(_halved_grad_fwd, _halved_grad_bwd)


def _scan(x):
    return lax.scan(lambda c, a: (c * jnp.sin(a) + a, c), jnp.sum(x), x)


def _while(x):
    return lax.while_loop(lambda s: s[0] < 4, lambda s: (s[0] + 1, s[1] * x), (0, x))[1]


def _cond(x):
    return lax.cond(x[0] > 0, lambda v: v * v, lambda v: jnp.exp(v), x)


_X = jnp.array([0.5, -1.0, 2.0, 0.3])

_FEATURES = {
    "scan": (_scan, (_X,), 0, ("fwd", "rev")),
    "while": (_while, (_X,), 0, ("fwd",)),
    "cond": (_cond, (_X,), 0, ("fwd", "rev")),
    "custom_jvp": (lambda x: _clipped_identity(x * 2.0), (_X,), 0, ("fwd", "rev")),
    "custom_vjp": (lambda x: _halved_grad(x) * x, (_X,), 0, ("rev",)),
    "gather": (lambda x: x[jnp.array([1, 1, 3])] * 2.0, (_X,), 0, ("fwd", "rev")),
    "scatter": (
        lambda x, y: x.at[jnp.array([0, 2])].add(y),
        (_X, jnp.array([1.0, 2.0])),
        (0, 1),
        ("fwd", "rev"),
    ),
    "dynamic_slice": (
        lambda x: lax.dynamic_slice(jnp.sin(x), (1,), (2,)),
        (_X,),
        0,
        ("fwd", "rev"),
    ),
    "cumsum": (lambda x: jnp.cumsum(x * x), (_X,), 0, ("fwd", "rev")),
    "sort": (lambda x: jnp.sort(x) * jnp.arange(4.0), (_X,), 0, ("fwd", "rev")),
    "conv": (
        lambda x, k: lax.conv(x[None, None], k[None, None], (1,), "SAME")[0, 0],
        (_X, jnp.array([0.2, -0.5, 1.0])),
        (0, 1),
        ("fwd", "rev"),
    ),
    "pad": (lambda x: lax.pad(x, 1.5, [(1, 2, 1)]), (_X,), 0, ("fwd", "rev")),
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", sorted(_FEATURES))
def test_supported_features(name, order):
    fun, args, argnums, refs = _FEATURES[name]
    check_jacve(fun, args, order, argnums=argnums, refs=refs)


@pytest.mark.parametrize("order", ORDERS)
def test_nested_jit_nonzero(order):
    inner = jax.jit(lambda v: jnp.sin(v) * v)
    outer = jax.jit(lambda v: inner(v) + jax.jit(jnp.exp)(v))
    result = check_jacve(outer, (_X,), order)
    assert bool(jnp.all(jnp.diag(result) != 0))


# --------------------------------------------------------------------------------------
# (5) has_aux follows JAX: (jacobian, aux).
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
def test_has_aux_returns_jacobian_then_aux(order):
    def f(x):
        y = jnp.sin(x)
        return y * 2.0, {"y": y, "total": jnp.sum(x)}

    order = resolve_order(order, f, (_X,), has_aux=True)
    result = graphax_eqx.jacve(f, order=order, has_aux=True)(_X)
    assert isinstance(result, tuple) and len(result) == 2
    jac, aux = result
    expected_jac, expected_aux = jax.jacrev(f, has_aux=True)(_X)
    assert_tree_matches(jac, expected_jac)
    assert_tree_matches(aux, expected_aux)


# --------------------------------------------------------------------------------------
# (6) SparseTensor results cross jax.jit.
# --------------------------------------------------------------------------------------


def _is_sparse(x):
    return is_sparse_block(x)


@pytest.mark.parametrize("order", ["fwd", "rev", "auto"])
def test_sparse_result_through_jit(order):
    def f(x, w):
        return jnp.sin(x) * 2.0, w @ x

    w = jnp.arange(8.0).reshape(2, 4) / 8.0

    @jax.jit
    def jac(x, w):
        return graphax_eqx.jacve(
            f, order=order, argnums=(0, 1), sparse_representation=True
        )(x, w)

    result = jac(_X, w)
    leaves = jax.tree_util.tree_leaves(result, is_leaf=_is_sparse)
    assert leaves and all(_is_sparse(leaf) for leaf in leaves)
    dense = jax.tree_util.tree_map(lambda s: s.dense(), result, is_leaf=_is_sparse)
    assert_tree_matches(dense, jax.jacrev(f, argnums=(0, 1))(_X, w))


@pytest.mark.parametrize(
    "fun",
    [
        lambda a, b: jnp.where(True, jnp.sin(a) * b, b),
        lambda a, b: jnp.where(False, jnp.sin(a) * b, b * a),
        lambda a, b: lax.select_n(1, jnp.sin(a) * b, b * a),
        lambda a, b: jnp.where(jnp.asarray([True, False]), jnp.sin(a) * b, b * a),
    ],
    ids=["where_true", "where_false", "select_n_int", "where_constant_mask"],
)
@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz"])
def test_select_with_a_literal_predicate(fun, order):
    # A predicate written as a Python bool or int reaches the rule as a literal.
    args = (jnp.array([0.3, -0.4]), jnp.array([0.5, 0.2]))
    expected = jax.jacrev(fun, argnums=(0, 1))(*args)
    for transform in (lambda f: f, jax.jit):
        jac = transform(graphax_eqx.jacve(fun, order=order, argnums=(0, 1)))
        assert_tree_matches(jac(*args), expected)


_EMPTY_AXIS = {
    "prod": lambda x, e: x * jnp.prod(e, axis=1),
    "prod_of_empty_slice": lambda x, e: x * jnp.prod(x[:0]) + jnp.sum(e, axis=1),
    "cumprod": lambda x, e: jnp.sum(jnp.cumprod(e, axis=1), axis=1) + x,
    "cummax": lambda x, e: jnp.sum(lax.cummax(e, axis=1), axis=1) * x,
    "cumlogsumexp": lambda x, e: jnp.sum(lax.cumlogsumexp(e, axis=1), axis=1) + x,
}


@pytest.mark.parametrize("name", sorted(_EMPTY_AXIS))
@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz"])
def test_reductions_and_scans_along_an_empty_axis(name, order):
    """Products and cumulative scans over an axis of length zero give JAX's empty or
    constant Jacobians (they raised from inside their rules)."""
    f = _EMPTY_AXIS[name]
    x, e = jnp.arange(1.0, 4.0), jnp.ones((3, 0))
    expected = jax.jacfwd(f, argnums=(0, 1))(x, e)
    for jac in (
        graphax_eqx.jacve(f, order=order, argnums=(0, 1)),
        jax.jit(graphax_eqx.jacve(f, order=order, argnums=(0, 1))),
    ):
        got = jac(x, e)
        for g, want in zip(got, expected, strict=True):
            assert g.shape == want.shape
            np.testing.assert_allclose(g, want)


_EMPTY_CONV = {
    # The output is empty.
    "empty_output": (
        lambda x: jnp.tanh(lax.conv(x, jnp.ones((1, 1, 1, 1)), (1, 1), "VALID")),
        (1, 1, 0, 3),
    ),
    # An empty intermediate inside a program whose output is not.
    "empty_intermediate": (
        lambda x: (
            jnp.sum(jnp.tanh(lax.conv(x, jnp.ones((2, 1, 3, 1)), (1, 1), "VALID")))
            + jnp.sum(x**2)
        ),
        (1, 1, 2, 3),
    ),
}


@pytest.mark.parametrize("name", sorted(_EMPTY_CONV))
@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz"])
def test_convolutions_with_an_empty_operand(name, order):
    """A convolution whose input or output has no entries gives JAX's (empty or
    zero) Jacobian; its coordinates raised `ZeroDivisionError` looking for ties
    along an axis of length zero."""
    f, shape = _EMPTY_CONV[name]
    x = jnp.ones(shape)
    expected = jax.jacfwd(f)(x)
    for sparse in (False, True):
        for transform in (lambda g: g, jax.jit):
            jac = transform(
                graphax_eqx.jacve(f, order=order, sparse_representation=sparse)
            )
            got = jac(x)
            got = got.dense() if sparse else got
            assert got.shape == expected.shape
            np.testing.assert_allclose(got, expected)


# --------------------------------------------------------------------------------------
# A maximum over values XLA computes in more than one kernel.
# --------------------------------------------------------------------------------------


def _offset_cumsum_max(which, dtype):
    offsets = jnp.array([0.04, -0.29, -0.78, -0.26], dtype)

    def f(d):
        # XLA fuses `0.3 * s + offset` into each kernel that reads it, with a fused
        # multiply-add in some and not in others.
        h = 0.3 * jnp.cumsum(d) + offsets[jnp.array([0, 0, 0, 0])]
        return h, (jnp.max(h) if which == "max" else jnp.min(-h))

    return f


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("which", ["max", "min"])
@pytest.mark.parametrize(
    "order", ["fwd", "rev", "markowitz", "relative_markowitz", "min_fill", "auto"]
)
def test_maximum_of_values_computed_in_several_kernels(which, order, dtype):
    """The derivative of a maximum goes to the entry it was taken from: the entries
    are compared with it on one stored copy, not on copies XLA rounds differently."""
    f = _offset_cumsum_max(which, dtype)
    jac = graphax_eqx.jacve(f, order=order)
    jitted = jax.jit(jac)
    rng = np.random.default_rng(0)
    inputs = [jnp.array([0.0, -0.27, 1.3, 1.0], dtype)]
    inputs += [jnp.asarray(rng.normal(size=4), dtype) for _ in range(20)]
    for d in inputs:
        want = jax.jacfwd(f)(d)
        for got in (jac(d), jitted(d)):
            assert_tree_matches(got, want)


# --------------------------------------------------------------------------------------
# Generic reductions whose initial value is an array built inside the function.
# --------------------------------------------------------------------------------------

_GENERIC_REDUCTIONS = {
    "reduce_max": lambda x, i: lax.reduce(x, i(-jnp.inf), lax.max, (1,)),
    "reduce_min": lambda x, i: lax.reduce(x, i(jnp.inf), lax.min, (0,)),
    "reduce_add": lambda x, i: lax.reduce(x, i(0.0), lax.add, (0,)),
    "window_max": lambda x, i: lax.reduce_window(
        x, i(-jnp.inf), lax.max, (2, 2), (1, 2), "SAME"
    ),
    "window_min": lambda x, i: lax.reduce_window(
        x, i(jnp.inf), lax.min, (1, 3), (1, 1), ((0, 0), (1, 1))
    ),
    "window_add": lambda x, i: lax.reduce_window(
        x, i(0.0), lax.add, (2, 2), (2, 1), "VALID"
    ),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("name", sorted(_GENERIC_REDUCTIONS))
def test_generic_reductions_with_array_initial_values(name, dtype):
    """`lax.reduce(x, jnp.array(-inf), lax.max, ...)` stages the generic reduction
    (its initial value is not known where JAX picks the primitive), which eager JAX
    runs as `reduce_max`. Where entries tie, the two share the derivative
    differently, and eager JAX's is the monoid's: the first maximum of a window, an
    equal share of a reduction's maxima. The Jacobian is the monoid's, and keeps
    its structure (not a dense fallback)."""
    reduction = _GENERIC_REDUCTIONS[name]

    def f(x):  # the initial value is an array: the generic primitive
        return jnp.sin(reduction(x * x, lambda v: jnp.array(v, x.dtype)))

    def g(x):  # a Python number: the monoid's primitive
        return jnp.sin(reduction(x * x, lambda v: v))

    generic = jax.make_jaxpr(f)(jnp.ones((4, 6), dtype)).eqns
    assert any(e.primitive in (lax.reduce_p, lax.reduce_window_p) for e in generic)
    # Ties in every row, column and window (squares of ±1, ±2), and none.
    tied = jnp.asarray(np.tile([1.0, -1.0, 2.0, -2.0, 1.0, 2.0], (4, 1)), dtype)
    tied = tied.at[1:3].multiply(-1.0)
    rng = np.random.default_rng(3)
    for x in (tied, jnp.asarray(rng.normal(size=(4, 6)), dtype)):
        want = jax.jacrev(g)(x)
        for order in ("fwd", "rev", "auto"):
            jac = graphax_eqx.jacve(f, order=order)
            assert_tree_matches(jac(x), want)
            assert_tree_matches(jax.jit(jac)(x), want)
    sparse = graphax_eqx.jacve(f, order="rev", sparse_representation=True)(tied)
    monoid = graphax_eqx.jacve(g, order="rev", sparse_representation=True)(tied)
    assert sparse.nse == monoid.nse


@pytest.mark.parametrize("order", ["markowitz", "auto", "min_fill"])
def test_orders_of_eager_graphs_are_not_reused_under_jit(order):
    # An eager call reads the sort's permutation by value (a static index map); under
    # `jit` it is traced (a lazy map), another graph. The order resolved eagerly was
    # reused under `jit`: `count_ops` there disagreed with `elimination_cost`.
    f = lambda x: jnp.median(x, axis=1)
    x = jax.random.normal(jax.random.key(0), (4, 5))
    want = graphax_eqx.elimination_cost(f, order=order)(x)
    graphax_eqx.jacve(f, order=order)(x)
    graphax_eqx.jacve(f, order=order)(x)
    box = {}

    def g(x):
        jac, counts = graphax_eqx.jacve(f, order=order, count_ops=True)(x)
        box.update(counts)
        return jac

    np.testing.assert_allclose(jax.jit(g)(x), jax.jacfwd(f)(x), rtol=1e-6)
    assert (box["num_muls"], box["num_adds"]) == (want.num_muls, want.num_adds)
    assert list(box["order"]) == list(want.order)


# --------------------------------------------------------------------------------------
# Index maps and convolutions in half precision meeting float32 products: `jnp.sum`
# of bfloat16 values sums in float32, so the products through a reversal, a pad or a
# convolution of bfloat16 values arrive in float32 (and a convolution with
# `preferred_element_type=float32` takes bfloat16 operands to a float32 result).


def _half_precision_programs():
    w = jnp.linspace(-1.0, 1.0, 18).reshape(3, 2, 3)

    def conv(v, kernel, **kw):
        return lax.conv_general_dilated(v[None], kernel, (1,), [(1, 1)], **kw)

    return {
        "sum after a reversal": lambda v: jnp.sum(jnp.sin(jnp.sin(v)[::-1])),
        "sum after a pad and a roll": lambda v: jnp.sum(
            jnp.tanh(jnp.roll(jnp.pad(jnp.sin(v), 1), 2, axis=1))
        ),
        "sum after a convolution": lambda v: jnp.sum(
            jnp.tanh(conv(v, w.astype(v.dtype)))
        ),
        "float32 convolution of bfloat16": lambda v: jnp.sum(
            jnp.tanh(conv(v, w.astype(v.dtype), preferred_element_type=jnp.float32))
        ),
    }


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", sorted(_half_precision_programs()))
def test_half_precision_maps_meeting_float32_products(dtype, name):
    f = _half_precision_programs()[name]
    x = jnp.linspace(-1.0, 1.0, 12).reshape(2, 6).astype(dtype)
    want = jax.jacrev(f)(x)
    reference = np.asarray(jax.jacrev(f)(x.astype(jnp.float32)), np.float64)
    for name in ORDERS:
        order = resolve_order(name, f, (x,))
        for got in (
            graphax_eqx.jacve(f, order=order)(x),
            jax.jit(graphax_eqx.jacve(f, order=order))(x),
            graphax_eqx.jacve(f, order=order, sparse_representation=True)(x).dense(),
        ):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_allclose(
                np.asarray(got, np.float64), reference, rtol=0.05, atol=0.05
            )


# --------------------------------------------------------------------------------------
# A dynamic update slice whose update reads its operand through a reshape.
# --------------------------------------------------------------------------------------

_UPDATE_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    import graphax_eqx

    QUERIES = np.random.default_rng(0).uniform(-0.2, 1.2, size=11)
    PICK, REVERSED = np.arange(11), np.arange(11)[::-1].copy()
    MASK = np.array([1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0], bool)

    def traced(x, start):
        # A start computed from the input (the comparison never holds).
        return start + (lax.stop_gradient(jnp.max(x)) > 1e9).astype(jnp.int32)

    def interp_then_update(start):
        def f(x):
            grid = jnp.linspace(0, 1, 12, dtype=x.dtype)
            y = jnp.interp(jnp.asarray(QUERIES, x.dtype), grid, x)
            at = (traced(x, start),)
            u = jnp.sin(lax.dynamic_update_slice(y, jnp.cos(y[:9]), at))
            return jnp.stack([u, 2 * u, jnp.cos(u)], axis=0)
        return f

    def column_then_update(start):
        def f(x):
            col = jnp.where(MASK[:, None], x[PICK][:, None], 2 * x[REVERSED][:, None])
            update = jnp.cos(col[:9, 0])
            at = (traced(x, start),)
            return lax.dynamic_update_slice(col.reshape(11), update, at)
        return f

    checked = 0
    for program in (interp_then_update, column_then_update):
        for start in (1, 2):
            f = program(start)
            x = jnp.asarray(np.random.default_rng(1).uniform(-1, 1, 12), jnp.float32)
            want = np.asarray(jax.jacfwd(f)(x))
            for order in ("fwd", "rev", "markowitz", "auto"):
                jac = graphax_eqx.jacve(f, order=order)
                sparse = graphax_eqx.jacve(f, order=order, sparse_representation=True)
                got = {
                    "jit": jax.jit(jac)(x),
                    "sparse": jax.jit(lambda x: sparse(x).dense())(x),
                }
                for how, value in got.items():
                    checked += 1
                    err = float(np.max(np.abs(np.asarray(value) - want)))
                    if not err < 1e-5:
                        name = program.__name__
                        print(f"FAIL {name} start={start} {order} {how}: {err}")
    print(f"CHECKED {checked}")
    """
)


def test_update_that_reads_its_operand_through_a_reshape():
    """XLA CPU applies `lax.dynamic_update_slice` in place, in a kernel that also
    computes the update; where the update read the operand through a reshaped view,
    that kernel read entries it had already overwritten (every start past 0, under
    `jax.jit`, with XLA's default fusion emitters, which the suite's other tests do not
    compile with). The update is written to memory first."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _UPDATE_SCRIPT],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert "CHECKED 32" in lines, lines[-20:]
    assert not [line for line in lines if line.startswith("FAIL")], lines


def _update_step(x, t):
    # An update slice whose update reads, through a reshape, the value its operand
    # is a view of; the written window overlaps the entries the update reads.
    n = x.shape[0]
    c = jnp.where(x.reshape(n, 1) > 0, x.reshape(n, 1), 0.5 * x.reshape(n, 1))
    return lax.dynamic_update_slice(c.reshape(n), jnp.tanh(c[:4, 0]), ((t + 2) % 3,))


_UPDATE_LOOPS = {
    "fori_loop": lambda x: lax.fori_loop(0, 2, lambda t, x: _update_step(x, t), x),
    "scan": lambda x: lax.scan(
        lambda x, t: (_update_step(x, t), None), x, jnp.arange(2)
    )[0],
    "while_loop": lambda x: lax.fori_loop(
        0, 2 + (x[0] > 100).astype(jnp.int32), lambda t, x: _update_step(x, t), x
    ),
    "nested": lambda x: lax.fori_loop(
        0,
        2,
        lambda k, y: (
            0.9 * lax.scan(lambda x, t: (_update_step(x, t), None), y, jnp.arange(2))[0]
        ),
        x,
    ),
}


@pytest.mark.parametrize("loop", sorted(_UPDATE_LOOPS))
def test_update_in_a_loop_that_reads_its_operand(loop):
    """The update slice above, in a loop body: XLA CPU applies it in place and reads
    entries it has already overwritten, so the loop's values (compiled even in eager
    calls) and `jax.jacfwd`'s Jacobian are wrong. `jacve` runs the loop with the
    update written apart, its tangents and cotangents too."""
    f = _UPDATE_LOOPS[loop]
    x = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, 6), jnp.float32)
    with jax.disable_jit():  # evaluated operation by operation: the reference
        want = np.asarray(jax.jacfwd(f)(x))
        value = np.asarray(f(x))
    for order in ("fwd", "rev", "markowitz", "auto"):
        jac = graphax_eqx.jacve(f, order=order)
        sparse = graphax_eqx.jacve(f, order=order, sparse_representation=True)
        np.testing.assert_allclose(jac(x), want, atol=1e-6, err_msg=order)
        np.testing.assert_allclose(jax.jit(jac)(x), want, atol=1e-6, err_msg=order)
        np.testing.assert_allclose(sparse(x).dense(), want, atol=1e-6, err_msg=order)
    got_value, got_jac = graphax_eqx.filter_value_and_jacve(f)(x)
    np.testing.assert_allclose(got_value, value, atol=1e-6)
    np.testing.assert_allclose(got_jac, want, atol=1e-6)


def test_integer_update_in_a_loop_that_reads_its_operand():
    """The same defect with an integer update (a counter state carried beside the
    differentiated one): its update is written apart too, so the values
    `filter_value_and_jacve` returns are the function's."""

    def counter_step(c, t):
        n = c.shape[0]
        d = c.reshape(n, 1)
        d = jnp.where(d > 0, d, d // 2)
        return lax.dynamic_update_slice(d.reshape(n), d[:4, 0] * 3 + 1, ((t + 2) % 3,))

    def f(x):
        start = (x, jnp.array([3, -5, 7, -2, 1, 4], jnp.int32))

        def body(carry, t):
            return (jnp.tanh(carry[0]), counter_step(carry[1], t)), None

        y, counts = lax.scan(body, start, jnp.arange(3))[0]
        return y + 1e-3 * counts.astype(y.dtype)

    x = jnp.linspace(-1, 1, 6, dtype=jnp.float32)
    with jax.disable_jit():
        value, want = f(x), jax.jacfwd(f)(x)
    for order in ("fwd", "rev"):
        got_value, got = graphax_eqx.filter_value_and_jacve(f, order=order)(x)
        np.testing.assert_allclose(got_value, value, atol=1e-6)
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_complex_update_in_a_loop_that_reads_its_operand():
    """The same defect with a complex state computed inside a real function: its
    update is written apart too (NaN in both parts marks the rewritten entry)."""

    def complex_step(c, t):
        n = c.shape[0]
        d = c.reshape(n, 1)
        d = jnp.where(jnp.real(d) > 0, d, d * (0.5 + 0.25j))
        update = jnp.tanh(d[:4, 0]) * (1 + 2j)
        return lax.dynamic_update_slice(d.reshape(n), update, ((t + 2) % 3,))

    def f(x):
        start = (x, (x * (1 - 0.5j)).astype(jnp.complex64))

        def body(carry, t):
            return (jnp.tanh(carry[0]), complex_step(carry[1], t)), None

        y, z = lax.scan(body, start, jnp.arange(3))[0]
        return y + jnp.real(z) * jnp.imag(z)

    x = jnp.linspace(-1, 1, 6, dtype=jnp.float32)
    with jax.disable_jit():
        value, want = f(x), jax.jacfwd(f)(x)
    for order in ("fwd", "rev", "markowitz"):
        got_value, got = graphax_eqx.filter_value_and_jacve(f, order=order)(x)
        np.testing.assert_allclose(got_value, value, atol=1e-5)
        np.testing.assert_allclose(got, want, atol=1e-5)
        got = jax.jit(graphax_eqx.jacve(f, order=order))(x)
        np.testing.assert_allclose(got, want, atol=1e-5)
