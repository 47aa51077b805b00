"""Public behaviour of `SparseTensor`, as returned with `sparse_representation=True`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import sparse as jsparse

import graphax_eqx

from .helpers import assert_tree_matches, is_sparse_block


def _is_sparse(x):
    return is_sparse_block(x)


_W = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (3, 4)))
_X = jnp.array([0.3, -0.8, 1.1, 0.5])
_Y = jnp.array([-0.2, 0.4, 0.9, -1.3])

# name -> (fun, args, argnums)
_CASES = {
    "sin": (jnp.sin, (_X,), 0),
    "add": (lambda x, y: x + y, (_X, _Y), (0, 1)),
    "matvec": (lambda w, x: w @ x, (_W, _X), (0, 1)),
    "reduce_sum": (jnp.sum, (_X,), 0),
    "reduce_sum_axis": (lambda w: jnp.sum(w, axis=0), (_W,), 0),
    "broadcast": (lambda x: jnp.broadcast_to(x, (3, 4)), (_X,), 0),
    "chain": (lambda w, x: jnp.tanh(w @ jnp.sin(x)), (_W, _X), (0, 1)),
    # Zero blocks between scalars: no entry at all.
    "scalar_unused": (lambda x, s: 2.0 * x, (jnp.array(1.5), jnp.array(3.0)), (0, 1)),
    "scalar_constant": (lambda x: jnp.zeros(()) + 1.0, (jnp.array(1.5),), 0),
}


def _sparse_jacobian(name, order="auto"):
    fun, args, argnums = _CASES[name]
    result = graphax_eqx.jacve(
        fun, order=order, argnums=argnums, sparse_representation=True
    )(*args)
    expected = jax.jacrev(fun, argnums=argnums)(*args)
    return result, expected


def _pairs(result, expected):
    sparse_leaves, sparse_def = jax.tree_util.tree_flatten(result, is_leaf=_is_sparse)
    dense_leaves, dense_def = jax.tree_util.tree_flatten(expected)
    assert sparse_def == dense_def
    assert all(_is_sparse(leaf) for leaf in sparse_leaves)
    return list(zip(sparse_leaves, dense_leaves, strict=True))


@pytest.mark.parametrize("order", ["fwd", "rev", "auto"])
@pytest.mark.parametrize("name", sorted(_CASES))
def test_dense_matches_jacrev(name, order):
    result, expected = _sparse_jacobian(name, order)
    for tensor, dense in _pairs(result, expected):
        assert_tree_matches(tensor.dense(), dense)


@pytest.mark.parametrize("name", sorted(_CASES))
def test_to_bcoo(name):
    result, expected = _sparse_jacobian(name)
    for tensor, dense in _pairs(result, expected):
        bcoo = tensor.to_bcoo()
        assert isinstance(bcoo, jsparse.BCOO)
        assert tuple(bcoo.shape) == dense.shape
        assert_tree_matches(bcoo.todense(), dense)


@pytest.mark.parametrize("name", sorted(_CASES))
def test_shape(name):
    result, expected = _sparse_jacobian(name)
    for tensor, dense in _pairs(result, expected):
        assert tuple(tensor.shape) == dense.shape


@pytest.mark.parametrize("name", sorted(_CASES))
def test_repr_mentions_shape(name):
    result, _ = _sparse_jacobian(name)
    for tensor in jax.tree_util.tree_leaves(result, is_leaf=_is_sparse):
        text = repr(tensor)
        assert isinstance(text, str) and text
        for size in tensor.shape:
            assert str(size) in text, f"{text!r} does not mention {tensor.shape}"


@pytest.mark.parametrize("name", sorted(_CASES))
def test_repr_of_mapped_leaves(name):
    # `jax.tree.map` may put anything in the leaves (shapes, say); the repr still
    # prints, as Equinox modules' do.
    result, _ = _sparse_jacobian(name)
    for tensor in jax.tree_util.tree_leaves(result, is_leaf=_is_sparse):
        mapped = jax.tree.map(lambda leaf: (leaf.shape, leaf.dtype), tensor)
        assert type(mapped) is type(tensor)
        text = repr(mapped)
        for size in tensor.shape:
            assert str(size) in text


@pytest.mark.parametrize("name", sorted(_CASES))
def test_is_pytree_of_arrays(name):
    result, _ = _sparse_jacobian(name)
    for tensor in jax.tree_util.tree_leaves(result, is_leaf=_is_sparse):
        leaves, treedef = jax.tree_util.tree_flatten(tensor)
        assert all(isinstance(leaf, jax.Array) for leaf in leaves)
        rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
        assert _is_sparse(rebuilt)
        assert_tree_matches(rebuilt.dense(), tensor.dense())


def test_sin_stores_no_more_than_a_diagonal():
    result, _ = _sparse_jacobian("sin")
    stored = sum(leaf.size for leaf in jax.tree_util.tree_leaves(result))
    assert stored <= _X.size


@pytest.mark.parametrize("name", sorted(_CASES))
def test_jit_round_trip(name):
    result, expected = _sparse_jacobian(name)
    through = jax.jit(lambda t: t)(result)
    for tensor, dense in _pairs(through, expected):
        assert_tree_matches(tensor.dense(), dense)
    densified = jax.jit(
        lambda t: jax.tree_util.tree_map(lambda s: s.dense(), t, is_leaf=_is_sparse)
    )(result)
    assert_tree_matches(densified, expected)


def test_jit_returning_sparse():
    fun, args, argnums = _CASES["chain"]
    jac = jax.jit(graphax_eqx.jacve(fun, argnums=argnums, sparse_representation=True))
    result = jac(*args)
    for tensor, dense in _pairs(result, jax.jacrev(fun, argnums=argnums)(*args)):
        assert_tree_matches(tensor.dense(), dense)


def test_dtype_float32():
    x = _X.astype(jnp.float32)
    result = graphax_eqx.jacve(jnp.sin, sparse_representation=True)(x)
    assert result.dense().dtype == jnp.float32
    assert result.to_bcoo().todense().dtype == jnp.float32


def test_sparse_with_has_aux():
    def f(x):
        y = jnp.sin(x)
        return y * _Y, {"y": y}

    jac, aux = graphax_eqx.jacve(f, has_aux=True, sparse_representation=True)(_X)
    expected_jac, expected_aux = jax.jacrev(f, has_aux=True)(_X)
    assert _is_sparse(jac)
    assert_tree_matches(jac.dense(), expected_jac)
    assert_tree_matches(aux, expected_aux)


def test_blocks_of_independent_arguments_store_no_entries():
    # The output does not depend on `y`: its block is zero and stores nothing,
    # under `jit` and `vmap` too.
    def f(x, y):
        return x[1:] - x[:-1]

    x, y = jnp.ones(6, jnp.float32), jnp.ones(11, jnp.float32)
    jac = graphax_eqx.jacve(f, argnums=(0, 1), sparse_representation=True)
    expected = jax.jacfwd(f, argnums=(0, 1))(x, y)
    for _, block_y in (jac(x, y), jax.jit(jac)(x, y)):
        assert block_y.to_bcoo().nse == 0
        np.testing.assert_array_equal(block_y.dense(), expected[1])
        np.testing.assert_array_equal(block_y.to_bcoo().todense(), expected[1])
    xs, ys = jnp.ones((3, 6), jnp.float32), jnp.ones((3, 11), jnp.float32)
    _, block_y = jax.vmap(jac)(xs, ys)
    batched = jax.vmap(jax.jacfwd(f, argnums=(0, 1)))(xs, ys)[1]
    np.testing.assert_array_equal(block_y.dense(), batched)
    np.testing.assert_array_equal(block_y.to_bcoo().todense(), batched)
    assert block_y.to_bcoo().nse == 0


def test_results_mapped_to_other_axes_are_refused():
    """`jax.vmap(..., out_axes=1)` puts the mapped axis inside a result's value
    array, where `.dense()` would read it as an entry axis: a clear error instead."""
    f = lambda x: jnp.roll(x, 1) * x  # 8 stored entries per batch element
    xs = jnp.arange(20.0, dtype=jnp.float32).reshape(5, 4)
    jac = graphax_eqx.jacve(f, sparse_representation=True)
    moved = jax.vmap(jac, out_axes=1)(xs)
    with pytest.raises(ValueError, match="out_axes"):
        moved.dense()
    with pytest.raises(ValueError, match="out_axes"):
        moved.to_bcoo()
    leading = jax.vmap(jac)(xs)
    np.testing.assert_array_equal(leading.dense(), jax.vmap(jax.jacfwd(f))(xs))


def test_nse_of_labelled_blocks():
    """`SparseTensor.nse`, like `CooTensor.nse`, is what `to_bcoo` stores."""
    x = jnp.arange(1.0, 7.0, dtype=jnp.float32)
    for f, nse in ((jnp.sin, 6), (lambda x: jnp.sum(x) * x, 36), (jnp.sum, 6)):
        block = graphax_eqx.jacve(f, sparse_representation=True)(x)
        assert block.nse == block.to_bcoo().nse == nse


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz"])
def test_overwritten_entries_are_not_stored(order):
    """`x.at[idx].set(...)` and `dynamic_update_slice` with known indices drop the
    entries they overwrite from the pattern, so `nse` stays structural through the
    stencils that follow (boundary conditions written as `u.at[0].set(...)`)."""
    n = 40
    u = jnp.asarray(np.random.default_rng(0).normal(size=n))

    def stencil(v):
        return v[2:] - 2 * v[1:-1] + v[:-2] + 0.1 * jnp.sin(v[1:-1])

    programs = [
        lambda x: x[:6].at[np.array([0, 2])].set(x[3:5] ** 2),
        lambda u: stencil(stencil(jnp.sin(u).at[: n // 2].set(0.0))),
        lambda u: stencil(jnp.sin(u).at[np.array([0, -1])].set(jnp.cos(u[:2]))),
        lambda u: stencil(lax.dynamic_update_slice(jnp.sin(u), jnp.zeros(9), (3,))),
    ]
    for k, f in enumerate(programs):
        expected = np.asarray(jax.jacfwd(f)(u))
        structured = graphax_eqx.jacve(f, order=order, sparse_representation=True)
        # Eagerly, and under `jit` (the same graph) for one program.
        for jac in (structured, jax.jit(structured)) if k == 1 else (structured,):
            block = jac(u)
            np.testing.assert_allclose(block.dense(), expected, rtol=1e-12, atol=1e-14)
            assert block.to_bcoo().nse == np.count_nonzero(expected)
        dense = jax.jit(graphax_eqx.jacve(f, order=order))(u)
        np.testing.assert_allclose(dense, expected, rtol=1e-12, atol=1e-14)
