"""Parity of `jacve` with `jax.jacfwd`/`jax.jacrev` over a table of small programs.

Every program runs under every order: "fwd", "rev", "markowitz", "relative_markowitz",
"min_fill", "auto" and a random valid explicit order taken from `make_graph`, except
that a named order eliminating in the same vertex sequence as another case is skipped
(`auto` always picks one of the others). All programs run in float32; those marked
`float64=True` also run in float64.
"""

import dataclasses
import functools
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
import pytest
from jax import lax

from .helpers import (
    ORDERS,
    check_jacve,
    doubled_sin,
    reference_jacobians,
    repeated_order,
    tolerances,
)


# --------------------------------------------------------------------------------------
# Argument specifications: each is called with (rng, dtype) and returns one argument.
# --------------------------------------------------------------------------------------


def U(*shape: int, lo: float = -1.0, hi: float = 1.0) -> Callable:
    """Uniform floats in [lo, hi)."""
    return lambda rng, dtype: jnp.asarray(rng.uniform(lo, hi, shape), dtype)


def NZ(*shape: int, lo: float = 0.5, hi: float = 2.0) -> Callable:
    """Floats with random sign and magnitude in [lo, hi): away from zero."""

    def make(rng, dtype):
        values = rng.uniform(lo, hi, shape) * rng.choice([-1.0, 1.0], shape)
        return jnp.asarray(values, dtype)

    return make


def FIX(values: Any) -> Callable:
    """Exact given values, in the program's float dtype."""
    return lambda rng, dtype: jnp.asarray(values, dtype)


def INT(values: Any, dtype: Any = np.int32) -> Callable:
    """An integer (or bool) array that is not differentiated."""
    return lambda rng, _: jnp.asarray(values, dtype)


def PY(value: Any) -> Callable:
    """A Python value passed as is."""
    return lambda rng, dtype: value


def WELL(n: int) -> Callable:
    """A well-conditioned (diagonally dominant) square matrix."""
    return lambda rng, dtype: jnp.asarray(
        3.0 * np.eye(n) + rng.uniform(-0.5, 0.5, (n, n)), dtype
    )


def LOWER(n: int) -> Callable:
    """A well-conditioned lower-triangular matrix."""
    return lambda rng, dtype: jnp.asarray(
        np.tril(rng.uniform(-0.5, 0.5, (n, n))) + 2.0 * np.eye(n), dtype
    )


def SYM(n: int) -> Callable:
    """A symmetric matrix with well-separated eigenvalues."""

    def make(rng, dtype):
        r = rng.uniform(-0.1, 0.1, (n, n))
        return jnp.asarray(np.diag(np.arange(1.0, n + 1.0)) + r + r.T, dtype)

    return make


def TREE(**specs: Callable) -> Callable:
    """A dict of arguments."""
    return lambda rng, dtype: {k: spec(rng, dtype) for k, spec in specs.items()}


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    fun: Callable
    specs: tuple[Callable, ...]
    argnums: int | tuple[int, ...] = 0
    has_aux: bool = False
    refs: tuple[str, ...] = ("fwd", "rev")
    float64: bool = False
    # Overrides of the dtype-based tolerances (e.g. for mixed precision programs).
    tol_dtype: Any = None

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode())

    def args(self, dtype: Any) -> tuple[Any, ...]:
        rng = np.random.default_rng(self.seed)
        return tuple(spec(rng, np.dtype(dtype)) for spec in self.specs)


PROGRAMS: list[Program] = []


def P(name: str, fun: Callable, *specs: Callable, **kwargs: Any) -> None:
    PROGRAMS.append(Program(name, fun, specs, **kwargs))


def _c(x: jax.Array, values: Any) -> jax.Array:
    """A closed-over constant in the dtype of `x`."""
    return jnp.asarray(values, x.dtype)


def _other_float(dtype: Any) -> Any:
    return jnp.float64 if np.dtype(dtype) == np.float32 else jnp.float32


_rng = np.random.default_rng(1234)
_W34 = _rng.uniform(-1, 1, (3, 4))
_W45 = _rng.uniform(-1, 1, (4, 5))
_V4 = _rng.uniform(-1, 1, (4,))
_IDX = np.array([2, 0, 2, 3])
_IDX_UNIQUE = np.array([3, 0])


# --------------------------------------------------------------------------------------
# Elementwise unary operations, each in its domain.
# --------------------------------------------------------------------------------------

