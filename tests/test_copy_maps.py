"""Copies (slices, splits, pads, gathers, ...) meeting dense blocks.

The partial of a primitive that copies entries is stored by coordinates and is also
the primitive itself as a map. Against a dense neighbour (the rows of a weight
matrix, `split(W @ x, 3)` in a GRU cell) the map is applied: the rows are sliced,
padded or gathered as the primitive does, at no multiplication, where coordinates
would multiply by a matrix of zeros and ones. These programs put every copying
primitive after a dense product (and, for reverse order, before one), in every order,
against `jax.jacfwd`, eagerly and under `jax.jit`, as arrays and as structured blocks.
"""

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from jax import lax

import graphax_eqx

from .helpers import (
    check_eager_jit_sparse,
    reference_jacobians,
    tree_allclose,
)


_ORDERS = ("fwd", "rev", "markowitz", "min_fill", "auto")
_RNG = np.random.default_rng(7)
_W = _RNG.normal(size=(96, 16))
_M = _RNG.normal(size=(5, 128))


def _split3(y):
    a, b, c = jnp.split(y, 3, axis=-1)
    return a * jnp.sin(b) + c


def _pad(y):
    config = [(0, 0)] * (y.ndim - 1) + [(1, 2)]
    return jnp.pad(y, config, constant_values=0.7)


def _dynamic_update(y):
    return lax.dynamic_update_slice_in_dim(y, jnp.cos(y[..., :2]), 20, axis=-1)


def _scatter_set(y):
    # Position 8 is written twice: one update wins, the other has no derivative.
    return y.at[..., np.array([3, 8, 8, 50])].set(jnp.cos(y[..., :4]))


def _reshape(y):
    return jnp.reshape(y, y.shape[:-1] + (8, 12))


def _stack(y):
    return jnp.stack([y[..., :48], y[..., 48:]], axis=0)


_OPS = {
    "split": _split3,
    "slice": lambda y: y[..., 10:70],
    "strided": lambda y: y[..., ::3],
    "rev": lambda y: y[..., ::-1],
    "pad": _pad,
    "concatenate": lambda y: jnp.concatenate([y[..., :40], 2.0 * y[..., 50:]], -1),
    "dynamic_update_slice": _dynamic_update,
    "scatter": _scatter_set,
    "take": lambda y: jnp.take(y, np.array([0, 5, 5, 95, 40]), axis=-1),
    "reshape": _reshape,
    "roll": lambda y: jnp.roll(y, 7, axis=-1),
    "stack": _stack,
}


def _after_dense(op):
    """`op` applied to the rows of a dense product, then a nonlinearity."""

    def fun(x):
        return jnp.tanh(op(x @ jnp.asarray(_W, x.dtype).T))

    return fun


def _between_dense(op):
    """As `_after_dense`, then mixed by a dense matrix (reverse order's cotangent is
    dense where it meets the copy)."""

    def fun(x):
        y = jnp.tanh(op(x @ jnp.asarray(_W, x.dtype).T))
        y = jnp.reshape(y, y.shape[: x.ndim - 1] + (-1,))
        m = jnp.asarray(_M[:, : y.shape[-1]], x.dtype)
        return jnp.sin(y @ m.T)

    return fun


_CASES = [
    pytest.param(wrap(op), shape, id=f"{wname}-{name}-{len(shape)}d")
    for name, op in _OPS.items()
    for wname, wrap in (("after", _after_dense), ("between", _between_dense))
    for shape in ((16,), (3, 16))
    if not (name == "stack" and wname == "between")
]


def _input(shape, dtype):
    return jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.5, shape), dtype)


@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("fun, shape", _CASES)
def test_copies_of_dense_blocks(fun, shape, order):
    x = _input(shape, jnp.float64)
    check_eager_jit_sparse(fun, x, order, 1e-10)


