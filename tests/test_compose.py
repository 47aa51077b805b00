"""`jacve` composed with JAX transformations, and tracing/caching behaviour."""

import collections

import jax
import jax.numpy as jnp
import pytest

import graphax_eqx

from .helpers import assert_tree_matches, is_sparse_block, repeated_order


def _f(x):
    return jnp.sin(x) * jnp.sum(x**2) + jnp.cumsum(jnp.exp(x))


def _scalar(x):
    return jnp.sum(jnp.sin(x) * x) + jnp.prod(jnp.cos(x)) + (x @ x) ** 2


def _vector(x):
    return jnp.stack([jnp.sum(jnp.exp(x) * x), x[0] * x[1] * x[2], jnp.tanh(x) @ x])


_X = jnp.array([0.3, -0.8, 1.1])


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz", "auto"])
def test_jit(order):
    result = jax.jit(graphax_eqx.jacve(_f, order=order))(_X)
    assert_tree_matches(result, jax.jacrev(_f)(_X))


def test_jit_with_argnums_and_pytrees():
    def f(p, x):
        return {"y": jnp.tanh(p["w"] @ x + p["b"]), "z": jnp.sum(p["w"])}

    p = {"w": jnp.arange(6.0).reshape(2, 3) / 6.0, "b": jnp.array([0.1, -0.2])}
    result = jax.jit(graphax_eqx.jacve(f, argnums=(0, 1)))(p, _X)
    assert_tree_matches(result, jax.jacrev(f, argnums=(0, 1))(p, _X))


@pytest.mark.parametrize("order", ["fwd", "rev", "auto"])
def test_vmap(order):
    xs = jnp.stack([_X, _X * 0.5, -_X, _X + 1.0])
    result = jax.vmap(graphax_eqx.jacve(_f, order=order))(xs)
    assert_tree_matches(result, jax.vmap(jax.jacrev(_f))(xs))


def test_vmap_in_axes_none():
    f = lambda x, w: jnp.tanh(w @ x)
    w = jnp.arange(6.0).reshape(2, 3) / 6.0
    xs = jnp.stack([_X, -_X])
    result = jax.vmap(graphax_eqx.jacve(f, argnums=(0, 1)), in_axes=(0, None))(xs, w)
    expected = jax.vmap(jax.jacrev(f, argnums=(0, 1)), in_axes=(0, None))(xs, w)
    assert_tree_matches(result, expected)


def test_jit_of_vmap():
    xs = jnp.stack([_X, _X * 0.5])
    result = jax.jit(jax.vmap(graphax_eqx.jacve(_f)))(xs)
    assert_tree_matches(result, jax.vmap(jax.jacrev(_f))(xs))


@pytest.mark.parametrize("outer", ["fwd", "rev", "auto"])
@pytest.mark.parametrize("inner", ["fwd", "rev", "auto"])
def test_hessian_of_scalar(inner, outer):
    hessian = graphax_eqx.jacve(graphax_eqx.jacve(_scalar, order=inner), order=outer)
    assert_tree_matches(hessian(_X), jax.hessian(_scalar)(_X))


@pytest.mark.parametrize("order", ["fwd", "rev", "auto"])
def test_jacobian_of_jacobian_of_vector(order):
    second = graphax_eqx.jacve(graphax_eqx.jacve(_vector, order=order), order=order)
    expected = jax.jacfwd(jax.jacrev(_vector))(_X)
    result = second(_X)
    assert result.shape == (3, 3, 3)
    assert_tree_matches(result, expected)


def test_hessian_argnums_tuple():
    f = lambda x, y: jnp.sum(jnp.sin(x) * y**2)
    y = jnp.array([0.5, 2.0, -1.0])
    hessian = graphax_eqx.jacve(graphax_eqx.jacve(f, argnums=(0, 1)), argnums=(0, 1))
    assert_tree_matches(hessian(_X, y), jax.hessian(f, argnums=(0, 1))(_X, y))


def _is_sparse(x):
    return is_sparse_block(x)