P("exp", jnp.exp, U(3, 4), float64=True)
P("exp2", jnp.exp2, U(3, 4))
P("expm1", jnp.expm1, U(3, 4))
P("log", jnp.log, U(3, 4, lo=0.5, hi=2.0), float64=True)
P("log1p", jnp.log1p, U(3, 4, lo=-0.5, hi=1.0))
P("log10", jnp.log10, U(4, lo=0.5, hi=2.0))
P("sin", jnp.sin, U(3, 4), float64=True)
P("cos", jnp.cos, U(3, 4))
P("tan", jnp.tan, U(3, 4))
P("asin", jnp.arcsin, U(3, 4, lo=-0.8, hi=0.8))
P("acos", jnp.arccos, U(3, 4, lo=-0.8, hi=0.8))
P("atan", jnp.arctan, U(3, 4, lo=-2.0, hi=2.0))
P("sinh", jnp.sinh, U(3, 4))
P("cosh", jnp.cosh, U(3, 4))
P("tanh", jnp.tanh, U(3, 4), float64=True)
P("asinh", jnp.arcsinh, U(3, 4, lo=-2.0, hi=2.0), float64=True)
P("acosh", jnp.arccosh, U(3, 4, lo=1.2, hi=3.0))
P("atanh", jnp.arctanh, U(3, 4, lo=-0.8, hi=0.8))
P("sqrt", jnp.sqrt, U(3, 4, lo=0.5, hi=2.0))
P("rsqrt", lax.rsqrt, U(3, 4, lo=0.5, hi=2.0))
P("cbrt", jnp.cbrt, U(3, 4, lo=0.5, hi=2.0))
P("cbrt_negative", lax.cbrt, U(4, lo=-2.0, hi=-0.5))
P("logistic", lax.logistic, U(3, 4, lo=-3.0, hi=3.0))
P("sigmoid", jax.nn.sigmoid, U(5, lo=-3.0, hi=3.0))
P("erf", lax.erf, U(3, 4, lo=-2.0, hi=2.0))
P("erfc", lax.erfc, U(3, 4, lo=-2.0, hi=2.0))
P("erf_inv", lax.erf_inv, U(3, 4, lo=-0.8, hi=0.8))
P("abs", jnp.abs, NZ(3, 4), float64=True)
P("sign", jnp.sign, NZ(4))
P("sign_times_x", lambda x: jnp.sign(x) * x**2, NZ(4))
P("integer_pow_3", lambda x: x**3, U(3, 4))
P("integer_pow_neg2", lambda x: lax.integer_pow(x, -2), NZ(3, 4))
P("square", jnp.square, U(3, 4))
P("reciprocal", jnp.reciprocal, NZ(4))
P("pow_float_literal", lambda x: x**2.5, U(4, lo=0.5, hi=2.0))
P("lgamma", lax.lgamma, U(3, 4, lo=0.5, hi=3.0))
P("digamma", lax.digamma, U(3, 4, lo=0.5, hi=3.0))
P("neg", jnp.negative, U(3, 4))
P("floor_times_x", lambda x: jnp.floor(x) * x, U(4, lo=-3.0, hi=3.0))
P("floor", jnp.floor, U(4, lo=-3.0, hi=3.0))
P("round_times_x", lambda x: jnp.round(x) * x, U(4, lo=-3.0, hi=3.0))
P("round", lax.round, U(4, lo=-3.0, hi=3.0))
P("ceil_times_x", lambda x: jnp.ceil(x) * x, U(4, lo=-3.0, hi=3.0))
P("sinc_with_zero", jnp.sinc, FIX([0.0, 0.3, -0.7, 1.2]))
P("gelu_tanh", lambda x: jax.nn.gelu(x, approximate=True), U(5))
P("gelu_erf", lambda x: jax.nn.gelu(x, approximate=False), U(5))
P("silu", jax.nn.silu, U(5))
P("elu", jax.nn.elu, NZ(5))
P("leaky_relu", jax.nn.leaky_relu, NZ(5))
P("exp_scalar", jnp.exp, U())
P("unary_chain", lambda x: jnp.log(jnp.cosh(jnp.sin(x)) + 1.0), U(3, 4), float64=True)
P(
    "unary_of_broadcast_sum",
    lambda x, y: jnp.tanh(x + y),
    U(3, 1),
    U(1, 4),
    argnums=(0, 1),
)

# --------------------------------------------------------------------------------------
# Binary operations with broadcasting.
# --------------------------------------------------------------------------------------

P("add_row", lambda x, y: x + y, U(3, 4), U(4), argnums=(0, 1), float64=True)
P("sub_outer", lambda x, y: x - y, U(3, 1), U(1, 4), argnums=(0, 1))
P("mul_scalar_array", lambda x, y: x * y, U(), U(3), argnums=(0, 1), float64=True)
P("mul_outer", lambda x, y: x * y, U(3, 1), U(1, 4), argnums=(0, 1))
P("mul_same_shape", lambda x, y: x * y, U(2, 3), U(2, 3), argnums=(0, 1))
P("div_column", lambda x, y: x / y, U(3, 4), NZ(3, 1), argnums=(0, 1), float64=True)
P("div_by_literal", lambda x: x / 3.0, U(4))
P("literal_div", lambda x: 2.0 / x, NZ(4))
P(
    "pow_broadcast",
    lambda x, y: x**y,
    U(2, 3, lo=0.5, hi=2.0),
    U(3),
    argnums=(0, 1),
    float64=True,
)
P("pow_literal_base", lambda x: jnp.power(2.0, x), U(4))
P("max_row", jnp.maximum, U(3, 4), U(4), argnums=(0, 1))
P("min_outer", jnp.minimum, U(3, 1), U(1, 4), argnums=(0, 1))
P(
    "max_ties",
    jnp.maximum,
    FIX([1.0, 2.0, -1.0, 0.5]),
    FIX([1.0, 0.0, -1.0, 1.5]),
    argnums=(0, 1),
    float64=True,
)
P("min_ties", jnp.minimum, FIX([1.0, 2.0, 0.5]), FIX([1.0, 0.0, 0.5]), argnums=(0, 1))
P("max_literal", lambda x: jnp.maximum(x, 0.25), U(5))
P("atan2", jnp.arctan2, U(3, 4), NZ(4), argnums=(0, 1), float64=True)
P("rem", jnp.fmod, U(3, 4, lo=0.1, hi=3.0), U(4, lo=0.7, hi=1.3), argnums=(0, 1))
P("remainder", jnp.remainder, U(2, 3, lo=-3.0, hi=3.0), NZ(3), argnums=(0, 1))
P("hypot", jnp.hypot, NZ(3), NZ(2, 3), argnums=(0, 1))
P("logaddexp", jnp.logaddexp, U(3, 4), U(4), argnums=(0, 1))
P("x_times_x", lambda x: x * x, U(5), float64=True)
P("x_times_sin_x", lambda x: x * jnp.sin(x), U(5))
P("x_plus_x", lambda x: x + x, U(3))
P("x_minus_x", lambda x: x - x, U(3))
P(
    "fma_broadcast",
    lambda a, b, c: a * b + c,
    U(3, 1),
    U(4),
    U(),
    argnums=(0, 1, 2),
)
P("squared_distance", lambda x, y: jnp.sum(jnp.square(x - y)), U(4), U(4), argnums=1)
P("polyval", jnp.polyval, U(3), U(4), argnums=(0, 1))
P("shared_subexpression", lambda x: (x + 1.0) * (x + 1.0) - jnp.exp(x + 1.0), U(4))

# --------------------------------------------------------------------------------------
# Selection, clamping, comparisons, conversions.
# --------------------------------------------------------------------------------------

P("where_broadcast", lambda x, y: jnp.where(x > 0, x, y), U(3, 4), U(4), argnums=(0, 1))
P(
    "where_compare_xy",
    lambda x, y: jnp.where(x > y, 2.0 * x, jnp.sin(y)),
    U(3, 4),
    U(4),
    argnums=(0, 1),
    float64=True,
)


