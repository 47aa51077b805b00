"""NaN and infinity where local partials are infinite: the same answers as JAX.

Where a partial is infinite or NaN (`log`, `sqrt` or `1/x` at 0, `arctanh` at ±1,
`pow`), JAX's own modes still give finite Jacobian entries in many cases, because a
selection (`jnp.where`, `relu`, `clip`) discards the other branch's derivative rather
than multiplying it by zero. jacve must do the same in every order.

The criterion, for every entry: where `jax.jacfwd` and `jax.jacrev` give the same
number (finite or infinite), jacve gives it; where both are finite, jacve is finite and
close; jacve is NaN only where one of them is.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import graphax_eqx as gx

from .helpers import distinct_orders


_ORDERS = ["fwd", "rev", "markowitz"]

# Points where partials blow up, plus ordinary and large ones. (Magnitudes near the
# overflow threshold are left out: there, rounding of a product depends on the order
# of association and any two modes may overflow differently.)
_SPECIAL = np.array([0.0, 1.0, -1.0, 0.5, -0.5, 2.0, 30.0, -1e-3])

_UNARY = {
    "log": jnp.log,
    "sqrt": jnp.sqrt,
    "recip": lambda a: 1.0 / a,
    "arctanh": jnp.arctanh,
    "relu": jax.nn.relu,
    "abs": jnp.abs,
    "sin": jnp.sin,
    "square": jnp.square,
    "clip": lambda a: jnp.clip(a, -0.5, 0.5),
    "log1p_abs": lambda a: jnp.log1p(jnp.abs(a)),
    "cbrt": jnp.cbrt,
}

_BINARY = {
    "mul": lambda a, b: a * b,
    "add": lambda a, b: a + b,
    "div": lambda a, b: a / b,
    "pow": lambda a, b: jnp.power(a, b),
    "max": jnp.maximum,
    "where_gt": lambda a, b: jnp.where(a > 0.2, b, 0.0),
    "where_safe_log": lambda a, b: jnp.where(
        a > 0, jnp.log(jnp.where(a > 0, a, 1.0)), b
    ),
    "sum_scale": lambda a, b: a * jnp.sum(b),
}


def _random_program(seed: int):
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(int(rng.integers(3, 7))):
        if rng.random() < 0.5:
            name = str(rng.choice(sorted(_UNARY)))
            steps.append((name, int(rng.integers(0, 10**6)), None))
        else:
            name = str(rng.choice(sorted(_BINARY)))
            steps.append(
                (name, int(rng.integers(0, 10**6)), int(rng.integers(0, 10**6)))
            )

    def f(x):
        pool = [x]
        for name, i, j in steps:
            a = pool[i % len(pool)]
            if j is None:
                pool.append(_UNARY[name](a))
            else:
                pool.append(_BINARY[name](a, pool[j % len(pool)]))
        return pool[-1] + 0.5 * pool[-2]

    x = rng.choice(_SPECIAL, size=3)
    return f, x, steps


def _check(result, fwd, rev, where):
    result, fwd, rev = (np.asarray(a, np.float64) for a in (result, fwd, rev))
    same = (fwd == rev) | (np.isnan(fwd) & np.isnan(rev))
    agree = same & ~np.isnan(fwd)
    np.testing.assert_array_equal(
        np.isnan(result) & ~(np.isnan(fwd) | np.isnan(rev)),
        False,
        err_msg=f"{where}: NaN where JAX gives a number",
    )
    finite = np.isfinite(fwd) & np.isfinite(rev)
    scale = np.maximum(1.0, np.abs(np.where(finite, fwd, 0.0)))
    ok = ~finite | (np.abs(np.where(finite, result - fwd, 0.0)) <= 1e-4 * scale)
    assert ok.all(), f"{where}: finite entries differ\n{result}\n{fwd}"
    inf_agree = agree & np.isinf(fwd)
    assert (result[inf_agree] == fwd[inf_agree]).all(), f"{where}: infinities differ"


@pytest.mark.parametrize(
    "seed", range(int(os.environ.get("GRAPHAX_NAN_PROGRAMS", "48")))
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_random_programs_at_singular_points(seed, dtype):
    if dtype == jnp.float64 and seed % 3:
        pytest.skip("float64 on a third of the programs keeps the suite fast")
    f, x, steps = _random_program(seed)
    x = jnp.asarray(x, dtype)
    with np.errstate(all="ignore"):
        fwd, rev = jax.jacfwd(f)(x), jax.jacrev(f)(x)
        for order in _ORDERS:
            where = f"{steps} at {x}, order={order}"
            _check(gx.jacve(f, order=order)(x), fwd, rev, where + " (eager)")
            _check(jax.jit(gx.jacve(f, order=order))(x), fwd, rev, where + " (jit)")


def _relu_log(x):
    return jnp.where(jax.nn.relu(x) > 0.2, jnp.log(jax.nn.relu(x)), 0.0) + x


@pytest.mark.parametrize("order", _ORDERS + ["auto"])
@pytest.mark.parametrize("jit", [False, True])
def test_selection_discards_an_infinite_branch(order, jit):
    x = jnp.array([-0.5, 1.0])
    jac = gx.jacve(_relu_log, order=order)
    jac = jax.jit(jac) if jit else jac
    expected = jax.jacfwd(_relu_log)(x)
    np.testing.assert_array_equal(expected, jax.jacrev(_relu_log)(x))
    np.testing.assert_allclose(jac(x), expected)
    np.testing.assert_allclose(jac(x), [[1.0, 0.0], [0.0, 2.0]])


@pytest.mark.parametrize("order", _ORDERS + ["auto"])
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("reduce", [jnp.max, jnp.min], ids=["max", "min"])
def test_extremum_of_a_nan_is_nan(reduce, order, jit):
    # No entry equals a NaN maximum, so JAX's rule divides 0 by 0 along that row.
    # XLA turns `mask / count` into a select that would give 0 there under `jit`.
    def fun(x):
        return reduce(jnp.sin(x), axis=1)

    x = jnp.array([[1.0, jnp.nan, 2.0], [0.5, 0.25, 1.5], [1.0, jnp.nan, jnp.inf]])
    fwd, rev = jax.jacfwd(fun)(x), jax.jacrev(fun)(x)
    jac = gx.jacve(fun, order=order)
    jac = jax.jit(jac) if jit else jac
    result = jac(x)
    _check(result, fwd, rev, f"{order}, jit={jit}")
    # A row holding a NaN: NaN for each of its entries, in both JAX modes and here.
    for row in (0, 2):
        assert np.isnan(fwd[row, row]).all() and np.isnan(rev[row, row]).all()
        assert np.isnan(result[row, row]).all()


@pytest.mark.parametrize("order", _ORDERS)
def test_double_where_is_finite(order):
    """The usual safe pattern: where(x > 0, sqrt(where(x > 0, x, 1)), 0)."""

    def f(x):
        safe = jnp.where(x > 0, x, 1.0)
        return jnp.where(x > 0, jnp.sqrt(safe), 0.0) * jnp.cos(x)

    x = jnp.array([0.0, -1.0, 4.0])
    np.testing.assert_allclose(gx.jacve(f, order=order)(x), jax.jacrev(f)(x))
    assert np.isfinite(gx.jacve(f, order=order)(x)).all()


@pytest.mark.parametrize("order", _ORDERS + ["auto"])
def test_paths_that_avoid_an_infinite_value_sum_to_a_number(order):
    """An entry is the sum over the graph's paths: where every path to it avoids an
    infinite value, it is that finite sum, even though both JAX modes add a zero
    tangent times the infinite value and return NaN there (documented in
    docs/getting_started.md). Elsewhere the usual criterion holds."""
    f = lambda u: jnp.sin(u) * jnp.roll(u, -1)
    u = jnp.array([1.0, jnp.inf, 2.0, 0.5])
    with np.errstate(all="ignore"):
        fwd, rev = jax.jacfwd(f)(u), jax.jacrev(f)(u)
        assert np.isnan(fwd[0, 1]) and np.isnan(rev[0, 1])
        sparse = gx.jacve(f, order=order, sparse_representation=True)
        for result in (gx.jacve(f, order=order)(u), jax.jit(sparse)(u).dense()):
            assert result[0, 1] == jnp.sin(u[0])
            _check(result, fwd, rev, f"order={order}")


@pytest.mark.parametrize("order", _ORDERS)
def test_clip_discards_an_infinite_partial(order):
    def f(x):
        return jnp.clip(jnp.log(x), -1.0, 1.0) + jnp.sqrt(jnp.clip(x, 1.0, 2.0))

    x = jnp.array([0.0, 1.5, 4.0])
    fwd, rev = jax.jacfwd(f)(x), jax.jacrev(f)(x)
    _check(gx.jacve(f, order=order)(x), fwd, rev, order)


# Selections after index maps: the selected-away entries must stay exactly zero
# through every later product, whichever way the elimination associates them.

_BEFORE_SELECTION = {
    "cumsum": jnp.cumsum,
    "reverse_cumsum": lambda a: jnp.cumsum(a[::-1])[::-1],
    "cumprod": jnp.cumprod,
    "sort": jnp.sort,
    "window_sum": lambda a: jax.lax.reduce_window(
        a, 0.0, jax.lax.add, (3,), (1,), "SAME"
    ),
    "stencil": lambda a: jnp.pad(a[2:] - 2 * a[1:-1] + a[:-2], 1),
}


@pytest.mark.parametrize("n", [4, 40])
@pytest.mark.parametrize("name", sorted(_BEFORE_SELECTION))
@pytest.mark.parametrize("sparse", [False, True])
def test_selection_after_an_index_map(name, n, sparse):
    inner = _BEFORE_SELECTION[name]

    def f(x):
        t = inner(x)
        return jnp.where(t > 0, jnp.sqrt(t), 0.0)

    x = jnp.asarray(np.resize([0.5, -0.8, -0.4, 0.9, 0.0, -1.5, 2.0], n))
    with np.errstate(all="ignore"):
        fwd, rev = jax.jacfwd(f)(x), jax.jacrev(f)(x)
        for order in distinct_orders(f, (x,), _ORDERS + ["min_fill", "auto"]):
            jac = gx.jacve(f, order=order, sparse_representation=sparse)
            for jit in (False, True):
                result = (jax.jit(jac) if jit else jac)(x)
                result = result.dense() if sparse else result
                _check(result, fwd, rev, f"{name}, n={n}, {order}, jit={jit}")


def _stencil(a):
    return jnp.pad(a[2:] - 2 * a[1:-1] + a[:-2], 1)


def _upwind(u):
    back = jnp.pad(u[1:] - u[:-1], (1, 0))
    ahead = jnp.pad(u[1:] - u[:-1], (0, 1))
    return jnp.where(u > 0, jnp.sqrt(u) * back, ahead * u)


@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("sparse", [False, True])
def test_selection_on_banded_partials(order, sparse):
    """Upwinding with a square root on one side, at a size where the stencils are
    stored as bands."""

    def f(x):
        return _upwind(_stencil(x) + x)

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.choice([0.0, 1.0, -1.0, 0.5, -0.5, 2.0], size=1100))
    with np.errstate(all="ignore"):
        fwd, rev = jax.jacfwd(f)(x), jax.jacrev(f)(x)
        result = gx.jacve(f, order=order, sparse_representation=sparse)(x)
        result = result.dense() if sparse else result
        _check(result, fwd, rev, order)


_INDEX_STEPS = {
    "sqrt": jnp.sqrt,
    "log": jnp.log,
    "recip": lambda a: 1.0 / a,
    "relu": jax.nn.relu,
    "where_sqrt": lambda a: jnp.where(a > 0, jnp.sqrt(a), 0.0),
    "where_log": lambda a: jnp.where(a > 0.1, jnp.log(a), a),
    "cumsum": jnp.cumsum,
    "sort": jnp.sort,
    "roll": lambda a: jnp.roll(a, 2),
    "stencil": _stencil,
    "gather": lambda a: a[np.arange(a.shape[0])[::-1] // 2 * 2],
    "segment_sum": lambda a: jax.ops.segment_sum(
        a, np.arange(a.shape[0]) % 3, a.shape[0]
    ),
    "scatter": lambda a: a.at[np.array([1, 3, 1])].set(jnp.sin(a[:3])),
    "matmul": lambda a: (
        jnp.asarray(np.random.default_rng(a.shape[0]).normal(size=(a.shape[0],) * 2))
        @ a
    ),
    "mul": lambda a: a * a[::-1],
    "select": lambda a: jnp.where(a > 0.2, a[::-1], 0.0),
    "window_sum": lambda a: jax.lax.reduce_window(
        a, 0.0, jax.lax.add, (3,), (1,), "SAME"
    ),
}


@pytest.mark.parametrize("seed", range(24))
def test_random_index_programs_at_singular_points(seed):
    rng = np.random.default_rng(10_000 + seed)
    names = [str(rng.choice(sorted(_INDEX_STEPS))) for _ in range(rng.integers(2, 6))]
    picks = [int(rng.integers(0, 10**6)) for _ in names]

    def f(x):
        pool = [x]
        for name, pick in zip(names, picks):
            pool.append(_INDEX_STEPS[name](pool[pick % len(pool)]))
        return pool[-1] + 0.5 * pool[-2]

    n = int(rng.choice([5, 24]))
    x = jnp.asarray(rng.choice(_SPECIAL, size=n))
    with np.errstate(all="ignore"):
        fwd, rev = jax.jacfwd(f)(x), jax.jacrev(f)(x)
        for order in distinct_orders(f, (x,), _ORDERS + ["min_fill", "auto"]):
            for sparse in (False, True):
                result = gx.jacve(f, order=order, sparse_representation=sparse)(x)
                result = result.dense() if sparse else result
                _check(result, fwd, rev, f"{names} at {x}, {order}, {sparse}")


def _linear_rule(fn, x):
    return jax.linearize(fn, x)[1]


@pytest.mark.parametrize(
    "name, fn, selects",
    [
        ("log1p", jnp.log1p, False),
        ("abs", jnp.abs, False),
        ("atan2", lambda a: jnp.arctan2(a, 2.0), False),
        ("max", lambda a: jnp.maximum(a, 0.3), False),
        ("softplus", jax.nn.softplus, False),
        ("relu", jax.nn.relu, True),
        ("clip", lambda a: jnp.clip(a, -0.5, 0.5), False),  # multiplies by 0
        ("where_zero", lambda a: jnp.where(a > 0, a, 0.0), True),
        ("where_both", lambda a: jnp.where(a > 0, a, 2 * a), False),
    ],
)
def test_selection_seen_on_the_rule(name, fn, selects):
    """A rule is probed for selected-away entries only where its jaxpr can select
    its seed away; elsewhere the partial carries no selection to propagate."""
    from graphax_eqx._rules.elementwise import seed_reaches

    x = jnp.linspace(-1.0, 1.0, 5)
    assert seed_reaches(_linear_rule(fn, x), x) == [not selects]
    # The Jacobian computes selections (booleans combining probes) only with one; a
    # `jnp.where` is a selection by its own rule, whatever its cases.
    jaxpr = jax.make_jaxpr(gx.jacve(lambda a: jnp.sum(fn(jnp.sin(a))), order="rev"))(x)
    combines = (jax.lax.not_p, jax.lax.and_p)
    computes_mask = any(e.primitive in combines for e in jaxpr.jaxpr.eqns)
    assert computes_mask == (selects or name == "where_both")
    np.testing.assert_allclose(
        gx.jacve(lambda a: fn(jnp.sin(a)), order="rev")(x),
        jax.jacfwd(lambda a: fn(jnp.sin(a)))(x),
        rtol=1e-6,
    )


@pytest.mark.parametrize("order", _ORDERS + ["auto"])
def test_window_sum_after_an_infinite_partial(order):
    """A windowed sum of `1/x` at x = 0: the window's entries are a pattern, not
    dense zeros, so the infinite partial meets no zero that would make it NaN."""

    def f(x):
        y = jax.lax.reduce_window(1.0 / x, 0.0, jax.lax.add, (3,), (1,), "SAME")
        return jnp.sin(y[::-1]) + x

    x = jnp.array([0.5, 0.0, 1.0, -2.0, 0.25, 0.0])
    with np.errstate(all="ignore"):
        fwd, rev = jax.jacfwd(f)(x), jax.jacrev(f)(x)
        for sparse in (False, True):
            result = gx.jacve(f, order=order, sparse_representation=sparse)(x)
            _check(result.dense() if sparse else result, fwd, rev, order)


@pytest.mark.parametrize("order", _ORDERS + ["auto"])
def test_window_max_before_an_infinite_partial(order):
    """`1/maxpool(x)` where a window's maximum is 0: the entries the maximum does not
    take are discarded, as in JAX, not multiplied by the infinite partial."""

    def f(x):
        y = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2), (1, 2), "VALID")
        return 1.0 / y

    x = jnp.array([[-1.0, 0.0, -2.0, -3.0], [-1.0, -5.0, -2.0, -0.5]])
    with np.errstate(all="ignore"):
        fwd, rev = jax.jacfwd(f)(x), jax.jacrev(f)(x)
        for sparse in (False, True):
            result = gx.jacve(f, order=order, sparse_representation=sparse)(x)
            result = result.dense() if sparse else result
            _check(result, fwd, rev, order)
            # Only the entries both modes give as infinite are infinite or NaN.
            assert np.isfinite(np.asarray(result)).sum() == result.size - 1


def _convolutions(jaxpr) -> int:
    found = 0
    for eqn in jaxpr.eqns:
        found += eqn.primitive is jax.lax.conv_general_dilated_p
        for value in eqn.params.values():
            if hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
                found += _convolutions(value.jaxpr)
    return found


@pytest.mark.parametrize("order", _ORDERS)
def test_final_products_apply_a_map_once(order):
    """A product from an input to an output is never multiplied again, so applying
    a linear map there (a convolution's transpose for the weights' gradient) needs no
    second run on the probe that carries a ReLU's selected-away entries: the program
    holds the forward and one backward convolution, as `jax.grad`'s does."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(k1, (4, 3, 8, 8))
    w = jax.random.normal(k2, (8, 3, 3, 3))

    def loss(w):
        y = jax.lax.conv(x, w, (1, 1), "SAME")
        return jnp.sum(jnp.tanh(jax.nn.relu(y)))

    jac = gx.jacve(loss, order=order)
    assert _convolutions(jax.make_jaxpr(jac)(w).jaxpr) == 2
    np.testing.assert_allclose(jac(w), jax.grad(loss)(w), rtol=1e-5, atol=1e-5)
    # At NaN and infinite points the usual criterion holds.
    special = x.at[0, 0, 0, :3].set(jnp.array([jnp.nan, jnp.inf, -jnp.inf]))

    def at_special(w):
        y = jax.lax.conv(special, w, (1, 1), "SAME")
        return jnp.sum(jnp.tanh(jax.nn.relu(y)))

    with np.errstate(all="ignore"):
        _check(
            gx.jacve(at_special, order=order)(w),
            jax.jacfwd(at_special)(w),
            jax.jacrev(at_special)(w),
            f"{order} at NaN and infinite inputs",
        )


