"""Products with `jax.experimental.sparse.BCOO` matrices whose indices are known at
trace time: their partials are static sparse patterns (the matrix's stored values,
duplicates summed, and for its values the entries of the other operand), so a
residual assembled from a sparse operator keeps the operator's sparsity. Other BCOO
products (traced indices, batch or dense axes) go through the exact fallback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import graphax_eqx


_ORDERS = ("fwd", "rev", "markowitz", "auto")
_N = 8


def _laplacian():
    a = 2.0 * np.eye(_N) - np.eye(_N, k=1) - np.eye(_N, k=-1)
    # Four padding elements (out of bounds), which every BCOO operation ignores.
    return sparse.BCOO.fromdense(a, nse=26)


def _rng(seed=0):
    return np.random.default_rng(seed)


_K = _laplacian()
_DUPLICATES = sparse.BCOO(
    (jnp.asarray([1.0, 2.0, 3.0, -0.5]), jnp.asarray([[0, 1], [0, 1], [3, 2], [7, 7]])),
    shape=(_N, _N),
)
_THREE_AXES = sparse.BCOO.fromdense(
    _rng(1).normal(size=(4, _N, 3)) * (_rng(2).uniform(size=(4, _N, 3)) > 0.5)
)
_BATCHED = sparse.BCOO.fromdense(np.stack([np.asarray(_K.todense())] * 2), n_batch=1)
# Negative indices count from the end (as in NumPy and JAX's own BCOO operations);
# -9 and 8 are out of bounds either way, and mark padding.
_NEGATIVE = sparse.BCOO(
    (
        jnp.asarray([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
        jnp.asarray([[0, 1], [-1, 2], [2, -1], [-8, -3], [-9, 0], [8, 1]]),
    ),
    shape=(_N, _N),
)
_VECTOR = sparse.BCOO(
    (jnp.asarray([1.0, 2.0, 3.0]), jnp.asarray([[1], [1], [-2]])), shape=(_N,)
)
_SQUARE = sparse.BCOO.fromdense(np.asarray([[0.0, 1.0], [2.0, 0.0]]))


def _vector(shape=(_N,), seed=3):
    return jnp.asarray(_rng(seed).uniform(0.5, 1.5, shape))


_CASES = {
    "matvec": (lambda u: _K @ u + u**3, _vector()),
    "vecmat": (lambda u: jnp.sin(u @ _K), _vector()),
    "matmat": (lambda u: jnp.sin(_K @ u), _vector((_N, 3))),
    "transposed": (lambda u: _K.T @ jnp.tanh(u), _vector()),
    "duplicates": (lambda u: jnp.sin(_DUPLICATES @ u), _vector()),
    "three_axes": (
        lambda u: jnp.sin(
            sparse.bcoo_dot_general(
                _THREE_AXES, u, dimension_numbers=(((1,), (0,)), ((), ()))
            )
        ),
        _vector((_N, 2)),
    ),
    "values": (
        lambda d: jnp.sin(sparse.BCOO((d, _K.indices), shape=_K.shape) @ _vector()),
        _K.data + 1.0,
    ),
    "negative_indices": (lambda u: jnp.sin(_NEGATIVE @ u), _vector()),
    "negative_indices_transposed": (lambda u: _NEGATIVE.T @ jnp.sin(u), _vector()),
    # Every axis of the matrix contracted: a scalar result.
    "contract_all": (
        lambda u: sparse.bcoo_dot_general(
            _VECTOR, jnp.sin(u), dimension_numbers=(((0,), (0,)), ((), ()))
        ),
        _vector(),
    ),
    "contract_both_axes": (
        lambda u: sparse.bcoo_dot_general(
            _SQUARE, jnp.sin(u), dimension_numbers=(((0, 1), (0, 1)), ((), ()))
        ),
        _vector((2, 2)),
    ),
    # Not static: indices computed inside the function, and a batch axis.
    "traced_indices": (
        lambda u: (
            sparse.BCOO(
                (u[:3], jnp.stack([u[:3], u[:3]], 1).astype(int) % _N), shape=(_N, _N)
            )
            @ jnp.sin(u)
        ),
        _vector(),
    ),
    "batched": (lambda u: jnp.sin(_BATCHED @ u), _vector()),
}


@pytest.mark.parametrize("sparse_out", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize(
    "order, jit",
    [(order, False) for order in _ORDERS] + [("rev", True), ("auto", True)],
)
@pytest.mark.parametrize("name", list(_CASES))
def test_bcoo_products(name, order, sparse_out, jit):
    fun, x = _CASES[name]
    expected = jax.jacfwd(fun)(x)
    jacobian = graphax_eqx.jacve(
        fun, order=order, sparse_representation=sparse_out, count_ops=True
    )
    jac, counts = (jax.jit(jacobian) if jit else jacobian)(x)
    dense = jac.dense() if sparse_out else jac
    np.testing.assert_allclose(dense, expected, rtol=1e-12, atol=1e-12)
    if jit or name != "traced_indices":
        # (Eagerly, indices computed from the input are known: that call's pattern,
        # which `elimination_cost`, tracing abstractly, cannot see. Under `jit`, the
        # indices of `K.T` for a constant `K` are computed at trace time, as
        # `elimination_cost` computes them.)
        cost = graphax_eqx.elimination_cost(fun, order=order)(x)
        assert int(counts["num_muls"]) == cost.num_muls


@pytest.mark.parametrize(
    "name",
    [
        "matvec",
        "vecmat",
        "matmat",
        "transposed",
        "duplicates",
        "three_axes",
        "negative_indices",
        "negative_indices_transposed",
    ],
)
def test_bcoo_products_keep_the_operator_pattern(name):
    fun, x = _CASES[name]
    expected = np.asarray(jax.jacfwd(fun)(x))
    jac = graphax_eqx.jacve(fun, sparse_representation=True)(x)
    assert isinstance(jac, graphax_eqx.CooTensor)
    assert jac.to_bcoo().nse == np.count_nonzero(expected)


def test_bcoo_products_under_vmap():
    fun, _ = _CASES["matmat"]
    xs = jnp.stack([_vector((_N, 3), seed) for seed in range(3)])
    got = jax.vmap(graphax_eqx.jacve(fun, order="rev"))(xs)
    np.testing.assert_allclose(got, jax.vmap(jax.jacfwd(fun))(xs), rtol=1e-12)