def _select_n_three(x, y, z):
    which = (x > 0).astype(jnp.int32) + (x > 0.5).astype(jnp.int32)
    return lax.select_n(which, x, y, z)


P("select_n_three", _select_n_three, U(6), U(6), U(6), argnums=(0, 1, 2))
P(
    "select_n_scalar_pred",
    lambda x, y: lax.select_n(jnp.sum(x) > 0, x * y, x - y),
    U(4),
    U(4),
    argnums=(0, 1),
)
P("clip_literals", lambda x: jnp.clip(x, -0.5, 0.5), U(3, 4))
P(
    "clamp_arrays",
    lambda lo, x, hi: lax.clamp(lo, x, hi),
    U(6, lo=-0.6, hi=-0.2),
    U(6),
    U(6, lo=0.2, hi=0.6),
    argnums=(0, 1, 2),
)
P(
    "clip_broadcast_bounds",
    lambda x, lo, hi: jnp.clip(x, lo, hi),
    U(3, 4),
    U(4, lo=-0.6, hi=-0.2),
    U(4, lo=0.2, hi=0.6),
    argnums=(0, 1, 2),
)
P("compare_masks", lambda x, y: (x > 0) * x + (x <= y) * y, U(5), U(5), argnums=(0, 1))
P(
    "convert_float_precision",
    lambda x: jnp.sin(x.astype(_other_float(x.dtype))) * 2.0,
    U(4),
    float64=True,
    tol_dtype=np.float32,
)
P("convert_to_int", lambda x: x * jnp.floor(x * 3.0).astype(jnp.int32), U(5, lo=0.05))
P("isfinite_mask", lambda x: jnp.where(jnp.isfinite(x), x * x, 0.0), U(4))
P("nan_to_num", lambda x: jnp.nan_to_num(x) * 2.0, U(4))

# --------------------------------------------------------------------------------------
# Structural operations.
# --------------------------------------------------------------------------------------

P("broadcast_row", lambda x: jnp.broadcast_to(x, (3, 4)) * 1.5, U(4), float64=True)
P("broadcast_column", lambda x: jnp.broadcast_to(x, (3, 4)), U(3, 1))
P("broadcast_scalar", lambda x: jnp.broadcast_to(x, (2, 3)), U())
P("broadcast_in_dim_middle", lambda x: lax.broadcast_in_dim(x, (3, 2, 4), (0,)), U(3))
P("reshape_merge", lambda x: jnp.sin(x).reshape(12), U(3, 4), float64=True)
P("reshape_split", lambda x: jnp.sin(x.reshape(3, 4)), U(12))
P("reshape_merge_leading", lambda x: x.reshape(6, 2) * 2.0, U(2, 3, 2))
P("reshape_merge_trailing", lambda x: x.reshape(2, 6), U(2, 3, 2))
P(
    "reshape_transpose_reshape",
    lambda x: jnp.cos(x.reshape(2, 3).T.reshape(6)),
    U(6),
)
P("reshape_regroup", lambda x: x.reshape(3, 2) @ _c(x, _W34[:2, :3]), U(2, 3))
P("squeeze", lambda x: jnp.squeeze(x, 0) * 3.0, U(1, 4))
P("squeeze_middle", lambda x: jnp.sin(jnp.squeeze(x, axis=1)), U(3, 1, 2))
P("expand_dims", lambda x, y: jnp.expand_dims(x, 0) * y, U(4), U(3, 4), argnums=(0, 1))
P("transpose_3d", lambda x: jnp.transpose(x, (2, 0, 1)), U(2, 3, 4), float64=True)
P("transpose_times", lambda x, y: x.T * y, U(3, 4), U(4, 3), argnums=(0, 1))
P("slice_simple", lambda x: x[1:3], U(5))
P("slice_strided_columns", lambda x: x[:, ::2], U(3, 5))
P("slice_step_negative_end", lambda x: x[1:-1:2], U(6), float64=True)
P("lax_slice_2d", lambda x: lax.slice(x, (0, 1), (3, 5), (2, 2)), U(4, 5))
P(
    "dynamic_slice_int_arg",
    lambda x, i: lax.dynamic_slice(x, (i,), (2,)),
    U(5),
    INT(2),
)
P(
    "dynamic_slice_argmax",
    lambda x: lax.dynamic_slice(x, (jnp.argmax(x),), (2,)) * x[0],
    U(5),
)
P("dynamic_slice_2d", lambda x: lax.dynamic_slice(x, (1, 0), (2, 3)), U(4, 3))
P(
    "dynamic_update_slice",
    lambda x, u: lax.dynamic_update_slice(x, u, (1,)),
    U(5),
    U(2),
    argnums=(0, 1),
    float64=True,
)
P(
    "dynamic_update_slice_2d_int_arg",
    lambda x, u, i: jnp.sin(lax.dynamic_update_slice(x, u * u, (i, 1))),
    U(3, 4),
    U(2, 2),
    INT(1, np.int64),
    argnums=(0, 1),
)
P("gather_duplicates", lambda x: x[_IDX] * 2.0, U(5), float64=True)
P("gather_columns", lambda x: x[:, _IDX], U(2, 4))
P("gather_index_arg", lambda x, idx: jnp.sin(x[idx]), U(5), INT([4, 1, 1]))
P("index_int", lambda x: x[2] * x, U(4))
P("index_dynamic_int", lambda x, i: x[i] * x, U(4), INT(3))
P("index_negative", lambda x: x[-1] + x[0], U(4))
P("gather_advanced_2d", lambda x: x[np.array([0, 2, 1]), np.array([1, 1, 0])], U(3, 2))
P("take_along_axis", lambda x: jnp.take_along_axis(x, np.array([[1], [0]]), 1), U(2, 3))
P("take_clip", lambda x: jnp.take(x, np.array([0, 7, 2]), mode="clip"), U(4))
P(
    "scatter_set",
    lambda x, y: x.at[_IDX_UNIQUE].set(y),
    U(5),
    U(2),
    argnums=(0, 1),
    float64=True,
)
P(
    "scatter_add_duplicates",
    lambda x, y: x.at[_IDX].add(y),
    U(5),
    U(4),
    argnums=(0, 1),
    float64=True,
)
P("scatter_set_slice", lambda x, y: x.at[1:3].set(y * y), U(5), U(2), argnums=(0, 1))
P(
    "scatter_add_column",
    lambda x, y: x.at[:, 1].add(jnp.sin(y)),
    U(3, 4),
    U(3),
    argnums=(0, 1),
)
P("scatter_set_scalar", lambda x, y: x.at[2].set(y), U(4), U(), argnums=(0, 1))
P("pad_constant", lambda x: jnp.pad(x, (1, 2)), U(4))
P(
    "pad_negative_interior",
    lambda x: lax.pad(x, _c(x, 0.0), [(1, -1, 1)]),
    U(4),
    float64=True,
)
P("pad_2d_mixed", lambda x: lax.pad(x, _c(x, 0.0), [(0, 1, 0), (-1, 2, 1)]), U(2, 3))
P(
    "pad_value_arg",
    lambda x, v: lax.pad(x * x, v, [(2, 1, 1)]),
    U(3),
    U(),
    argnums=(0, 1),
)
P("pad_reflect", lambda x: jnp.pad(x, 2, mode="reflect"), U(4))
P("pad_edge_2d", lambda x: jnp.pad(x, ((1, 0), (0, 1)), mode="edge"), U(2, 3))
P(
    "concatenate_with_repeat",
    lambda x, y: jnp.concatenate([x, y, x]),
    U(3),
    U(2),
    argnums=(0, 1),
    float64=True,
)
P(
    "concatenate_axis1",
    lambda x, y: jnp.concatenate([jnp.sin(x), y], axis=1),
    U(3, 2),
    U(3, 1),
    argnums=(0, 1),
)
P("stack", lambda x, y: jnp.stack([x, y * 2.0]), U(3), U(3), argnums=(0, 1))
P("split_halves", lambda x: tuple(jnp.split(jnp.sin(x), 2)), U(6), float64=True)
P("split_sections_axis1", lambda x: tuple(jnp.split(x, [1, 3], axis=1)), U(2, 5))
P("flip", lambda x: jnp.flip(x) * x, U(5), float64=True)
P("flip_axis1", lambda x: jnp.flip(jnp.exp(x), axis=1), U(2, 3))
P("roll", lambda x: jnp.roll(x, 2) * jnp.arange(5.0, dtype=x.dtype), U(5))
P("tile", lambda x: jnp.tile(x, 2), U(3))
P("repeat", lambda x: jnp.repeat(x, 2), U(3))
P("diag_vector", lambda x: jnp.diag(x) @ jnp.ones(3, x.dtype), U(3))
P("diagonal_matrix", lambda x: jnp.diagonal(x) * 2.0, U(3, 3))
P("triu", lambda x: jnp.triu(x) + jnp.tril(x, -1) * 3.0, U(3, 3))
P("trace", jnp.trace, U(3, 3))
P("swapaxes_then_reshape", lambda x: jnp.swapaxes(x, 0, 1).reshape(-1), U(2, 3))

