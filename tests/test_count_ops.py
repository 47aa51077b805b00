"""Multiplication counts reported by `jacve(..., count_ops=True)`.

Expected counts are derived by hand from the engine's cost rule:

- an elementwise op on shape (n,) has a diagonal partial, stored as a length-n vector;
- composing two diagonals costs n multiplications;
- composing anything with a pure identity (the partial of `a + c` w.r.t. `a`, or an
  output's identity edge) costs 0;
- composing a dense (m, n) partial with a diagonal costs m * n; composing dense
  (p, m) with dense (m, n) costs p * m * n.

Vertices are numbered 1.. in definition order; every output is joined to its own output
vertex by an identity edge, so the last defined variable is an intermediate too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import graphax_eqx
from graphax_eqx._orders import AUTO_MARGIN

from .helpers import assert_tree_matches, graph_of


N = 5


def _chain(x):
    # 1: sin, 2: exp, 3: add (identity partial), 4: log.
    return jnp.log(jnp.exp(jnp.sin(x)) + 2.0)


_rng = np.random.default_rng(0)
_A = _rng.uniform(-1, 1, (5, 4))
_B = _rng.uniform(-1, 1, (4, 3))
_C = _rng.uniform(-1, 1, (3, 2))
_W = _rng.uniform(-1, 1, (3, 4))


def _matrix_chain(x):
    # 1: C @ x (3,), 2: B @ v1 (4,), 3: A @ v2 (5,); x has shape (2,).
    return _A @ (_B @ (_C @ x))


def _tanh_w_sin(x):
    # 1: sin (4,), 2: W @ v1 (3,), 3: tanh (3,).
    return jnp.tanh(_W @ jnp.sin(x))


def _sin_matvec(w, x):
    # 1: w @ x (3,), 2: sin (3,).
    return jnp.sin(w @ x)


def _counts(fun, args, order, **kwargs):
    result, counts = graphax_eqx.jacve(fun, order=order, count_ops=True, **kwargs)(
        *args
    )
    assert_tree_matches(
        result, jax.jacrev(fun, argnums=kwargs.get("argnums", 0))(*args)
    )
    _check_counts_shape(fun, args, counts, argnums=kwargs.get("argnums", 0))
    return counts


def _check_counts_shape(fun, args, counts, argnums=0):
    assert {"num_muls", "num_adds", "order", "order_counts"} <= set(counts)
    assert type(counts["num_muls"]) is int
    assert type(counts["num_adds"]) is int
    assert all(type(v) is int for v in counts["order"])
    assert all(type(c) is int for c in counts["order_counts"])
    graph = graph_of(fun, args, argnums=argnums)
    assert len(counts["order"]) == len(graph.intermediates)
    assert sorted(counts["order"]) == sorted(int(v) for v in graph.intermediates)
    assert len(counts["order_counts"]) == len(counts["order"])
    assert sum(counts["order_counts"]) == counts["num_muls"]


def test_chain_graph():
    graph = graph_of(_chain, (jnp.ones(N),))
    assert tuple(graph.intermediates) == (1, 2, 3, 4)


def test_chain_forward():
    # 1: (1->2 diag) o (x->1 diag) = N          -> x->2 diag
    # 2: (2->3 identity) o (x->2 diag) = 0      -> x->3 diag
    # 3: (3->4 diag) o (x->3 diag) = N          -> x->4 diag
    # 4: (4->out identity) o (x->4 diag) = 0
    counts = _counts(_chain, (jnp.linspace(0.1, 1.0, N),), "fwd")
    assert counts["order"] == [1, 2, 3, 4]
    assert counts["order_counts"] == [N, 0, N, 0]
    assert counts["num_muls"] == 2 * N
    # No vertex is reached by two paths, so nothing is ever summed.
    assert counts["num_adds"] == 0


def test_chain_reverse():
    # 4: (4->out identity) o (3->4 diag) = 0    -> 3->out diag
    # 3: (3->out diag) o (2->3 identity) = 0    -> 2->out diag
    # 2: (2->out diag) o (1->2 diag) = N        -> 1->out diag
    # 1: (1->out diag) o (x->1 diag) = N
    counts = _counts(_chain, (jnp.linspace(0.1, 1.0, N),), "rev")
    assert counts["order"] == [4, 3, 2, 1]
    assert counts["order_counts"] == [0, 0, N, N]
    assert counts["num_muls"] == 2 * N
    assert counts["num_adds"] == 0


@pytest.mark.parametrize("alias, canonical", [("forward", "fwd"), ("reverse", "rev")])
def test_alias_counts(alias, canonical):
    x = jnp.linspace(0.1, 1.0, N)
    assert _counts(_chain, (x,), alias) == _counts(_chain, (x,), canonical)


# Edges of the matrix chain: x->1 dense (3, 2), 1->2 dense (4, 3), 2->3 dense (5, 4),
# 3->out identity. Costs per explicit order:
#   [1, 2, 3]: 1: 4*3*2 = 24 (x->2 is (4, 2)); 2: 5*4*2 = 40; 3: 0            -> 64
#   [1, 3, 2]: 1: 24; 3: 0 (2->out is (5, 4)); 2: 5*4*2 = 40                    -> 64
#   [2, 1, 3]: 2: 5*4*3 = 60 (1->3 is (5, 3)); 1: 5*3*2 = 30; 3: 0              -> 90
#   [2, 3, 1]: 2: 60; 3: 0 (1->out is (5, 3)); 1: 30                            -> 90
#   [3, 1, 2]: 3: 0; 1: 24; 2: 40                                               -> 64
#   [3, 2, 1]: 3: 0; 2: 5*4*3 = 60; 1: 5*3*2 = 30                               -> 90
_MATRIX_CHAIN_COUNTS = {
    (1, 2, 3): [24, 40, 0],
    (1, 3, 2): [24, 0, 40],
    (2, 1, 3): [60, 30, 0],
    (2, 3, 1): [60, 0, 30],
    (3, 1, 2): [0, 24, 40],
    (3, 2, 1): [0, 60, 30],
}


def test_matrix_chain_graph():
    graph = graph_of(_matrix_chain, (jnp.ones(2),))
    assert tuple(graph.intermediates) == (1, 2, 3)


def test_matrix_chain_forward_reverse():
    x = jnp.array([0.3, -0.7])
    fwd = _counts(_matrix_chain, (x,), "fwd")
    rev = _counts(_matrix_chain, (x,), "rev")
    assert fwd["order"] == [1, 2, 3]
    assert fwd["order_counts"] == [24, 40, 0]
    assert fwd["num_muls"] == 64
    assert rev["order"] == [3, 2, 1]
    assert rev["order_counts"] == [0, 60, 30]
    assert rev["num_muls"] == 90


def test_matrix_chain_markowitz():
    # Initial costs: 1 -> (4, 3) o (3, 2) = 24; 2 -> (5, 4) o (4, 3) = 60; 3 -> 0.
    # Take 3. Then 1 -> 24 and 2 -> (5, 4) o (4, 3) = 60: take 1.
    # Then 2 -> (5, 4) o (4, 2) = 40.
    counts = _counts(_matrix_chain, (jnp.array([0.3, -0.7]),), "markowitz")
    assert counts["order"] == [3, 1, 2]
    assert counts["order_counts"] == [0, 24, 40]
    assert counts["num_muls"] == 64


@pytest.mark.parametrize("order", sorted(_MATRIX_CHAIN_COUNTS))
def test_matrix_chain_explicit_orders(order):
    counts = _counts(_matrix_chain, (jnp.array([0.3, -0.7]),), list(order))
    assert counts["order"] == list(order)
    assert counts["order_counts"] == _MATRIX_CHAIN_COUNTS[order]
    assert counts["num_muls"] == sum(_MATRIX_CHAIN_COUNTS[order])


def test_matrix_chain_auto_is_cheapest():
    counts = _counts(_matrix_chain, (jnp.array([0.3, -0.7]),), "auto")
    assert counts["num_muls"] == 64


def test_dense_times_diagonal():
    # Edges: x->1 diag (4,), 1->2 dense (3, 4) [W], 2->3 diag (3,), 3->out identity.
    # fwd: 1: (3, 4) o diag(4) = 12; 2: diag(3) o (3, 4) = 12; 3: 0            -> 24
    # rev: 3: 0; 2: diag(3) o (3, 4) = 12; 1: (3, 4) o diag(4) = 12            -> 24
    x = jnp.linspace(-0.5, 0.5, 4)
    fwd = _counts(_tanh_w_sin, (x,), "fwd")
    rev = _counts(_tanh_w_sin, (x,), "rev")
    assert fwd["order_counts"] == [12, 12, 0]
    assert fwd["num_muls"] == 24
    assert rev["order_counts"] == [0, 12, 12]
    assert rev["num_muls"] == 24


def test_matvec_both_arguments():
    # w->1 is tied on the row axis (3) with value x (4,): d(w@x)_i/dw_jk = delta_ij x_k.
    # x->1 is dense (3, 4) with value w. 1->2 is diag (3,); 2->out identity.
    # fwd: 1: diag(3) o tied(3 | 4) = 3*4 and diag(3) o dense(3, 4) = 3*4; 2: 0  -> 24
    # rev: 2: 0; 1: the same two products                                      -> 24
    w = jnp.asarray(_W)
    x = jnp.linspace(-0.5, 0.5, 4)
    fwd = _counts(_sin_matvec, (w, x), "fwd", argnums=(0, 1))
    rev = _counts(_sin_matvec, (w, x), "rev", argnums=(0, 1))
    assert fwd["order"] == [1, 2]
    assert fwd["order_counts"] == [24, 0]
    assert fwd["num_muls"] == 24
    assert rev["order"] == [2, 1]
    assert rev["order_counts"] == [0, 24]
    assert rev["num_muls"] == 24


def _mlp(x):
    h = jnp.tanh(_B @ x[:3] + 0.5)
    return jnp.sum(jnp.sin(_A @ h) ** 2)


def _fan_out(x):
    a = jnp.sin(x)
    return jnp.stack([jnp.sum(a * jnp.cos(x)), jnp.sum(a**2)])


def _wide_to_narrow(x):
    return _C.T @ jnp.tanh(_B.T @ jnp.exp(_A.T @ x))


_AUTO_PROGRAMS = [
    (_chain, (jnp.linspace(0.1, 1.0, N),)),
    (_matrix_chain, (jnp.array([0.3, -0.7]),)),
    (_tanh_w_sin, (jnp.linspace(-0.5, 0.5, 4),)),
    (_mlp, (jnp.linspace(-0.5, 0.5, 4),)),
    (_fan_out, (jnp.linspace(-0.5, 0.5, 4),)),
    (_wide_to_narrow, (jnp.linspace(-0.5, 0.5, 5),)),
]


@pytest.mark.parametrize(
    "fun, args", _AUTO_PROGRAMS, ids=[f.__name__ for f, _ in _AUTO_PROGRAMS]
)
def test_auto_not_worse_than_named_orders(fun, args):
    # `auto` takes the better of fwd and rev unless a heuristic saves at least
    # `AUTO_MARGIN` of its multiplications.
    names = ("fwd", "rev", "markowitz", "relative_markowitz", "min_fill", "auto")
    muls = {order: _counts(fun, args, order)["num_muls"] for order in names}
    plain = min(muls["fwd"], muls["rev"])
    best = min(muls[o] for o in names[:-1])
    assert muls["auto"] <= plain, muls
    if best < (1 - AUTO_MARGIN) * plain:
        assert muls["auto"] < (1 - AUTO_MARGIN) * plain, muls


@pytest.mark.parametrize("seed", range(3))
def test_random_order_counts_consistent(seed):
    fun, args = _mlp, (jnp.linspace(-0.5, 0.5, 4),)
    graph = graph_of(fun, args)
    order = [
        int(v) for v in np.random.default_rng(seed).permutation(graph.intermediates)
    ]
    counts = _counts(fun, args, order)
    assert counts["order"] == order


def test_count_ops_with_has_aux():
    def f(x):
        y = jnp.sin(x)
        return jnp.exp(y), y

    x = jnp.linspace(0.1, 1.0, N)
    (jac, aux), counts = graphax_eqx.jacve(
        f, order="fwd", has_aux=True, count_ops=True
    )(x)
    expected_jac, expected_aux = jax.jacrev(f, has_aux=True)(x)
    assert_tree_matches(jac, expected_jac)
    assert_tree_matches(aux, expected_aux)
    # 1: sin, 2: exp. fwd: 1: diag o diag = N; 2: identity to the output = 0.
    assert counts["num_muls"] == N
    assert counts["order_counts"] == [N, 0]


def test_count_ops_is_static_information():
    """Counting does not depend on the values, only on shapes and structure."""
    a = _counts(_matrix_chain, (jnp.array([0.3, -0.7]),), "rev")
    b = _counts(_matrix_chain, (jnp.array([5.0, 2.0]),), "rev")
    assert a == b


def _stencil(u):
    # Slices are pure index maps (no stored values); `2 * s`, `-` and `sin(s) ** 3`
    # have diagonal partials; the scalar factors 2 and -1 are stored as scalars.
    return u[2:] - 2 * u[1:-1] + u[:-2] + jnp.sin(u[1:-1]) ** 3


@pytest.mark.parametrize("n", [12, 200])
def test_stencil_counts_by_hand(n):
    # Forward: ∂(2s)/∂u gathers the constant 2 onto the slice's n - 2 entries (no
    # multiplication); `-` multiplies those n - 2 values by -1; `sin(s)` gathers
    # cos(s) onto the slice (no multiplication); `** 3` multiplies 3 sin(s)² into
    # them: 2 (n - 2) in all.
    # Reverse: the output's cotangent meets 3 sin(s)² (a pure identity: 0), then
    # cos(s) (n - 2), and on the other path -1 meets 2 (1, two scalars); the slices
    # only move the accumulated values (0).
    u = jnp.linspace(0.5, 1.5, n)
    _, fwd = graphax_eqx.jacve(_stencil, order="fwd", count_ops=True)(u)
    _, rev = graphax_eqx.jacve(_stencil, order="rev", count_ops=True)(u)
    assert fwd["num_muls"] == 2 * (n - 2)
    assert rev["num_muls"] == (n - 2) + 1
    jac = graphax_eqx.jacve(_stencil, order="rev", sparse_representation=True)(u)
    assert isinstance(jac, graphax_eqx.CooTensor)
    assert jac.to_bcoo().nse == 3 * (n - 2)
