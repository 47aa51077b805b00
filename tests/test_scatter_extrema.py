"""Scattered maxima and minima (`x.at[idx].max(v)`, `jax.ops.segment_max`,
`segment_min`) with indices known at trace time: each update's partial sits at its
static destination, the operand's on the diagonal, and where several values reach an
output (ties) they share its derivative equally, as in JAX's own rule. Indices
computed inside the function go through the exact fallback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import graphax_eqx


_ORDERS = ("fwd", "rev", "markowitz", "auto")
_IDS = jnp.asarray([0, 2, 2, 1, 0, 3, 3, 3])


def _x(seed=0):
    return jnp.asarray(np.random.default_rng(seed).uniform(0.5, 1.5, 8))


_CASES = {
    "segment_max": (lambda v: jnp.sin(jax.ops.segment_max(v * v, _IDS, 4)), _x()),
    "segment_min": (lambda v: jax.ops.segment_min(jnp.cos(v), _IDS, 4), _x()),
    # An empty segment (its output the identity, -inf) and ties within segments.
    "segment_max_empty": (lambda v: jax.ops.segment_max(v * v, _IDS, 5) * 2.0, _x()),
    "segment_max_ties": (
        lambda v: jax.ops.segment_max(v, _IDS, 4) * 2.0,
        jnp.asarray([1.0, 2.0, 2.0, 0.5, 1.0, 3.0, 3.0, 1.0]),
    ),
    "at_max": (lambda v: jnp.sin(v[:4].at[_IDS % 4].max(v * 0.9)), _x()),
    "at_max_ties": (
        lambda v: v[:4].at[jnp.asarray([0, 0, 1, 1])].max(v[4:]),
        jnp.asarray([1.0, 2.0, 3.0, 0.5, 1.0, 1.0, 3.0, 0.7]),
    ),
    "at_min_rows": (
        lambda v: jnp.tanh(
            v.reshape(4, 2).at[jnp.asarray([1, 3, 1])].min(v[:6].reshape(3, 2) * 1.1)
        ),
        _x(1),
    ),
    "dropped": (
        lambda v: v[:4].at[jnp.asarray([0, 7, 2, 9])].max(v[4:], mode="drop"),
        _x(2),
    ),
    "traced_ids": (
        lambda v: jax.ops.segment_max(v, (v * 3).astype(jnp.int32) % 3, 3),
        _x(3),
    ),
}


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize(
    "order, jit",
    [(order, False) for order in _ORDERS] + [("rev", True), ("auto", True)],
)
@pytest.mark.parametrize("name", list(_CASES))
def test_scattered_extrema(name, order, jit, sparse):
    fun, x = _CASES[name]
    expected = jax.jacfwd(fun)(x)
    np.testing.assert_allclose(jax.jacrev(fun)(x), expected, rtol=1e-12, atol=1e-12)
    jacobian = graphax_eqx.jacve(
        fun, order=order, sparse_representation=sparse, count_ops=True
    )
    jac, counts = (jax.jit(jacobian) if jit else jacobian)(x)
    np.testing.assert_allclose(
        jac.dense() if sparse else jac, expected, rtol=1e-12, atol=1e-12
    )
    if not jit and name != "traced_ids":
        cost = graphax_eqx.elimination_cost(fun, order=order)(x)
        assert int(counts["num_muls"]) == cost.num_muls


def test_segment_maxima_keep_the_segments_pattern():
    fun, x = _CASES["segment_max"]
    jac = graphax_eqx.jacve(fun, sparse_representation=True)(x)
    # Every update may be its segment's maximum: one structural entry per update.
    assert isinstance(jac, graphax_eqx.CooTensor)
    assert jac.nse == 8