# --------------------------------------------------------------------------------------
# Reductions.
# --------------------------------------------------------------------------------------

P("sum_all", jnp.sum, U(3, 4), float64=True)
P("sum_axis0", lambda x: jnp.sum(jnp.sin(x), axis=0), U(3, 4))
P("sum_axis1_keepdims", lambda x: jnp.sum(x, axis=1, keepdims=True) * x, U(3, 4))
P("mean_axis", lambda x: jnp.mean(x * x, axis=1), U(3, 4))
P("max_axis", lambda x: jnp.max(x, axis=1), U(3, 4))
P(
    "reduce_max_ties",
    lambda x: jnp.max(x, axis=1),
    FIX([[1.0, 1.0, 0.5], [2.0, 0.0, 2.0]]),
    float64=True,
)
P("max_all_ties", jnp.max, FIX([0.5, 2.0, 2.0, 2.0, -1.0]))
P("min_axis0", lambda x: jnp.min(x, axis=0), U(3, 4))
P(
    "reduce_min_ties",
    lambda x: jnp.min(x, axis=0),
    FIX([[1.0, 3.0], [1.0, 2.0], [4.0, 2.0]]),
)
P("prod_all", jnp.prod, NZ(5, lo=0.5, hi=1.5), float64=True)
P("prod_one_zero", jnp.prod, FIX([0.5, 0.0, 2.0, -1.5]), float64=True)
P("prod_two_zeros", jnp.prod, FIX([0.0, 3.0, 0.0, 2.0]))
P("prod_axis_with_zero", lambda x: jnp.prod(x, axis=1), FIX([[0.5, 0.0], [2.0, 3.0]]))
P("argmax_gather", lambda x: x[jnp.argmax(x)] * x, U(5))
P(
    "argmax_axis_take",
    lambda x: jnp.take_along_axis(x, jnp.argmax(x, axis=1, keepdims=True), 1),
    U(3, 4),
)
P("norm", jnp.linalg.norm, NZ(4), float64=True)
P("logsumexp", jsp.special.logsumexp, U(3, 4))
P("logsumexp_axis", lambda x: jsp.special.logsumexp(x, axis=0), U(3, 4))
P("var_axis0", lambda x: jnp.var(x, axis=0), U(3, 4))
P("std", jnp.std, U(5))
P("sum_of_broadcast", lambda x: jnp.sum(jnp.broadcast_to(x, (3, 4)), axis=1), U(4))

# --------------------------------------------------------------------------------------
# Cumulative operations.
# --------------------------------------------------------------------------------------