def test_sparse_representation_under_jit():
    jac = jax.jit(graphax_eqx.jacve(_f, sparse_representation=True))
    result = jac(_X)
    assert _is_sparse(result)
    assert_tree_matches(result.dense(), jax.jacrev(_f)(_X))
    # A second call reuses the compiled function and still gives a SparseTensor.
    again = jac(_X * 2.0)
    assert _is_sparse(again)
    assert_tree_matches(again.dense(), jax.jacrev(_f)(_X * 2.0))


def _stencil(u):
    return u[2:] - 2.0 * u[1:-1] + u[:-2] + jnp.sin(u[1:-1]) ** 3


def _batched_flux(x):
    # Index maps on a (B, 3) array: tied on B, coordinates on the last axis.
    return jnp.stack([x[:, 0] * x[:, 1], jnp.sin(x[:, 2]), x[:, 0] ** 2], axis=1)


def _selected(x):
    return jnp.where(x > 0.5, jnp.sin(x), x[::-1])


def _elementwise(x):
    return jnp.sin(x) * x


@pytest.mark.parametrize("order", ["fwd", "rev", "min_fill"])
@pytest.mark.parametrize(
    "fun, shape, depth",
    [
        (_stencil, (3, 9), 1),
        (_stencil, (2, 3, 9), 2),
        (_batched_flux, (2, 4, 3), 1),
        (_selected, (3, 6), 1),
        (_elementwise, (4, 5), 1),
        (_elementwise, (4,), 1),
        # Pure index maps and identities: the same Jacobian for every element.
        (lambda x: x + 1.0, (3, 4), 1),
        (lambda x: x[1:3], (3, 4), 1),
        (lambda x: jnp.pad(x[::-1], 1), (3, 4), 1),
        (lambda x: jnp.roll(x, 2).reshape(2, 2).T, (2, 3, 4), 2),
    ],
)
def test_sparse_results_under_vmap(fun, shape, depth, order):
    # vmap adds leading axes to a structured result's values; `.dense()` and
    # `.to_bcoo()` return them, as `jax.vmap(jax.jacfwd(f))` does.
    xs = jax.random.uniform(jax.random.key(0), shape, minval=0.1, maxval=0.9)
    if order == "min_fill":
        same = repeated_order(fun, (xs[(0,) * depth],), order, ("fwd", "rev"))
        if same is not None:
            pytest.skip(f"{order!r} eliminates in the same order as {same!r} here")
    ref = jax.jacfwd(fun)
    jac = graphax_eqx.jacve(fun, order, sparse_representation=True)
    for _ in range(depth):
        ref, jac = jax.vmap(ref), jax.vmap(jac)
    want = ref(xs)
    for got in (jac(xs), jax.jit(jac)(xs)):
        assert is_sparse_block(got)
        assert got.dense().shape == want.shape
        assert_tree_matches(got.dense(), want)
        bcoo = got.to_bcoo()
        assert bcoo.n_batch == depth and bcoo.shape == want.shape
        assert_tree_matches(bcoo.todense(), want)


def test_to_bcoo_of_a_scalar_block():
    def f(x):
        return jnp.sin(x) * x

    x = jnp.asarray(0.7)
    got = graphax_eqx.jacve(f, sparse_representation=True)(x)
    bcoo = got.to_bcoo()
    assert bcoo.shape == () and bcoo.nse == 1
    assert_tree_matches(bcoo.todense(), jax.jacfwd(f)(x))


