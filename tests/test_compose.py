"""`jacve` composed with JAX transformations, and tracing/caching behaviour."""

import jax
import jax.numpy as jnp
import pytest

import graphax_eqx

from .helpers import assert_tree_matches


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
    return isinstance(x, graphax_eqx.SparseTensor)


def test_sparse_representation_under_jit():
    jac = jax.jit(graphax_eqx.jacve(_f, sparse_representation=True))
    result = jac(_X)
    assert _is_sparse(result)
    assert_tree_matches(result.dense(), jax.jacrev(_f)(_X))
    # A second call reuses the compiled function and still gives a SparseTensor.
    again = jac(_X * 2.0)
    assert _is_sparse(again)
    assert_tree_matches(again.dense(), jax.jacrev(_f)(_X * 2.0))


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
def test_no_retrace_on_same_shapes(order):
    calls = []

    def f(x):
        calls.append(None)
        return jnp.sin(x) * jnp.sum(x)

    jac = graphax_eqx.jacve(f, order=order)
    first = jac(_X)
    traced = len(calls)
    assert traced >= 1
    second = jac(_X * 2.0)
    assert len(calls) == traced, "same shapes and dtypes must not call `f` again"
    reference = jax.jacrev(lambda x: jnp.sin(x) * jnp.sum(x))
    assert_tree_matches(first, reference(_X))
    assert_tree_matches(second, reference(_X * 2.0))
    # A new shape is a new trace.
    jac(jnp.ones(5))
    assert len(calls) > traced


def test_no_retrace_with_count_ops_and_has_aux():
    calls = []

    def f(x, y):
        calls.append(None)
        return jnp.exp(x) * y, x + y

    jac = graphax_eqx.jacve(f, argnums=(0, 1), has_aux=True, count_ops=True)
    (_, _), counts = jac(_X, _X)
    traced = len(calls)
    (_, _), again = jac(_X + 1.0, _X - 1.0)
    assert len(calls) == traced
    assert counts == again