P("cumsum", jnp.cumsum, U(5), float64=True)
P("cumsum_axis1", lambda x: jnp.cumsum(jnp.sin(x), axis=1), U(2, 4))
P("cumsum_reverse", lambda x: lax.cumsum(x, axis=0, reverse=True) * x, U(4, 2))
P("cumprod", jnp.cumprod, NZ(5, lo=0.5, hi=1.5), float64=True)
P("cumprod_axis0", lambda x: jnp.cumprod(x, axis=0), NZ(3, 2, lo=0.5, hi=1.5))
P("cummax", lambda x: lax.cummax(x, axis=0), U(6))
P("cummin", lambda x: lax.cummin(x, axis=0), U(6))
P("cummax_ties", lambda x: lax.cummax(x, axis=0), FIX([1.0, 0.5, 1.0, 2.0, 2.0]))
P("cumlogsumexp", lambda x: lax.cumlogsumexp(x, axis=0), U(5), float64=True)
P("associative_scan_add", lambda x: lax.associative_scan(jnp.add, x), U(5))
P("associative_scan_mul", lambda x: lax.associative_scan(jnp.multiply, x), NZ(4))

# --------------------------------------------------------------------------------------
# Sorting.
# --------------------------------------------------------------------------------------

P("sort", jnp.sort, U(5), float64=True)
P("sort_axis0", lambda x: jnp.sort(x, axis=0), U(3, 2))
P(
    "sort_multi_operand",
    lambda x, y: lax.sort((x, y * 2.0), num_keys=1),
    U(5),
    U(5),
    argnums=(0, 1),
    float64=True,
)
P("argsort_gather", lambda x, y: x[jnp.argsort(x)] * y, U(5), U(5), argnums=(0, 1))
P("top_k", lambda x: lax.top_k(x, 2)[0], U(5))
P("median", jnp.median, U(5))

# --------------------------------------------------------------------------------------
# dot_general.
# --------------------------------------------------------------------------------------

P("matvec", lambda w, x: w @ x, U(3, 4), U(4), argnums=(0, 1), float64=True)
P("vecmat", lambda x, w: x @ w, U(3), U(3, 4), argnums=(0, 1))
P("matmat", lambda a, b: a @ b, U(3, 4), U(4, 2), argnums=(0, 1), float64=True)
P(
    "batched_einsum",
    lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
    U(2, 3, 2),
    U(2, 2, 3),
    argnums=(0, 1),
    float64=True,
)
P("vector_dot", jnp.dot, U(4), U(4), argnums=(0, 1))
P("outer", jnp.outer, U(3), U(4), argnums=(0, 1))
P(
    "einsum_rowwise",
    lambda a, b: jnp.einsum("ij,ij->i", a, b),
    U(3, 4),
    U(3, 4),
    argnums=(0, 1),
)
P("einsum_trace", lambda a: jnp.einsum("ii->", a), U(3, 3))
P(
    "tensordot_two_axes",
    lambda a, b: jnp.tensordot(a, b, axes=2),
    U(2, 3, 2),
    U(3, 2, 2),
    argnums=(0, 1),
)
P("x_dot_x", lambda x: x @ x, U(4))
P("gram", lambda m: m @ m.T, U(3, 2), float64=True)
P("matmul_batch_broadcast", lambda a, b: a @ b, U(2, 3, 4), U(4, 2), argnums=(0, 1))
P(
    "dot_general_odd_batch",
    lambda a, b: lax.dot_general(a, b, (((2,), (0,)), ((1,), (1,)))),
    U(3, 2, 4),
    U(4, 2, 3),
    argnums=(0, 1),
)
P("matvec_constant", lambda x: jnp.tanh(_c(x, _W34) @ x), U(4))


def _mlp(params, x):
    h = jnp.tanh(params["w1"] @ x + params["b1"])
    return jnp.tanh(params["w2"] @ h + params["b2"])


P(
    "mlp",
    _mlp,
    TREE(w1=U(4, 3), b1=U(4), w2=U(2, 4), b2=U(2)),
    U(3),
    argnums=(0, 1),
    float64=True,
)

# --------------------------------------------------------------------------------------
# Convolutions.
# --------------------------------------------------------------------------------------

P(
    "conv1d",
    lambda lhs, rhs: lax.conv(lhs, rhs, (1,), "VALID"),
    U(1, 2, 5),
    U(3, 2, 2),
    argnums=(0, 1),
    float64=True,
)
P(
    "conv2d_same",
    lambda lhs, rhs: lax.conv(lhs, rhs, (1, 1), "SAME"),
    U(1, 1, 4, 4),
    U(2, 1, 2, 2),
    argnums=(0, 1),
)
P(
    "conv1d_strided_dilated",
    lambda lhs, rhs: lax.conv_general_dilated(
        lhs, rhs, (2,), [(1, 1)], rhs_dilation=(2,)
    ),
    U(1, 1, 5),
    U(2, 1, 2),
    argnums=(0, 1),
)
P(
    "conv2d_grouped_lhs_dilated",
    lambda lhs, rhs: lax.conv_general_dilated(
        lhs, rhs, (1, 1), [(0, 0), (1, 0)], lhs_dilation=(2, 1), feature_group_count=2
    ),
    U(1, 2, 3, 3),
    U(2, 1, 2, 2),
    argnums=(0, 1),
)
P(
    "conv2d_nhwc",
    lambda lhs, rhs: lax.conv_general_dilated(
        lhs, rhs, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    ),
    U(1, 3, 3, 2),
    U(2, 2, 2, 1),
    argnums=(0, 1),
)
P("convolve_1d", lambda x, y: jnp.convolve(x, y), U(4), U(2), argnums=(0, 1))

# --------------------------------------------------------------------------------------
# stop_gradient and linear algebra.
# --------------------------------------------------------------------------------------

P("stop_gradient_product", lambda x: x * lax.stop_gradient(x), U(4), float64=True)
P("stop_gradient_only", lambda x: lax.stop_gradient(jnp.sin(x)), U(3))
P(
    "stop_gradient_tree",
    lambda x, y: jax.tree_util.tree_map(lax.stop_gradient, (x, y))[0] * y,
    U(3),
    U(3),
    argnums=(0, 1),
)
P("solve", jnp.linalg.solve, WELL(3), U(3), argnums=(0, 1), float64=True)
P(
    "solve_matrix_rhs",
    lambda a, b: jnp.linalg.solve(a, b),
    WELL(2),
    U(2, 3),
    argnums=(0, 1),
)
P("inv", jnp.linalg.inv, WELL(3))
P("det", jnp.linalg.det, WELL(3))
P(
    "cholesky",
    lambda a: jnp.linalg.cholesky(a @ a.T + 3.0 * jnp.eye(3, dtype=a.dtype)),
    U(3, 3),
)
P(
    "solve_triangular",
    lambda l, b: jsp.linalg.solve_triangular(l, b, lower=True),
    LOWER(3),
    U(3),
    argnums=(0, 1),
)
P("eigvalsh", jnp.linalg.eigvalsh, SYM(3), float64=True)
P("qr_r", lambda a: jnp.linalg.qr(a)[1], WELL(3))
P("singular_values", lambda a: jnp.linalg.svd(a, compute_uv=False), WELL(3))

