"""`lax.scan` and `lax.cond` as linear maps of their linearisation.

Programs small enough for the dense fallback are covered by `test_programs.py`; here
the dense limit is lowered so that every scan and cond becomes a map, and the
Jacobians are compared with JAX's in every order, dense and sparse, eager and under
`jit`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax import lax

import graphax_eqx as gx
import graphax_eqx._graph as graph
import graphax_eqx._rules.control as control
from graphax_eqx._sparse import linear_map

from .helpers import distinct_orders, tolerances


_ORDERS = ["fwd", "rev", "markowitz", "auto"]


def _matrix(n, seed, dtype):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(n, n)) / np.sqrt(n), dtype)


def _carry_and_outputs(x):
    # A float carry, an integer counter, stacked outputs and a closed-over matrix.
    w = _matrix(6, 0, x.dtype)

    def step(carry, xi):
        h, count = carry
        h = jnp.tanh(w @ h + xi * x[:6])
        return (h, count + 1), jnp.sin(h[:2]) * xi[:2]

    xs = x[6:14, None] * jnp.ones((8, 6), x.dtype)
    (h, count), ys = lax.scan(step, (x[8:14], 0), xs)
    return jnp.concatenate([h * count, ys.reshape(-1)])


def _no_inputs(x):
    # Weights from the differentiated argument, nothing scanned over.
    a, b = x[:36].reshape(6, 6), x[36:42]

    def step(h, _):
        return jnp.tanh(a @ h) * b, jnp.sum(h)

    h, ys = lax.scan(step, jnp.ones(6, x.dtype), None, length=7)
    return jnp.concatenate([h, ys])


def _reverse_unrolled_batched(x):
    def one(v):
        def step(c, vi):
            return c * jnp.cos(vi) + vi, c

        c, ys = lax.scan(step, v[0], v, reverse=True, unroll=2)
        return ys * c

    return jax.vmap(one)(x.reshape(4, 9)).reshape(-1)


def _nested(x):
    def outer(c, row):
        def inner(d, v):
            return d * jnp.sin(v) + v, d

        d, ds = lax.scan(inner, c, row)
        return d, jnp.sum(ds)

    c, ys = lax.scan(outer, x[0], x[1:].reshape(4, 5))
    return jnp.append(ys, c)


def _fori(x):
    w = _matrix(5, 1, x.dtype)
    return lax.fori_loop(0, 6, lambda i, h: jnp.tanh(w @ h) + h * i, x)


def _cond(x):
    w = _matrix(8, 2, x.dtype)
    y, index = lax.cond(
        x[0] > 0,
        lambda v: (jnp.sin(w @ v), jnp.argmax(v)),
        lambda v: (v * v[::-1], jnp.asarray(3)),
        x,
    )
    branches = [jnp.tanh, lambda v: v**3, lambda v: jnp.exp(-v)]
    return lax.switch(jnp.argmin(x) % 3, branches, y) * index


_PROGRAMS = {
    "carry_and_outputs": (_carry_and_outputs, 14),
    "no_inputs": (_no_inputs, 42),
    "reverse_unrolled_batched": (_reverse_unrolled_batched, 36),
    "nested": (_nested, 21),
    "fori": (_fori, 5),
    "cond": (_cond, 8),
}


@pytest.fixture
def maps(monkeypatch):
    """Every scan and cond becomes linear maps; returns how many were made."""
    made = []

    def counted(*args, **kwargs):
        made.append(args[1:3])
        return linear_map(*args, **kwargs)

    monkeypatch.setattr(control, "_MAX_DENSE_ENTRIES", 0)
    monkeypatch.setattr(control, "linear_map", counted)
    monkeypatch.setattr(graph, "MAX_UNROLLED_EQNS", 0)
    return made


def _close(actual, expected, dtype):
    rtol, atol = tolerances(dtype)
    scale = max(1.0, float(jnp.max(jnp.abs(expected))))
    np.testing.assert_allclose(actual, expected, rtol=rtol * 10, atol=atol * 10 * scale)


# Every program in float64 (every order); two of them in float32 as well.
@pytest.mark.parametrize(
    "name, dtype",
    [(name, jnp.float64) for name in _PROGRAMS]
    + [(name, jnp.float32) for name in ("nested", "fori")],
)
def test_loops_as_maps(name, dtype, maps):
    fn, n = _PROGRAMS[name]
    rng = np.random.default_rng(3)
    for sign in (1.0, -1.0) if name == "cond" else (1.0,):
        x = jnp.asarray(rng.uniform(-1, 1, n), dtype).at[0].multiply(sign)
        fwd, rev = jax.jacfwd(fn)(x), jax.jacrev(fn)(x)
        _close(fwd, rev, dtype)
        # Eagerly once, then under `jit`: every order in float64 (with sparse
        # output too in forward and reverse mode), forward and reverse mode in
        # float32.
        _close(gx.jacve(fn)(x), rev, dtype)
        # (`auto` under `jit` only where it eliminates unlike the named orders.)
        orders = distinct_orders(fn, (x,), _ORDERS)
        for order in orders if dtype == jnp.float64 else ("fwd", "rev"):
            both = dtype == jnp.float64 and order in ("fwd", "rev")
            for sparse in (False, True) if both else (False,):
                jac = gx.jacve(fn, order=order, sparse_representation=sparse)
                result = jax.jit(jac)(x)
                _close(result.dense() if sparse else result, rev, dtype)
    assert maps


def _mixed_precision(x):
    # A float32 state driven by float16 inputs, read out in float32.
    w = _matrix(6, 4, jnp.float32)

    def step(h, xi):
        h = jnp.tanh(w @ h + xi.astype(jnp.float32))
        return h, (h[:2] * 2).astype(jnp.float16)

    h, ys = lax.scan(step, x[:6], x[6:].reshape(3, 6).astype(jnp.float16))
    return jnp.concatenate([h, ys.reshape(-1).astype(jnp.float32)])


@pytest.mark.parametrize("order", ["fwd", "rev", "auto"])
def test_loop_inputs_outputs_and_state_in_different_dtypes(order, maps):
    x = jnp.linspace(-0.8, 0.9, 24, dtype=jnp.float32)
    expected = jax.jacrev(_mixed_precision)(x)
    result = jax.jit(gx.jacve(_mixed_precision, order=order))(x)
    assert result.dtype == expected.dtype
    np.testing.assert_allclose(result, expected, rtol=2e-2, atol=2e-3)
    assert maps


@pytest.mark.parametrize("name", ["carry_and_outputs", "cond"])
def test_loop_counts_match_the_simulator(name, maps):
    fn, n = _PROGRAMS[name]
    x = jnp.linspace(-0.5, 0.7, n)
    for order in ["fwd", "rev", "markowitz"]:
        _, counts = gx.jacve(fn, order=order, count_ops=True)(x)
        assert counts["num_muls"] > 0
        assert gx.elimination_cost(fn, order=order)(x).num_muls == counts["num_muls"]


def test_second_derivative_through_a_scan(maps):
    fn, n = _PROGRAMS["fori"]

    def loss(x):
        return jnp.sum(fn(x) ** 2)

    x = jnp.linspace(-0.5, 0.7, n)
    hessian = gx.jacve(gx.jacve(loss, order="rev"), order="fwd")(x)
    _close(hessian, jax.hessian(loss)(x), jnp.float32)


def _largest_array(closed) -> int:
    sizes = [0]
    for eqn in closed.jaxpr.eqns:
        for v in eqn.outvars:
            sizes.append(int(np.prod(v.aval.shape)))
        for value in eqn.params.values():
            if hasattr(value, "jaxpr") and hasattr(value, "consts"):
                sizes.append(_largest_array(value))
    return max(sizes)


def test_recurrent_loss_needs_no_dense_jacobian():
    """A scalar loss through a long recurrence: the scan's partials are applied to
    the one cotangent, never stored (the stored block would have 16 · 32 · 1056
    entries)."""
    cell = eqx.nn.GRUCell(8, 32, key=jr.PRNGKey(0))
    xs = jr.normal(jr.PRNGKey(1), (16, 40, 8))

    def loss(cell, xs):
        def run(seq):
            def step(h, x):
                return cell(x, h), None

            return lax.scan(step, jnp.zeros(32), seq)[0]

        return jnp.mean(jax.vmap(run)(xs) ** 2)

    grads = gx.filter_jacve(loss)(cell, xs)
    expected = eqx.filter_grad(loss)(cell, xs)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    params, static = eqx.partition(cell, eqx.is_array)
    program = jax.make_jaxpr(
        lambda p, xs: gx.filter_jacve(loss)(eqx.combine(p, static), xs)
    )(params, xs)
    dense_block = 16 * 32 * cell.weight_hh.size
    assert _largest_array(program) < dense_block // 8


def _reversed_scans(closed) -> int:
    count = 0
    for eqn in closed.jaxpr.eqns:
        count += eqn.primitive is lax.scan_p and eqn.params["reverse"]
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):
                    count += _reversed_scans(sub)
    return count


@pytest.mark.parametrize("order", ["rev", "fwd", "markowitz"])
def test_loop_inputs_share_one_transposed_loop(order):
    """Every parameter of a recurrent cell reaches the loss through the same
    scan: their partials share one transposed scan, as JAX's reverse mode runs one
    in all, where each would otherwise run its own."""
    cell = eqx.nn.GRUCell(4, 24, key=jr.PRNGKey(0))
    xs = jr.normal(jr.PRNGKey(1), (12, 4))

    def loss(cell, xs):
        def step(h, x):
            return cell(x, h), None

        return jnp.sum(lax.scan(step, jnp.zeros(24), xs)[0] ** 2)

    grad = gx.filter_jacve(loss, order=order)
    expected = eqx.filter_grad(loss)(cell, xs)
    actual = eqx.filter_jit(grad)(cell, xs)
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    params, static = eqx.partition(cell, eqx.is_array)
    program = jax.make_jaxpr(lambda p, xs: grad(eqx.combine(p, static), xs))(params, xs)
    # One transposed (reversed) scan for all four parameters.
    assert _reversed_scans(program) == 1


@jax.custom_vjp
def _sin_by_rule(x):
    return jnp.sin(x)


_sin_by_rule.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,))


@pytest.mark.parametrize("order", ["rev", "fwd", "markowitz"])
def test_loops_holding_a_custom_vjp_keep_the_dense_path(order, maps):
    """A `custom_vjp` function has no forward mode, so a loop holding one cannot be
    linearised: it keeps the dense fallback (reverse mode), and makes no maps."""
    w = _matrix(12, 5, jnp.float32)

    def scanned(x):
        return lax.scan(lambda h, _: (_sin_by_rule(w @ h), None), x, None, length=3)[0]

    def branched(x):
        return lax.cond(x[0] > 0, lambda x: _sin_by_rule(w @ x), lambda x: 2 * x, x)

    x = jnp.linspace(-0.9, 0.8, 12)
    for fn in (scanned, branched):
        expected = jax.jacrev(fn)(x)
        _close(gx.jacve(fn, order=order)(x), expected, jnp.float32)
        _close(jax.jit(gx.jacve(fn, order=order))(x), expected, jnp.float32)
    assert not maps


def test_scan_operand_counts_in_either_params_form():
    """A scan's consts and carries are counted from JAX 0.10's named counts and from
    the packed operand structure (`ft_in`: consts, carries, scanned inputs) that JAX
    0.11 records instead."""
    from graphax_eqx import _jax_private as jp

    def body(c, a):
        return (c[0] * a, c[1] + k), c[0]

    k = jnp.arange(2.0, dtype=jnp.float32)  # closed over: the scan's one const
    carry = (jnp.float32(1.0), jnp.zeros(2, jnp.float32))
    closed = jax.make_jaxpr(lambda c, xs: lax.scan(body, c, xs))(
        carry, jnp.ones(3, jnp.float32)
    )
    (eqn,) = [e for e in closed.eqns if e.primitive is lax.scan_p]
    n_consts, n_carry = jp.scan_counts(eqn.params)
    assert (n_consts, n_carry, len(eqn.invars) - n_consts - n_carry) == (1, 2, 1)

    class Packed:  # the interface of JAX 0.11's `FlatTree` that is read
        def __init__(self, *parts):
            self.parts = parts

        def unpack(self):
            return self.parts

    packed = {"ft_in": Packed([None] * 3, [None] * 2, [None])}
    assert jp.scan_counts(packed) == (3, 2)


# Short loops of structured steps are unrolled into the graph (`_graph.unrolls`).


def _heat_step(u):
    return u + 0.1 * (jnp.roll(u, 1) - 2 * u + jnp.roll(u, -1)) - 0.01 * u**3


def _heat_fori(u):
    return lax.fori_loop(0, 4, lambda i, v: _heat_step(v), u)


def _heat_python(u):
    for _ in range(4):
        u = _heat_step(u)
    return u


def _scan_with_history(u):
    # Scanned inputs and stacked outputs, a closed-over array, an integer counter,
    # a reverse scan nested in the body.
    forcing = jnp.linspace(0.0, 1.0, u.shape[0], dtype=u.dtype)

    def inner(c, a):
        return jnp.sin(c) * a + jnp.roll(c, 2), c[::3]

    def step(carry, x):
        v, k = carry
        v = _heat_step(v) + x * forcing
        w, ws = lax.scan(inner, v, jnp.stack([x, 2 * x]), reverse=True)
        return (w * (k + 1), k + 1), jnp.concatenate([ws[1], v[:4] ** 2])

    xs = jnp.stack([0.1 * u, 0.05 * u**2, jnp.roll(u, 3)])
    (v, _), ys = lax.scan(step, (u, 0), xs)
    return v, ys


def _structural_nnz(jac) -> int:
    return int(np.count_nonzero(np.asarray(jac)))


@pytest.mark.parametrize("order", _ORDERS)
def test_short_structured_loops_keep_their_sparsity(order):
    n = 160
    u = jnp.linspace(0.5, 1.5, n)
    expected = jax.jacfwd(_heat_fori)(u)
    for transform in (lambda f: f, jax.jit):
        jac = transform(gx.jacve(_heat_fori, order=order, sparse_representation=True))
        result = jac(u)
        assert result.nse == _structural_nnz(expected) == 9 * n
        _close(result.dense(), expected, jnp.float64)
    # The same counts as the loop written out in Python.
    _, counts = gx.jacve(_heat_fori, order=order, count_ops=True)(u)
    _, python_counts = gx.jacve(_heat_python, order=order, count_ops=True)(u)
    assert counts == python_counts


@pytest.mark.parametrize("order", _ORDERS)
def test_unrolled_scans_with_inputs_outputs_and_nesting(order):
    u = jnp.linspace(-0.7, 0.9, 150)
    expected = jax.jacfwd(_scan_with_history)(u)
    assert _scan_eqns(_scan_with_history, u) and all(
        graph.unrolls(e) for e in _scan_eqns(_scan_with_history, u)
    )
    for transform in (lambda f: f, jax.jit):
        dense = transform(gx.jacve(_scan_with_history, order=order))(u)
        sparse = transform(
            gx.jacve(_scan_with_history, order=order, sparse_representation=True)
        )(u)
        for d, s, e in zip(dense, sparse, expected, strict=True):
            _close(d, e, jnp.float64)
            _close(s.dense(), e, jnp.float64)
            assert s.nse == _structural_nnz(e)


def _scan_eqns(fn, *args) -> list:
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return [e for e in eqns if e.primitive is lax.scan_p]


def test_dense_long_or_small_loops_stay_loops():
    u = jnp.linspace(0.5, 1.5, 160)
    w = _matrix(160, 0, jnp.float64)
    programs = {
        "dense step": lambda v: lax.fori_loop(0, 4, lambda i, h: jnp.tanh(w @ h), v),
        "long": lambda v: lax.fori_loop(0, 9, lambda i, h: _heat_step(h), v),
        "many equations": lambda v: lax.fori_loop(
            0,
            8,
            lambda i, h: _heat_python(_heat_python(_heat_python(_heat_python(h)))),
            v,
        ),
        "small": lambda v: lax.fori_loop(0, 4, lambda i, h: _heat_step(h), v[:8]),
        "while inside": lambda v: lax.fori_loop(
            0, 2, lambda i, h: lax.while_loop(lambda c: c[0] < 2, _bump, (0, h))[1], v
        ),
    }
    for name, fn in programs.items():
        (eqn,) = _scan_eqns(fn, u)
        assert not graph.unrolls(eqn), name
        _close(gx.jacve(fn, order="rev")(u), jax.jacfwd(fn)(u), jnp.float64)
    assert graph.MAX_UNROLLED_STEPS == 8
    # Structured steps unroll, also where a small constant kernel or matrix is
    # applied inside a `jit` of `jax.numpy`'s.
    kernel = jnp.array([0.2, -0.5, 0.3])
    cell = jnp.array([[1.0, 2.0, 3.0], [0.0, 1.0, 0.0], [2.0, 0.0, 1.0]])
    programs = {
        "stencil": _heat_fori,
        "convolve": lambda v: lax.fori_loop(
            0, 4, lambda i, h: jnp.convolve(h, kernel, mode="same") + jnp.tanh(h), v
        ),
        "per-cell product": lambda v: lax.fori_loop(
            0, 4, lambda i, h: (h.reshape(-1, 3) @ cell).reshape(-1) + jnp.sin(h), v
        ),
    }
    u = u[:150]
    for name, fn in programs.items():
        (eqn,) = _scan_eqns(fn, u)
        assert graph.unrolls(eqn), name
        _close(gx.jacve(fn, order="rev")(u), jax.jacfwd(fn)(u), jnp.float64)


def _bump(c):
    return c[0] + 1, _heat_step(c[1])