def test_products_through_index_maps_apply_a_map_once():
    """An input Jacobian of a CNN in reverse order: the convolution's transpose meets
    the cotangent after the ReLU and the max pool (which select entries away), and
    its result reaches the input through the unit axis `eqx.nn.Conv2d` adds, a pure
    index map. Nothing with values multiplies that result again, so the transpose
    runs once, with no second run on a probe of the selected-away entries."""
    import equinox as eqx

    k = jax.random.split(jax.random.PRNGKey(0), 3)
    cnn = eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(3, 8, 3, key=k[0]),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.MaxPool2d(2, 2),
            eqx.nn.Lambda(jnp.ravel),
            eqx.nn.Linear(8 * 7 * 7, 10, key=k[1]),
        ]
    )
    x = jax.random.normal(k[2], (3, 16, 16))
    jac = gx.jacve(cnn, order="rev")
    # The forward convolution and one transposed application.
    assert _convolutions(jax.make_jaxpr(jac)(x).jaxpr) == 2
    np.testing.assert_allclose(
        jax.jit(jac)(x), jax.jacrev(cnn)(x), rtol=1e-5, atol=1e-6
    )
    special = x.at[0, 0, :3].set(jnp.array([jnp.nan, jnp.inf, -jnp.inf]))
    with np.errstate(all="ignore"):
        for order in _ORDERS:
            _check(
                gx.jacve(cnn, order=order)(special),
                jax.jacfwd(cnn)(special),
                jax.jacrev(cnn)(special),
                f"{order} at NaN and infinite inputs",
            )