@pytest.mark.parametrize("order", ("fwd", "rev", "auto"))
def test_copies_of_dense_blocks_float32(order):
    fun = _between_dense(_split3)
    x = _input((16,), jnp.float32)
    (expected,) = jtu.tree_leaves(reference_jacobians(fun, (x,), refs=("fwd",)))
    out = jax.jit(graphax_eqx.jacve(fun, order=order))(x)
    assert out.dtype == jnp.float32
    assert tree_allclose(out, expected, rtol=1e-5, atol=1e-5)


def _gru_like(x):
    a, b, c = jnp.split(jnp.asarray(_W, x.dtype) @ x, 3)
    return jnp.sin(a) * b + c


def test_split_rows_cost_nothing():
    # Forward order: the three pieces of `W @ x` are rows of `W`, sliced (no
    # multiplication); `sin(a) * b + c` then scales 32 × 16 blocks: `cos(a)` once,
    # and `sin(a) * b` by each factor's derivative, 3 × 512 in all. Multiplying by
    # zeros and ones would cost 3 × 32 × 96 × 16 = 147,456 more.
    x = _input((16,), jnp.float64)
    jac, counts = graphax_eqx.jacve(_gru_like, order="fwd", count_ops=True)(x)
    assert counts["num_muls"] == 3 * 32 * 16
    assert tree_allclose(jac, jax.jacfwd(_gru_like)(x), rtol=1e-12, atol=1e-12)
    cost = graphax_eqx.elimination_cost(_gru_like, order="fwd")(x)
    assert cost.num_muls == counts["num_muls"]
    # The emitted program multiplies no matrix besides the function's own product.
    jaxpr = jax.make_jaxpr(graphax_eqx.jacve(_gru_like, order="fwd"))(x)
    dots = [e for e in jaxpr.eqns if e.primitive is lax.dot_general_p]
    assert len(dots) == 1


def test_a_copy_keeps_its_ties_against_a_dense_block():
    # `x @ W` on (4, 8) is tied on the 4 tokens. Reshaping the 8 features into
    # (2, 4) moves them only, so the product keeps the tie: 4 × 8 × 8 stored
    # entries, scaled by `cos` in 256 multiplications in forward order. The reshape
    # applied as a map would store the block without its tie (1,024 entries).
    w = jnp.asarray(np.random.default_rng(5).normal(size=(8, 8)))

    def fun(x):
        return jnp.sin(jnp.reshape(x @ w, (4, 2, 4)))

    x = _input((4, 8), jnp.float64)
    jac, counts = graphax_eqx.jacve(fun, order="fwd", count_ops=True)(x)
    assert counts["num_muls"] == 4 * 8 * 8
    assert tree_allclose(jac, jax.jacfwd(fun)(x), rtol=1e-12, atol=1e-12)
    block = graphax_eqx.jacve(fun, order="fwd", sparse_representation=True)(x)
    assert block.nse == 4 * 8 * 8


def _copy_programs():
    y = jnp.asarray(np.random.default_rng(2).normal(size=(6, 8)))
    upd = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3)))
    idx = np.array([[1, 2], [5, 0], [1, 2]])
    return {
        "slice": (lambda a: a[1:5, ::3], (y,)),
        "rev": (lambda a: a[::-1], (y,)),
        "pad": (lambda a: jnp.pad(a, ((1, 2), (0, 3)), constant_values=0.5), (y,)),
        "concatenate": (lambda a, b: jnp.concatenate([a, b], 0), (y, 2 * y)),
        "split": (lambda a: jnp.split(a, [2, 5], axis=1), (y,)),
        "reshape": (lambda a: jnp.reshape(a, (4, 12)), (y,)),
        "take": (lambda a: jnp.take(a, np.array([0, 3, 3, 7]), axis=1), (y,)),
        "dynamic_update_slice": (
            lambda a, b: lax.dynamic_update_slice(a, b, (2, 4)),
            (y, upd),
        ),
        "scatter": (lambda a, b: a.at[idx[:, 0], idx[:, 1]].set(b[0]), (y, upd)),
        "dynamic_slice": (lambda a: lax.dynamic_slice(a, (1, 2), (3, 4)), (y,)),
        "stack": (lambda a, b: jnp.stack([a, b], 1), (y, 2 * y)),
        "tile": (lambda a: jnp.tile(a, (2, 1)), (y,)),
    }


