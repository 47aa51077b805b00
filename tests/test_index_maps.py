"""Jacobians through primitives that move, gather, scatter or pad indices.

Every case is compared with `jax.jacfwd`, for each elimination order, both as dense
arrays and as structured blocks (through `.dense()`). Further sections cover index
arrays computed inside the function, chained stencil programs, the number of stored
entries of sparse results, composition with JAX transformations, precision, and
several differentiated arguments.
"""

import functools
import math

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from jax import lax

import graphax_eqx

from .helpers import (
    assert_tree_matches,
    check_jacve,
    on_host,
    reference_jacobians,
    repeated_order,
    tree_allclose,
)


_ORDERS = ("fwd", "rev", "markowitz", "auto")
_RTOL = 1e-10
_ATOL = 1e-10  # scaled by the largest magnitude of the reference


# --------------------------------------------------------------------------------------
# Utilities
# --------------------------------------------------------------------------------------


def _is_block(x):
    """A structured Jacobian block, as returned with `sparse_representation=True`."""
    return (
        not isinstance(x, jax.Array)
        and callable(getattr(x, "dense", None))
        and callable(getattr(x, "to_bcoo", None))
    )


def _densify(tree):
    return jtu.tree_map(lambda block: block.dense(), tree, is_leaf=_is_block)


def _uniform(shape, seed=0):
    """Values in [0.5, 1.5]: no zeros, and `sin`, `cos` and `exp` of them are
    nonzero."""
    return jnp.asarray(np.random.default_rng(seed).uniform(0.5, 1.5, shape))


def _inputs(*shapes):
    """An input builder: one float64 array per shape, each from its own seed."""

    def build():
        return tuple(_uniform(shape, seed=k) for k, shape in enumerate(shapes))

    return build


@functools.cache
def _args(build):
    return build()


@functools.cache
def _jacfwd(fun, build, argnums):
    args = _args(build)
    return reference_jacobians(fun, args, argnums=argnums, refs=("fwd",))["fwd"]


def _scale(tree):
    return max(
        [1.0]
        + [
            float(np.max(np.abs(np.asarray(l, np.float64))))
            for l in jtu.tree_leaves(tree)
        ]
    )


def _assert_close(actual, expected, rtol=_RTOL, atol=_ATOL):
    """Equal structure, shapes, dtypes, and values within `rtol` and `atol` (the
    latter relative to the largest reference magnitude)."""
    assert_tree_matches(actual, expected, rtol=rtol, atol=atol)
    assert tree_allclose(actual, expected, rtol=rtol, atol=atol * _scale(expected))


def _assert_blocks(result, expected):
    """`result` holds one structured block per leaf of `expected`, of its shape."""
    blocks, block_def = jtu.tree_flatten(result, is_leaf=_is_block)
    dense, dense_def = jtu.tree_flatten(expected)
    assert block_def == dense_def
    for block, leaf in zip(blocks, dense, strict=True):
        assert _is_block(block), f"not a structured block: {type(block).__name__}"
        assert tuple(block.shape) == leaf.shape


@functools.cache
def _backend_error(fun, build, argnums) -> float:
    """0 on the CPU. Elsewhere, ten times the error of the backend's own
    `jax.jit(jax.jacfwd(fun))` against the CPU reference: XLA on GPUs computes some
    float64 convolutions under `jit` to about float32 precision (`jax.jit(fun)`
    itself differs from the CPU by 1e-7 on an H100, even at "highest" precision), and
    `jacve` can be no more exact than the compiled operations it runs."""
    if jax.default_backend() == "cpu":
        return 0.0
    expected = _jacfwd(fun, build, argnums)
    own = jax.jit(jax.jacfwd(fun, argnums=argnums))(*_args(build))
    err = max(
        float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(e, np.float64))))
        for a, e in zip(jtu.tree_leaves(own), jtu.tree_leaves(expected), strict=True)
    )
    return 10 * err / _scale(expected)


def _check(fun, build, argnums, order, sparse):
    """`jacve` of `fun` at `build()` against `jax.jacfwd`, dense or via `.dense()`."""
    args = _args(build)
    if order == "auto":
        same = repeated_order(
            fun, args, order, ("fwd", "rev", "markowitz"), argnums=argnums
        )
        if same is not None:
            pytest.skip(f"'auto' eliminates in the same order as {same!r} here")
    expected = _jacfwd(fun, build, argnums)
    # The tolerances widen where the backend's own compiled Jacobian is less exact.
    backend = _backend_error(fun, build, argnums)
    rtol, atol = max(_RTOL, backend), max(_ATOL, backend)
    if not sparse:
        check_jacve(
            fun,
            args,
            order,
            argnums=argnums,
            references={"fwd": expected},
            rtol=rtol,
            atol=atol,
        )
        return
    result = graphax_eqx.jacve(
        fun, order=order, argnums=argnums, sparse_representation=True
    )(*args)
    _assert_blocks(result, expected)
    _assert_close(_densify(result), expected, rtol=rtol, atol=atol)


def _case(name, fun, build, argnums=0, marks=()):
    return pytest.param(fun, build, argnums, id=name, marks=marks)


# Which of several updates to one position a scatter writes is the backend's choice,
# and on GPUs it varies between compiled programs: `jax.jacfwd`'s choice there need
# not be `jacve`'s. `test_colliding_scatter_value_and_jacobian_agree` checks what
# holds on every backend (value and Jacobian keep the same update).
_SAME_WRITER_AS_REFERENCE = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="colliding scatter updates: the written one is backend-chosen",
)


def _smooth(op):
    """`op` between two nonlinear elementwise maps, so that Jacobian entries are not
    plain 0/1 and differ from entry to entry. Works on any pytree `op` returns."""

    def fun(x):
        return jtu.tree_map(lambda y: jnp.sin(1.3 * y), op(x * x))

    return fun


def _in_axis(x, axis, index):
    """`x[..., index, ...]` with `index` at `axis`."""
    full = [slice(None)] * x.ndim
    full[axis] = index
    return x[tuple(full)]


# 2-D inputs are (5, 6), 3-D inputs (3, 4, 5).
_X1 = _inputs((9,))
_X2 = _inputs((5, 6))
_X3 = _inputs((3, 4, 5))


def _per_axis(name, op, positions=3):
    """One 3-D case per axis (or per position, for ops that insert an axis)."""
    return [
        _case(f"{name}_ax{axis}_3d", _smooth(functools.partial(op, axis=axis)), _X3)
        for axis in range(positions)
    ]


# --------------------------------------------------------------------------------------
# Single index-moving primitives, with constant index data
# --------------------------------------------------------------------------------------

_IDX = np.array([2, 0, 2, -1, 3, 3])  # repeated and negative entries
_IDX_COL = np.array([5, 1, 1, -2, 0])
_K1 = np.array([0.5, -1.25, 0.75])
_K3 = np.random.default_rng(30).uniform(-1.0, 1.0, (2, 3, 2, 3))


def _stack_shifted(x, axis):
    return jnp.stack([x[1:], 2.0 * x[::-1][1:]], axis=axis)


def _take_along(x, axis):
    rng = np.random.default_rng(axis + 10 * x.ndim)
    shape = list(x.shape)
    shape[axis] += 2
    return jnp.take_along_axis(x, rng.integers(0, x.shape[axis], shape), axis=axis)


def _mask(shape):
    return np.arange(int(np.prod(shape))).reshape(shape) % 3 == 1


def _conv2d(x, k):
    return lax.conv_general_dilated(x[None, None], k, (1, 1), "SAME")


def _conv3d(x, k):
    # Strided, padded and dilated; x acts as (N=1, C=3, H=4, W=5).
    return lax.conv_general_dilated(
        x[None], k, (1, 2), ((1, 0), (0, 1)), rhs_dilation=(2, 1)
    )


# Per-axis variants: axis 0, 1, 2 of a 3-D input get different flavours of the op.
_SLICES = (slice(1, -1), slice(1, None, 2), slice(-1, 0, -2))


def _slice_axis(x, axis):
    return _in_axis(x, axis, _SLICES[axis])


def _reverse_axis(x, axis):
    return lax.rev(x, (axis,)) if axis == 1 else jnp.flip(x, axis=axis)


def _diff_axis(x, axis):
    return jnp.diff(x, n=2 if axis == 1 else 1, axis=axis)


def _cumsum_axis(x, axis):
    return lax.cumsum(x, axis=axis, reverse=axis == 1)


