"""Convolution partials kept in two forms: their coordinates and their linear map.

A convolution's partial with respect to its input is stored by coordinates, and is
also the convolution as a linear map. Each product picks the form of least cost:
the coordinates against sparse neighbours (the input's identity, elementwise
derivatives, other convolutions), the map against dense ones (a loss's cotangent, a
dense layer), where a gather per entry pair would cost several times the
convolution. Products over coordinates with an elementwise or index-map neighbour
carry the map on, composed with that neighbour.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import graphax_eqx
from graphax_eqx import _indexed
from graphax_eqx._rules.linalg import _conv
from graphax_eqx._sparse import dense_pattern, diagonal, product

from .helpers import assert_matches_references, reference_jacobians


_ORDERS = ("fwd", "rev", "markowitz", "auto")


def _layers(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    # 27 and 72 kernel entries per output: both sides of the former coordinate limit.
    first = eqx.nn.Conv2d(3, 8, 3, padding=1, key=k1)
    second = eqx.nn.Conv2d(8, 2, 3, padding=1, stride=2, key=k2)
    head = eqx.nn.Linear(2 * 6 * 6, 5, key=k3)
    to64 = lambda m: jax.tree.map(  # noqa: E731
        lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, m
    )
    return to64(first), to64(second), to64(head)


def _features(img):
    first, second, _ = _layers()
    return second(jax.nn.gelu(first(img)))


def _logits(img):
    _, _, head = _layers()
    return head(jnp.ravel(_features(img)))


def _image():
    return jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.5, (3, 12, 12)))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("fun", [_features, _logits], ids=["features", "logits"])
def test_convolution_networks(fun, order, sparse):
    img = _image()
    references = reference_jacobians(fun, (img,))
    jacobian = graphax_eqx.jacve(
        fun, order=order, sparse_representation=sparse, count_ops=True
    )
    jac, counts = jacobian(img)
    dense = jac.dense() if sparse else jac
    assert_matches_references(dense, references)
    if sparse and fun is _features:
        # Exactly the structural nonzeros (the values have no accidental zeros).
        expected = np.count_nonzero(np.asarray(references["fwd"]))
        assert jac.to_bcoo().nse == expected
    cost = graphax_eqx.elimination_cost(fun, order=order)(img)
    assert int(counts["num_muls"]) == cost.num_muls
    jitted, _ = jax.jit(jacobian)(img)
    assert_matches_references(jitted.dense() if sparse else jitted, references)


def test_networks_under_vmap_and_nested():
    imgs = jnp.stack([_image(), 2.0 * _image()])
    got = jax.vmap(graphax_eqx.jacve(_logits, order="rev"))(imgs)
    expected = jax.vmap(jax.jacfwd(_logits))(imgs)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    # The Jacobian of a gradient, each level by vertex elimination.
    energy = lambda y: jnp.sum(_features(y) ** 2)  # noqa: E731
    grad = lambda x: graphax_eqx.jacve(energy, order="rev")(x)  # noqa: E731
    img = _image()[:, :6, :6]
    hess = graphax_eqx.jacve(grad, order="fwd")(img)
    np.testing.assert_allclose(hess, jax.hessian(energy)(img), rtol=1e-9, atol=1e-11)


def _conv_partial(fan_in_features=8):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, fan_in_features, 6, 6)))
    w = jnp.asarray(np.random.default_rng(1).normal(size=(2, fan_in_features, 3, 3)))
    conv = lambda lhs, rhs: lax.conv_general_dilated(  # noqa: E731
        lhs, rhs, (1, 1), ((1, 1), (1, 1))
    )
    (eqn,) = jax.make_jaxpr(conv)(x, w).jaxpr.eqns
    params = eqn.params
    [out], partials = _conv((x, w), (True, False), **params)
    partial = partials[(0, 0)]
    assert isinstance(partial, _indexed.MappedCooTensor)
    return x, w, out, partial


def test_each_product_picks_its_form():
    x, _, out, partial = _conv_partial()
    p = partial.pattern
    # A dense cotangent (a loss's, a dense layer's) meets the map.
    row = dense_pattern((4,), out.shape)
    assert _indexed.mapped_choice(row, p, True, True) == (False, True)
    # An elementwise derivative keeps the coordinates, and the result carries the map.
    diag = diagonal(jnp.ones(out.shape), out.shape).pattern
    assert _indexed.mapped_choice(diag, p, True, True) == (False, False)
    summary = _indexed.mixed_product_summary(diag, p, True, True)
    assert isinstance(summary[0], _indexed.MappedPattern)
    # The input's identity keeps the coordinates too.
    identity = diagonal(None, x.shape, x.dtype).pattern
    assert _indexed.mapped_choice(p, identity, True, False) == (False, False)


@pytest.mark.parametrize("seed", range(4))
def test_carried_maps_equal_their_coordinates(seed):
    """The map a product over coordinates carries on applies exactly its entries,
    and so does the map read off a tensor that lost it."""
    rng = np.random.default_rng(seed)
    x, _, out, partial = _conv_partial()
    d = diagonal(jnp.asarray(rng.uniform(0.5, 1.5, out.shape)), out.shape)
    for a, b in ((d, partial), (partial, diagonal(None, x.shape, x.dtype))):
        result, _ = product(a, b)
        assert isinstance(result, _indexed.MappedCooTensor)
        matrix = result.dense().reshape(int(np.prod(out.shape)), -1)
        t = jnp.asarray(rng.normal(size=result.in_shape))
        y = jnp.asarray(rng.normal(size=result.out_shape))
        linear = _indexed.as_map(result)
        np.testing.assert_allclose(
            np.ravel(linear.fn(t)), matrix @ np.ravel(t), rtol=1e-12, atol=1e-12
        )
        np.testing.assert_allclose(
            np.ravel(linear.tfn(y)), np.ravel(y) @ matrix, rtol=1e-12, atol=1e-12
        )
        # Without its map, the coordinates are applied.
        bare = _indexed.CooTensor(result.val, result.pattern, result.dtype)
        fallback = _indexed.as_map(bare)
        np.testing.assert_allclose(
            np.ravel(fallback.fn(t)), matrix @ np.ravel(t), rtol=1e-12, atol=1e-12
        )
        np.testing.assert_allclose(
            np.ravel(fallback.tfn(y)), np.ravel(y) @ matrix, rtol=1e-12, atol=1e-12
        )


def test_results_hold_no_maps():
    jac = graphax_eqx.jacve(
        lambda img: _layers()[0](img), order="fwd", sparse_representation=True
    )(_image())
    assert type(jac) is graphax_eqx.CooTensor
    assert not isinstance(jac.pattern, _indexed.MappedPattern)