@pytest.mark.parametrize("name", sorted(_copy_programs()))
def test_copy_maps_equal_their_coordinates(name):
    # Each copy's map (and its transpose) applied to random arrays equals the copy
    # applied through its coordinates, with every other float operand (an update, a
    # padding value) nonzero: the map is linear in its operand alone.
    from graphax_eqx._indexed import (
        MappedCooTensor,
        apply_partial,
        apply_partial_t,
        as_map,
        plain_tensor,
    )
    from graphax_eqx._rules._base import rules

    fun, args = _copy_programs()[name]
    closed = jax.make_jaxpr(fun)(*args)
    rng = np.random.default_rng(4)
    checked = 0

    def walk(jaxpr, consts, vals):
        nonlocal checked
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, vals, strict=True))
        for eqn in jaxpr.eqns:
            invals = [v.val if hasattr(v, "val") else env[v] for v in eqn.invars]
            if "jaxpr" in eqn.params and eqn.primitive not in rules:
                inner = eqn.params["jaxpr"]
                outs = walk(inner.jaxpr, inner.consts, invals)
                env.update(zip(eqn.outvars, outs, strict=True))
                continue
            if eqn.primitive not in rules:  # no derivative: comparisons, iota, ...
                outs = eqn.primitive.bind(*invals, **eqn.params)
                outs = outs if eqn.primitive.multiple_results else [outs]
                env.update(zip(eqn.outvars, outs, strict=True))
                continue
            floats = [jnp.issubdtype(jnp.result_type(v), jnp.floating) for v in invals]
            outs, partials = rules[eqn.primitive](invals, floats, **eqn.params)
            env.update(zip(eqn.outvars, outs, strict=True))
            for partial in partials.values():
                if not isinstance(partial, MappedCooTensor):
                    continue
                linear, coords = as_map(partial), plain_tensor(partial)
                t = jnp.asarray(rng.normal(size=partial.in_shape))
                u = jnp.asarray(rng.normal(size=partial.out_shape))
                assert tree_allclose(linear.fn(t), apply_partial(coords, t))
                assert tree_allclose(linear.tfn(u), apply_partial_t(coords, u))
                checked += 1
        return [v.val if hasattr(v, "val") else env[v] for v in jaxpr.outvars]

    walk(closed.jaxpr, closed.consts, args)
    assert checked > 0


@pytest.mark.parametrize("shape", [(), (3,), (2, 3), (2, 1, 3)])
def test_stack_sources_read_in_numpy(shape):
    """Where each output of `stack` and `unstack` comes from, read off in NumPy (one
    JAX call per operand would stack all of them), equals what the primitive itself
    computes on numbered entries."""
    from graphax_eqx import _jax_private as jp
    from graphax_eqx._rules import structural

    n = int(np.prod(shape))
    numbered = np.arange(1, n + 1, dtype=np.int32).reshape(shape)
    for axis in range(len(shape) + 1):
        for count in (1, 3):
            for i in range(count):
                args = [np.zeros(shape, np.int32) for _ in range(count)]
                args[i] = numbered
                want = np.asarray(jnp.stack(args, axis=axis)).reshape(-1) - 1
                (got,) = structural._stack_sources(jp.stack_p, axis, [shape] * count, i)
                np.testing.assert_array_equal(got, want)
    for axis in range(len(shape)):
        wants = jp.bind(jp.unstack_p, dict(axis=axis), numbered)
        gots = structural._stack_sources(jp.unstack_p, axis, [shape], 0)
        assert len(gots) == len(wants)
        for got, want in zip(gots, wants, strict=True):
            np.testing.assert_array_equal(got, np.asarray(want).reshape(-1) - 1)