_PRIMITIVE_CASES = [
    # Slices: one axis at a time (the others untouched): interior, strided, reversed
    # with a stride; then all axes at once, and an integer index.
    *_per_axis("slice", _slice_axis),
    _case(
        "lax_slice_3d",
        _smooth(lambda x: lax.slice(x, (0, 1, 1), (3, 4, 5), (2, 2, 3))),
        _X3,
    ),
    _case("slice_integer_3d", _smooth(lambda x: x[:, -1, 1:4]), _X3),
    # Padding, with different widths on the two sides.
    _case(
        "pad_constant_3d",
        _smooth(lambda x: jnp.pad(x, ((1, 2), (0, 1), (2, 0)), constant_values=0.7)),
        _X3,
    ),
    _case(
        "pad_edge_3d",
        _smooth(lambda x: jnp.pad(x, ((0, 0), (2, 1), (0, 0)), "edge")),
        _X3,
    ),
    _case(
        "pad_reflect_2d",
        _smooth(lambda x: jnp.pad(x, ((1, 2), (2, 3)), "reflect")),
        _X2,
    ),
    _case(
        "lax_pad_interior_2d",
        _smooth(lambda x: lax.pad(x, 0.5, ((1, -1, 1), (0, 2, 2)))),
        _X2,
    ),
    # Concatenation, stacking, splitting.
    *_per_axis(
        "concatenate",
        lambda x, axis: jnp.concatenate(
            [_in_axis(x, axis, slice(1, None)), _in_axis(x, axis, slice(None, 2))],
            axis=axis,
        ),
    ),
    *_per_axis("stack", _stack_shifted, positions=4),
    *_per_axis("split", lambda x, axis: jnp.split(x, [2], axis=axis)),
    # Reversal (`jnp.flip`, and `lax.rev` on axis 1) and rolling.
    *_per_axis("reverse", _reverse_axis),
    *_per_axis("roll", lambda x, axis: jnp.roll(x, 1, axis=axis)),
    # A shift beyond the axis size, and a negative one.
    _case("roll_two_axes_2d", _smooth(lambda x: jnp.roll(x, (7, -2), (0, 1))), _X2),
    _case("roll_flat_2d", _smooth(lambda x: jnp.roll(x, 4)), _X2),
    # Reshapes that merge and split axes; squeeze and expand_dims; transposes.
    _case("reshape_flat_2d", _smooth(lambda x: x.reshape(-1)), _X2),
    _case("reshape_merge_3d", _smooth(lambda x: x.reshape(12, 5)), _X3),
    _case("reshape_regroup_3d", _smooth(lambda x: x.reshape(6, 2, 5)), _X3),
    _case("squeeze_3d", _smooth(lambda x: jnp.squeeze(x[1:2, :, 3:4], (0, 2))), _X3),
    _case("expand_dims_3d", _smooth(lambda x: jnp.expand_dims(x, (0, 2, 5))), _X3),
    _case("transpose_2d", _smooth(lambda x: x.T), _X2),
    _case("transpose_3d", _smooth(lambda x: jnp.transpose(x, (1, 2, 0))), _X3),
    # Gathers with constant index arrays.
    *_per_axis(
        "take", lambda x, axis: jnp.take(x, _IDX % x.shape[axis] - 1, axis=axis)
    ),
    _case("getitem_rows_2d", _smooth(lambda x: x[_IDX]), _X2),
    _case("getitem_columns_2d", _smooth(lambda x: x[:, _IDX_COL]), _X2),
    _case(
        "getitem_pairs_2d",
        _smooth(lambda x: x[_IDX, np.array([5, 1, 1, -2, 0, 5])]),
        _X2,
    ),
    _case(
        "getitem_index_matrix_2d",
        _smooth(lambda x: x[np.array([[0, 4], [4, -1]])]),
        _X2,
    ),
    _case("getitem_mixed_3d", _smooth(lambda x: x[_IDX % 3, 1:3, _IDX % 5]), _X3),
    *_per_axis("take_along_axis", _take_along),
    # Dynamic slices and updates with constant starts (some clamped).
    _case(
        "dynamic_slice_clamped_2d",
        _smooth(lambda x: lax.dynamic_slice(x, (4, 5), (2, 3))),
        _X2,
    ),
    _case(
        "dynamic_slice_3d",
        _smooth(lambda x: lax.dynamic_slice(x, (1, 0, 2), (2, 3, 2))),
        _X3,
    ),
    _case(
        "dynamic_update_slice_2d",
        lambda x, u: jnp.sin(lax.dynamic_update_slice(x * x, jnp.exp(u), (1, 2))),
        _inputs((5, 6), (2, 3)),
        (0, 1),
    ),
    _case(
        "dynamic_update_slice_clamped_3d",
        lambda x, u: jnp.sin(lax.dynamic_update_slice(x * x, u * u, (2, 1, -3))),
        _inputs((3, 4, 5), (2, 2, 3)),
        (0, 1),
    ),
    # Starts below -size: wrapped once (to a negative start), then clamped to 0.
    _case(
        "dynamic_update_slice_below_minus_size_3d",
        lambda x, u: jnp.sin(lax.dynamic_update_slice(x * x, u * u, (-5, 1, -7))),
        _inputs((3, 4, 5), (2, 2, 3)),
        (0, 1),
    ),
    _case(
        "dynamic_slice_below_minus_size_2d",
        _smooth(lambda x: lax.dynamic_slice(x, (-9, -8), (2, 3))),
        _X2,
    ),
    # Scatters: add with colliding indices, set with distinct ones.
    _case(
        "scatter_add_rows_2d",
        lambda x, y: jnp.sin((x * x).at[_IDX].add(jnp.exp(y))),
        _inputs((5, 6), (6, 6)),
        (0, 1),
    ),
    _case(
        "scatter_add_3d",
        lambda x, y: jnp.sin((x * x).at[_IDX % 3, :, 2].add(jnp.exp(y))),
        _inputs((3, 4, 5), (6, 4)),
        (0, 1),
    ),
    _case(
        "scatter_add_self_3d",
        lambda x: jnp.sin(x.at[:, np.array([1, 1, 3])].add(x[:, :3] * x[:, 1:4])),
        _X3,
    ),
    _case(
        "scatter_set_2d",
        lambda x, y: jnp.sin((x * x).at[np.array([3, 0, -1])].set(jnp.exp(y))),
        _inputs((5, 6), (3, 6)),
        (0, 1),
    ),
    _case(
        "scatter_set_colliding_2d",
        lambda x, y: jnp.sum(
            jnp.sin((x * x).at[np.array([1, 4, 1, 30])].set(jnp.exp(y))), axis=0
        ),
        _inputs((5, 6), (4, 6)),
        (0, 1),
        _SAME_WRITER_AS_REFERENCE,
    ),
    # Segment sums with constant ids (unsorted with an empty segment; sorted).
    _case(
        "segment_sum_2d",
        _smooth(lambda x: jax.ops.segment_sum(x, np.array([2, 0, 2, 1, 0]), 4)),
        _X2,
    ),
    _case(
        "segment_sum_sorted_3d",
        _smooth(
            lambda x: jax.ops.segment_sum(
                x, np.array([0, 0, 1]), 2, indices_are_sorted=True
            )
        ),
        _X3,
    ),
    # Differences (second differences on axis 1) and cumulative sums (reversed on
    # axis 1).
    *_per_axis("diff", _diff_axis),
    *_per_axis("cumsum", _cumsum_axis),
    # Convolutions, with a closed-over kernel and with the kernel differentiated.
    _case(
        "convolve_rows_2d",
        _smooth(jax.vmap(lambda row: jnp.convolve(row, _K1, mode="same"))),
        _X2,
    ),
    _case("conv_strided_dilated_3d", _smooth(lambda x: _conv3d(x, _K3)), _X3),
    _case(
        "convolve_and_kernel_1d",
        lambda x, k: jnp.sin(jnp.convolve(x * x, k, mode="full")),
        _inputs((9,), (3,)),
        (0, 1),
    ),
    _case(
        "conv_and_kernel_2d",
        lambda x, k: jnp.sin(_conv2d(x * x, k)),
        _inputs((5, 6), (2, 1, 3, 3)),
        (0, 1),
    ),
    _case(
        "conv_kernel_only_3d",
        lambda x, k: jnp.sin(_conv3d(x, k * k)),
        _inputs((3, 4, 5), (2, 3, 2, 3)),
        1,
    ),
    # Several input and output features, grouped, with the input dilated and a
    # channels-last layout, as `eqx.nn.Conv` layers and transposed convolutions use.
    _case(
        "conv_features_grouped_3d",
        lambda x, k: jnp.sin(
            lax.conv_general_dilated(
                x[None],
                k * k,
                (1, 1),
                ((0, 1), (1, 1)),
                lhs_dilation=(1, 2),
                feature_group_count=3,
            )
        ),
        _inputs((3, 4, 5), (6, 1, 2, 3)),
        (0, 1),
    ),
    _case(
        "conv_channels_last_3d",
        _smooth(
            lambda x: lax.conv_general_dilated(
                x[None],
                jnp.asarray(np.random.default_rng(3).normal(size=(3, 2, 5, 4))),
                (2, 1),
                ((1, 1), (0, 2)),
                dimension_numbers=("NHWC", "HWIO", "NCHW"),
            )
        ),
        _X3,
    ),
    # Windowed sums: pooling, strides, padding and both dilations.
    _case(
        "avg_pool_3d",
        _smooth(
            lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2, 2), (1, 2, 1), "VALID")
        ),
        _X3,
    ),
    _case(
        "window_sum_padded_dilated_2d",
        _smooth(
            lambda x: lax.reduce_window(
                x, 0.0, lax.add, (3, 2), (1, 2), ((2, 0), (1, 1)), (1, 2), (2, 1)
            )
        ),
        _X2,
    ),
    _case(
        "window_sum_same_1d",
        _smooth(lambda x: lax.reduce_window(x, 0.0, lax.add, (4,), (1,), "SAME")),
        _X1,
    ),
    # Windowed maxima and minima (max pooling): the window's pattern, one entry taken.
    _case(
        "max_pool_3d",
        _smooth(
            lambda x: lax.reduce_window(
                x, -jnp.inf, lax.max, (1, 2, 2), (1, 2, 1), "VALID"
            )
        ),
        _X3,
    ),
    _case(
        "max_pool_padded_dilated_2d",
        _smooth(
            lambda x: lax.reduce_window(
                x, -jnp.inf, lax.max, (3, 2), (1, 2), ((2, 0), (1, 1)), (1, 2), (2, 1)
            )
        ),
        _X2,
    ),
    _case(
        "min_pool_same_1d",
        _smooth(lambda x: lax.reduce_window(x, jnp.inf, lax.min, (4,), (1,), "SAME")),
        _X1,
    ),
    # Selection with a constant mask.
    _case(
        "where_mask_2d",
        lambda x: jnp.where(_mask((5, 6)), jnp.sin(x), jnp.cos(x) * x),
        _X2,
    ),
    _case("tile_2d", _smooth(lambda x: jnp.tile(x, (2, 1, 3))), _X2),
    _case("diagonal_2d", _smooth(lambda x: jnp.diagonal(x, offset=1)), _X2),
    _case(
        "where_mask_zero_3d",
        _smooth(lambda x: jnp.where(_mask((3, 4, 5)), x, 0.0)),
        _X3,
    ),
]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("fun, build, argnums", _PRIMITIVE_CASES)
def test_primitive(fun, build, argnums, order, sparse):
    _check(fun, build, argnums, order, sparse)


def _window_sum_array_init(x):
    return lax.reduce_window(x, jnp.zeros((), x.dtype), lax.add, (2, 3), (1, 2), "SAME")


def _window_max_array_init(x):
    init = jnp.full((), -jnp.inf, x.dtype)
    return lax.reduce_window(x, init, lax.max, (2, 2), (1, 1), "VALID")


@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("op", [_window_sum_array_init, _window_max_array_init])
def test_generic_reduce_window(op, order):
    # An initial value that is an array, not a Python number, is traced as the
    # generic `reduce_window`. Neither `jax.jacfwd` nor `jax.jacrev` differentiates
    # it under `jit`; eagerly JAX reads the initial value and takes the windowed sum
    # or maximum instead, which is the reference here, and so does `jacve` (see
    # `test_generic_reductions_with_array_initial_values` for ties).
    fun = _smooth(op)
    (x,) = _args(_X2)
    expected = jax.jacfwd(fun)(on_host(x))
    for transform in (lambda f: f, jax.jit):
        dense_jac = transform(graphax_eqx.jacve(fun, order=order))(x)
        structured = graphax_eqx.jacve(fun, order=order, sparse_representation=True)
        structured = transform(structured)
        np.testing.assert_allclose(dense_jac, expected, rtol=_RTOL, atol=_ATOL)
        np.testing.assert_allclose(
            structured(x).dense(), expected, rtol=_RTOL, atol=_ATOL
        )


# --------------------------------------------------------------------------------------
# Index arrays computed inside the function
# --------------------------------------------------------------------------------------

_XY = _inputs((5, 6), (5, 6))


def _sorted_rows(x, y):
    return jnp.sin(x[jnp.argsort(y[:, 0])] * y)


def _own_sort(x):
    # The permutation comes from the differentiated argument itself.
    return jnp.sin(x[jnp.argsort(x[:, 1])]) * x


def _sorted_rows_both(x, y):
    return x[jnp.argsort(y[:, 0])] * jnp.cos(y)


def _traced_dynamic_slice(x, y):
    start = (jnp.argmax(y[:, 0]), jnp.argmin(y[0]))
    return jnp.sin(lax.dynamic_slice(x * x, start, (2, 3)))