# --------------------------------------------------------------------------------------
# Windows, special functions, complex intermediates, other dtypes.
# --------------------------------------------------------------------------------------

P(
    "reduce_window_sum",
    lambda x: lax.reduce_window(x, 0.0, lax.add, (2,), (1,), "VALID"),
    U(5),
)
P(
    "max_pool_2d",
    lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (1, 1), "SAME"),
    U(3, 3),
    float64=True,
)
P("one_hot_argmax", lambda x: jax.nn.one_hot(jnp.argmax(x), 4, dtype=x.dtype) * x, U(4))
P(
    "random_bits_constant",
    lambda x: jax.random.normal(jax.random.key(0), (3,), x.dtype) * x,
    U(3),
)
P(
    "einsum_three_operands",
    lambda a, b, c: jnp.einsum("ij,jk,k->i", a, b, c),
    U(2, 3),
    U(3, 2),
    U(2),
    argnums=(0, 1, 2),
)
P(
    "interp",
    lambda x, fp: jnp.interp(x, jnp.array([0.0, 0.5, 1.0], x.dtype), fp),
    U(3, lo=0.05, hi=0.95),
    U(3),
    argnums=(0, 1),
)
P(
    "gammainc_wrt_x",
    jsp.special.gammainc,
    U(3, lo=1.0, hi=2.0),
    U(3, lo=0.5, hi=2.0),
    argnums=1,
)
P("xlogy", jsp.special.xlogy, FIX([0.0, 2.0, 0.5]), U(3, lo=0.5), argnums=(0, 1))
P("scalar_times_literals", lambda x: 3.0 * x**2 - x / 4.0 + 1.0, U(), float64=True)
P("scalar_literal_max", lambda x: jnp.maximum(x, 0.0) * 2.0, U())
P(
    "mixed_precision_args",
    lambda x, y: x.astype(y.dtype) * jnp.sin(y) + jnp.sum(x),
    lambda rng, dtype: jnp.asarray(rng.uniform(-1, 1, 3), np.float32),
    lambda rng, dtype: jnp.asarray(rng.uniform(-1, 1, 3), np.float64),
    argnums=(0, 1),
    tol_dtype=np.float32,
)
P(
    "float16_input",
    lambda x: jnp.exp(x) * x,
    lambda rng, dtype: jnp.asarray(rng.uniform(-1, 1, 3), np.float16),
)

# --------------------------------------------------------------------------------------
# custom_jvp and custom_vjp.
# --------------------------------------------------------------------------------------


@jax.custom_jvp
def safe_norm(x):
    return jnp.sqrt(jnp.sum(x * x))


@safe_norm.defjvp
def _safe_norm_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    norm = safe_norm(x)
    nonzero = norm > 0
    denominator = jnp.where(nonzero, norm, 1.0)
    return norm, jnp.where(nonzero, jnp.vdot(x, t) / denominator, 0.0)


@jax.custom_jvp
def cube_doubled_slope(x):
    return x**3


@cube_doubled_slope.defjvp
def _cube_doubled_slope_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    # Deliberately not the true derivative: the custom rule must win.
    return x**3, 6.0 * x**2 * t


@jax.custom_jvp
def scaled_product(x, y):
    return x * y


@scaled_product.defjvp
def _scaled_product_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    return x * y, 2.0 * y * tx + 3.0 * x * ty


@jax.custom_vjp
def times_total(x):
    return x * jnp.sum(x)


def _times_total_fwd(x):
    return x * jnp.sum(x), x


def _times_total_bwd(x, g):
    # The true cotangent is g * sum(x) + vdot(g, x); the second term is halved.
    return (g * jnp.sum(x) + 0.5 * jnp.vdot(g, x),)


times_total.defvjp(_times_total_fwd, _times_total_bwd)


@jax.custom_vjp
def skewed_product(x, y):
    return x * y


def _skewed_product_fwd(x, y):
    return x * y, (x, y)


def _skewed_product_bwd(residuals, g):
    x, y = residuals
    return g * y, 3.0 * g * x


skewed_product.defvjp(_skewed_product_fwd, _skewed_product_bwd)


P("relu_at_zero", jax.nn.relu, FIX([-1.0, 0.0, 0.5, 0.0]), float64=True)
P("relu_of_matvec", lambda w, x: jax.nn.relu(w @ x), U(3, 4), U(4), argnums=(0, 1))
P("softplus", jax.nn.softplus, U(5, lo=-3.0, hi=3.0))
P("safe_norm_at_zero", safe_norm, FIX([0.0, 0.0, 0.0]), float64=True)
P("safe_norm_nonzero", lambda x: safe_norm(x) * x, NZ(3))
P("custom_jvp_elementwise", cube_doubled_slope, U(4), float64=True)
P("custom_jvp_two_args", scaled_product, U(3), U(3), argnums=(0, 1))
P("custom_jvp_in_jit", jax.jit(lambda x: cube_doubled_slope(jnp.sin(x))), U(3))
P("custom_vjp_elementwise", doubled_sin, U(4), refs=("rev",), float64=True)
P("custom_vjp_non_elementwise", times_total, U(4), refs=("rev",), float64=True)
P(
    "custom_vjp_two_args",
    lambda x, y: skewed_product(jnp.exp(x), y),
    U(3),
    U(3),
    argnums=(0, 1),
    refs=("rev",),
)
P("softmax", jax.nn.softmax, U(4), float64=True)
P("log_softmax", jax.nn.log_softmax, U(2, 3))

# --------------------------------------------------------------------------------------
# Pytrees, argnums, outputs, constants, non-differentiated arguments.
# --------------------------------------------------------------------------------------