def _masked_stencil(u):
    # A `where` inside a stencil: the sparse result carries a mask of the entries
    # selected away, which becomes a float0 array in the result's tangent.
    return jnp.where(u > 0.6, jnp.sin(u * jnp.roll(u, 1)), 0.0) + u[::-1] ** 2


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz"])
def test_tangents_of_masked_sparse_results(order):
    u = jnp.linspace(0.1, 1.3, 8)
    ts = jnp.stack([jnp.cos(jnp.arange(8.0)), jnp.ones(8)])
    jacobian = graphax_eqx.jacve(_masked_stencil, order, sparse_representation=True)
    assert jacobian(u).mask is not None

    def want(t):
        return jax.jvp(jax.jacrev(_masked_stencil), (u,), (t,))[1]

    def tangent(t):
        return jax.jvp(jacobian, (u,), (t,))[1]

    def dense(t):
        return tangent(t).dense()

    def bcoo(t):
        return tangent(t).to_bcoo().todense()

    for read in (dense, bcoo):
        assert_tree_matches(read(ts[0]), want(ts[0]))
        assert_tree_matches(jax.jit(read)(ts[0]), want(ts[0]))
        assert_tree_matches(jax.vmap(read)(ts), jax.vmap(want)(ts))
    linear = jax.linearize(jacobian, u)[1]
    assert_tree_matches(linear(ts[1]).to_bcoo().todense(), want(ts[1]))


@pytest.mark.parametrize("order", ["fwd", "rev", "auto"])
def test_grad_through_jacve(order):
    def loss(x, jacobian):
        return jnp.sum(jacobian(_f)(x) ** 2) + jnp.sum(jnp.sin(x))

    jacve = lambda f: graphax_eqx.jacve(f, order=order)
    expected = jax.grad(loss)(_X, jax.jacrev)
    assert_tree_matches(jax.grad(loss)(_X, jacve), expected)
    value, grad = jax.value_and_grad(loss)(_X, jacve)
    assert_tree_matches(value, loss(_X, jax.jacrev))
    assert_tree_matches(grad, expected)


def test_grad_through_jacve_under_jit():
    def loss(w, x):
        jac = graphax_eqx.jacve(lambda v: jnp.tanh(w @ v))(x)
        return jnp.sum(jac**2)

    w = jnp.arange(6.0).reshape(2, 3) / 6.0

    def expected_loss(w, x):
        return jnp.sum(jax.jacrev(lambda v: jnp.tanh(w @ v))(x) ** 2)

    result = jax.jit(jax.grad(loss))(w, _X)
    assert_tree_matches(result, jax.grad(expected_loss)(w, _X))


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz", "auto"])
def test_eager_calls_retrace_but_reuse_the_analysis(order, monkeypatch):
    """Eagerly, every call traces `f` (as `jax.jacrev` does); the analysed graph and
    the resolved order are reused; under `jit` nothing is traced again."""
    calls, analyses = [], []
    real_analyse = graphax_eqx._jacve.analyse

    def counting_analyse(*args, **kwargs):
        analyses.append(None)
        return real_analyse(*args, **kwargs)

    monkeypatch.setattr(graphax_eqx._jacve, "analyse", counting_analyse)
    monkeypatch.setattr(graphax_eqx._jacve, "_ANALYSES", collections.OrderedDict())
    scale = jnp.arange(1.0, 4.0) * 0.37  # a value unlikely to be analysed elsewhere

    def f(x):
        calls.append(None)
        return jnp.sin(x) * jnp.sum(x) * scale

    jac = graphax_eqx.jacve(f, order=order)
    first = jac(_X)
    second = jac(_X * 2.0)
    assert len(calls) == 2
    assert len(analyses) == 1
    reference = jax.jacrev(lambda x: jnp.sin(x) * jnp.sum(x) * scale)
    assert_tree_matches(first, reference(_X))
    assert_tree_matches(second, reference(_X * 2.0))
    jitted = jax.jit(jac)
    jitted(_X)
    traced = len(calls)
    jitted(_X + 1.0)
    assert len(calls) == traced, "under `jit`, same shapes must not call `f` again"
    # A new shape is a new structure.
    graphax_eqx.jacve(lambda x: f(x)[:2], order=order)(_X)
    assert len(analyses) == 2


def test_count_ops_and_has_aux_stable_across_calls():
    def f(x, y):
        return jnp.exp(x) * y, x + y

    jac = graphax_eqx.jacve(f, argnums=(0, 1), has_aux=True, count_ops=True)
    (_, aux), counts = jac(_X, _X)
    (_, again_aux), again = jac(_X + 1.0, _X - 1.0)
    assert counts == again
    assert_tree_matches(again_aux, (_X + 1.0) + (_X - 1.0))