def _traced_dynamic_update(x, u, y):
    start = (jnp.argmin(y[:, 2]), jnp.argmax(y[1]))
    return jnp.sin(lax.dynamic_update_slice(x * x, jnp.exp(u), start))


def _traced_negative_update(x, u, y):
    # Negative starts, some below -size: wrapped once, then clamped.
    start = (jnp.argmin(y[:, 2]) - 8, jnp.argmax(y[1]) - 9)
    return jnp.sin(lax.dynamic_update_slice(x * x, jnp.exp(u), start))


def _traced_scatter_add(x, u, y):
    # Three targets for five rows: colliding indices.
    return jnp.sin((x * x).at[jnp.argsort(y[:, 0]) % 3].add(jnp.exp(u)))


def _traced_scatter_set(x, u, y):
    # Three targets for five rows: some updates are overwritten.
    return jnp.sin((x * x).at[jnp.argsort(y[:, 0]) % 3].set(jnp.exp(u)))


def _traced_gather_scatter(x, y):
    idx = jnp.argsort(y[:, 3])
    gathered = jnp.sin(x[idx % 4]) * x[(idx + 1) % 5]
    return jnp.zeros((3, 6), x.dtype).at[idx % 3].add(gathered)


_TRACED_CASES = [
    _case("argsort_other", _sorted_rows, _XY),
    _case("argsort_self", _own_sort, _X2),
    _case("argsort_both_args", _sorted_rows_both, _XY, (0, 1)),
    _case("sort", lambda x: jnp.sin(jnp.sort(x * x, axis=1)), _X2),
    _case(
        "take_along_argsort",
        lambda x, y: jnp.sin(jnp.take_along_axis(x * x, jnp.argsort(y, axis=0), 0)),
        _XY,
    ),
    _case(
        "columns_argmax",
        lambda x, y: jnp.sin(x[:, jnp.argmax(y, axis=1)] * x[:, :5]),
        _XY,
    ),
    _case("dynamic_slice", _traced_dynamic_slice, _XY),
    _case(
        "dynamic_update_slice",
        _traced_dynamic_update,
        _inputs((5, 6), (2, 3), (5, 6)),
        (0, 1),
    ),
    _case(
        "dynamic_update_slice_negative",
        _traced_negative_update,
        _inputs((5, 6), (2, 3), (5, 6)),
        (0, 1),
    ),
    _case("scatter_add", _traced_scatter_add, _inputs((5, 6), (5, 6), (5, 6)), (0, 1)),
    _case(
        "scatter_set",
        _traced_scatter_set,
        _inputs((5, 6), (5, 6), (5, 6)),
        (0, 1),
        _SAME_WRITER_AS_REFERENCE,
    ),
    _case(
        "segment_sum",
        lambda x, y: jnp.sin(
            jax.ops.segment_sum(x * x, jnp.argsort(y[:, 0]) % 3, num_segments=3)
        ),
        _XY,
    ),
    _case(
        "roll_shift",
        lambda x, y: jnp.sin(jnp.roll(x * x, jnp.argmax(y[0]), axis=1)),
        _XY,
    ),
    _case("where_mask", lambda x, y: jnp.where(y > 1.0, jnp.sin(x), x * x), _XY),
    _case("gather_scatter", _traced_gather_scatter, _XY),
]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("fun, build, argnums", _TRACED_CASES)
def test_traced_indices(fun, build, argnums, order, sparse):
    _check(fun, build, argnums, order, sparse)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("fun, build, argnums", _TRACED_CASES)
def test_traced_indices_jit(fun, build, argnums, sparse):
    jac = jax.jit(graphax_eqx.jacve(fun, argnums=argnums, sparse_representation=sparse))
    result = jac(*_args(build))
    expected = _jacfwd(fun, build, argnums)
    if sparse:
        _assert_blocks(result, expected)
        result = _densify(result)
    _assert_close(result, expected)


def _first_written_ids(params, indices, out_shape, upd_shape):
    # A backend on which the first of colliding updates is written, not the last.
    n = math.prod(upd_shape)
    ids = lax.iota(np.int32, n).reshape(upd_shape) + 1
    start = jnp.full(out_shape, n + 1, np.int32)
    won = lax.scatter_min(
        start,
        indices,
        ids,
        params["dimension_numbers"],
        indices_are_sorted=params["indices_are_sorted"],
        mode=params["mode"],
    )
    return jnp.where(won == n + 1, 0, won)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("traced", [False, True], ids=["static", "traced"])
@pytest.mark.parametrize("order", _ORDERS)
def test_colliding_scatter_value_and_jacobian_agree(
    order, traced, sparse, jit, monkeypatch
):
    # Which colliding update a scatter writes is the backend's choice (GPUs vary
    # between programs). The value must come from the update the Jacobian keeps.
    from graphax_eqx._rules import structural

    monkeypatch.setattr(structural, "_written_ids", _first_written_ids)
    rows = [3, 0, 3, 1, 0, 7]  # 7 is out of bounds: dropped

    def f(x, u, idx):
        return jnp.cos(x).at[idx].set(jnp.sin(u) * u)

    def first_wins(x, u):
        # Rows 0, 2 and 3 of `u` are written first at 3, 0 and 1.
        written = (jnp.sin(u) * u)[jnp.array([0, 1, 3])]
        return jnp.cos(x).at[jnp.array([3, 0, 1])].set(written)

    x = jnp.linspace(0.1, 0.9, 5)
    u = jnp.array([-0.0, 2.0, 3.0, 5.0, 7.0, 11.0])
    if traced:
        fun = functools.partial(f, idx=jnp.array(rows))
    else:
        fun = lambda x, u: f(x, u, np.array(rows))  # noqa: E731
    vj = graphax_eqx.value_and_jacve(
        fun, order=order, argnums=(0, 1), sparse_representation=sparse
    )
    if jit:
        vj = jax.jit(vj)
    value, jac = vj(x, u)
    if sparse:
        jac = _densify(jac)
    expected = first_wins(x, u)
    np.testing.assert_array_equal(value, expected)
    np.testing.assert_array_equal(np.signbit(value), np.signbit(expected))
    _assert_close(jac, jax.jacfwd(first_wins, argnums=(0, 1))(x, u))


# --------------------------------------------------------------------------------------
# Chained programs
# --------------------------------------------------------------------------------------


def _stencil(u):
    return u[2:] - 2.0 * u[1:-1] + u[:-2] + jnp.sin(u[1:-1]) ** 3


def _laplacian(u):
    # Periodic 5-point Laplacian of each channel of a (C, H, W) state.
    lap = (
        jnp.roll(u, 1, axis=1)
        + jnp.roll(u, -1, axis=1)
        + jnp.roll(u, 1, axis=2)
        + jnp.roll(u, -1, axis=2)
        - 4.0 * u
    )
    return lap + u**2


def _bratu(u):
    # Zero Dirichlet boundary through padding.
    p = jnp.pad(u, 1)
    lap = p[2:, 1:-1] + p[:-2, 1:-1] + p[1:-1, 2:] + p[1:-1, :-2] - 4.0 * u
    return lap + 0.5 * jnp.exp(u)


def _flux(x):
    # A batch of states (B, 6) mapped row by row to fluxes (B, 4).
    return jnp.stack(
        [
            x[:, 0] * x[:, 1],
            x[:, 1] - x[:, 2] ** 2,
            jnp.sin(x[:, 3]) * x[:, 4],
            x[:, 5] * x[:, 0],
        ],
        axis=1,
    )


_GATHER_A = np.array([0, 2, 2, 4, 1, 4, 6])
_GATHER_B = np.array([3, 3, 5, 0, 6, 1, 2])
_SCATTER = np.array([0, 1, 1, 3, 0, 2, 3])


def _gather_scatter(x):
    # Gathers with repeated indices feeding a scatter-add with collisions.
    gathered = jnp.sin(x[_GATHER_A]) * x[_GATHER_B]
    return jnp.zeros(4, x.dtype).at[_SCATTER].add(gathered) + x[3:]


def _heat(u):
    # Three explicit steps of periodic heat flow with a small reaction term.
    for _ in range(3):
        u = u + 0.1 * (jnp.roll(u, 1) + jnp.roll(u, -1) - 2.0 * u) + 0.05 * jnp.sin(u)
    return u


_STENCIL = _case("stencil", _stencil, _inputs((9,)))
_LAPLACIAN = _case("laplacian", _laplacian, _inputs((2, 6, 7)))
_BRATU = _case("bratu", _bratu, _inputs((6, 7)))
_FLUX = _case("flux", _flux, _inputs((4, 6)))
_GATHER_SCATTER = _case("gather_scatter", _gather_scatter, _inputs((7,)))
_HEAT = _case("heat", _heat, _inputs((9,)))

_CHAIN_CASES = [_STENCIL, _LAPLACIAN, _BRATU, _FLUX, _GATHER_SCATTER, _HEAT]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("fun, build, argnums", _CHAIN_CASES)
def test_chain(fun, build, argnums, order, sparse):
    _check(fun, build, argnums, order, sparse)


# --------------------------------------------------------------------------------------
# Stored entries of sparse results
# --------------------------------------------------------------------------------------

# These programs have no accidental zeros for inputs in [0.5, 1.5]: every entry that
# can be nonzero by structure is nonzero in value, so `jax.jacfwd`'s count of nonzero
# entries is the structural count.
_POOL = _case(
    "pool_twice",
    _smooth(
        lambda x: lax.reduce_window(
            jnp.cos(lax.reduce_window(x, 0.0, lax.add, (2, 2), (1, 1), "SAME")),
            0.0,
            lax.add,
            (2, 3),
            (2, 1),
            "VALID",
        )
    ),
    _X2,
)
# `jnp.diagonal` picks a formula by platform (`lax.platform_dependent`); `jnp.tile`
# is a primitive of its own.
_DIAGONAL_TILED = _case(
    "diagonal_tiled",
    _smooth(lambda x: jnp.tile(jnp.diagonal(x[:, :5]), (2, 3)) * x[:2, :1]),
    _X2,
)
_NO_ACCIDENTAL_ZEROS = [
    _STENCIL,
    _LAPLACIAN,
    _BRATU,
    _FLUX,
    _HEAT,
    _POOL,
    _DIAGONAL_TILED,
]


@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("fun, build, argnums", _NO_ACCIDENTAL_ZEROS)
def test_structural_nonzero_count(fun, build, argnums, order):
    expected = _jacfwd(fun, build, argnums)
    jac = graphax_eqx.jacve(fun, order=order, sparse_representation=True)(*_args(build))
    bcoo = jac.to_bcoo()
    assert tuple(bcoo.shape) == expected.shape
    _assert_close(bcoo.todense(), expected)
    # Asserts the structural nonzero count: the BCOO stores exactly the entries that
    # can be nonzero, neither dense storage nor explicit zeros nor duplicates.
    assert bcoo.nse == np.count_nonzero(np.asarray(expected))


def _interior_steps(u):
    # Three explicit steps on the interior of a fixed-boundary rod: a band of seven
    # diagonals on 30 points, dense enough that some products of its coordinate
    # partials run densely.
    for _ in range(3):
        inner = u[1:-1] + 0.1 * (u[2:] - 2.0 * u[1:-1] + u[:-2])
        u = u.at[1:-1].set(inner + 0.01 * jnp.sin(u[1:-1]))
    return u[1:-1] * u[:-2]