P(
    "dict_in_scalar_out",
    lambda p: jnp.sum(jnp.sin(p["a"]) * p["b"]),
    TREE(a=U(3), b=U(3)),
    float64=True,
)
P(
    "dict_in_nested_out",
    lambda p: {"u": (p["a"] * 2.0, jnp.sum(p["b"])), "v": {"w": p["a"] @ p["b"]}},
    TREE(a=U(3), b=U(3)),
    float64=True,
)
P(
    "tuple_out_two_args",
    lambda x, y: (x * y, jnp.sin(x)),
    U(3),
    U(3),
    argnums=(0, 1),
)
P(
    "list_in",
    lambda xs: xs[0] * jnp.cos(xs[1]),
    lambda rng, dtype: [U(3)(rng, dtype), U(3)(rng, dtype)],
)
P(
    "nested_tuple_in",
    lambda t: t[0] + t[1][0] * t[1][1],
    lambda rng, dtype: (U(2)(rng, dtype), (U(2)(rng, dtype), U()(rng, dtype))),
)
P(
    "argnums_skip_middle",
    lambda x, c, y: jnp.sin(x) * c + y,
    U(3),
    U(3),
    U(3),
    argnums=(0, 2),
)
P("argnums_single_tuple", lambda x, y: x * jnp.exp(y), U(3), U(3), argnums=(1,))
P("argnums_int_second", lambda x, y: x * jnp.exp(y), U(3), U(3), argnums=1)
P(
    "argnums_reversed",
    lambda x, y: x * jnp.exp(y),
    U(3),
    U(3),
    argnums=(1, 0),
)
P(
    "shared_multi_output",
    lambda x: (jnp.sin(x) * 2.0, jnp.sin(x) + jnp.cos(x), jnp.sum(x)),
    U(3),
)


def _output_reused(x):
    y = jnp.sin(x)
    z = y * y + 1.0
    return y, z


P("output_also_used_later", _output_reused, U(4), float64=True)
P("output_is_input", lambda x: (x, jnp.sin(x)), U(3), float64=True)
P("output_is_input_twice", lambda x: (x, x), U(3))
P("output_only_input", lambda x: x, U(2, 2))
P("input_passthrough_other_arg", lambda x, y: (x, y * 2.0), U(2), U(3), argnums=(0, 1))
P("constant_output", lambda x: (jnp.sin(x), jnp.ones(2, x.dtype)), U(3))
P("only_constant_output", lambda x: jnp.full((2,), 3.0, x.dtype), U(3))
P("closed_over_numpy", lambda x: _c(x, _W45).T @ jnp.sin(x), U(4), float64=True)
P(
    "closed_over_jax",
    lambda x: x * jnp.asarray(_V4, x.dtype) + jnp.sum(x),
    U(4),
)
P("int_array_arg", lambda x, n: x * n + jnp.sin(x), U(3), INT([1, 2, 3]))
P("python_int_arg", lambda x, n: x**n, U(3), PY(3))
P("int_array_power", lambda x, n: jnp.power(x, n), U(3, lo=0.5, hi=2.0), INT(3))
P("python_float_arg_undiff", lambda x, s: jnp.sin(x) * s, U(3), PY(2.5))
# The Jacobian is float64 (the dtype of `s`) but holds `sin(x)` computed in float32:
# backends round float32 `sin` differently, so compare to float32 precision.
P(
    "python_float_arg_diff",
    lambda x, s: jnp.sin(x) * s,
    U(3),
    PY(2.5),
    argnums=1,
    tol_dtype=np.float32,
)
P("python_float_times_literal", lambda x: 3.0 * x**2 + 1.0, PY(2.0))
P(
    "bool_arg",
    lambda x, m: jnp.where(m, x, -x) * x,
    U(4),
    INT([True, False, True, False], np.bool_),
)
P("scalar_in_scalar_out", lambda x: jnp.sin(x) * jnp.exp(x), U(), float64=True)
P("vector_to_scalar", lambda x: jnp.sum(jnp.sin(x) ** 2), U(4))
P(
    "has_aux_input",
    lambda x, y: (jnp.sin(x) * y, {"s": x}),
    U(3),
    U(3),
    argnums=(0, 1),
    has_aux=True,
    float64=True,
)


def _aux_intermediate(x):
    h = jnp.tanh(x)
    return jnp.sum(h * h), h


P("has_aux_intermediate", _aux_intermediate, U(4), has_aux=True)
P(
    "has_aux_argnums_int",
    lambda x, y: (x @ y, (x.sum(), y)),
    U(3),
    U(3),
    argnums=1,
    has_aux=True,
)

# --------------------------------------------------------------------------------------
# Transformations and control flow inside the function.
# --------------------------------------------------------------------------------------

P(
    "nested_jit",
    lambda x: jax.jit(lambda v: jnp.sin(v) * v)(x) + 1.0,
    U(4),
    float64=True,
)
P(
    "double_nested_jit",
    jax.jit(lambda x: jax.jit(lambda v: jnp.exp(v) @ v)(x) * x),
    U(3),
)
P(
    "jit_static_arg",
    lambda x: jax.jit(lambda v, n: v**n, static_argnums=1)(x, 3),
    U(3),
)
P(
    "jit_multiple_outputs",
    lambda x, y: jax.jit(lambda a, b: (a * b, a - b))(x, y),
    U(3),
    U(3),
    argnums=(0, 1),
)
P(
    "vmap_rows",
    lambda m, v: jax.vmap(lambda r: jnp.dot(r, v))(m),
    U(3, 4),
    U(4),
    argnums=(0, 1),
    float64=True,
)
P(
    "vmap_in_axes_none",
    lambda x, s: jax.vmap(lambda a, b: jnp.sin(a) * b, in_axes=(0, None))(x, s),
    U(3, 2),
    U(2),
    argnums=(0, 1),
)
P(
    "cond",
    lambda x: lax.cond(jnp.sum(x) > 0, lambda v: jnp.sin(v) * 2.0, jnp.cos, x),
    U(4, lo=0.1, hi=1.0),
    float64=True,
)
P(
    "cond_false_branch",
    lambda x: lax.cond(jnp.sum(x) > 0, lambda v: jnp.sin(v) * 2.0, jnp.cos, x),
    U(4, lo=-1.0, hi=-0.1),
)
P(
    "cond_two_operands",
    lambda x, y: lax.cond(x[0] > y[0], lambda a, b: a * b, lambda a, b: a + b, x, y),
    U(3),
    U(3),
    argnums=(0, 1),
)
P(
    "switch",
    lambda x, k: lax.switch(k, [jnp.sin, jnp.cos, lambda v: v * v], x),
    U(3),
    INT(2),
)