def _two_convolutions(w2, groups=1):
    k1, _ = jax.random.split(jax.random.PRNGKey(3))
    w1 = jax.random.normal(k1, (8, 3, 3, 3))

    def f(x):
        y = jax.nn.relu(jax.lax.conv(x, w1, (1, 1), "SAME"))
        z = jax.lax.conv_general_dilated(
            y, w2, (1, 1), "SAME", feature_group_count=groups
        )
        return jnp.sum(jnp.tanh(jax.nn.relu(z)), axis=(1, 2, 3))

    return f


@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("groups", [1, 2])
def test_selected_away_entries_through_a_convolution(order, groups):
    """A ReLU's selected-away entries meet a convolution's transpose whose result is
    multiplied again (by the first ReLU and convolution): the entries of the result
    made only of selected-away terms are found from window sums of a probe's summed
    features (per group), not by a second full convolution. At infinite kernel
    entries that is forward mode's answer (the selection discards whatever the
    kernel gives); the criterion of this file holds."""
    k2, k3 = jax.random.split(jax.random.PRNGKey(4))
    w2 = jax.random.normal(k2, (6, 8 // groups, 3, 3))
    x = jax.random.normal(k3, (2, 3, 6, 6))
    f = _two_convolutions(w2, groups)
    jac = gx.jacve(f, order=order)
    np.testing.assert_allclose(jac(x), jax.jacfwd(f)(x), rtol=1e-4, atol=1e-5)
    if order == "rev":
        # Two forward convolutions and two transposes, as `jax.grad` has.
        assert _convolutions(jax.make_jaxpr(jac)(x).jaxpr) == 4
    w_inf = w2.at[0, 1, 1, 1].set(jnp.inf).at[3, 0, 0, 2].set(-jnp.inf)
    g = _two_convolutions(w_inf, groups)
    special = x.at[0, 0, 0, :3].set(jnp.array([jnp.nan, jnp.inf, -jnp.inf]))
    with np.errstate(all="ignore"):
        for fun, point, where in (
            (g, x, "infinite kernel entries"),
            (f, special, "NaN and infinite inputs"),
        ):
            want = jax.jacfwd(fun)(point), jax.jacrev(fun)(point)
            for call in (
                gx.jacve(fun, order=order),
                jax.jit(gx.jacve(fun, order=order)),
            ):
                _check(call(point), *want, f"{order} at {where}")


@pytest.mark.parametrize("seed", range(12))
def test_convolution_probes_reach_what_the_convolution_reaches(seed):
    """A convolution's probe (window sums of the summed input features of each
    group) is NaN exactly where the convolution with a finite kernel is, forward
    and transposed, for random strides, padding, dilations, groups and layouts."""
    from graphax_eqx._rules.linalg import _conv_probe
    from graphax_eqx._sparse import linear_map

    rng = np.random.default_rng(seed)
    nd = int(rng.integers(1, 3))
    window = tuple(int(k) for k in rng.integers(1, 4, nd))
    spatial = tuple(int(s) for s in rng.integers(4, 8, nd))
    groups = int(rng.integers(1, 3))
    n = int(rng.integers(1, 3))
    c, o = groups * int(rng.integers(1, 4)), groups * int(rng.integers(1, 4))
    names = "HWD"[:nd]
    specs = [("NC" + names, "OI" + names, "NC" + names)]
    if nd == 2:
        specs.append(("NHWC", "HWIO", "NHWC"))
    lhs_names, rhs_names, out_names = specs[int(rng.integers(len(specs)))]

    def arranged(names_of, sizes):
        return tuple(sizes[k] for k in names_of)

    lhs_sizes = dict(N=n, C=c, **dict(zip(names, spatial, strict=True)))
    rhs_sizes = dict(O=o, I=c // groups, **dict(zip(names, window, strict=True)))
    lhs_shape = arranged(lhs_names, lhs_sizes)
    rhs_shape = arranged(rhs_names, rhs_sizes)
    kernel = jnp.asarray(rng.standard_normal(rhs_shape), jnp.float32)
    kernel = kernel.at[(0,) * len(rhs_shape)].set(0.0)

    def conv(t):
        return jax.lax.conv_general_dilated(
            t,
            kernel,
            tuple(int(s) for s in strides),
            padding,
            tuple(int(s) for s in dilations[0]),
            tuple(int(s) for s in dilations[1]),
            (lhs_names, rhs_names, out_names),
            feature_group_count=groups,
        )

    strides = rng.integers(1, 3, nd)
    padding = tuple(tuple(int(p) for p in rng.integers(0, 3, 2)) for _ in range(nd))
    dilations = rng.integers(1, 3, (2, nd))
    like = jax.ShapeDtypeStruct(lhs_shape, jnp.float32)
    (eqn,) = jax.make_jaxpr(conv)(like).jaxpr.eqns
    params = eqn.params
    out_shape = jax.eval_shape(conv, jax.ShapeDtypeStruct(lhs_shape, jnp.float32))
    out_shape = tuple(out_shape.shape)
    probe = _conv_probe(params, rhs_shape, out_shape)
    m = linear_map(conv, lhs_shape, out_shape, jnp.float32, probe=probe)
    for density in (0.05, 0.3):
        t = np.where(rng.random(lhs_shape) < density, np.nan, 0.0)
        t = jnp.asarray(t, jnp.float32)
        np.testing.assert_array_equal(
            np.isnan(m.probe(t)), np.isnan(m.fn(t)), err_msg="forward"
        )
        ct = np.where(rng.random(out_shape) < density, np.nan, 0.0)
        ct = jnp.asarray(ct, jnp.float32)
        np.testing.assert_array_equal(
            np.isnan(m.tprobe(ct)), np.isnan(m.tfn(ct)), err_msg="transposed"
        )


def _selected_consts(jaxpr) -> int:
    """Selects that take a matrix constant of `jaxpr` as an operand."""
    consts = {v for v in jaxpr.constvars if v.aval.ndim == 2}
    return sum(
        e.primitive is jax.lax.select_n_p and any(v in consts for v in e.invars)
        for e in jaxpr.eqns
    )


@pytest.mark.parametrize("order", _ORDERS)
def test_known_finite_weights_are_not_selected(order):
    """A ReLU's selected-away entries meet the next weight matrix inside a
    contraction. Against a factor that may be infinite the selection is moved onto
    it (a select writing a copy of the matrix on every call); a constant known to be
    finite at trace time needs none."""
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    w1 = jax.random.normal(k[0], (64, 16))
    w2 = jax.random.normal(k[1], (8, 64))
    x = jax.random.normal(k[2], (16,))

    def net(w2, x):
        return w2 @ jax.nn.relu(w1 @ x)

    def known(x):
        return net(w2, x)

    program = jax.make_jaxpr(gx.jacve(known, order=order))(x).jaxpr
    assert len(program.constvars) == 2
    assert _selected_consts(program) == 0
    np.testing.assert_allclose(
        jax.jit(gx.jacve(known, order=order))(x), jax.jacrev(known)(x), rtol=1e-5
    )
    # An infinite entry where the ReLU selects its input away: as before.
    inactive = int(jnp.argmin(w1 @ x))
    w2_inf = w2.at[0, inactive].set(jnp.inf)

    def infinite(x):
        return net(w2_inf, x)

    with np.errstate(all="ignore"):
        _check(
            jax.jit(gx.jacve(infinite, order=order))(x),
            jax.jacfwd(infinite)(x),
            jax.jacrev(infinite)(x),
            f"{order}, an infinite weight",
        )
        # Traced weights (arguments of the jitted function) keep the selection.
        traced = jax.jit(lambda w, x: gx.jacve(lambda x: net(w, x), order=order)(x))
        _check(
            traced(w2_inf, x),
            jax.jacfwd(infinite)(x),
            jax.jacrev(infinite)(x),
            f"{order}, an infinite traced weight",
        )


@pytest.mark.parametrize("order", ["fwd", "rev"])
def test_quotient_partials_at_zeros_and_infinities(order):
    """Both partials of `x / y` share one reciprocal of `y` (one division fewer per
    quotient, which XLA would otherwise compute in a kernel of its own); their
    signed zeros, infinities and NaNs are still those of JAX's rule. (JAX's rule
    squares `y`, so it overflows to infinities and NaNs for tiny `y` where the
    quotient's partials are finite; such magnitudes are left out.)"""
    values = np.array([0.0, -0.0, 1.0, -2.0, 0.5, np.inf, -np.inf, np.nan])
    x, y = (a.ravel() for a in np.meshgrid(values, values))
    x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)

    def f(x, y):
        return x / y

    jac = gx.jacve(f, order=order, argnums=(0, 1))
    with np.errstate(all="ignore"):
        for mode, got in (("eager", jac(x, y)), ("jit", jax.jit(jac)(x, y))):
            for k in range(2):
                _check(
                    jnp.diagonal(got[k]),
                    jnp.diagonal(jax.jacfwd(f, argnums=k)(x, y)),
                    jnp.diagonal(jax.jacrev(f, argnums=k)(x, y)),
                    f"{order} {mode}, ∂/∂{'xy'[k]}",
                )