@pytest.mark.parametrize(
    "order", ["fwd", "rev", "markowitz", "relative_markowitz", "min_fill", "auto"]
)
def test_products_run_densely_keep_their_structural_entries(order):
    # A product whose dense form is cheaper than its entry pairs runs densely; its
    # result used to keep every entry of the dense free part (nse 840 here, for
    # Markowitz and the fill-in orders). Small results are read back onto their
    # structural coordinates, and the count stays what the simulator predicts.
    build = _inputs((30,))
    expected = _jacfwd(_interior_steps, build, 0)
    jacobian = jax.jit(
        graphax_eqx.jacve(
            _interior_steps, order=order, sparse_representation=True, count_ops=True
        )
    )
    jac, counts = jacobian(*build())
    bcoo = jac.to_bcoo()
    _assert_close(bcoo.todense(), expected)
    assert bcoo.nse == np.count_nonzero(np.asarray(expected))
    cost = graphax_eqx.elimination_cost(_interior_steps, order=order)(*build())
    assert int(counts["num_muls"]) == cost.num_muls
    dense = graphax_eqx.jacve(_interior_steps, order=order)(*build())
    _assert_close(dense, expected)


# --------------------------------------------------------------------------------------
# Composition with JAX transformations
# --------------------------------------------------------------------------------------

_TAKE_ALONG_2D = _case(
    "take_along_axis_2d", _smooth(functools.partial(_take_along, axis=1)), _X2
)


@pytest.mark.parametrize("order", ["rev", "auto"])
@pytest.mark.parametrize("fun, build, argnums", [*_CHAIN_CASES, _TAKE_ALONG_2D])
def test_jit_sparse(fun, build, argnums, order):
    jac = jax.jit(graphax_eqx.jacve(fun, order=order, sparse_representation=True))
    result = jac(*_args(build))
    expected = _jacfwd(fun, build, argnums)
    _assert_blocks(result, expected)
    _assert_close(result.dense(), expected)


@pytest.mark.parametrize(
    "fun, build, argnums, order",
    [
        pytest.param(*_STENCIL.values, "rev", id="stencil-rev"),
        pytest.param(*_FLUX.values, "auto", id="flux-auto"),
        pytest.param(
            *_TAKE_ALONG_2D.values, "markowitz", id="take_along_axis_2d-markowitz"
        ),
    ],
)
def test_vmap(fun, build, argnums, order):
    (x,) = _args(build)
    xs = jnp.stack([x, 1.2 * x - 0.1, 1.4 - 0.5 * x])
    result = jax.vmap(graphax_eqx.jacve(fun, order=order))(xs)
    expected = jax.jit(jax.vmap(jax.jacfwd(fun)))(xs)
    _assert_close(result, expected)


def _state_flux(s):
    # A per-example function reading a small state vector by index, with repeated
    # and out-of-order reads, its outputs stacked.
    rho, u, p = s[0], s[1], s[2]
    energy = p / 0.4 + 0.5 * rho * u * u
    return jnp.stack([rho * u, rho * u * u + p, u * (energy + p), s[2] * s[0] - s[1]])


def _state_steps(x):
    for _ in range(3):
        dx = jnp.stack([x[1] - x[0], x[0] * (2.0 - x[2]) - x[1], x[0] * x[1] - x[2]])
        x = x + 0.1 * dx
    return x


@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("fun, width", [(_state_flux, 3), (_state_steps, 3)])
def test_vmap_of_state_vector_functions(fun, width, order):
    # Few-entry coordinate lists are combined by slices: checked under `vmap`, in
    # `jit`, against `jax.jacfwd` and `jax.jacrev`.
    xs = _uniform((5, width), seed=11)
    expected = jax.vmap(jax.jacfwd(fun))(xs)
    _assert_close(jax.vmap(jax.jacrev(fun))(xs), expected)
    for call in (jax.vmap, lambda f: jax.jit(jax.vmap(f))):
        _assert_close(call(graphax_eqx.jacve(fun, order=order))(xs), expected)
    # Batched along a later axis, and with a sparse result.
    sparse = jax.vmap(
        graphax_eqx.jacve(fun, order=order, sparse_representation=True),
        in_axes=1,
    )(xs.T)
    _assert_close(sparse.dense(), expected)


@pytest.mark.parametrize("n", [1, 2, 7, 40])
def test_short_takes_match_gathers(n):
    from graphax_eqx import _indexed

    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.standard_normal((3, 6, 5)))
    for idx in (
        np.zeros(0, np.int64),
        np.arange(min(n, 6)),
        rng.integers(0, 6, n),
        np.sort(rng.integers(0, 6, n))[::-1].copy(),
    ):
        for axis in (0, 1, 2):
            idx_axis = idx % x.shape[axis]
            got = _indexed._take_axis(x, idx_axis, axis)
            np.testing.assert_array_equal(got, jnp.take(x, idx_axis, axis=axis))


@pytest.mark.parametrize(
    "inner, outer",
    [("fwd", "rev"), ("markowitz", "auto")],
)
def test_second_derivative(inner, outer):
    u = _uniform((6,), seed=3)
    second = graphax_eqx.jacve(graphax_eqx.jacve(_stencil, order=inner), order=outer)
    result = second(u)
    assert result.shape == (4, 6, 6)
    _assert_close(result, jax.jacfwd(jax.jacfwd(_stencil))(u))


_DTYPE_CASES = [
    _STENCIL,
    _case(
        "scatter_add_rows_2d",
        lambda x, y: jnp.sin((x * x).at[_IDX].add(jnp.exp(y))),
        _inputs((5, 6), (6, 6)),
        (0, 1),
    ),
]

