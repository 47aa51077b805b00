"""Coordinates meeting a full block: products by rows.

Reverse order reaches the weight matrix of `split(W @ x, 3)` (a GRU cell's gates)
with a cotangent stored by coordinates: three diagonals side by side. Each of its
entries meets a whole row of `W`, and the product gathers those rows whole,
multiplies and sums them by segment, where gathering both factors per entry pair
read `W` one element at a time. These programs put coordinates on either side of a
full block, with batch ties, masks of selected-away entries and bands, and check
that the product runs by rows and equals `jax.jacfwd`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import graphax_eqx
from graphax_eqx import _indexed

from .helpers import (
    check_eager_jit_sparse,
    tree_allclose,
)


_ORDERS = ("fwd", "rev", "markowitz", "min_fill", "auto")
_RNG = np.random.default_rng(11)
_W = _RNG.normal(size=(384, 16)) / 4.0
_V = _RNG.normal(size=(40, 128)) / 8.0


def _w(x):
    return jnp.asarray(_W, x.dtype)


def _gates(x):
    # `x @ W.T` split into three gates along the last axis, then mixed
    # elementwise: reverse order meets `W` with three diagonals side by side.
    a, b, c = jnp.split(x @ _w(x).T, 3, axis=-1)
    return jnp.tanh(a) * jax.nn.sigmoid(b) + c


def _gates_selected(x):
    # As `_gates`, with a gate selected away where it is negative (a mask).
    a, b, c = jnp.split(x @ _w(x).T, 3, axis=-1)
    return jnp.where(a > 0, a, 0.0) * jnp.sin(b) + c


def _uneven(x):
    # Rows of `W` met by unequal numbers of entries: 0, 1 or 2 per output.
    y = x @ _w(x).T
    pad = [(0, 0)] * (y.ndim - 1) + [(40, 40)]
    return jnp.sin(y[..., :160] + jnp.pad(y[..., 200:280], pad))


def _diff_rows(x):
    # A first difference (a band) of the rows of `W @ x`.
    return jnp.cos(jnp.diff(x @ _w(x).T, axis=-1))


def _mixed_input(x):
    # Coordinates first (two halves of `x` added), then a full block: `V` meets
    # them column by column.
    z = x[..., :128] + 2.0 * x[..., 128:256] - x[..., ::3][..., :128]
    return jnp.sin(z @ jnp.asarray(_V, x.dtype).T)


_T = _RNG.normal(size=(64, 64)) / 8.0


def _token_mixing(x):
    # A shared per-token layer (tied on the tokens), then tokens mixed by copies
    # (tied on the features). Neither tie survives the product: the per-token
    # blocks become a block diagonal, read by runs of 64 columns, and where the
    # layer's value does not vary along the tokens it is first laid out by rows.
    h = jnp.tanh(x @ jnp.asarray(_T, x.dtype).T)
    z = jnp.roll(h, 1, axis=-2) + 2.0 * h[..., ::-1, :]
    return jnp.sin(z)


_PROGRAMS = {
    "gates": (_gates, (16,)),
    "gates_selected": (_gates_selected, (16,)),
    "uneven": (_uneven, (16,)),
    "diff_rows": (_diff_rows, (16,)),
    "mixed_input": (_mixed_input, (400,)),
    "token_mixing": (_token_mixing, (16, 64)),
}


def _input(shape, dtype):
    return jnp.asarray(np.random.default_rng(1).uniform(-1.0, 1.5, shape), dtype)


@pytest.fixture
def rows_products(monkeypatch):
    """How many products ran by rows while tracing."""
    calls = []
    inner = _indexed._rows_product

    def counted(*args, **kwargs):
        calls.append(args[2].rows.side)
        return inner(*args, **kwargs)

    monkeypatch.setattr(_indexed, "_rows_product", counted)
    return calls


@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("batch", ((), (3,)), ids=("1d", "batched"))
@pytest.mark.parametrize("name", sorted(_PROGRAMS))
def test_rows_products_match_jacfwd(name, batch, order):
    fun, shape = _PROGRAMS[name]
    x = _input(batch + shape, jnp.float64)
    check_eager_jit_sparse(fun, x, order, 1e-10)


@pytest.mark.parametrize(
    "name, order, side",
    [
        ("gates", "rev", "b"),
        ("gates_selected", "rev", "b"),
        ("uneven", "rev", "b"),
        ("diff_rows", "rev", "b"),
        ("mixed_input", "fwd", "a"),
        ("mixed_input", "markowitz", "a"),
        ("token_mixing", "fwd", "b"),
        ("token_mixing", "rev", "b"),
    ],
)
@pytest.mark.parametrize("batch", ((), (3,)), ids=("1d", "batched"))
def test_products_run_by_rows(rows_products, name, order, side, batch):
    fun, shape = _PROGRAMS[name]
    x = _input(batch + shape, jnp.float64)
    jac = jax.jit(graphax_eqx.jacve(fun, order=order))(x)
    assert side in rows_products
    assert tree_allclose(jac, jax.jacfwd(fun)(x), rtol=1e-10, atol=1e-10)


def test_reverse_order_reads_whole_rows_of_the_weights(rows_products):
    # `W` (384 × 16) is read by gathers of whole rows of 16 entries, not by 6,144
    # gathers of one entry each; the count of multiplications is that of the entry
    # pairs.
    x = _input((16,), jnp.float32)
    jaxpr = jax.make_jaxpr(graphax_eqx.jacve(_gates, order="rev"))(x)
    gathers = [e for e in jaxpr.eqns if e.primitive is lax.gather_p]
    assert (1, 16) in [e.params["slice_sizes"] for e in gathers]
    for e in gathers:
        if e.params["slice_sizes"] == (1,):
            assert int(np.prod(e.outvars[0].aval.shape)) < 384 * 16
    _, counts = graphax_eqx.jacve(_gates, order="rev", count_ops=True)(x)
    cost = graphax_eqx.elimination_cost(_gates, order="rev")(x)
    assert cost.num_muls == counts["num_muls"]


@pytest.mark.parametrize("order", ("fwd", "rev", "auto"))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_rows_products_low_precision(order, dtype):
    x = _input((3, 16), dtype)
    expected = jax.jacfwd(_gates)(x.astype(jnp.float32))
    out = jax.jit(graphax_eqx.jacve(_gates, order=order))(x)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 5e-2
    assert tree_allclose(out.astype(jnp.float32), expected, rtol=tol, atol=tol)


def test_rows_products_under_vmap_and_nested():
    x = _input((4, 16), jnp.float64)
    per_row = jax.vmap(graphax_eqx.jacve(_gates, order="rev"))(x)
    expected = jax.vmap(jax.jacfwd(_gates))(x)
    assert tree_allclose(per_row, expected, rtol=1e-10, atol=1e-10)
    x1 = x[0]
    hess = graphax_eqx.jacve(graphax_eqx.jacve(_gates, order="rev"), order="rev")(x1)
    assert tree_allclose(hess, jax.jacfwd(jax.jacfwd(_gates))(x1), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("order", ("fwd", "rev"))
def test_block_diagonal_read_by_runs(monkeypatch, order):
    # The per-token blocks of `_token_mixing` are runs of 64 of 1,024 columns; in
    # reverse order the shared layer's value (one 64 × 64 block for all tokens) is
    # laid out by rows first.
    plans = []
    inner = _indexed._rows_product

    def counted(a, b, plan, dtype):
        plans.append(plan.rows)
        return inner(a, b, plan, dtype)

    monkeypatch.setattr(_indexed, "_rows_product", counted)
    x = _input((16, 64), jnp.float64)
    jac = jax.jit(graphax_eqx.jacve(_token_mixing, order=order))(x)
    assert [p.shape for p in plans] == [(1024, 64)]
    assert (plans[0].gather is not None) == (order == "rev")
    assert tree_allclose(jac, jax.jacfwd(_token_mixing)(x), rtol=1e-10, atol=1e-10)
