"""The structured-partial algebra against dense arithmetic.

Random patterns (ties with and without values, broadcasts, dense axes, linear maps)
are multiplied and added; the results must equal the dense products and sums, and the
pattern-only plans must predict the same patterns and counts.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from graphax_eqx._eliminate import SimEdge, sim_add, sim_edge, sim_product
from graphax_eqx._sparse import (
    LinearMap,
    SparseTensor,
    add,
    from_labeled,
    linear_map,
    product,
    to_sparse,
    with_mask,
)


def _random_partial(rng, out_shape, in_shape, key):
    """A random SparseTensor with random ties / carried labels over the given shapes."""
    labels = [("o", k) for k in range(len(out_shape))]
    free_out = list(range(len(out_shape)))
    for i, n in enumerate(in_shape):
        candidates = [k for k in free_out if out_shape[k] == n]
        if candidates and rng.random() < 0.5:
            k = candidates[rng.integers(len(candidates))]
            free_out.remove(k)
            labels.append(("o", k))
        else:
            labels.append(("i", i))
    distinct = list(dict.fromkeys(labels))
    carried = [lab for lab in distinct if rng.random() < 0.6]
    sizes = dict(zip(labels, tuple(out_shape) + tuple(in_shape)))
    if rng.random() < 0.15:
        val = None
    else:
        val = jax.random.normal(key, tuple(sizes[lab] for lab in carried))
    return from_labeled(
        val,
        tuple(carried) if val is not None else (),
        out_shape,
        in_shape,
        labels,
        jnp.float64,
    )


def _shape(rng):
    return tuple(int(s) for s in rng.choice([1, 2, 3], size=rng.integers(0, 3)))


@pytest.mark.parametrize("seed", range(60))
def test_product_and_sum_match_dense(seed):
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    w, v, u = _shape(rng), _shape(rng), _shape(rng)
    if rng.random() < 0.5:
        v = w  # make ties between w and v likely
    if rng.random() < 0.5:
        u = v
    a = _random_partial(rng, w, v, keys[0])
    b = _random_partial(rng, v, u, keys[1])
    c, muls = product(a, b)
    nw, nv = len(w), len(v)
    ad, bd = a.dense(), b.dense()
    letters = "abcdefghijkl"
    sw, sv = letters[:nw], letters[nw : nw + nv]
    su = letters[nw + nv : nw + nv + len(u)]
    expected = jnp.einsum(f"{sw}{sv},{sv}{su}->{sw}{su}", ad, bd)
    assert jnp.allclose(to_sparse(c).dense(), expected, atol=1e-10)
    # The pattern-only plan agrees with the real product.
    sim, sim_muls = sim_product(sim_edge(a), sim_edge(b))
    assert sim == sim_edge(c)
    assert sim_muls == muls
    assert isinstance(muls, int) and muls <= max(1, math.prod(w + v + u)) * 2

    # Sums of two partials of the same shape, with different structure.
    d = _random_partial(rng, w, u, keys[2])
    s, adds = add(c, d)
    assert jnp.allclose(to_sparse(s).dense(), expected + d.dense(), atol=1e-10)
    sim_s, sim_adds = sim_add(sim_edge(c), sim_edge(d))
    assert sim_s == sim_edge(s)
    assert sim_adds == adds


@pytest.mark.parametrize("seed", range(20))
def test_linear_maps_compose_with_partials(seed):
    rng = np.random.default_rng(100 + seed)
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    n = 24  # large enough that maps stay lazy
    perm = jnp.asarray(rng.permutation(n))
    lin = linear_map(lambda t: t[perm] * 2.0, (n,), (n,), jnp.float64)
    lin_dense = to_sparse(lin).dense()
    a = (
        _random_partial(rng, (3,), (n,), keys[0])
        if seed % 2
        else _random_partial(rng, (n,), (n,), keys[0])
    )
    c, _ = product(a, lin)
    assert jnp.allclose(to_sparse(c).dense(), a.dense() @ lin_dense, atol=1e-10)
    b = (
        _random_partial(rng, (n,), (2,), keys[1])
        if seed % 2
        else _random_partial(rng, (n,), (n,), keys[1])
    )
    c, _ = product(lin, b)
    assert jnp.allclose(to_sparse(c).dense(), lin_dense @ b.dense(), atol=1e-10)
    c, _ = product(lin, lin)
    assert isinstance(c, LinearMap)
    assert jnp.allclose(to_sparse(c).dense(), lin_dense @ lin_dense, atol=1e-10)
    d = _random_partial(rng, (n,), (n,), keys[2])
    s, _ = add(lin, d)
    assert jnp.allclose(to_sparse(s).dense(), lin_dense + d.dense(), atol=1e-10)


def test_sparse_tensor_is_a_pytree_through_jit():
    st = from_labeled(jnp.arange(3.0), (0,), (3,), (3,), (0, 0), jnp.float32)
    out = jax.jit(lambda t: t)(st)
    assert isinstance(out, SparseTensor)
    assert out.pattern == st.pattern
    assert jnp.array_equal(out.dense(), jnp.diag(jnp.arange(3.0)))
    assert jnp.array_equal(out.to_bcoo().todense(), out.dense())
    assert "diagonal" in repr(out)


def test_sim_edge_of_identity_has_no_values():
    st = from_labeled(None, (), (4,), (4,), (0, 0), jnp.float32)
    assert sim_edge(st) == SimEdge(st.pattern, False)


def _with_random_mask(rng, st, nonfinite: bool):
    """`st` with a random selection mask, or with infinities and NaN in its values."""
    if st.val is None or st.val.ndim == 0:
        return st
    if nonfinite:
        bad = rng.choice(
            [0.0, np.inf, -np.inf, np.nan], size=st.val.shape, p=[0.6, 0.1, 0.1, 0.2]
        )
        val = jnp.where(bad == 0, st.val, jnp.asarray(bad))
        return SparseTensor(val, st.pattern, st.dtype)
    return with_mask(st, jnp.asarray(rng.random(st.val.shape) < 0.4))


def _terms(st):
    """Dense value, and where a term exists and is not selected away."""
    ones = SparseTensor(
        None if st.val is None else jnp.ones_like(st.val), st.pattern, st.dtype
    )
    live = ones.dense() != 0
    if st.mask is not None:
        masked = SparseTensor(st.mask.astype(st.dtype), st.pattern, st.dtype).dense()
        live = live & (masked == 0)
    return st.dense(), live


@pytest.mark.parametrize("seed", range(40))
def test_selected_away_entries_stay_zero_through_products(seed):
    """A selection discards whatever its entry would multiply, in every association,
    as `jnp.where` discards the other branch's derivative in JAX."""
    rng = np.random.default_rng(500 + seed)
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    x, w, v, u = (_shape(rng) for _ in range(4))
    if rng.random() < 0.5:
        w = x
    if rng.random() < 0.5:
        v = w
    if rng.random() < 0.5:
        u = v
    a = _with_random_mask(rng, _random_partial(rng, x, w, keys[0]), False)
    b = _with_random_mask(rng, _random_partial(rng, w, v, keys[1]), False)
    c = _with_random_mask(rng, _random_partial(rng, v, u, keys[2]), True)
    (ad, al), (bd, bl), (cd, cl) = _terms(a), _terms(b), _terms(c)
    letters = "abcdefghijkl"
    sx, sw = letters[: len(x)], letters[len(x) : len(x) + len(w)]
    sv = letters[len(x) + len(w) : len(x) + len(w) + len(v)]
    su = letters[len(x) + len(w) + len(v) : len(x) + len(w) + len(v) + len(u)]
    spec = f"{sx}{sw},{sw}{sv},{sv}{su}->{sx}{sw}{sv}{su}"
    terms = jnp.einsum(spec, ad, bd, cd)
    live = jnp.einsum(spec, al, bl, cl)
    axes = tuple(range(len(x), len(x) + len(w) + len(v)))
    expected = np.asarray(jnp.sum(jnp.where(live, terms, 0.0), axis=axes))
    for abc in (product(product(a, b)[0], c)[0], product(a, product(b, c)[0])[0]):
        got = np.asarray(to_sparse(abc).dense())
        # Infinities may meet in another association; NaN only where they do.
        finite = np.isfinite(expected)
        assert not (np.isnan(got) & finite).any()
        np.testing.assert_allclose(
            got[finite], expected[finite], rtol=1e-12, atol=1e-12
        )