# (rtol, atol), atol relative to the largest reference magnitude.
_DTYPE_TOLERANCES = {
    "float64": (1e-10, 1e-10),
    "float32": (1e-5, 1e-5),
    "bfloat16": (6e-2, 6e-2),
}


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("fun, build, argnums", _DTYPE_CASES)
def test_dtype(fun, build, argnums, dtype, sparse):
    args = tuple(a.astype(dtype) for a in _args(build))
    result = graphax_eqx.jacve(fun, argnums=argnums, sparse_representation=sparse)(
        *args
    )
    if sparse:
        result = _densify(result)
    assert all(leaf.dtype == jnp.dtype(dtype) for leaf in jtu.tree_leaves(result))
    # bfloat16 is compared in float32, against a float32 reference at the same
    # (rounded) inputs.
    compare = jnp.float64 if dtype == "float64" else jnp.float32
    ref_args = tuple(a.astype(compare) for a in args)
    expected = jax.jacfwd(fun, argnums=argnums)(*ref_args)
    result = jtu.tree_map(lambda a: a.astype(compare), result)
    rtol, atol = _DTYPE_TOLERANCES[dtype]
    _assert_close(result, expected, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------------------
# Several differentiated arguments and outputs
# --------------------------------------------------------------------------------------


_PAIR_TAKE = np.argsort(np.arange(36).reshape(6, 6) % 5, axis=1)


def _pair_scatter(x, y):
    # x: (5, 6), y: (6, 6)
    gathered = jnp.take_along_axis(y * y, _PAIR_TAKE, axis=1)
    return (
        jnp.sin((x * x).at[_IDX % 5].add(gathered)),
        jnp.stack([x[0], y[-1], jnp.roll(x[2], 2) * y[3]]),
    )


def _pair_3d(x, y):
    # x: (3, 4, 5), y: (4, 3)
    moved = jnp.transpose(x, (1, 0, 2))[:, :, 1:4]
    return {
        "product": jnp.sin(moved * jnp.expand_dims(jnp.roll(y, 1, axis=0), -1)),
        "sum": jnp.cumsum(x[1], axis=0)[::2, :3] + jnp.flip(y.T, 1)[1:, 1:],
    }


def _pair_update(x, y):
    # x: (5, 6), y: (2, 3): y lands in x, and a slice of x scales y.
    updated = lax.dynamic_update_slice(x, jnp.sin(y), (2, 1))
    return updated[::2] ** 2, y * lax.dynamic_slice(x, (3, 3), (2, 3))


_PAIR_CASES = [
    _case("scatter_gather", _pair_scatter, _inputs((5, 6), (6, 6)), (0, 1)),
    _case("transpose_roll_3d", _pair_3d, _inputs((3, 4, 5), (4, 3)), (0, 1)),
    _case("dynamic_update_reversed", _pair_update, _inputs((5, 6), (2, 3)), (1, 0)),
]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("fun, build, argnums", _PAIR_CASES)
def test_several_arguments(fun, build, argnums, order, sparse):
    _check(fun, build, argnums, order, sparse)


# --------------------------------------------------------------------------------------
# Structurally zero products
# --------------------------------------------------------------------------------------


def _sin_cos_halves(x):
    # The slice after the concatenate reads only the `sin` half: the `cos` half's
    # placement times that slice has no entries.
    y = jnp.concatenate([jnp.sin(x[:2]), jnp.cos(x[2:])])
    return y[:2] * 3.0


def test_disjoint_index_maps_leave_no_edge():
    from graphax_eqx._eliminate import eliminate_vertex, sim_add, sim_product
    from graphax_eqx._simulator import Simulator

    x = jnp.arange(1.0, 5.0)
    graph = graphax_eqx.make_graph(_sin_cos_halves)(x)
    by_primitive = {v.primitive: v.id for v in graph.vertices}
    concat, sin, cos = (by_primitive[p] for p in ("concatenate", "sin", "cos"))
    (head,) = graph._sim.succ[concat]  # the slice after the concatenate

    # The pattern simulator and the shared elimination loop agree: eliminating the
    # concatenate links `sin` to the slice and leaves `cos` without a successor.
    sim = Simulator(graph._sim, graph.intermediates)
    state = sim.start()
    sim.eliminate(state, sim.index[concat])
    assert set(state.succ[sim.index[sin]]) == {sim.index[head]}
    assert state.succ[sim.index[cos]] == {}
    edges = graph._sim.copy_with(lambda e: e)
    eliminate_vertex(edges, concat, sim_product, sim_add)
    assert set(edges.succ[sin]) == {head}
    assert edges.succ[cos] == {}

    # Every order still gives jacfwd's Jacobian, with the counts the simulator says.
    expected = jax.jacfwd(_sin_cos_halves)(x)
    for order in ("fwd", "rev", "markowitz", "min_fill"):
        jac, counts = graphax_eqx.jacve(_sin_cos_halves, order=order, count_ops=True)(x)
        np.testing.assert_allclose(jac, expected, rtol=1e-6)
        cost = graphax_eqx.elimination_cost(_sin_cos_halves, order=order)(x)
        assert counts["num_muls"] == cost.num_muls
        assert counts["num_adds"] == cost.num_adds


# --------------------------------------------------------------------------------------
# Sums of sums gather their terms once
# --------------------------------------------------------------------------------------


def _periodic_laplacian(x):
    # Reverse mode adds the five stencil terms of each species one at a time, each
    # sum gathering the previous one: the chains `sums_as_gathers` flattens.
    u, v = x[0], x[1]
    lap = (
        jnp.roll(u, 1, 0)
        + jnp.roll(u, -1, 0)
        + jnp.roll(u, 1, 1)
        + jnp.roll(u, -1, 1)
        - 4.0 * u
    )
    pad = jnp.pad(v[1:-1, 1:-1], 1)  # entries absent from the other terms
    return jnp.stack([0.3 * lap - u * v**2, 0.2 * lap + jnp.sin(pad) * u])


def _gather_depth(closed_jaxpr) -> int:
    """The longest chain of `gather`s feeding each other in the live program."""
    producer = {v: e for e in closed_jaxpr.jaxpr.eqns for v in e.outvars}
    memo = {}

    def depth(v):
        e = producer.get(v) if isinstance(v, jex_core.Var) else None
        if e is None:
            return 0
        if id(e) not in memo:
            inner = max((depth(i) for i in e.invars), default=0)
            memo[id(e)] = inner + (e.primitive.name == "gather")
        return memo[id(e)]

    return max(depth(v) for v in closed_jaxpr.jaxpr.outvars)


@pytest.mark.parametrize("max_terms", [0, 2, 8])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("order", ("fwd", "rev", "markowitz", "min_fill"))
def test_chained_sums(order, sparse, max_terms, monkeypatch):
    from graphax_eqx import _indexed

    # Every sum qualifies at this size; `max_terms` 0 turns flattening off and 2
    # makes most chains overflow into plain gathers.
    monkeypatch.setattr(_indexed, "MIN_FLAT_NNZ", 0)
    monkeypatch.setattr(_indexed, "MAX_SUM_TERMS", max_terms)
    x = _uniform((2, 6, 7))
    expected = jax.jacfwd(_periodic_laplacian)(x)
    jac = graphax_eqx.jacve(
        _periodic_laplacian, order=order, sparse_representation=sparse
    )(x)
    _assert_close(jac.dense() if sparse else jac, expected)
    # Nothing is kept once the elimination is done.
    assert not _indexed._SUMS.terms


def test_chained_sums_are_flattened(monkeypatch):
    from graphax_eqx import _indexed

    monkeypatch.setattr(_indexed, "MIN_FLAT_NNZ", 0)
    x = _uniform((2, 6, 7))
    depth = {}
    for max_terms in (0, 8):
        monkeypatch.setattr(_indexed, "MAX_SUM_TERMS", max_terms)
        fn = graphax_eqx.jacve(
            _periodic_laplacian, order="rev", sparse_representation=True
        )
        depth[max_terms] = _gather_depth(jax.make_jaxpr(fn)(x))
    # Reverse mode chains one gather per added term without flattening.
    assert depth[8] < depth[0] - 2, depth


def test_chained_sums_nested_and_under_jit():
    from graphax_eqx import _indexed

    x = _uniform((2, 6, 7))

    def total(y):
        return jnp.sum(_periodic_laplacian(y) ** 2)

    hess = jax.jit(graphax_eqx.jacve(graphax_eqx.jacve(total, order="rev")))(x)
    _assert_close(hess, jax.hessian(total)(x))
    assert not _indexed._SUMS.terms


# --------------------------------------------------------------------------------------
# Gathers through untied broadcasts
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_untie_gathers_from_the_value_not_its_broadcast(seed):
    from graphax_eqx import _indexed

    rng = np.random.default_rng(seed)
    # Output (3, 5, 4, 6) ← input (5, 7, 4): axes 1 and 2 of the output tied to axes
    # 0 and 2 of the input, a few random entries over the free axes (3, 6) ← (7,).
    out_shape, in_shape = (3, 5, 4, 6), (5, 7, 4)
    ties = ((1, 0), (2, 2))
    varying = tuple(bool(v) for v in rng.integers(0, 2, size=2))
    keys = rng.choice(3 * 6 * 7, size=9, replace=False)
    p = _indexed.CooPattern(out_shape, in_shape, ties, varying, keys // 7, keys % 7)
    count = rng.integers(1, 3)
    which = frozenset(int(t) for t in rng.choice(2, size=count, replace=False))
    untied, untie = _indexed._untie(p, which)
    assert len(untied.ties) == 2 - len(which)
    val = jnp.asarray(rng.standard_normal(p.val_shape))
    compact = untie.compact(val)
    # The untied pattern's whole value, read through the indices, is the same
    # Jacobian as the tied one.
    full = compact[..., untie.index(np.arange(untied.nnz))]
    assert full.shape == untied.val_shape
    np.testing.assert_array_equal(
        _indexed.CooTensor(full, untied, val.dtype).dense(),
        _indexed.CooTensor(val, p, val.dtype).dense(),
    )
    # Without a broadcast along the untied ties the value does not vary along.
    assert (
        compact.size
        * math.prod(k for k, v in zip(untie.ks, untie.kept, strict=True) if not v)
        == full.size
    )
    # Repeated entries, and the one-past-the-end zero.
    idx = np.append(rng.integers(0, untied.nnz, size=40), untied.nnz)
    expected = jnp.concatenate([full, jnp.zeros(full.shape[:-1] + (1,))], -1)[..., idx]
    padded = jnp.concatenate([compact, jnp.zeros(compact.shape[:-1] + (1,))], -1)
    np.testing.assert_array_equal(padded[..., untie.index(idx)], expected)


# Colliding pairs added up by gathers
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "counts",
    [
        [1, 1, 1],
        [2],
        [1, 3, 1, 2],
        [8] * 5 + [1] * 40 + [5, 3],  # a mesh: diagonal blocks sum many edges
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 33, 64, 1, 1],  # every count group
        [1000, 2, 2, 1],  # skewed: one entry takes most pairs
    ],
)
@pytest.mark.parametrize("lead", [(), (3,), (2, 4)])
def test_segment_sums_by_gathers(counts, lead):
    from graphax_eqx import _indexed

    counts = np.asarray(counts)
    seg = np.repeat(np.arange(len(counts)), counts)
    plan = _indexed.segment_sum_plan(seg, len(counts))
    # No group pads its rows to more than twice the pairs they hold.
    for rest in plan.rest:
        held = np.count_nonzero(rest < len(seg))
        assert rest.size <= 2 * held
    rng = np.random.default_rng(len(seg) + len(lead))
    x = rng.standard_normal(lead + (len(seg),))
    expected = np.zeros(lead + (len(counts),))
    np.add.at(np.moveaxis(expected, -1, 0), seg, np.moveaxis(x, -1, 0))
    got = _indexed._segment_sum_last(jnp.asarray(x), plan)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    live = jnp.asarray(rng.integers(0, 2, size=lead + (len(seg),)), jnp.int32)
    expected_live = np.zeros(lead + (len(counts),), np.int64)
    np.add.at(
        np.moveaxis(expected_live, -1, 0), seg, np.moveaxis(np.asarray(live), -1, 0)
    )
    np.testing.assert_array_equal(_indexed._segment_sum_last(live, plan), expected_live)


def test_colliding_products_run_without_scatters():
    # A spring network: each node's diagonal block sums its edges. The Jacobian's
    # pairs collide on the diagonal, and are added up by gathers.
    senders = np.array([0, 1, 2, 3, 0, 1])
    receivers = np.array([1, 2, 3, 0, 2, 3])

    def forces(x):
        d = x[receivers] - x[senders]
        f = d * jnp.sqrt(jnp.sum(d * d, axis=-1, keepdims=True))
        return jax.ops.segment_sum(f, senders, 4) - jax.ops.segment_sum(f, receivers, 4)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 2)))
    for order in ("fwd", "rev", "markowitz"):
        jac = graphax_eqx.jacve(forces, order=order, sparse_representation=True)
        np.testing.assert_allclose(
            jac(x).todense(), jax.jacfwd(forces)(x), rtol=1e-12, atol=1e-12
        )
        text = jax.jit(jac).lower(x).as_text()
        assert "scatter" not in text, order


def _producers(jaxpr) -> dict:
    return {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}


@pytest.mark.parametrize("order", ["markowitz", "min_fill"])
def test_values_read_twice_by_a_product_are_written_apart(order):
    # Cross-country orders on a spring network multiply the coordinates of the
    # gathers (x[i], x[j]) by those of the sums into the nodes: every edge's partial
    # is read once per end. Fused into that gather, XLA CPU recomputed the partial
    # (itself gathered) for every read: min fill ran 2.1 ms on the sparse suite's
    # 10,000 nodes, against 1.0 ms written apart.
    from benchmarks.sparse_tasks import build_spring_network

    forces = build_spring_network(5)
    x = jnp.asarray(
        1.05 * np.stack(np.meshgrid(np.arange(5.0), np.arange(5.0)), -1).reshape(-1, 2)
        + 0.1 * np.random.default_rng(1).standard_normal((25, 2)),
        jnp.float32,
    )
    jac = graphax_eqx.jacve(forces, order=order, sparse_representation=True)
    closed = jax.make_jaxpr(lambda x: jac(x).val)(x)
    consts = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    producers = _producers(closed.jaxpr)
    repeated = 0
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name != "gather":
            continue
        operand, indices = eqn.invars
        index = consts.get(indices)
        if index is None or operand not in producers:
            continue  # inputs, and gathers of the function itself
        index = np.asarray(index).ravel()
        if len(np.unique(index)) == len(index):
            continue
        source = producers[operand].primitive.name
        if source in ("concatenate", "broadcast_in_dim", "reshape"):
            continue  # a zero appended to select, or a layout of what was written
        repeated += 1
        assert source == "write_apart", (source, eqn)
    assert repeated > 0
    np.testing.assert_allclose(
        jax.jit(jac)(x).todense(), jax.jacfwd(forces)(x), rtol=2e-5, atol=2e-5
    )


def test_untie_index_of_an_empty_pattern():
    from graphax_eqx import _indexed

    empty = np.zeros(0, np.int64)
    p = _indexed.CooPattern((4, 3), (4, 2), ((0, 0),), (False,), empty, empty)
    untied, untie = _indexed._untie(p, frozenset({0}))
    assert untied.nnz == 0
    # Only the one-past-the-end zero can be asked for; it stays one past the end.
    np.testing.assert_array_equal(untie.index(np.array([0, 0])), [0, 0])


def test_constant_coefficients_are_not_gathered_through_broadcasts():
    # The stencil's constant weights are tied along the grid and untied where they
    # meet the rolls' coordinates; the elimination gathers (or broadcasts) them from
    # the weights themselves.
    x = _uniform((2, 6, 7))
    for order in ("fwd", "rev", "markowitz", "min_fill"):
        fn = graphax_eqx.jacve(
            _periodic_laplacian, order=order, sparse_representation=True
        )
        jaxpr = jax.make_jaxpr(fn)(x).jaxpr
        producer = {v: e for e in jaxpr.eqns for v in e.outvars}

        def source(v):
            # Look through the reshapes between a gather and what it gathers from.
            e = producer.get(v) if isinstance(v, jex_core.Var) else None
            while e is not None and e.primitive.name == "reshape":
                v = e.invars[0]
                e = producer.get(v) if isinstance(v, jex_core.Var) else None
            return e

        for e in jaxpr.eqns:
            if e.primitive.name == "gather":
                src = source(e.invars[0])
                assert src is None or src.primitive.name != "broadcast_in_dim", order
        _assert_close(fn(x).dense(), jax.jacfwd(_periodic_laplacian)(x))