def _scan_carry_only(x):
    def step(c, _):
        return jnp.sin(c) * 1.5 + c, None

    return lax.scan(step, x, None, length=3)[0]


def _scan_carry_and_ys(x, xs):
    def step(c, a):
        c = jnp.sin(c) * a + c
        return c, c * 2.0

    return lax.scan(step, x, xs)


def _scan_reverse(x):
    def step(c, a):
        return c * a, c + a

    return lax.scan(step, jnp.ones((), x.dtype), x, reverse=True)


P("scan_carry", _scan_carry_only, U(3), float64=True)
P("scan_carry_and_ys", _scan_carry_and_ys, U(3), U(4, 3), argnums=(0, 1), float64=True)
P("scan_reverse", _scan_reverse, U(4))
P("lax_map", lambda x: lax.map(lambda r: jnp.sum(jnp.sin(r)), x), U(3, 2))


def _while_fixed_count(x):
    def body(state):
        i, v = state
        return i + 1, jnp.sin(v) * 1.1 + v

    return lax.while_loop(lambda s: s[0] < 3, body, (0, x))[1]


def _while_data_dependent(x):
    return lax.while_loop(lambda v: jnp.sum(v * v) < 10.0, lambda v: v * 1.5, x)


P("while_fixed_count", _while_fixed_count, U(3), refs=("fwd",), float64=True)
P("while_data_dependent", _while_data_dependent, U(3, lo=0.5, hi=1.0), refs=("fwd",))
P(
    "fori_loop_static",
    lambda x: lax.fori_loop(0, 3, lambda i, v: jnp.cos(v) * v + i, x),
    U(3),
    float64=True,
)
P(
    "fori_loop_traced_bound",
    lambda x, n: lax.fori_loop(0, n, lambda i, v: jnp.sin(v) + v, x),
    U(3),
    INT(3),
    refs=("fwd",),
)
P("checkpoint", lambda x: jax.checkpoint(lambda v: jnp.sin(jnp.sin(v)) * v)(x), U(4))
P(
    "checkpoint_policy",
    lambda x: jax.checkpoint(
        lambda v: jnp.exp(v) @ jnp.cos(v),
        policy=jax.checkpoint_policies.nothing_saveable,
    )(x),
    U(3),
)
P(
    "checkpoint_in_scan",
    lambda x: lax.scan(
        jax.checkpoint(lambda c, a: (jnp.tanh(c * a), c)), x, jnp.ones((2, 3), x.dtype)
    ),
    U(3),
)


# --------------------------------------------------------------------------------------
# Tests.
# --------------------------------------------------------------------------------------

_BY_NAME = {p.name: p for p in PROGRAMS}


def test_table_size_and_names():
    assert len(_BY_NAME) == len(PROGRAMS), "program names must be unique"
    assert len(PROGRAMS) >= 150


@functools.cache
def _references(name: str, dtype_name: str) -> dict[str, Any]:
    program = _BY_NAME[name]
    return reference_jacobians(
        program.fun,
        program.args(dtype_name),
        argnums=program.argnums,
        has_aux=program.has_aux,
        refs=program.refs,
    )


# The named orders each of `order` may repeat the vertex sequence of. Each of these is
# a case of its own, and a heuristic that repeats one of them is skipped in favour of
# it (Markowitz order is forward or reverse order on most of these small graphs), so
# `auto` (which picks one of the five) always repeats one.
_MAY_REPEAT = {
    "markowitz": ("fwd", "rev"),
    "relative_markowitz": ("fwd", "rev", "markowitz"),
    "min_fill": ("fwd", "rev", "markowitz"),
    "auto": ("fwd", "rev", "markowitz", "relative_markowitz", "min_fill"),
}


def _run(program: Program, dtype: Any, order: str) -> None:
    args = program.args(dtype)
    same = None
    if order in _MAY_REPEAT:
        same = repeated_order(
            program.fun,
            args,
            order,
            _MAY_REPEAT[order],
            argnums=program.argnums,
            has_aux=program.has_aux,
        )
    if same is not None:
        pytest.skip(f"{order!r} eliminates in the same order as {same!r} here")
    rtol = atol = None
    if program.tol_dtype is not None:
        rtol, atol = tolerances(program.tol_dtype)
    check_jacve(
        program.fun,
        args,
        order,
        argnums=program.argnums,
        has_aux=program.has_aux,
        references=_references(program.name, np.dtype(dtype).name),
        seed=program.seed,
        rtol=rtol,
        atol=atol,
    )


# The greedy heuristics beyond Markowitz run through the whole parity table too.
PARITY_ORDERS = ORDERS + ("relative_markowitz", "min_fill")


@pytest.mark.parametrize("order", PARITY_ORDERS)
@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_parity_float32(program, order):
    _run(program, np.float32, order)


@pytest.mark.parametrize("order", PARITY_ORDERS)
@pytest.mark.parametrize(
    "program", [p for p in PROGRAMS if p.float64], ids=lambda p: p.name
)
def test_parity_float64(program, order):
    _run(program, np.float64, order)


# Complex intermediates are pairs of real vertices; tests/test_complex.py has more.
COMPLEX_PROGRAMS = [
    lambda x: jnp.real(x * (1.0 + 2.0j)) + jnp.imag(x * x * 1j),
    lambda x: jnp.abs(jnp.fft.fft(x)),
]


@pytest.mark.parametrize("fun", COMPLEX_PROGRAMS)
@pytest.mark.parametrize("order", ["fwd", "rev", "auto"])
def test_complex_intermediates(fun, order):
    x = jnp.linspace(0.1, 0.9, 4)
    check_jacve(fun, (x,), order)