# Convolution layouts (lhs, rhs, out) per number of spatial axes, the usual ones and
# a scrambled one.
_CONV_LAYOUTS = {
    1: [("NCH", "OIH", "NCH"), ("NHC", "HIO", "NHC"), ("HNC", "OHI", "CHN")],
    2: [("NCHW", "OIHW", "NCHW"), ("NHWC", "HWIO", "NHWC"), ("CWNH", "IWHO", "WHNC")],
    3: [("NCDHW", "OIDHW", "NCDHW"), ("NDHWC", "DHWIO", "NDHWC")],
}


@pytest.mark.parametrize("seed", range(6))
def test_convolution_entries_from_parameters(seed):
    """The entries of a convolution's index map computed from its parameters equal
    those read off by convolving positions with one-hot kernels."""
    from graphax_eqx._rules.linalg import _conv_entries, _conv_maps

    rng = np.random.default_rng(seed)
    layouts = _CONV_LAYOUTS
    checked = 0
    while checked < 12:
        nd = int(rng.integers(1, 3))
        groups = int(rng.choice([1, 2]))
        sizes = dict(
            N=int(rng.integers(1, 3)),
            C=groups * int(rng.integers(1, 3)),
            O=groups * int(rng.integers(1, 3)),
        )
        spatial = [int(rng.integers(3, 7)) for _ in range(nd)]
        kernel = [int(rng.integers(1, 4)) for _ in range(nd)]
        lhs_spec, rhs_spec, out_spec = layouts[nd][int(rng.integers(0, 3))]
        dims = dict(zip("HW", spatial))
        lhs = np.zeros([{**sizes, **dims}[c] for c in lhs_spec])
        kdims = dict(O=sizes["O"], I=sizes["C"] // groups, **dict(zip("HW", kernel)))
        rhs = np.zeros([kdims[c] for c in rhs_spec])

        def conv(l, r, nd=nd, groups=groups, specs=(lhs_spec, rhs_spec, out_spec)):
            return lax.conv_general_dilated(
                l,
                r,
                [int(rng.integers(1, 3)) for _ in range(nd)],
                [
                    (int(rng.integers(-1, 3)), int(rng.integers(0, 3)))
                    for _ in range(nd)
                ],
                [int(rng.integers(1, 3)) for _ in range(nd)],
                [int(rng.integers(1, 3)) for _ in range(nd)],
                dimension_numbers=specs,
                feature_group_count=groups,
            )

        try:
            (eqn,) = jax.make_jaxpr(conv)(lhs, rhs).jaxpr.eqns
        except (TypeError, ValueError):  # an output axis of negative size
            continue
        out_shape = tuple(eqn.outvars[0].aval.shape)
        if 0 in out_shape:
            continue
        rows, srcs, taps = _conv_entries(eqn.params, lhs.shape, rhs.shape, out_shape)
        maps = _conv_maps(eqn.params, lhs, rhs)
        if maps is None:  # more kernel entries than it reads off
            continue
        expected = sorted(
            (r, int(src[r]), t)
            for t, src in enumerate(maps)
            for r in np.nonzero(src >= 0)[0].tolist()
        )
        assert sorted(zip(rows.tolist(), srcs.tolist(), taps.tolist())) == expected
        checked += 1


def test_single_feature_convolutions_are_summed_by_taps():
    """On the CPU, a convolution whose outputs each read one input feature is
    evaluated as a sum of strided slices times kernel entries (XLA CPU's convolution
    kernels are several times slower there): the same values as
    `lax.conv_general_dilated` for any layout, stride, dilation, padding and feature
    groups, eagerly and under `jit`; the Jacobian with respect to the input then
    compiles to no convolution at all."""
    from graphax_eqx._rules.linalg import _conv_value, _tap_sum_applies

    rng = np.random.default_rng(0)
    layouts = _CONV_LAYOUTS
    checked = 0
    while checked < 8:
        nd = int(rng.integers(1, 4))
        groups = int(rng.choice([1, 2, 3]))
        per_group = int(rng.choice([1, 2]))
        specs = layouts[nd][int(rng.integers(0, len(layouts[nd])))]
        dtype = np.float64 if checked % 2 else np.float32
        axes = {1: "H", 2: "HW", 3: "DHW"}[nd]
        spatial = dict(zip(axes, rng.integers(2, 7, nd).tolist()))
        kernel = dict(zip(axes, rng.integers(1, 4, nd).tolist()))
        lhs = rng.standard_normal(
            [{"N": 2, "C": groups, **spatial}[c] for c in specs[0]]
        ).astype(dtype)
        rhs = rng.standard_normal(
            [{"O": groups * per_group, "I": 1, **kernel}[c] for c in specs[1]]
        ).astype(dtype)
        strides = rng.integers(1, 3, nd).tolist()
        padding = [(int(lo), int(hi)) for lo, hi in rng.integers(-1, 3, (nd, 2))]
        lhs_dilation = rng.integers(1, 3, nd).tolist()
        rhs_dilation = rng.integers(1, 3, nd).tolist()

        def conv(x, k, args=(strides, padding, lhs_dilation, rhs_dilation)):
            return lax.conv_general_dilated(
                x, k, *args, dimension_numbers=specs, feature_group_count=groups
            )

        try:
            expected = conv(lhs, rhs)
        except (TypeError, ValueError):  # an output axis of negative size
            continue
        if expected.size == 0:
            continue
        (eqn,) = jax.make_jaxpr(conv)(lhs, rhs).jaxpr.eqns
        assert _tap_sum_applies(lhs, rhs, eqn.params) == (
            jax.default_backend() == "cpu"
        )
        eager = _conv_value(jnp.asarray(lhs), jnp.asarray(rhs), eqn.params)
        jitted = jax.jit(lambda x, k, p=eqn.params: _conv_value(x, k, p))(lhs, rhs)
        for got in (eager, jitted):
            assert_tree_matches(got, expected)  # tolerances of the dtype

        checked += 1
        if checked % 3:
            continue  # the parity tables run such convolutions through every order

        def f(x, k):
            return jnp.sin(conv(x * x, k))

        jac = graphax_eqx.jacve(f, order="rev", argnums=(0, 1))
        assert_tree_matches(
            jax.jit(jac)(lhs, rhs), jax.jacfwd(f, argnums=(0, 1))(lhs, rhs)
        )
        if jax.default_backend() == "cpu":
            # The input's partial is the kernel's entries: nothing else convolves.
            jac_x = jax.jit(graphax_eqx.jacve(f, order="rev"))
            assert "convolution(" not in jac_x.lower(lhs, rhs).compile().as_text()


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz"])
def test_window_sum_past_the_pattern_size_is_a_linear_map(order, monkeypatch):
    """A windowed sum too large for a pattern is applied as the linear map it is,
    never differentiated densely."""
    import graphax_eqx._rules.structural as structural

    monkeypatch.setattr(structural, "_MAX_WINDOW_ENTRIES", 10)

    def f(x):
        y = lax.reduce_window(jnp.cos(x), 0.0, lax.add, (2, 3), (1, 2), "SAME")
        return jnp.sin(y)

    x = _uniform((4, 6))
    expected = jax.jacfwd(f)(x)
    _assert_close(graphax_eqx.jacve(f, order=order)(x), expected)
    sparse = jax.jit(graphax_eqx.jacve(f, order=order, sparse_representation=True))
    _assert_close(sparse(x).dense(), expected)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("order", _ORDERS)
def test_window_max_takes_the_first_of_equal_entries(order, sparse):
    """Where several entries of a window hold its maximum, the derivative goes to the
    first of them in the window's row-major order, as `jax.jacrev` gives it."""
    x = jnp.asarray([[1, 1, 0, 2, 2], [1, 0, 2, 2, 1], [0, 0, 0, 0, 0]], jnp.float32)
    for window, strides, padding in [
        ((2, 2), (2, 2), "VALID"),
        ((2, 2), (1, 1), "SAME"),
        ((3, 3), (1, 2), "SAME"),
    ]:

        def f(x):
            return lax.reduce_window(x, -jnp.inf, lax.max, window, strides, padding)

        jac = graphax_eqx.jacve(f, order=order, sparse_representation=sparse)(x)
        jac = jac.dense() if sparse else jac
        np.testing.assert_array_equal(jac, jax.jacrev(f)(x))


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz"])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("reducer", ["max", "min"])
def test_window_chooser_with_nan_and_infinite_entries(order, sparse, reducer):
    """Windows holding NaN, or only infinities of the identity's sign, give the
    derivative to the entry `jax.jacrev` gives it to: the entry after a NaN, a final
    NaN, or the padding (no input) where the padding comes first among equals."""
    op, identity = (lax.max, -jnp.inf) if reducer == "max" else (lax.min, jnp.inf)
    rng = np.random.default_rng(3)
    values = np.array([0.0, 1.0, np.nan, np.inf, -np.inf], np.float32)
    for window, strides, padding, base in [
        ((3,), (1,), "SAME", None),
        ((2,), (2,), "VALID", None),
        ((3,), (2,), ((2, 1),), None),
        ((2,), (1,), ((1, 1),), (2,)),
        ((17,), (3,), "SAME", None),  # more entries than are folded one by one
    ]:

        def f(x):
            return lax.reduce_window(
                x, identity, op, window, strides, padding, base_dilation=base
            )

        for _ in range(8):
            x = jnp.asarray(rng.choice(values, size=7))
            jac = graphax_eqx.jacve(f, order=order, sparse_representation=sparse)(x)
            jac = jac.dense() if sparse else jac
            np.testing.assert_array_equal(jac, jax.jacrev(f)(x))


@pytest.mark.parametrize("order", _ORDERS)
def test_cumulative_sums_of_constants_are_left_to_run_time(order):
    # A cumulative sum meeting a pure index map is applied to a constant, which XLA
    # would fold at compile time in time quadratic in the axis length (3 s for 400
    # rows of 1,200). Each one reads its operand through an optimisation barrier.
    def f(u):
        return jnp.cumsum(jnp.sin(u))[::3] + jnp.cumsum(u[::-1] * u)[1:-2:2].sum()

    x = _uniform((30,))
    jaxpr = jax.make_jaxpr(graphax_eqx.jacve(f, order=order))(x).jaxpr
    made_by = {v: e.primitive.name for e in jaxpr.eqns for v in e.outvars}
    # The function's own sums are of vectors; those of the partials, of matrices.
    sums = [
        e
        for e in jaxpr.eqns
        if e.primitive is lax.cumsum_p and len(e.invars[0].aval.shape) > 1
    ]
    assert sums
    assert all(made_by.get(e.invars[0]) == "optimization_barrier" for e in sums)
    _assert_close(graphax_eqx.jacve(f, order=order)(x), jax.jacfwd(f)(on_host(x)))


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz"])  # `auto` picks one
def test_tiled_pooling_reduces_over_split_axes(order):
    """Max, min and average pooling whose windows tile the input (any remainder
    dropped) run as a reduction over axes split off the pooled ones: the same
    Jacobian as `jax.jacrev`, ties and NaNs included, with the pooled axes tied, so
    a gradient through it gathers nothing."""
    import equinox as eqx

    rng = np.random.default_rng(7)
    ties = np.array([0.0, 1.0, 2.0], np.float32)
    # (pooling, input shape, whether its windows cover the input exactly)
    cases = [
        (eqx.nn.MaxPool2d(2, 2), (3, 6, 8), True),
        (eqx.nn.MaxPool2d(2, 2), (3, 6, 7), False),
        (eqx.nn.MaxPool1d(3, 3), (2, 10), False),
        (eqx.nn.MaxPool3d(2, 2), (1, 4, 4, 6), True),
        (lambda x: -eqx.nn.MaxPool2d(2, 2)(-x), (2, 4, 4), True),
        (
            lambda x: lax.reduce_window(
                x, jnp.inf, lax.min, (1, 2, 3), (1, 2, 3), "VALID"
            ),
            (2, 5, 6),
            False,
        ),
        (eqx.nn.AvgPool2d(2, 2), (3, 6, 8), True),
        (eqx.nn.AvgPool2d(3, 3), (2, 7, 6), False),
    ]
    # Reverse mode (a training step's) on every case; the other orders split them.
    if order != "rev":
        cases = cases[::2] if order == "fwd" else cases[1::2]
    for pool, shape, exact in cases:

        def f(x, pool=pool):
            return jnp.sin(pool(x))

        for values, fn in [(ties, f), (np.append(ties, np.nan), pool)]:
            x = jnp.asarray(rng.choice(values, size=shape))
            expected = jax.jit(jax.jacrev(fn))(x)
            dense = jax.jit(graphax_eqx.jacve(fn, order=order))(x)
            jacs = [dense]
            if order != "rev" or fn is pool:
                # Sparse results: with NaNs in reverse mode (fwd and markowitz split
                # the cases between them and check both value sets).
                sparse = graphax_eqx.jacve(fn, order=order, sparse_representation=True)
                jacs.append(jax.jit(sparse)(x).dense())
            for jac in jacs:
                # A windowed sum may round its last bit differently from JAX's.
                np.testing.assert_allclose(jac, expected, rtol=1e-6, atol=0)
        # Batched, as in a training step: a gradient through the pooling.
        w = jnp.asarray(
            rng.normal(
                size=jax.eval_shape(jax.vmap(pool), jnp.zeros((4,) + shape)).shape
            )
        )

        def loss(x, pool=pool):
            return jnp.sum(w * jnp.tanh(jax.vmap(pool)(jnp.cos(x))))

        xb = _uniform((4,) + shape)
        grad = graphax_eqx.jacve(loss, order=order)
        expected = jax.jit(jax.grad(loss))(xb)
        _assert_close(jax.jit(grad)(xb), expected, rtol=1e-6, atol=1e-6)
        if order == "rev" and exact:
            prims = {e.primitive.name for e in jax.make_jaxpr(grad)(xb).jaxpr.eqns}
            assert "gather" not in prims


@pytest.mark.parametrize("order", ["fwd", "rev"])
def test_window_max_past_the_pattern_size(order, monkeypatch):
    """A windowed maximum too large for a pattern still has the right Jacobian."""
    import graphax_eqx._rules.structural as structural

    monkeypatch.setattr(structural, "_MAX_WINDOW_ENTRIES", 10)

    def f(x):
        y = lax.reduce_window(jnp.cos(x), -jnp.inf, lax.max, (2, 3), (1, 2), "SAME")
        return jnp.sin(y)

    x = _uniform((4, 6))
    _assert_close(graphax_eqx.jacve(f, order=order)(x), jax.jacfwd(f)(on_host(x)))


# --------------------------------------------------------------------------------------
# Trace-time joins and sorts of coordinate lists
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_coordinate_join_and_sort_match_brute_force(seed):
    from graphax_eqx import _indexed

    rng = np.random.default_rng(seed)
    n_v = int(rng.integers(1, 12))
    cols_a = rng.integers(0, n_v, size=int(rng.integers(0, 30)))
    rows_b = rng.integers(0, n_v, size=int(rng.integers(0, 30)))
    if seed % 2:
        rows_b = np.sort(rows_b)  # the usual row-major order
    ia, ib = _indexed._join(cols_a, rows_b, n_v)
    # Every pair, listed entry by entry of A, B's entries in their order.
    expected = [(i, j) for i in range(len(cols_a)) for j in range(len(rows_b))]
    expected = [(i, j) for i, j in expected if cols_a[i] == rows_b[j]]
    assert list(zip(ia.tolist(), ib.tolist(), strict=True)) == expected

    keys = rng.integers(0, 9, size=int(rng.integers(0, 25)))
    if seed % 3 == 0:
        keys = np.unique(keys)  # sorted and distinct: no sorting needed
    uniq, order, group = _indexed._sort_unique(keys)
    stable = np.argsort(keys, kind="stable")
    np.testing.assert_array_equal(uniq, np.unique(keys))
    np.testing.assert_array_equal(stable if order is None else order, stable)
    np.testing.assert_array_equal(uniq[group], keys[stable])


@pytest.mark.parametrize("sparse", [False, True])
def test_dense_blocks_past_int32_positions_index_rows_and_columns(sparse, monkeypatch):
    """A dense result of 2**31 entries or more (a 47,000-point stencil's 2.2e9) is
    scattered by row and column indices: flat positions would overflow int32. The
    limit is lowered here so that the path runs at a small size."""
    from graphax_eqx import _indexed

    def f(u):
        return jnp.concatenate([u[2:] - 2 * u[1:-1] + u[:-2], u[:1] * u[-1:]])

    x = jnp.linspace(0.1, 1.0, 40)
    expected = jax.jacfwd(f)(x)
    monkeypatch.setattr(_indexed, "FLAT_INDEX_LIMIT", 16)
    jac = graphax_eqx.jacve(f, sparse_representation=sparse)
    for result in (jac(x), jax.jit(jac)(x)):
        result = result.dense() if sparse else result
        np.testing.assert_array_equal(result, expected)


def _random_coo(rng, out_shape, in_shape, tied: bool):
    from graphax_eqx import _indexed

    ties = ((0, 0),) if tied else ()
    varying = (bool(rng.integers(2)),) if tied else ()
    start = 1 if tied else 0
    n_out, n_in = math.prod(out_shape[start:]), math.prod(in_shape[start:])
    size = int(rng.integers(0, min(12, n_out * n_in) + 1))
    keys = np.sort(rng.choice(n_out * n_in, size=size, replace=False))
    return _indexed.CooPattern(
        out_shape, in_shape, ties, varying, keys // n_in, keys % n_in
    )


@pytest.mark.parametrize("seed", range(24))
def test_plan_summaries_match_the_plans(seed):
    """Simulating an elimination summarises coordinate products and sums (pattern,
    whether values are stored, count) without their entry lists: the same as the
    plans the elimination runs."""
    from graphax_eqx import _indexed

    rng = np.random.default_rng(seed)
    tie_a, tie_b = bool(rng.integers(2)), bool(rng.integers(2))
    pa = _random_coo(rng, (3, 4), (3, 5), tie_a)
    pb = _random_coo(rng, (3, 5), (3, 2), tie_b)
    pc = _random_coo(rng, (3, 4), (3, 5), tie_b)
    checks = [
        (_indexed.coo_product_plan, _indexed.coo_product_summary, pb, "muls"),
        (_indexed.coo_sum_plan, _indexed.coo_sum_summary, pc, "adds"),
        (_indexed.mixed_product_plan, _indexed.mixed_product_summary, pb, "muls"),
        (_indexed.mixed_sum_plan, _indexed.mixed_sum_summary, pc, "adds"),
    ]
    for a_val in (False, True):
        for b_val in (False, True):
            for make_plan, summarise, other, count in checks:
                plan = make_plan(pa, other, a_val, b_val)
                expected = (plan.pattern, plan.has_val, getattr(plan, count))
                assert summarise(pa, other, a_val, b_val) == expected


@pytest.mark.parametrize(
    "f",
    [
        lambda x: x[::-1],
        lambda x: x[np.array([3, 0, 0, 7, 5, 11, 2])],
        lambda x: jnp.concatenate([x[4:], x[:4], x[2:5]]),
    ],
    ids=["flip", "take", "concatenate"],
)
def test_large_dense_index_maps_are_scattered_when_they_run(f, monkeypatch):
    """The dense Jacobian of a pure index map (every entry one) is a constant for
    small blocks; past `CONSTANT_BLOCK_MAX` entries (a 20,000-entry flip would embed
    1.6 GB in the program) it is scattered at run time. The limit is lowered here."""
    from graphax_eqx import _indexed

    x = jnp.linspace(0.1, 1.2, 12)
    expected = jax.jacfwd(f)(x)
    monkeypatch.setattr(_indexed, "CONSTANT_BLOCK_MAX", 8)
    for order in ("fwd", "rev"):
        jac = graphax_eqx.jacve(f, order=order)
        for result in (jac(x), jax.jit(jac)(x)):
            np.testing.assert_array_equal(result, expected)
        text = jax.jit(jac).lower(x).as_text()
        assert "scatter" in text


def test_pair_keys_count_like_pairs():
    """Ties with weights are found by counting equal (key, weight) pairs: as one
    integer each where they fit, as rows of two otherwise, with the same counts."""
    from graphax_eqx import _indexed

    rng = np.random.default_rng(0)
    key = rng.integers(0, 50, 400)
    widx = rng.integers(0, 7, 400)
    _, expected = np.unique(np.stack([key, widx], axis=1), return_counts=True, axis=0)
    _, counts = np.unique(_indexed._pair_key(key, widx), return_counts=True)
    np.testing.assert_array_equal(counts, expected)
    huge = np.array([2**61, 3, 2**61], np.int64)
    assert _indexed._pair_key(huge, np.array([0, 5, 0])).shape == (3, 2)


# --------------------------------------------------------------------------------------
# Cumulative sums and sorts along one axis of a batch
# --------------------------------------------------------------------------------------


def _batched_cumsums(x):
    # Forward along one axis, reversed along another, through nonlinearities.
    a = jnp.cumsum(jnp.sin(x), axis=1)
    b = lax.cumsum(jnp.exp(x) * x, axis=0, reverse=True)
    return jnp.cos(a) * (2.0 + b)


@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("shape", [(5, 7), (3, 4, 6)])
def test_batched_cumulative_sums_stay_block_diagonal(shape, order):
    # Each slice's cumulative sum depends on that slice only: the other axes are
    # tied, and the result stores exactly the entries that can be nonzero, where it
    # used to store the whole dense block.
    def f(x):
        return jnp.cumsum(jnp.sin(x) + 2.0, axis=-1) ** 2

    x = _uniform(shape)
    expected = jax.jacfwd(f)(on_host(x))
    jac = graphax_eqx.jacve(f, order=order, sparse_representation=True)(x)
    bcoo = jac.to_bcoo()
    _assert_close(bcoo.todense(), expected)
    assert bcoo.nse == np.count_nonzero(np.asarray(expected))
    n = shape[-1]
    assert bcoo.nse == math.prod(shape[:-1]) * n * (n + 1) // 2
    _assert_close(jax.jit(graphax_eqx.jacve(f, order=order))(x), expected)
    # Both directions and other axes, several cumulative sums meeting.
    x2 = _uniform((4, 6), seed=1)
    expected2 = jax.jacfwd(_batched_cumsums)(on_host(x2))
    for sparse in (False, True):
        got = graphax_eqx.jacve(
            _batched_cumsums, order=order, sparse_representation=sparse
        )(x2)
        _assert_close(got.dense() if sparse else got, expected2)


def _sorted_rows(x):
    # Sorts along one axis and the other, one carrying a second operand.
    s = jnp.sort(jnp.sin(3.0 * x), axis=1)
    keys, vals = lax.sort((x[:, ::-1] * 1.7, jnp.exp(x)), dimension=0, num_keys=1)
    return s * vals + keys


@pytest.mark.parametrize("order", _ORDERS)
def test_batched_sorts_stay_block_diagonal(order):
    # A sort along one axis permutes each slice on its own: one permutation block
    # per slice, tied on the other axes (6 · 5 · 5 entries here, not (6 · 5)²).
    x = _uniform((6, 5), seed=2)
    expected = jax.jacfwd(_sorted_rows)(on_host(x))
    jac = graphax_eqx.jacve(_sorted_rows, order=order, sparse_representation=True)(x)
    _assert_close(jac.dense(), expected)

    def per_row(x):
        return jnp.sort(jnp.sin(3.0 * x), axis=1)

    bcoo = graphax_eqx.jacve(per_row, order=order, sparse_representation=True)(
        x
    ).to_bcoo()
    assert bcoo.nse <= 6 * 5 * 5
    _assert_close(bcoo.todense(), jax.jacfwd(per_row)(on_host(x)))
    dense = jax.jit(graphax_eqx.jacve(_sorted_rows, order=order))(x)
    _assert_close(dense, expected)
    # Under `vmap`, and in float32.
    xs = jnp.stack([x, x[::-1]]).astype(jnp.float32)
    got = jax.vmap(graphax_eqx.jacve(_sorted_rows, order=order))(xs)
    ref = jax.vmap(jax.jacfwd(_sorted_rows))(on_host(xs))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------
# Sums that separate ties
# --------------------------------------------------------------------------------------


def _pairwise(x):
    return jnp.abs(x[:, None] - x[None, :] + 0.05) + jnp.sin(x)[None, :]


def _kernel_rows(x):
    d = x[:, None] - 2.0 * x[None, :]
    return jnp.exp(-(d**2)) * jnp.cos(x)[:, None]


@pytest.mark.parametrize(
    "order", ["fwd", "rev", "markowitz", "relative_markowitz", "min_fill", "auto"]
)
@pytest.mark.parametrize("fun", [_pairwise, _kernel_rows, lambda x: jnp.kron(x, x)])
def test_sums_that_separate_ties_stay_coordinates(fun, order):
    # `x[:, None] - x[None, :]` adds two broadcasts of `x` tied on different axes:
    # summed as labeled partials, every combination of the separated axes would be
    # stored (n³ entries). They are summed as coordinates: 2n² - n entries.
    n = 24
    x = jnp.asarray(np.linspace(0.1, 1.3, n))
    expected = jax.jacfwd(fun)(on_host(x))
    jac, counts = graphax_eqx.jacve(
        fun, order=order, sparse_representation=True, count_ops=True
    )(x)
    bcoo = jac.to_bcoo()
    _assert_close(bcoo.todense(), expected)
    assert bcoo.nse == np.count_nonzero(np.asarray(expected))
    assert bcoo.nse <= 2 * n * n
    cost = graphax_eqx.elimination_cost(fun, order=order)(x)
    assert (int(counts["num_muls"]), int(counts["num_adds"])) == (
        cost.num_muls,
        cost.num_adds,
    )
    _assert_close(jax.jit(graphax_eqx.jacve(fun, order=order))(x), expected)


@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("sparse", [False, True])
def test_update_of_a_gathered_copy_with_its_own_slice(order, sparse):
    # XLA's CPU backend (jaxlib 0.10.2) miscompiles `jax.jit(f)` here (x = [1, 2, 3]
    # gives [1, -1, 1, -1, 1, -1] instead of [1, -1, -2, -1, -3, -3]), so the
    # reference is eager `jax.jacfwd`; jacve agrees eagerly, on repeat eager calls
    # (which run compiled) and under `jit`.
    index = np.array([0, 1, 0, 2, 2, 2])

    def f(v):
        g = v[index]
        return lax.dynamic_update_slice(g, -g[:5], (1,))

    x = jnp.array([1.0, 2.0, 3.0])
    want = reference_jacobians(f, (x,), refs=("fwd",), jit=False)["fwd"]
    jac = graphax_eqx.jacve(f, order=order, sparse_representation=sparse)
    for got in (jac(x), jac(x), jax.jit(jac)(x)):
        got = got.todense() if sparse else got
        assert_tree_matches(got, want)


@pytest.mark.parametrize("order", ["fwd", "rev", "auto"])
def test_out_of_bounds_gathers_clamp_with_known_and_traced_indices(order):
    # `a[i]` gathers with indices promised in bounds; out of bounds, the gather clamps
    # them. Known indices (eager) and traced ones (`jit`) give the clamped
    # derivative alike, as `jax.jacfwd` does (`jax.jacrev` drops those rows).
    x = jnp.linspace(0.1, 1.0, 6)
    i = jnp.array([7, 0, -9, 2])
    f = lambda a, i: a[i] ** 2
    want = jax.jacfwd(f)(x, i)
    assert float(want[0, 5]) != 0.0
    for got in (
        graphax_eqx.jacve(f, order=order)(x, i),
        jax.jit(graphax_eqx.jacve(f, order=order))(x, i),
        graphax_eqx.jacve(lambda a: f(a, i), order=order)(x),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    sparse_jac = graphax_eqx.jacve(f, order=order, sparse_representation=True)
    sparse = jax.jit(sparse_jac)(x, i)
    np.testing.assert_allclose(sparse.dense(), want, rtol=1e-6)


@pytest.mark.parametrize("order", _ORDERS)
def test_index_maps_from_constant_float_values_are_static_under_jit(order):
    # `jnp.interp` on a grid built in `fun` (`jnp.linspace`) searches it with float
    # comparisons. Eagerly those values are known; under `jit` they are computed from
    # constants only, so they are computed at trace time too: the gathers keep static
    # coordinates (not dense blocks), and the counts equal `elimination_cost`'s.
    n = 12
    xq = jnp.concatenate([jnp.linspace(0.05, 0.95, 9), jnp.linspace(0.0, 1.0, n)])

    def f(y):
        grid = jnp.linspace(0.0, 1.0, n)
        order_of = jnp.argsort(jnp.cos(3.0 * grid))  # float keys, constant
        # A scatter-add whose ids `searchsorted` finds (`update_jaxpr` is no loop).
        bins = jnp.asarray([0.0, 0.3, 0.5, 1.0])
        counts, _ = jnp.histogram(grid, bins=bins, weights=y, density=True)
        interpolated = jnp.interp(xq, grid, jnp.sin(y) * y) + y[order_of][:3].sum()
        return jnp.concatenate([interpolated, counts])

    y = _uniform((n,))
    want = jax.jacfwd(f)(on_host(y))
    cost = graphax_eqx.elimination_cost(f, order=order)(y)
    eager = graphax_eqx.jacve(f, order=order, sparse_representation=True)(y)
    jitted = jax.jit(
        graphax_eqx.jacve(f, order=order, sparse_representation=True, count_ops=True)
    )
    (jac, counts), value = jitted(y), jax.jit(f)(y)
    assert isinstance(jac, graphax_eqx.CooTensor)
    assert repr(jac) == repr(eager)
    assert (int(counts["num_muls"]), int(counts["num_adds"])) == (
        cost.num_muls,
        cost.num_adds,
    )
    _assert_close(jac.dense(), want)
    got_value, _ = jax.jit(graphax_eqx.value_and_jacve(f, order=order))(y)
    # Equal up to the order the histogram's scatter-add sums its colliding weights.
    np.testing.assert_allclose(got_value, value, rtol=1e-6)


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz"])
def test_stacked_rows_are_put_together_not_summed(order):
    """Rows of a `stack` store disjoint entries: their sum is one gather of the rows
    put end to end, not one gather-and-add per row (which made a program of `n`
    stacked rows emit and compile `n` growing sums)."""
    rows = 40

    def f(x):
        return jnp.stack([jnp.sin(x[i % 8]) * x[(i + 1) % 8] for i in range(rows)])

    x = jnp.linspace(0.1, 1.0, 10)
    fun = graphax_eqx.jacve(f, order=order)
    eqns = jax.make_jaxpr(fun)(x).jaxpr.eqns
    assert sum(e.primitive is lax.add_p for e in eqns) <= 2
    assert len(eqns) < 20 * rows
    want = jax.jacfwd(f)(x)
    np.testing.assert_allclose(fun(x), want, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(fun)(x), want, rtol=1e-6)
    sparse = graphax_eqx.jacve(f, order=order, sparse_representation=True)(x)
    np.testing.assert_allclose(sparse.dense(), want, rtol=1e-6)


@pytest.mark.parametrize("order", ["fwd", "rev"])
def test_chains_of_stacked_rows_are_written_to_memory(order):
    """Summing a stack's rows puts them together by concatenation; a sum of such
    sums feeds the next, and XLA CPU fuses the whole chain into one kernel (it
    crashed compiling 250 levels in reverse order). The chain is written to memory
    every `MAX_NESTED_JOINS` levels, so fused chains stay short."""
    from jax.extend.core import Literal

    def program(rows):
        def f(x):
            return jnp.stack(
                [x[i % 20] * x[(i * 3) % 20] + x[(i + 1) % 20] for i in range(rows)]
            )

        return f

    def longest_fused_chain(rows):
        fun = graphax_eqx.jacve(program(rows), order=order)
        run = {}
        for eqn in jax.make_jaxpr(fun)(jnp.linspace(0.1, 1.0, 20)).jaxpr.eqns:
            ins = [run.get(v, 0) for v in eqn.invars if not isinstance(v, Literal)]
            here = max(ins, default=0)
            if eqn.primitive.name == "write_apart":
                here = 0
            elif eqn.primitive is lax.concatenate_p:
                here += 1
            for v in eqn.outvars:
                run[v] = here
        return max(run.values())

    # Without the writes, 150 rows fuse chains of about 300 concatenations.
    assert longest_fused_chain(150) <= 100
    x = jnp.linspace(0.1, 1.0, 20)
    f = program(60)
    np.testing.assert_allclose(
        jax.jit(graphax_eqx.jacve(f, order=order))(x), jax.jacfwd(f)(x), rtol=1e-6
    )
