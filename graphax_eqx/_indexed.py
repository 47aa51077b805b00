"""Static sparse patterns: the partials of index-moving primitives.

Slices, pads, concatenates, rolls, gathers and scatter-adds with indices known at trace
time have Jacobians with a few nonzeros per row. Their partial is a
`graphax_eqx.CooTensor`: some output axes are *tied* to input axes (the axes the
primitive does not move, as for elementwise ops), and the remaining *free* axes carry a
list of `(row, col)` coordinates held in NumPy at trace time.

Products and sums of such partials are planned symbolically at trace time (which
entries meet, where each product lands) and run as a gather of the value arrays, one
multiply and a segment sum. Composing pure index maps costs nothing at run time. A
result whose density passes `DENSE_FRACTION` is stored densely instead.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import threading
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import sparse as jsparse
from jaxtyping import Array

from . import _jax_private as jp
from ._sparse import (
    BlockShape,
    Pattern,
    SparseTensor,
    _cast,
    _dtype_str,
    _transpose,
    batched_bcoo,
    batched_dense,
    eager_compiled,
    full_mask,
    is_known,
    known,
    make_pattern,
    vmapped_axes,
    without_tangent_mask,
)


# A product or sum whose free part is denser than this, and large, is stored densely:
# past it, a dense `dot_general` beats gathers and segment sums (see
# benchmarks/NOTES.md). Its structural zeros are then stored too.
DENSE_FRACTION = 0.5
DENSE_MIN_SIZE = 1 << 14
# A product whose entry pairs number more than 1/DENSE_PRODUCT_RATIO of the dense
# product's multiplications runs densely: on CPU a pair (gather, multiply, segment
# sum) costs about as much as 100 multiplications of a dense `dot_general` (measured
# with 384 × 384 random patterns; see benchmarks/NOTES.md).
DENSE_PRODUCT_RATIO = 100
# Beyond this many entry pairs, a product is not planned entry by entry.
MAX_PAIRS = 1 << 26
# Gathers of at most `SMALL_TAKE` entries by static indices, in at most
# `SMALL_TAKE_RUNS` runs of consecutive indices, are emitted as slices.
SMALL_TAKE = 16
SMALL_TAKE_RUNS = 8


def _index_dtype(n: int):
    return np.int32 if n < 2**31 else np.int64


@dataclasses.dataclass(frozen=True, eq=False)
class CooPattern:
    """The static structure of a `graphax_eqx.CooTensor`.

    `ties` pairs an output axis with an input axis of equal size (ascending output
    axis); `varying[t]` says whether the value varies along tie `t`. Every other axis is
    free: `rows[e]` / `cols[e]` are the flat (row-major) indices of entry `e` over the
    free output / input axes, in ascending axis order. Entries are distinct. The value
    array, when there is one, has shape `(size of each varying tie..., nnz)`.
    """

    out_shape: tuple[int, ...]
    in_shape: tuple[int, ...]
    ties: tuple[tuple[int, int], ...]
    varying: tuple[bool, ...]
    rows: np.ndarray
    cols: np.ndarray

    def __post_init__(self):
        assert len(self.ties) == len(self.varying)
        assert self.rows.shape == self.cols.shape and self.rows.ndim == 1
        self.rows.flags.writeable = False
        self.cols.flags.writeable = False

    @functools.cached_property
    def _key(self) -> tuple:
        # A cheap fingerprint (a sample and two sums); equality compares in full.
        step = max(1, self.nnz // 512)
        sample = (self.rows[::step] * 7919 + self.cols[::step]).tobytes()
        sums = (int(self.rows.sum()), int(self.cols.sum()), int(self.rows @ self.cols))
        return (self.out_shape, self.in_shape, self.ties, self.varying, sample, sums)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        if self is other:
            return True
        return (
            isinstance(other, CooPattern)
            and self._key == other._key
            and np.array_equal(self.rows, other.rows)
            and np.array_equal(self.cols, other.cols)
        )

    @property
    def shape(self) -> tuple[int, ...]:
        return self.out_shape + self.in_shape

    @functools.cached_property
    def out_free(self) -> tuple[int, ...]:
        tied = {o for o, _ in self.ties}
        return tuple(k for k in range(len(self.out_shape)) if k not in tied)

    @functools.cached_property
    def in_free(self) -> tuple[int, ...]:
        tied = {i for _, i in self.ties}
        return tuple(k for k in range(len(self.in_shape)) if k not in tied)

    @property
    def out_free_shape(self) -> tuple[int, ...]:
        return tuple(self.out_shape[k] for k in self.out_free)

    @property
    def in_free_shape(self) -> tuple[int, ...]:
        return tuple(self.in_shape[k] for k in self.in_free)

    @property
    def n_out_free(self) -> int:
        return math.prod(self.out_free_shape)

    @property
    def n_in_free(self) -> int:
        return math.prod(self.in_free_shape)

    @property
    def nnz(self) -> int:
        return int(self.rows.shape[0])

    @property
    def tie_sizes(self) -> tuple[int, ...]:
        return tuple(self.out_shape[o] for o, _ in self.ties)

    @property
    def val_shape(self) -> tuple[int, ...]:
        sizes = [s for s, v in zip(self.tie_sizes, self.varying, strict=True) if v]
        return tuple(sizes) + (self.nnz,)

    @property
    def val_size(self) -> int:
        return math.prod(self.val_shape)

    @property
    def structural_nnz(self) -> int:
        return self.nnz * math.prod(self.tie_sizes)

    @property
    def density(self) -> float:
        return self.nnz / max(1, self.n_out_free * self.n_in_free)

    def with_varying(self, varying) -> CooPattern:
        varying = tuple(bool(v) for v in varying)
        if varying == self.varying:
            return self
        return CooPattern(
            self.out_shape, self.in_shape, self.ties, varying, self.rows, self.cols
        )


@dataclasses.dataclass(frozen=True, eq=False)
class MappedPattern(CooPattern):
    """The coordinates of a partial that is also a linear map cheap to apply (a
    convolution's), described by `linear` (a `graphax_eqx._sparse.LinearPattern`).

    A product picks one form by its cost (`mapped_choice`): the coordinates against
    sparse neighbours, the map against dense ones, where a gather per entry pair
    would cost several times the convolution that applies the map. Every other
    operation sees plain coordinates (`plain`).
    """

    linear: Any = None
    # Whether the map only copies entries (a slice, pad, gather, ... possibly
    # composed with elementwise factors), as opposed to a convolution's.
    copies: bool = False

    @functools.cached_property
    def _key(self) -> tuple:
        return CooPattern._key.func(self) + ("map", self.linear, self.copies)

    @functools.cached_property
    def plain(self) -> CooPattern:
        return CooPattern(
            self.out_shape, self.in_shape, self.ties, self.varying, self.rows, self.cols
        )


def plain(p):
    """`p` with the map of a `MappedPattern` dropped (any other pattern as it is)."""
    return p.plain if isinstance(p, MappedPattern) else p


class CooTensor(BlockShape, eqx.Module):
    """A sparse Jacobian block of shape `out_shape + in_shape` with static indices.

    Returned by `graphax_eqx.jacve` with `sparse_representation=True` where
    index-moving primitives (slices, pads, rolls, gathers, scatter-adds, ...) shaped the
    Jacobian. Axes the primitives did not move are *tied*: the block is zero off their
    diagonal. The other (*free*) axes store one value per structural nonzero, at the
    coordinates `pattern.rows` / `pattern.cols` known at trace time.

    It is a pytree whose children are the value array (and mask), so it passes through
    `jax.jit`, `jax.vmap` and `eqx.filter_jit`.

    Under `jax.vmap` the value array (and mask) gain the mapped axes in front, and
    `.dense()` and `.to_bcoo()` (a BCOO with as many batch dimensions) return them,
    as `jax.vmap(jax.jacfwd(f))` would. (A result always stores its values, ones for
    a pure index map, so that every leaf gains the mapped axes.)

    **Attributes:**

    - `val`: an array of shape `(size of each varying tie..., nnz)`, or `None` when
        every stored entry is exactly one (inside the elimination, never in a result).
    - `pattern`: the static `graphax_eqx._indexed.CooPattern`.
    - `dtype`: the dtype of the Jacobian.
    - `mask`: `None`, or a boolean array shaped like `val` marking selected-away
        entries (see `graphax_eqx.SparseTensor`).
    - `layout`: on a mesh with explicit axes, the `PartitionSpec` of the dense
        block (`jax.jacrev`'s), which `.dense()` gives it; else `None`.
    """

    val: Array | None
    pattern: CooPattern = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    mask: Array | None = None
    layout: Any = eqx.field(static=True, default=None)

    @property
    def nse(self) -> int:
        """The number of structurally nonzero entries."""
        return self.pattern.structural_nnz

    def dense(self) -> Array:
        """The Jacobian as a dense array of shape `out_shape + in_shape` (with the
        leading axes `jax.vmap` added, if any)."""
        block = without_tangent_mask(self)
        return eager_compiled(type(block)._dense_ops, block)

    def _dense_ops(self) -> Array:
        """`dense`, as the operations that compute it (not compiled apart)."""
        batch = vmapped_axes(self.val, self.pattern.val_shape)
        if batch:
            return batched_dense(self, batch)
        out = to_labeled(self)._dense_ops()
        return jp.laid_out(out, self.layout, self.val)

    def todense(self) -> Array:
        """Alias of `graphax_eqx.CooTensor.dense`."""
        return self.dense()

    def to_bcoo(self) -> jsparse.BCOO:
        """The Jacobian as a `jax.experimental.sparse.BCOO` matrix storing exactly the
        structural nonzeros."""
        block = without_tangent_mask(self)
        p = block.pattern
        batch = vmapped_axes(block.val, p.val_shape)
        if batch:
            return batched_bcoo(block, batch)
        nties = len(p.ties)
        tie_grid = np.indices(p.tie_sizes, dtype=np.int64)
        tie_grid = tie_grid.reshape(nties, math.prod(p.tie_sizes))
        ntie = tie_grid.shape[1]
        index = np.zeros((ntie, p.nnz, len(p.shape)), np.int64)
        nout = len(p.out_shape)
        for t, (o, i) in enumerate(p.ties):
            index[:, :, o] = tie_grid[t][:, None]
            index[:, :, nout + i] = tie_grid[t][:, None]
        out_c = _unravel(p.rows, p.out_free_shape)
        in_c = _unravel(p.cols, p.in_free_shape)
        for k, axis in enumerate(p.out_free):
            index[:, :, axis] = out_c[k][None, :]
        for k, axis in enumerate(p.in_free):
            index[:, :, nout + axis] = in_c[k][None, :]
        data = eager_compiled(_coo_data, block)
        index = index.reshape(ntie * p.nnz, len(p.shape)).astype(
            _index_dtype(max(p.shape, default=1))
        )
        return jsparse.BCOO((data.reshape(-1), jnp.asarray(index)), shape=p.shape)

    def __repr__(self) -> str:
        p = self.pattern
        shape = " ".join(map(str, p.out_shape)) + " | " + " ".join(map(str, p.in_shape))
        ties = ", ".join(
            f"{o}~{i}{' diagonal' if v else ''}"
            for (o, i), v in zip(p.ties, p.varying, strict=True)
        )
        val = (
            "val=1"
            if self.val is None
            else "val[" + "x".join(map(str, p.val_shape)) + "]"
        )
        return (
            f"CooTensor({_dtype_str(self.dtype)}[{shape.strip()}], ties=({ties}), "
            f"nnz={p.nnz} of {p.n_out_free}x{p.n_in_free} free, {val})"
        )


class MappedCooTensor(CooTensor):
    """A `CooTensor` whose pattern is a `MappedPattern`, with the map itself
    (`linear`, a `graphax_eqx._sparse.LinearMap`); only inside the elimination."""

    linear: Any = eqx.field(static=True, default=None)


def plain_tensor(x):
    """`x` with the map of a `MappedCooTensor` dropped."""
    if isinstance(x, CooTensor) and isinstance(x.pattern, MappedPattern):
        return CooTensor(x.val, x.pattern.plain, x.dtype, x.mask)
    return x


def mapped(ct, linear, copies: bool = False):
    """`ct` (a partial) as a `MappedCooTensor` that is also `linear`, where it is
    stored by coordinates; any other partial as it is. `copies`: whether `linear`
    only copies entries."""
    if type(ct) is not CooTensor:
        return ct
    p = ct.pattern
    pattern = MappedPattern(
        p.out_shape,
        p.in_shape,
        p.ties,
        p.varying,
        p.rows,
        p.cols,
        linear.pattern,
        copies,
    )
    return MappedCooTensor(ct.val, pattern, ct.dtype, ct.mask, linear=linear)


def as_map(x):
    """The linear map of a partial with a `MappedPattern`.

    A tensor that carries its map gives it. Any other (a pattern passed on unchanged
    with other values) is applied through its coordinates, which is exact whatever
    its values are."""
    from ._sparse import LinearMap

    if isinstance(x, MappedCooTensor) and x.linear is not None:
        return x.linear
    pattern = x.pattern
    assert isinstance(pattern, MappedPattern)
    linear = pattern.linear
    x = plain_tensor(x)
    return LinearMap(
        lambda t: apply_partial(x, t), lambda y: apply_partial_t(x, y), linear, x.dtype
    )


def _as_array(out) -> Array:
    if isinstance(out, CooTensor):
        out = to_labeled(out)
    return out._dense_ops()


def apply_partial(x, t: Array) -> Array:
    """A partial (stored, by coordinates or labels) applied to `t` (shape
    `in_shape`): entry by entry over coordinates."""
    from ._sparse import dense, product

    out, _ = product(x, dense(t, x.in_shape, ()))
    return _as_array(out)


def apply_partial_t(x, y: Array) -> Array:
    """The transpose of a stored partial applied to `y` (shape `out_shape`)."""
    from ._sparse import dense, product

    out, _ = product(dense(y, (), x.out_shape), x)
    return _as_array(out)


def _coo_data(ct: CooTensor) -> Array:
    return _full_val(ct, ct.pattern)


def _full_val(ct: CooTensor, p: CooPattern) -> Array:
    """The value over `(every tie..., nnz)`, ones where there is no value."""
    full = p.tie_sizes + (p.nnz,)
    if ct.val is None:
        return jnp.ones(full, ct.dtype)
    dims = tuple(t for t, v in enumerate(p.varying) if v) + (len(p.ties),)
    val = ct.val
    if ct.mask is not None:
        val = lax.select(ct.mask, lax.full_like(val, 0), val)
    return lax.broadcast_in_dim(val, full, dims)


def _unravel(flat: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    if not shape:
        return ()
    return tuple(np.asarray(c) for c in np.unravel_index(flat, shape))


def _ravel(coords, shape: tuple[int, ...], n: int) -> np.ndarray:
    if not shape:
        return np.zeros(n, np.int64)
    return np.asarray(np.ravel_multi_index(tuple(coords), shape), np.int64)


#
# Building patterns from index maps.
#


def from_entries(
    out_shape: tuple[int, ...],
    in_shape: tuple[int, ...],
    rows: np.ndarray,
    cols: np.ndarray,
    dtype,
    weights: tuple[np.ndarray, Array] | None = None,
):
    """The partial with distinct entries `(rows[e], cols[e])` (flat indices over the
    whole output / input), with ties found automatically.

    Without `weights` every entry is one. With `weights = (index, values)`, entry `e`
    is `values[index[e]]` (`values` a 1-D array, traced or not); a tie is then only
    taken where the weights repeat along it.

    Full free parts come back as a `graphax_eqx.SparseTensor`; others as a
    `graphax_eqx.CooTensor`.
    """
    widx = None if weights is None else weights[0]
    p, widx = entry_pattern(out_shape, in_shape, rows, cols, widx)
    val = None
    if weights is not None:
        assert widx is not None
        values = jnp.asarray(weights[1])
        val = _cast(_take_last(values, widx), dtype)
    return finish(CooTensor(val, p, jnp.dtype(dtype)))


def entry_pattern(
    out_shape: tuple[int, ...],
    in_shape: tuple[int, ...],
    rows: np.ndarray,
    cols: np.ndarray,
    widx: np.ndarray | None = None,
) -> tuple[CooPattern, np.ndarray | None]:
    """The pattern of `from_entries`, and `widx` in its entry order (entries sorted by
    row, then column, over the free axes)."""
    out_shape = tuple(int(s) for s in out_shape)
    in_shape = tuple(int(s) for s in in_shape)
    rows = np.asarray(rows, np.int64)
    cols = np.asarray(cols, np.int64)
    widx = None if widx is None else np.asarray(widx, np.int64)
    out_c = list(_unravel(rows, out_shape)) if out_shape else []
    in_c = list(_unravel(cols, in_shape)) if in_shape else []
    out_axes = list(range(len(out_shape)))
    in_axes = list(range(len(in_shape)))
    ties = []
    for o in range(len(out_shape)):
        for i in list(in_axes):
            n = out_shape[o]
            if in_shape[i] != n or not n:
                continue
            ko, ki = out_axes.index(o), in_axes.index(i)
            if not np.array_equal(out_c[ko], in_c[ki]):
                continue
            rest_o = [c for k, c in enumerate(out_c) if k != ko]
            rest_i = [c for k, c in enumerate(in_c) if k != ki]
            shape_o = tuple(out_shape[a] for a in out_axes if a != o)
            shape_i = tuple(in_shape[a] for a in in_axes if a != i)
            key = _ravel(rest_o, shape_o, len(rows)) * max(1, math.prod(shape_i))
            key = key + _ravel(rest_i, shape_i, len(rows))
            if len(key) % n:
                continue
            if widx is not None:
                key = _pair_key(key, widx)
            axis = 0 if key.ndim == 2 else None
            _, counts = np.unique(key, return_counts=True, axis=axis)
            if not np.all(counts == n):
                continue
            keep = out_c[ko] == 0
            ties.append((o, i))
            out_c = [c[keep] for k, c in enumerate(out_c) if k != ko]
            in_c = [c[keep] for k, c in enumerate(in_c) if k != ki]
            out_axes.remove(o)
            in_axes.remove(i)
            rows = rows[keep]
            if widx is not None:
                widx = widx[keep]
            break
    n_entries = len(rows)
    free_out = tuple(out_shape[a] for a in out_axes)
    free_in = tuple(in_shape[a] for a in in_axes)
    r = _ravel(out_c, free_out, n_entries)
    c = _ravel(in_c, free_in, n_entries)
    order = np.lexsort((c, r))
    p = CooPattern(
        out_shape,
        in_shape,
        tuple(ties),
        (False,) * len(ties),
        r[order],
        c[order],
    )
    return p, None if widx is None else widx[order]


def _pair_key(key: np.ndarray, widx: np.ndarray) -> np.ndarray:
    """One integer per `(key, widx)` pair where the pairs fit in int64 (a sort of
    integers, where rows of a 2-column array sort about 20 times slower), else the
    pairs as rows."""
    span = int(widx.max()) + 1 if len(widx) else 1
    if len(key) and (int(key.max()) + 1) * span >= 2**62:
        return np.stack([key, widx], axis=1)
    return key * span + widx


def finish(ct: CooTensor):
    """`ct`, or its `graphax_eqx.SparseTensor` where its free part is better stored
    densely."""
    if _store_dense(ct.pattern):
        return to_labeled(ct)
    return ct


def _store_dense(p: CooPattern) -> bool:
    """Whether `p` is better stored dense on its free axes.

    A full free part loses nothing. Otherwise only large, dense free parts are: dense
    storage stores structural zeros, and a tie that a later sum or product separates
    turns a dense free part into a dense square block, where coordinates grow only
    linearly.
    """
    size = p.n_out_free * p.n_in_free
    if p.nnz == size:
        return True
    return size >= DENSE_MIN_SIZE and p.nnz > DENSE_FRACTION * size


#
# Conversions.
#


def _labels_of(p: CooPattern):
    nties = {o: t for t, (o, _) in enumerate(p.ties)}
    tiesi = {i: t for t, (_, i) in enumerate(p.ties)}
    labels = [
        ("t", nties[k]) if k in nties else ("o", k) for k in range(len(p.out_shape))
    ]
    labels += [
        ("t", tiesi[k]) if k in tiesi else ("i", k) for k in range(len(p.in_shape))
    ]
    val_labels = [("t", t) for t, v in enumerate(p.varying) if v]
    val_labels += [("o", k) for k in p.out_free] + [("i", k) for k in p.in_free]
    return labels, val_labels


@functools.lru_cache(maxsize=4096)
def labeled_pattern(p: CooPattern) -> tuple[Pattern, tuple[int, ...]]:
    """The pattern (dense on the free axes) that `to_labeled` gives, and the
    permutation from the scattered value layout to it."""
    labels, val_labels = _labels_of(p)
    return make_pattern(p.out_shape, p.in_shape, tuple(labels), tuple(val_labels))


# Dense blocks of pure index maps (every entry one) with more entries than this are
# scattered at run time rather than embedded as constants.
CONSTANT_BLOCK_MAX = 2**20

# Scatters into a dense block with at least this many entries index its rows and
# columns separately (a flat position would overflow int32 indices).
FLAT_INDEX_LIMIT = 2**31


def _scatter_free(val: Array, p: CooPattern, fill) -> Array:
    """`(vary..., nnz)` values scattered to `(vary..., *out_free, *in_free)`."""
    lead = tuple(val.shape[:-1])
    flat = p.rows * p.n_in_free + p.cols
    size = p.n_out_free * p.n_in_free
    if p.nnz == size and np.array_equal(flat, np.arange(size)):
        out = val
    else:
        # Banded results list their entries by diagonal, not in flat order: the
        # hint is given only where it holds (a false one may mislead XLA).
        ordered = bool(np.all(flat[1:] > flat[:-1]))
        if size < FLAT_INDEX_LIMIT:
            out = jnp.full(lead + (size,), fill, val.dtype)
            idx = flat.astype(np.int32)
            out = out.at[..., idx].set(
                val, unique_indices=True, indices_are_sorted=ordered
            )
        else:
            # Flat positions past int32 (indices are int32 without x64): rows and
            # columns are indexed separately.
            n_out, n_in = p.n_out_free, p.n_in_free
            out = jnp.full(lead + (n_out, n_in), fill, val.dtype)
            rows = p.rows.astype(_index_dtype(n_out))
            cols = p.cols.astype(_index_dtype(n_in))
            out = out.at[..., rows, cols].set(
                val, unique_indices=True, indices_are_sorted=ordered
            )
    return lax.reshape(out, lead + p.out_free_shape + p.in_free_shape)


def to_labeled(ct: CooTensor) -> SparseTensor:
    """`ct` as a `graphax_eqx.SparseTensor`, dense on its free axes."""
    p = ct.pattern
    pattern, perm = labeled_pattern(p)
    if ct.val is None:
        if p.n_out_free * p.n_in_free > CONSTANT_BLOCK_MAX:
            # Scattered when it runs: as a constant, the block would be embedded in
            # the program (a 20,000-entry permutation: 1.6 GB, 35 s to compile).
            ones = jnp.ones((p.nnz,), ct.dtype)
            return SparseTensor(
                _transpose(_scatter_free(ones, p, 0), perm), pattern, ct.dtype
            )
        flat = np.zeros(p.n_out_free * p.n_in_free, np.dtype(ct.dtype))
        flat[p.rows * p.n_in_free + p.cols] = 1
        val = jnp.asarray(flat.reshape(p.out_free_shape + p.in_free_shape))
        val = _transpose(val, perm)
        return SparseTensor(val, pattern, ct.dtype)
    val = _transpose(_scatter_free(ct.val, p, 0), perm)
    mask = None
    if ct.mask is not None:
        # Entries off the coordinates hold no term: selected away too.
        mask = _transpose(_scatter_free(ct.mask, p, True), perm)
    return SparseTensor(_cast(val, ct.dtype), pattern, ct.dtype, mask)


# A vectorised batch of Jacobians with at most this many entries each (per entry of
# the batch axes) is computed densely; see `densify_small_blocks`.
SMALL_BLOCK = 32


def _free_size(partial) -> int | None:
    """Entries per tie (the product of the free axes' sizes) of a partial stored by
    ties and coordinates or labels, else `None`."""
    if isinstance(partial, CooTensor):
        return partial.pattern.n_out_free * partial.pattern.n_in_free
    if isinstance(partial, SparseTensor):
        p = partial.pattern
        counts = collections.Counter(p.labels)
        return math.prod(p.sizes[label] for label, c in counts.items() if c == 1)
    return None


def densify_small_blocks(graph, structure) -> bool:
    """Store the coordinate partials of `graph` densely on their free axes when the
    graph is a vectorised batch of small Jacobians; returns whether it did.

    A function written on a batch axis (`x[:, i]` of a `(B, n)` array, elementwise
    formulas, `stack(..., axis=1)`) has partials tied on the batch, each a small block
    per batch entry. Stored by coordinates, every sum of two blocks with different
    entries gathers both into their union, and XLA evaluates those gathers entry by
    entry inside the kernel that writes the result. Stored densely (as `jax.jacfwd`
    stores its tangents), products and sums are broadcast arithmetic. That is done
    when every partial has at most `SMALL_BLOCK` entries per tie and every coordinate
    partial is tied on more entries than its block has. The exact patterns of the
    Jacobian's blocks are found first, by eliminating the graph's patterns as they
    are, and kept in `graph.exact`: the
    blocks are read back to those entries once eliminated (`restore_exact`), so the
    result stores exactly its structural nonzeros."""
    from ._eliminate import sim_edge
    from ._simulator import Simulator

    edges = [e for row in graph.succ.values() for e in row.values()]
    coo = [e for e in edges if isinstance(e, CooTensor)]
    # Coordinates on small blocks of a batch: every coordinate partial tied on more
    # entries than its block has (a small mesh's index maps are not a batch).
    if not coo or any(
        math.prod(e.pattern.tie_sizes) <= e.pattern.n_out_free * e.pattern.n_in_free
        for e in coo
    ):
        return False
    for e in edges:
        size = _free_size(e)
        if size is None or size > SMALL_BLOCK:
            return False
    sim = Simulator(graph.copy_with(sim_edge), list(structure.intermediates))
    state = sim.start()
    for i in sorted(state.remaining):
        sim.eliminate(state, i)
    exact = {}
    ins: dict[int, int] = {}
    outs: dict[int, int] = {}
    for iu, row in enumerate(state.succ):
        for iw, k in row.items():
            pattern = sim.edge(k).pattern
            u, w = sim.vertices[iu], sim.vertices[iw]
            if isinstance(pattern, CooPattern):
                exact[u, w] = pattern
            out_free, in_free = _free_sizes(pattern)
            ins[u] = max(ins.get(u, 0), in_free)
            outs[w] = max(outs.get(w, 0), out_free)
    for u, row in graph.succ.items():
        for w, e in list(row.items()):
            if isinstance(e, CooTensor):
                graph.set(u, w, _densified(e))
    graph.exact = exact
    graph.block_sizes = (sum(ins.values()), sum(outs.values()))
    return True


def _free_sizes(pattern) -> tuple[int, int]:
    """(output, input) entries per tie of a partial's pattern."""
    if isinstance(pattern, CooPattern):
        return pattern.n_out_free, pattern.n_in_free
    counts = collections.Counter(pattern.labels)
    n_out = len(pattern.out_shape)
    out_labels, in_labels = pattern.labels[:n_out], pattern.labels[n_out:]
    return tuple(  # pyright: ignore
        math.prod(pattern.sizes[a] for a in side if counts[a] == 1)
        for side in (out_labels, in_labels)
    )


def _densified(e: CooTensor) -> SparseTensor:
    """`e` stored densely on its free axes, its structural zeros selected away: a
    product through them holds no term, so an infinite partial meets no zero there
    (as on coordinates) and the Jacobian's NaNs stay where the coordinates put them.

    A pure index map (no values, nothing selected away) becomes a block of zeros and
    ones known when the program is traced, held as a NumPy array: products with it
    select entries rather than multiply them (see `graphax_eqx._sparse.
    _select_contraction`), which keeps those NaN semantics without a mask."""
    if e.mask is None and e.val is None:
        assert not any(e.pattern.varying)
        p = e.pattern
        pattern, perm = labeled_pattern(p)
        flat = np.zeros(p.n_out_free * p.n_in_free, np.dtype(e.dtype))
        flat[p.rows * p.n_in_free + p.cols] = 1
        block = flat.reshape(p.out_free_shape + p.in_free_shape)
        return SparseTensor(known(np.transpose(block, perm)), pattern, e.dtype)
    if e.mask is None:
        val = e.val
        if val is None:
            assert not any(e.pattern.varying)
            val = jnp.ones((e.pattern.nnz,), e.dtype)
        e = CooTensor(val, e.pattern, e.dtype, jnp.zeros(val.shape, bool))
    return to_labeled(e)


def settle_known_blocks(graph, masked: bool) -> None:
    """Store the blocks `_densified` keeps known when the program is traced as
    arrays: before an order other than forward and reverse mode is eliminated
    (`masked`, with their structural zeros as a mask), and after every elimination
    (those no product consumed), as results are.

    Eliminated in forward (reverse) order, every product is a partial times an
    accumulated tangent (cotangent) block, as in `jax.jacfwd` (`jax.jacrev`): a block
    entry no path reaches is zero there as in JAX's tangents, and a known block,
    applied by selection, moves entries as JAX's index maps do. Other orders multiply
    accumulated blocks with one another, where such a zero would meet an infinite
    partial that neither of JAX's modes multiplies by it: there every entry that
    holds no term is selected away, as on coordinates."""
    for u, row in graph.succ.items():
        for w, e in list(row.items()):
            if not isinstance(e, SparseTensor):
                continue
            if not (is_known(e.val) or is_known(e.mask)):
                continue
            mask = e.mask
            if masked and is_known(e.val):
                mask = np.asarray(e.val) == 0
            val = None if e.val is None else jnp.asarray(np.asarray(e.val))
            mask = None if mask is None else jnp.asarray(np.asarray(mask))
            graph.set(u, w, SparseTensor(val, e.pattern, e.dtype, mask))


def restore_exact(graph) -> None:
    """Read the blocks that `densify_small_blocks` computed densely back to their
    exact entries (one gather each)."""
    for (u, w), pattern in graph.exact.items():
        block = graph.succ[u].get(w)
        if not isinstance(block, SparseTensor):
            continue
        if block.val is not None and pattern.nnz < block.pattern.val_size:
            # Written apart first: fused with the gather below, the elimination
            # would be evaluated entry by entry (see `_jax_private.write_apart`).
            block = dataclasses.replace(block, val=jp.write_apart(block.val))
        full = to_coo(block)
        p = full.pattern
        if p.ties != pattern.ties or p.shape != pattern.shape:
            continue  # not expected; the dense block stays correct
        keys = p.rows * p.n_in_free + p.cols
        order = np.argsort(keys, kind="stable")
        at = order[
            np.searchsorted(keys[order], pattern.rows * p.n_in_free + pattern.cols)
        ]
        exact = CooPattern(
            p.out_shape, p.in_shape, p.ties, p.varying, pattern.rows, pattern.cols
        )
        val = None if full.val is None else _take_last(full.val, at)
        mask = None if full.mask is None else _take_last(full.mask, at)
        graph.set(u, w, CooTensor(val, exact, full.dtype, mask))


@functools.lru_cache(maxsize=4096)
def _coo_of_labeled(p: Pattern) -> tuple[CooPattern, Callable]:
    nout = len(p.out_shape)
    ties, varying, free = [], [], []
    for label in range(p.num_labels):
        axes = [k for k, c in enumerate(p.labels) if c == label]
        if len(axes) == 2:
            ties.append((axes[0], axes[1] - nout))
            varying.append(label in p.val_labels)
        else:
            free.append(label)
    sizes = p.sizes
    free_sizes = tuple(sizes[label] for label in free)
    n = math.prod(free_sizes)
    out_free = [k for k in range(nout) if p.labels[k] in free]
    in_free = [k for k in range(len(p.in_shape)) if p.labels[nout + k] in free]
    n_in = math.prod(p.in_shape[k] for k in in_free)
    in_order = [p.labels[k] for k in out_free] + [p.labels[nout + k] for k in in_free]
    if in_order == free:
        # The free labels run over the output's axes, then the input's: entry `e`
        # is row `e // n_in`, column `e % n_in`.
        rows, cols = np.divmod(np.arange(n, dtype=np.int64), max(n_in, 1))
    else:
        grid = np.indices(free_sizes, dtype=np.int64).reshape(len(free), n)
        rows = _ravel(
            [grid[free.index(p.labels[k])] for k in out_free],
            tuple(p.out_shape[k] for k in out_free),
            n,
        )
        cols = _ravel(
            [grid[free.index(p.labels[nout + k])] for k in in_free],
            tuple(p.in_shape[k] for k in in_free),
            n,
        )
    order_t = sorted(range(len(ties)), key=lambda t: ties[t][0])
    tie_labels = [p.labels[ties[t][0]] for t in order_t]
    ties = [ties[t] for t in order_t]
    varying = [varying[t] for t in order_t]
    coo = CooPattern(p.out_shape, p.in_shape, tuple(ties), tuple(varying), rows, cols)
    target = [lab for lab, v in zip(tie_labels, varying, strict=True) if v] + free
    target_shape = tuple(sizes[lab] for lab in target)
    lead = target_shape[: len(target) - len(free)]

    def convert(val):
        # `val` is laid out over `p.val_labels` (ascending).
        present = [lab for lab in target if lab in p.val_labels]
        val = _transpose(val, [p.val_labels.index(lab) for lab in present])
        dims = tuple(target.index(lab) for lab in present)
        if tuple(val.shape) != target_shape:
            val = lax.broadcast_in_dim(val, target_shape, dims)
        return lax.reshape(val, lead + (n,))

    return coo, convert


def to_coo(st: SparseTensor) -> CooTensor:
    """`st` as a `graphax_eqx.CooTensor` (exact; its ties stay ties)."""
    coo, convert = _coo_of_labeled(st.pattern)
    if st.val is None:
        return CooTensor(None, coo.with_varying((False,) * len(coo.ties)), st.dtype)
    mask = full_mask(st)
    return CooTensor(
        convert(st.val), coo, st.dtype, None if mask is None else convert(mask)
    )


#
# Untying: moving tied axes into the free part.
#


@dataclasses.dataclass(frozen=True, eq=False)
class _Untie:
    """How the value array of a pattern maps onto that of the pattern `_untie` makes.

    The untied pattern's value is `(varying kept ties..., nnz · k)`, the untied axes
    laid out last in each entry (entry `e`, untied coordinates `g` at `e · k + g`). It
    is never built: along the untied ties the value does not vary it would be a
    broadcast. Its entries `idx` are read as `compact(val)[..., index(idx)]`.
    """

    order: tuple[int, ...]  # value axes to (varying kept..., nnz, varying untied...)
    lead: tuple[int, ...]  # sizes of the varying kept ties
    nnz: int
    ks: tuple[int, ...]  # sizes of the untied ties
    kept: tuple[bool, ...]  # whether the value varies along each untied tie

    @property
    def identity(self) -> bool:
        return not self.ks

    def compact(self, val: Array) -> Array:
        """`val` transposed to `(varying kept..., nnz, varying untied...)` and
        flattened after the kept ties."""
        if self.identity:
            return val
        val = _transpose(val, self.order)
        n = math.prod(val.shape[len(self.lead) :])
        if val.ndim != len(self.lead) + 1:
            val = lax.reshape(val, self.lead + (n,))
        return val

    def index(self, idx: np.ndarray) -> np.ndarray:
        """Indices into `compact(val)` of the entries `idx` of `self(val)`; an index
        one past the end (a zero) stays one past the end."""
        if self.identity or all(self.kept):
            return idx
        k = math.prod(self.ks)
        which = [t for t, keep in enumerate(self.kept) if keep]
        kept_sizes = tuple(self.ks[t] for t in which)
        n = self.nnz * math.prod(kept_sizes)
        end = idx >= self.nnz * k
        if end.all():  # also every index of an empty value
            return np.full_like(idx, n)
        e, g = np.divmod(np.where(end, 0, idx), k)
        coords = _unravel(g, self.ks)
        kept = [coords[t] for t in which]
        out = _ravel([e] + kept, (self.nnz,) + kept_sizes, len(idx)).astype(idx.dtype)
        return np.where(end, n, out)


@functools.lru_cache(maxsize=4096)
def _untie(p: CooPattern, which: frozenset[int]) -> tuple[CooPattern, _Untie]:
    """`p` with the ties in `which` made free, and the matching value transform."""
    if not which:
        return p, _Untie((), (), p.nnz, (), ())
    gone = sorted(which)
    keep = [t for t in range(len(p.ties)) if t not in which]
    ks = tuple(p.tie_sizes[t] for t in gone)
    k = math.prod(ks)
    nnz = p.nnz
    kgrid = _unravel(np.arange(k), ks)
    out_old = _unravel(p.rows, p.out_free_shape)
    in_old = _unravel(p.cols, p.in_free_shape)
    out_free = sorted(p.out_free + tuple(p.ties[t][0] for t in gone))
    in_free = sorted(p.in_free + tuple(p.ties[t][1] for t in gone))

    def coords(free, old_free, old, side):
        cs = []
        for axis in free:
            if axis in old_free:
                cs.append(np.repeat(old[old_free.index(axis)], k))
            else:
                t = next(t for t in gone if p.ties[t][side] == axis)
                cs.append(np.tile(kgrid[gone.index(t)], nnz))
        return cs

    rows = _ravel(
        coords(out_free, p.out_free, out_old, 0),
        tuple(p.out_shape[a] for a in out_free),
        nnz * k,
    )
    cols = _ravel(
        coords(in_free, p.in_free, in_old, 1),
        tuple(p.in_shape[a] for a in in_free),
        nnz * k,
    )
    new = CooPattern(
        p.out_shape,
        p.in_shape,
        tuple(p.ties[t] for t in keep),
        tuple(p.varying[t] for t in keep),
        rows,
        cols,
    )
    vary_old = [t for t in range(len(p.ties)) if p.varying[t]]
    vary_keep = [t for t in keep if p.varying[t]]
    # Target layout: (varying kept ties..., nnz, each untied tie...).
    target = vary_keep + ["nnz"] + [("gone", t) for t in gone]
    source = [t if t in keep else ("gone", t) for t in vary_old] + ["nnz"]
    order = sorted(range(len(source)), key=lambda j: target.index(source[j]))
    lead = tuple(p.tie_sizes[t] for t in vary_keep)
    return new, _Untie(tuple(order), lead, nnz, ks, tuple(p.varying[t] for t in gone))


#
# Products.
#


@dataclasses.dataclass(frozen=True, eq=False)
class CooProductPlan:
    pattern: Any  # CooPattern, or the labeled Pattern when stored densely
    coo: CooPattern
    kind: str
    muls: int
    has_val: bool
    untie_a: _Untie
    untie_b: _Untie
    ia: np.ndarray
    ib: np.ndarray
    seg: SegmentSum | None  # adds up colliding pairs; None when no two pairs collide
    counts: np.ndarray | None  # pairs per entry (value-free operands)
    a_dims: tuple[int, ...]  # result varying-tie position of each A value axis
    b_perm: tuple[int, ...]
    b_dims: tuple[int, ...]
    densify: bool
    # Set where one operand is a full block: the product then runs row by row.
    rows: RowsPlan | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class RowsPlan:
    """`A · B` where one operand stores whole rows: every entry of its free part (a
    dense block met by coordinates, as where reverse mode reaches a weight matrix
    through slices or splits), or, for B, runs of `L` consecutive columns starting
    at multiples of `L` in every row (a block diagonal: per-token blocks whose tie
    the other operand lacks). Each entry of the sparse operand meets a whole row of
    B (`side == "b"`) or a whole column of a full A (`side == "a"`), gathered as one
    contiguous slice, multiplied and summed by segment along that axis. A gather per
    entry pair would read the operand one element at a time, several times slower.

    `order` lists the sparse operand's entries sorted by the segment they add into
    (A's free row and the block of columns of the row of B it meets, or B's free
    column), `index` the row of B or column of A each of them meets, and `shape`
    the operand read by rows, as (rows, entries per row) for B or (rows, columns)
    for A.
    """

    side: str
    order: np.ndarray
    index: np.ndarray
    seg: SegmentSum
    shape: tuple[int, int]
    uniform: int  # entries per segment where all segments have as many, else 0
    # Where the value of the operand read by rows holds each of its entries in
    # row-major order (`None`: in that order already).
    gather: np.ndarray | None = None


# An operand is read by rows only where a row holds at least this many entries.
MIN_ROW = 4


def _row_runs(p: CooPattern) -> tuple[int, np.ndarray | None]:
    """`(L, perm)` where every row of `p` (an untied pattern) stores the `L`
    consecutive columns from a multiple of `L` (`L` is the width of the free part
    where `p` is full), and `perm` lists its entries in row-major order (`None`
    where they are in that order already); `(0, None)` where its rows are not such
    runs."""
    k, n = p.n_out_free, p.n_in_free
    if not p.nnz or p.nnz % k or n % (p.nnz // k):
        return 0, None
    run = p.nnz // k
    rows, cols, perm = p.rows, p.cols, None
    flat = rows.astype(np.int64) * n + cols
    if len(flat) > 1 and not np.all(flat[1:] > flat[:-1]):
        perm = np.argsort(flat, kind="stable")
        rows, cols = rows[perm], cols[perm]
    if not np.array_equal(rows, np.repeat(np.arange(k), run)):
        return 0, None
    cols = cols.reshape(k, run)
    start = cols[:, :1]
    if np.any(start % run) or np.any(cols - start != np.arange(run)):
        return 0, None
    return run, perm


def _rows_side(pa2, pb2) -> tuple[str, int, np.ndarray | None] | None:
    """Which untied operand of `A · B` a `RowsPlan` reads by rows, its run length
    and the order of its entries (see `_row_runs`); `None` where neither can be."""
    b_run, b_perm = _row_runs(pb2)
    a_run, a_perm = _row_runs(pa2) if pa2.n_out_free >= MIN_ROW else (0, None)
    a_full = a_run and a_run == pa2.n_in_free
    if b_run >= MIN_ROW and (not a_full or b_run >= pa2.n_out_free):
        return "b", b_run, b_perm
    return ("a", a_run, a_perm) if a_full else None


@functools.lru_cache(maxsize=4096)
def by_rows(pa: CooPattern, pb: CooPattern, a_val: bool, b_val: bool) -> bool:
    """Whether `coo_product_plan(pa, pb, a_val, b_val)` runs by rows."""
    if not (a_val and b_val) or not _pair_count(pa, pb)[0]:
        return False
    pa2, _, pb2, _ = _untied_pair(pa, pb)
    return _rows_side(pa2, pb2) is not None


def _rows_plan(pa2, untie_a, pb2, untie_b) -> RowsPlan | None:
    """A `RowsPlan` for the untied operands of `A · B`, or `None`."""
    found = _rows_side(pa2, pb2)
    if found is None:
        return None
    side, run, perm = found
    if side == "b":
        # Segments: A's row, and the block of `run` columns the row of B covers.
        cols = pb2.cols if perm is None else pb2.cols[perm]
        start = cols[::run].astype(np.int64)
        segments = pa2.rows.astype(np.int64) * (pb2.n_in_free // run)
        segments = segments + start[pa2.cols] // run
        index, shape, untie, nnz = pa2.cols, (pb2.n_out_free, run), untie_b, pb2.nnz
    else:
        segments, index = pb2.cols, pb2.rows
        shape, untie, nnz = (pa2.n_out_free, pa2.n_in_free), untie_a, pa2.nnz
    # Where the value of the operand read by rows sits for each entry, row-major.
    read = untie.index(np.arange(nnz) if perm is None else perm)
    gather = None if np.array_equal(read, np.arange(nnz)) else read
    order = np.argsort(segments, kind="stable")
    _, _, seg = _sort_unique(segments[order])
    counts = np.bincount(seg)
    uniform = int(counts[0]) if np.all(counts == counts[0]) else 0
    plan = segment_sum_plan(seg, len(counts))
    return RowsPlan(side, order, index[order], plan, shape, uniform, gather)


def _join(cols_a: np.ndarray, rows_b: np.ndarray, n_v: int):
    """All pairs `(ia, ib)` with `cols_a[ia] == rows_b[ib]`, both in `0..n_v-1`: for
    each entry of A in turn, the entries of B in the row it meets, in B's order.

    Linear in the pairs: B's entries are bucketed by row by counting (B's rows are
    usually sorted already), so each entry of A finds its run of B's entries by
    direct lookup.
    """
    per_row = np.bincount(rows_b, minlength=n_v)
    row_start = np.cumsum(per_row) - per_row
    by_row = None
    if len(rows_b) > 1 and not np.all(rows_b[1:] >= rows_b[:-1]):
        by_row = np.argsort(rows_b, kind="stable")
    counts = per_row[cols_a]
    total = int(counts.sum())
    ia = np.repeat(np.arange(len(cols_a), dtype=np.int64), counts)
    offset = np.repeat(row_start[cols_a] - (np.cumsum(counts) - counts), counts)
    ib = offset + np.arange(total, dtype=np.int64)
    return ia, (ib if by_row is None else by_row[ib])


def _untied_pair(pa: CooPattern, pb: CooPattern):
    """Both operands with the ties the other lacks made free."""
    a_tie_v = {i: t for t, (_, i) in enumerate(pa.ties)}
    b_tie_v = {o: t for t, (o, _) in enumerate(pb.ties)}
    pa2, untie_a = _untie(
        pa, frozenset(t for j, t in a_tie_v.items() if j not in b_tie_v)
    )
    pb2, untie_b = _untie(
        pb, frozenset(t for j, t in b_tie_v.items() if j not in a_tie_v)
    )
    assert pa2.in_free == pb2.out_free, (pa2, pb2)
    return pa2, untie_a, pb2, untie_b


@functools.lru_cache(maxsize=4096)
def _pair_count(pa: CooPattern, pb: CooPattern) -> tuple[int, CooPattern, CooPattern]:
    """Entry pairs of `A · B` (found without listing them), and the untied operands."""
    pa2, _, pb2, _ = _untied_pair(pa, pb)
    n_v = pa2.n_in_free
    pairs = int(
        np.dot(
            np.bincount(pa2.cols, minlength=n_v).astype(np.float64),
            np.bincount(pb2.rows, minlength=n_v).astype(np.float64),
        )
    )
    return pairs, pa2, pb2


def coo_product_muls(pa: CooPattern, pb: CooPattern, a_val: bool, b_val: bool) -> int:
    """The multiplications of `coo_product_plan(pa, pb, a_val, b_val)`, without
    planning the product entry by entry."""
    if not (a_val and b_val):
        return 0
    pairs, pa2, pb2 = _pair_count(pa, pb)
    b_by_v = {o: t for t, (o, _) in enumerate(pb2.ties)}
    lead = 1
    for ta, (o, j) in enumerate(pa2.ties):
        if pa2.varying[ta] or pb2.varying[b_by_v[j]]:
            lead *= pa2.out_shape[o]
    return pairs * lead


@functools.lru_cache(maxsize=4096)
def dense_is_better(pa: CooPattern, pb: CooPattern) -> bool:
    """Whether `A · B` should run on dense free parts rather than entry by entry."""
    pairs, pa2, pb2 = _pair_count(pa, pb)
    n_v = pa2.n_in_free
    dense_muls = pa2.n_out_free * n_v * pb2.n_in_free
    if pairs > MAX_PAIRS:
        return True
    # Small products stay sparse: they are cheap either way, and dense storage would
    # store structural zeros.
    return dense_muls >= DENSE_MIN_SIZE and pairs * DENSE_PRODUCT_RATIO > dense_muls


def _product_keys(pa: CooPattern, pb: CooPattern):
    """The untied operands of `A · B`, its entry pairs `(ia, ib)` and the flat
    result entry of each pair."""
    assert pa.in_shape == pb.out_shape, (pa, pb)
    pa2, untie_a, pb2, untie_b = _untied_pair(pa, pb)
    ia, ib = _join(pa2.cols, pb2.rows, pa2.n_in_free)
    keys = pa2.rows[ia] * pb2.n_in_free + pb2.cols[ib]
    return pa2, untie_a, pb2, untie_b, ia, ib, keys


def _product_pattern(
    pa: CooPattern,
    pb: CooPattern,
    pa2: CooPattern,
    pb2: CooPattern,
    uniq: np.ndarray,
    has_val: bool,
    a_val: bool,
    b_val: bool,
):
    """The coordinates of `A · B` (entries `uniq`, flat) and, for each of its ties,
    the tie of the untied B it comes from."""
    n_u = pb2.n_in_free
    # Result ties, ordered by output axis (A's order).
    b_by_v = {o: t for t, (o, _) in enumerate(pb2.ties)}
    ties, varying, b_of = [], [], []
    for ta, (o, j) in enumerate(pa2.ties):
        tb = b_by_v[j]
        ties.append((o, pb2.ties[tb][1]))
        varying.append((a_val and pa2.varying[ta]) or (b_val and pb2.varying[tb]))
        b_of.append(tb)
    coo = CooPattern(
        pa.out_shape,
        pb.in_shape,
        tuple(ties),
        tuple(varying) if has_val else (False,) * len(ties),
        uniq // n_u if n_u else uniq,
        uniq % n_u if n_u else uniq,
    )
    return coo, b_of


def _product_muls(coo: CooPattern, pairs: int, a_val: bool, b_val: bool) -> int:
    if not (a_val and b_val):
        return 0
    return pairs * math.prod(coo.tie_sizes[t] for t, v in enumerate(coo.varying) if v)


# Past this many entry pairs, the entries of a product are found by a sparse matrix
# product of the two patterns (compiled, without listing the pairs) rather than by
# listing, sorting and deduplicating the pairs in NumPy.
MIN_SPARSE_JOIN = 1 << 16


def _product_entries(pa2: CooPattern, pb2: CooPattern) -> np.ndarray:
    """The sorted distinct flat entries of `A · B` for untied operands: a product of
    the two patterns as `scipy.sparse` matrices of ones, whose stored entries are
    where at least one pair lands (sums of ones are never zero)."""
    import scipy.sparse as sp

    n_v, n_u = pa2.n_in_free, pb2.n_in_free
    a = sp.csr_matrix(
        (np.ones(pa2.nnz, np.int32), (pa2.rows, pa2.cols)),
        shape=(pa2.n_out_free, n_v),
    )
    b = sp.csr_matrix(
        (np.ones(pb2.nnz, np.int32), (pb2.rows, pb2.cols)), shape=(n_v, n_u)
    )
    c: Any = a @ b  # a CSR matrix
    c.sort_indices()
    rows = np.repeat(np.arange(c.shape[0], dtype=np.int64), np.diff(c.indptr))
    return rows * n_u + c.indices.astype(np.int64)


@functools.lru_cache(maxsize=4096)
def coo_product_summary(pa: CooPattern, pb: CooPattern, a_val: bool, b_val: bool):
    """`(pattern, has_val, muls)` of `coo_product_plan(pa, pb, a_val, b_val)`,
    without keeping its entry pairs: what simulating an elimination needs, at a
    fraction of the memory of a plan of millions of pairs."""
    pairs, pa2, pb2 = _pair_count(pa, pb)
    if pairs >= MIN_SPARSE_JOIN:
        uniq = _product_entries(pa2, pb2)
    else:
        pa2, _, pb2, _, _, _, keys = _product_keys(pa, pb)
        uniq = _distinct(keys)
    has_val = a_val or b_val or len(uniq) != pairs
    coo, _ = _product_pattern(pa, pb, pa2, pb2, uniq, has_val, a_val, b_val)
    densify = _store_dense(coo)
    pattern = labeled_pattern(coo)[0] if densify else coo
    muls = _product_muls(coo, pairs, a_val, b_val)
    return pattern, True if densify else has_val, muls


@functools.lru_cache(maxsize=65536)
def coo_product_plan(pa: CooPattern, pb: CooPattern, a_val: bool, b_val: bool):
    """Plan `A · B` for `A: w ← v`, `B: v ← u` given as static sparse patterns."""
    pa2, untie_a, pb2, untie_b, ia, ib, keys = _product_keys(pa, pb)
    # Pairs sorted by entry (stably: each entry's pairs keep their order).
    uniq, order, seg = _sort_unique(keys)
    if order is not None:
        ia, ib = ia[order], ib[order]
    collide = len(uniq) != len(keys)
    counts = None
    if not a_val and not b_val and collide:
        counts = np.bincount(seg, minlength=len(uniq))
    has_val = a_val or b_val or counts is not None
    coo, b_of = _product_pattern(pa, pb, pa2, pb2, uniq, has_val, a_val, b_val)
    res_vary = [t for t, v in enumerate(coo.varying) if v]
    a_dims = tuple(res_vary.index(t) for t, v in enumerate(pa2.varying) if v and a_val)
    b_vary = [t for t in range(len(pb2.ties)) if pb2.varying[t]] if b_val else []
    res_of_b = {tb: t for t, tb in enumerate(b_of)}
    b_perm = tuple(sorted(range(len(b_vary)), key=lambda k: res_of_b[b_vary[k]]))
    b_dims = tuple(sorted(res_vary.index(res_of_b[tb]) for tb in b_vary))
    densify = _store_dense(coo)
    pattern = labeled_pattern(coo)[0] if densify else coo
    rows = None
    if a_val and b_val and len(ia):
        rows = _rows_plan(pa2, untie_a, pb2, untie_b)
    return CooProductPlan(
        pattern,
        coo,
        "coo",
        _product_muls(coo, len(ia), a_val, b_val),
        True if densify else has_val,
        untie_a,
        untie_b,
        ia,
        ib,
        segment_sum_plan(seg, len(uniq)) if collide else None,
        counts,
        a_dims,
        b_perm,
        b_dims,
        densify,
        rows,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class SegmentSum:
    """How to add up the pairs of a product that land on the same entry, by gathers.

    The pairs come sorted by entry. Entry `e` takes its first pair from `first[e]`;
    the entries with more than one pair are grouped by count (each group padded to
    at most twice its smallest count), and group `g` adds up `rest[g]`, one padded
    row of the remaining pairs per entry. `back[e]` reads an entry's row total from
    the concatenated group totals. An index one past the end selects a zero.

    Gathers, not a scatter-add: on a GPU a scatter-add is serialised by atomic
    updates of the same entry (a spring network's product ran 4x slower as a
    scatter), and every gather here fuses with the multiplication that feeds it.
    """

    first: np.ndarray
    rest: tuple[np.ndarray, ...]
    back: np.ndarray | None


def segment_sum_plan(seg: np.ndarray, n: int) -> SegmentSum:
    """The gathers adding up the values of sorted segments `seg` into `n` entries."""
    npairs = len(seg)
    counts = np.bincount(seg, minlength=n)
    starts = np.cumsum(counts) - counts
    first = np.where(counts > 0, starts, npairs)
    multi = np.flatnonzero(counts > 1)
    if not len(multi):
        return SegmentSum(first, (), None)
    # Groups of entries whose counts lie in [2^k, 2^(k+1)): each row pads to its
    # group's largest count, so the padding stays below the pairs themselves.
    group = np.floor(np.log2(counts[multi])).astype(np.int64)
    order = np.argsort(group, kind="stable")
    multi, group = multi[order], group[order]
    rest, back = [], np.full(n, len(multi), np.int64)
    back[multi] = np.arange(len(multi))
    for k in np.unique(group):
        members = multi[group == k]
        c = counts[members]
        j = np.arange(1, int(c.max()))
        index = starts[members][:, None] + j[None, :]
        rest.append(np.where(j[None, :] < c[:, None], index, npairs))
    return SegmentSum(first, tuple(rest), back)


def _with_zero(x: Array, axis: int = -1) -> Array:
    """`x` with a zero after the last entry of `axis` (the index one past the end
    then selects it)."""
    axis = axis % x.ndim
    shape = tuple(x.shape)
    zero = jnp.zeros(shape[:axis] + (1,) + shape[axis + 1 :], x.dtype)
    return jnp.concatenate([x, zero], axis)


def _segment_sum_last(x: Array, plan: SegmentSum) -> Array:
    """The entries' sums of `x`'s last axis, holding pairs sorted by entry."""
    return _segment_sum_axis(x, plan, x.ndim - 1)


def _segment_sum_axis(x: Array, plan: SegmentSum, axis: int) -> Array:
    """The entries' sums along `axis` of `x`, holding pairs sorted by entry."""
    shape = tuple(x.shape)
    x = _with_zero(x, axis)
    out = _take_axis(x, plan.first, axis)
    if plan.back is None:
        return out
    totals = []
    for rest in plan.rest:
        rows = _take_axis(x, rest.reshape(-1), axis)
        split = shape[:axis] + rest.shape + shape[axis + 1 :]
        rows = lax.reshape(rows, split)
        totals.append(jnp.sum(rows, axis=axis + 1, dtype=rows.dtype))
    total = totals[0] if len(totals) == 1 else lax.concatenate(totals, axis)
    return lax.add(out, _take_axis(_with_zero(total, axis), plan.back, axis))


def _take_last(x: Array, idx: np.ndarray) -> Array:
    """`x[..., idx]` for static in-bounds `idx` (see `_take_axis`)."""
    return _take_axis(x, idx, x.ndim - 1)


def _take_axis(x: Array, idx: np.ndarray, axis: int) -> Array:
    """`jnp.take(x, idx, axis)` for static in-bounds `idx`: one `gather` (of whole
    slices along the other axes), or slices where `idx` is short."""
    n = x.shape[axis]
    if len(idx) == n and np.array_equal(idx, np.arange(n)):
        return x
    shape = tuple(x.shape)
    if n == 1:
        # Every index is 0: a broadcast, not a gather.
        out = shape[:axis] + (len(idx),) + shape[axis + 1 :]
        return lax.broadcast_in_dim(x, out, tuple(range(x.ndim)))
    breaks = None
    if 0 < len(idx) <= SMALL_TAKE:
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    if breaks is not None and len(breaks) < SMALL_TAKE_RUNS:
        # A few runs of consecutive indices: slices, put together. Under `vmap` (a
        # per-example function reading a state vector by index) a gather along the
        # last axis becomes a batched gather that XLA lays out with transposes and
        # copies; slices stay in place and fuse. (Many runs of single entries are
        # slower as slices than as one gather.)
        pieces = [
            lax.slice_in_dim(x, int(run[0]), int(run[-1]) + 1, axis=axis)
            for run in np.split(idx, breaks)
        ]
        return pieces[0] if len(pieces) == 1 else lax.concatenate(pieces, axis)
    dnums = lax.GatherDimensionNumbers(
        offset_dims=tuple(d for d in range(x.ndim) if d != axis),
        collapsed_slice_dims=(axis,),
        start_index_map=(axis,),
    )
    indices = jnp.asarray(idx.reshape(-1, 1), _index_dtype(n))
    return lax.gather(
        x,
        indices,
        dnums,
        shape[:axis] + (1,) + shape[axis + 1 :],
        indices_are_sorted=bool(np.all(idx[1:] >= idx[:-1])),
        mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    )


def _run_starts(ordered: np.ndarray) -> np.ndarray:
    """Where each run of equal values of a sorted, non-empty array starts."""
    first = np.empty(len(ordered), bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return first


def _distinct(keys: np.ndarray) -> np.ndarray:
    """The sorted distinct `keys` (a stable sort: linear on sorted runs)."""
    if len(keys) < 2 or np.all(keys[1:] > keys[:-1]):
        return keys
    ordered = np.sort(keys, kind="stable")
    return ordered[_run_starts(ordered)]


def _sort_unique(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Sorted distinct `keys`; the stable order that sorts `keys` (`None` where they
    are sorted and distinct already); and for each key in that order, the index of
    its value among the distinct ones (ascending)."""
    if len(keys) < 2 or np.all(keys[1:] > keys[:-1]):
        return keys, None, np.arange(len(keys))
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    first = _run_starts(ordered)
    group = np.cumsum(first, dtype=np.int64)
    group -= 1
    return ordered[first], order, group


#
# Sums kept as the gathers they are made of.
#
# A sum of coordinate partials gathers each operand's values into the union of their
# entries. Sums that feed sums (reverse mode adding a stencil's terms one at a time)
# would gather a gather of a gather...: XLA fuses such a chain into one kernel that
# chases indices through every level for each entry, several times slower than
# gathering each term once (benchmarks/NOTES.md). So while an elimination runs, the
# value array of a sum is remembered with the gathers it adds up, and a sum that
# takes it as an operand gathers those bases directly, through indices composed at
# trace time. Products still gather the sum as it is: its value is computed once and
# may feed several of them. Sums of more than `MAX_SUM_TERMS` terms, and short
# coordinate lists (fewer than `MIN_FLAT_NNZ` entries, such as a few entries per
# tied row of a batch, where XLA handles the chain well) are gathered as they are.

MAX_SUM_TERMS = 8
MIN_FLAT_NNZ = 64


class _SumTerms(threading.local):
    """Per thread: how many eliminations are running, and for each remembered sum,
    id(value array) -> (the array itself, its terms). A term `(base, index)` stands
    for `base[..., index]`, where an index equal to `base.shape[-1]` selects a zero.
    The array is kept so that its id is not reused while the entry lives."""

    def __init__(self):
        self.depth = 0
        self.terms: dict[int, tuple[Array, tuple[tuple[Array, np.ndarray], ...]]] = {}
        # id(value array of a sum) -> (the array, how many sums of disjoint terms
        # it is computed through; see `MAX_NESTED_JOINS`).
        self.joined: dict[int, tuple[Array, int]] = {}


_SUMS = _SumTerms()


@contextlib.contextmanager
def sums_as_gathers():
    """Within this context, sums of coordinate partials remember their terms."""
    _SUMS.depth += 1
    try:
        yield
    finally:
        _SUMS.depth -= 1
        if not _SUMS.depth:
            _SUMS.terms.clear()
            _SUMS.joined.clear()


def _terms_of(x: Array) -> tuple[tuple[Array, np.ndarray], ...]:
    entry = _SUMS.terms.get(id(x))
    if entry is not None and entry[0] is x:
        return entry[1]
    return ((x, np.arange(x.shape[-1])),)


def _gathered_terms(x: Array, idx: np.ndarray) -> tuple[tuple[Array, np.ndarray], ...]:
    """The terms of `x[..., idx]` (`idx == x.shape[-1]` selecting a zero)."""
    out = []
    for base, index in _terms_of(x):
        out.append((base, np.append(index, base.shape[-1])[idx]))
    return tuple(out)


def _emit_terms(terms: tuple[tuple[Array, np.ndarray], ...], joins=None) -> Array:
    """The sum of `terms`; `joins`, a list, is told of a sum of disjoint terms."""
    disjoint = _disjoint_terms(terms)
    if disjoint is not None:
        if joins is not None:
            joins.append(disjoint)
        return disjoint
    total = None
    for base, index in terms:
        n = base.shape[-1]
        if np.any(index == n):
            base = _with_zero(base)
        part = _take_last(base, index)
        total = part if total is None else lax.add(total, part)
    assert total is not None
    return total


def _disjoint_terms(terms: tuple[tuple[Array, np.ndarray], ...]) -> Array | None:
    """A sum of gathered terms no two of which store the same entry (the rows of a
    `stack` added one at a time, say) as one gather of the terms put end to end:
    pairwise, each sum would gather both operands and add them, and a sum of `n`
    rows would emit `n` such steps. `None` where two terms share an entry, or the
    terms' values cannot be put together."""
    if len(terms) < 2:
        return None
    bases = [base for base, _ in terms]
    lead, dtype = tuple(bases[0].shape[:-1]), bases[0].dtype
    if any(tuple(b.shape[:-1]) != lead or b.dtype != dtype for b in bases):
        return None
    stored = [index < base.shape[-1] for base, index in terms]
    if np.any(np.sum(stored, axis=0) > 1):
        return None
    offsets = np.cumsum([0] + [b.shape[-1] for b in bases])
    at = np.full(len(terms[0][1]), offsets[-1], np.int64)  # no term: a zero
    for (_, index), here, offset in zip(terms, stored, offsets[:-1], strict=True):
        at[here] = index[here] + offset
    joined = lax.concatenate(bases, len(lead))
    if np.any(at == offsets[-1]):
        joined = _with_zero(joined)
    return _take_last(joined, at)


# A sum computed through more than this many sums of disjoint terms (`coo_add`) is
# written to memory first: XLA CPU fuses the chain of concatenations, gathers and
# additions into one kernel, and crashed (a segmentation fault) compiling one of 250
# levels, the sum of a stack's rows in reverse order.
MAX_NESTED_JOINS = 16


def _nested_joins(x) -> int:
    """How many sums of disjoint terms the value array `x` of a sum is computed
    through, since it was last written to memory (see `MAX_NESTED_JOINS`)."""
    entry = _SUMS.joined.get(id(x))
    return entry[1] if entry is not None and entry[0] is x else 0


def _reads_twice(at: np.ndarray, n: int) -> bool:
    """Whether gathering `at` from `n` entries reads some entry more than once."""
    return len(at) > n or len(np.unique(at)) < len(at)


def coo_product(a, b, plan: CooProductPlan, dtype):
    """`A · B` entry by entry. An operand may be a `CooTensor`, or a `BandTensor`
    whose entries are then read straight off its diagonals: one gather of the entries
    the product uses rather than one of all of them and another of those (a band
    meeting the two boundary entries of a `concatenate` uses a handful)."""
    from ._band import BandTensor, to_coo as band_to_coo

    p = plan.coo
    if plan.rows is not None and a.val is not None and b.val is not None:
        return _rows_product(a, b, plan, dtype)
    res_vary = tuple(p.tie_sizes[t] for t, v in enumerate(p.varying) if v)
    npairs = len(plan.ia)
    shape = res_vary + (npairs,)
    factors, masks = [], []
    for x, untie, idx, perm, dims in (
        (a, plan.untie_a, plan.ia, None, plan.a_dims),
        (b, plan.untie_b, plan.ib, plan.b_perm, plan.b_dims),
    ):
        if isinstance(x, BandTensor) and not untie.identity:
            x = band_to_coo(x)
        if x.val is None:
            continue
        parts = [x.val] if x.mask is None else [x.val, x.mask]
        if isinstance(x, BandTensor):
            parts = [lax.reshape(part, (math.prod(part.shape),)) for part in parts]
            at = x.pattern.positions[idx]
        else:
            parts = [untie.compact(part) for part in parts]
            at = untie.index(idx)
        if not isinstance(parts[0], np.ndarray) and _reads_twice(
            at, parts[0].shape[-1]
        ):
            # Written to memory first: fused into the gather, its computation would
            # be repeated for every read (see `_jax_private.write_apart`).
            parts[0] = jp.write_apart(parts[0])
        aligned = []
        for part in parts:
            part = _take_last(part, at)
            if perm is not None:
                part = _transpose(part, tuple(perm) + (part.ndim - 1,))
            if tuple(part.shape) != shape:
                part = lax.broadcast_in_dim(
                    part, shape, tuple(dims) + (len(shape) - 1,)
                )
            aligned.append(part)
        factors.append(_cast(aligned[0], dtype))
        if len(aligned) == 2:
            masks.append(aligned[1])
    out_mask = None
    if not factors:
        if plan.counts is None:
            val = None
        else:
            val = jnp.asarray(plan.counts.astype(np.dtype(dtype)))
    else:
        val = factors[0]
        for f in factors[1:]:
            val = lax.mul(val, f)
        if masks:
            out_mask = masks[0] if len(masks) == 1 else lax.bitwise_or(*masks)
            val = lax.select(out_mask, lax.full_like(val, 0), val)
        if plan.seg is not None:
            val = _segment_sum_last(val, plan.seg)
            if out_mask is not None:
                # Selected away where every term of the entry is.
                live = lax.bitwise_not(out_mask).astype(np.int32)
                out_mask = _segment_sum_last(live, plan.seg) == 0
    out = CooTensor(val, p, jnp.dtype(dtype), out_mask)
    if plan.densify:
        return to_labeled(out)
    return out


def _rows_product(a, b, plan: CooProductPlan, dtype):
    """`A · B` by the rows of its full operand (see `RowsPlan`)."""
    p, rows = plan.coo, plan.rows
    assert rows is not None
    res_vary = tuple(p.tie_sizes[t] for t, v in enumerate(p.varying) if v)
    lead = len(res_vary)
    # Products over (sparse entries, full row) for side "b", (full column, sparse
    # entries) for side "a"; the sparse entries' axis is summed by segment.
    k_full, n_full = rows.shape
    n_e = len(rows.order)
    shape = res_vary + ((n_e, n_full) if rows.side == "b" else (k_full, n_e))
    e_axis = lead if rows.side == "b" else lead + 1
    factors, masks = [], []
    for x, untie, perm, dims, full in (
        (a, plan.untie_a, None, plan.a_dims, rows.side == "a"),
        (b, plan.untie_b, plan.b_perm, plan.b_dims, rows.side == "b"),
    ):
        x = _unband(x)
        assert x.val is not None
        parts = [x.val] if x.mask is None else [x.val, x.mask]
        aligned = []
        for part in parts:
            if full:
                part = untie.compact(part)
                if rows.gather is not None:
                    # Laid out by rows once, then read by rows.
                    part = _take_last(part, rows.gather)
                    part = lax.optimization_barrier(part)
                part = lax.reshape(part, tuple(part.shape[:-1]) + rows.shape)
                # The full operand's rows (of B) or columns (of A) each entry meets.
                axis = part.ndim - (2 if rows.side == "b" else 1)
                part = _take_axis(part, rows.index, axis)
                at_dims = (lead, lead + 1)
            else:
                part = _take_last(untie.compact(part), untie.index(rows.order))
                # Computed once: fused into the product, XLA would recompute the
                # gathers that make it for each entry of the full operand's rows.
                part = lax.optimization_barrier(part)
                at_dims = (e_axis,)
            if perm is not None:
                nv = len(perm)
                part = _transpose(part, tuple(perm) + tuple(range(nv, part.ndim)))
            if tuple(part.shape) != shape:
                part = lax.broadcast_in_dim(part, shape, tuple(dims) + at_dims)
            aligned.append(part)
        factors.append(_cast(aligned[0], dtype))
        if len(aligned) == 2:
            masks.append(aligned[1])
    val = lax.mul(factors[0], factors[1])
    out_mask = None
    if masks:
        out_mask = masks[0] if len(masks) == 1 else lax.bitwise_or(*masks)
        val = lax.select(out_mask, lax.full_like(val, 0), val)
    val = _segment_rows(val, rows, e_axis)
    if out_mask is not None:
        # Selected away where every term of the entry is.
        live = lax.bitwise_not(out_mask).astype(np.int32)
        out_mask = _segment_rows(live, rows, e_axis) == 0
        out_mask = lax.reshape(out_mask, res_vary + (p.nnz,))
    val = lax.reshape(val, res_vary + (p.nnz,))
    out = CooTensor(val, p, jnp.dtype(dtype), out_mask)
    if plan.densify:
        return to_labeled(out)
    return out


def _segment_rows(x: Array, rows: RowsPlan, axis: int) -> Array:
    """The segments' sums of `x` along `axis` (see `RowsPlan`)."""
    if rows.uniform:
        shape = tuple(x.shape)
        split = shape[:axis] + (shape[axis] // rows.uniform, rows.uniform)
        x = lax.reshape(x, split + shape[axis + 1 :])
        return jnp.sum(x, axis=axis + 1, dtype=x.dtype)
    return _segment_sum_axis(x, rows.seg, axis)


#
# Sums.
#


@dataclasses.dataclass(frozen=True, eq=False)
class CooSumPlan:
    pattern: Any
    coo: CooPattern
    adds: int
    has_val: bool
    untie_a: _Untie
    untie_b: _Untie
    pos_a: np.ndarray  # for each result entry, its index in A (nnz of A: absent)
    pos_b: np.ndarray
    a_dims: tuple[int, ...]
    b_dims: tuple[int, ...]
    counts: np.ndarray | None
    densify: bool
    nnz_a: int
    nnz_b: int


def _sum_keys(pa: CooPattern, pb: CooPattern):
    """Both operands of `A + B` with the ties they do not share made free, and their
    flat entries."""
    assert pa.shape == pb.shape, (pa, pb)
    common = set(pa.ties) & set(pb.ties)
    pa2, untie_a = _untie(
        pa, frozenset(t for t, tie in enumerate(pa.ties) if tie not in common)
    )
    pb2, untie_b = _untie(
        pb, frozenset(t for t, tie in enumerate(pb.ties) if tie not in common)
    )
    assert pa2.ties == pb2.ties
    n_u = pa2.n_in_free
    return (
        pa2,
        untie_a,
        pb2,
        untie_b,
        pa2.rows * n_u + pa2.cols,
        pb2.rows * n_u + pb2.cols,
    )


def _sum_pattern(pa, pa2, pb2, uniq, has_val: bool, a_val: bool, b_val: bool):
    """The coordinates of `A + B` (entries `uniq`, flat)."""
    n_u = pa2.n_in_free
    varying = tuple(
        (a_val and va) or (b_val and vb)
        for va, vb in zip(pa2.varying, pb2.varying, strict=True)
    )
    return CooPattern(
        pa.out_shape,
        pa.in_shape,
        pa2.ties,
        varying if has_val else (False,) * len(varying),
        uniq // n_u if n_u else uniq,
        uniq % n_u if n_u else uniq,
    )


def _sum_adds(coo: CooPattern, overlap: int) -> int:
    return overlap * math.prod(coo.tie_sizes[t] for t, v in enumerate(coo.varying) if v)


@functools.lru_cache(maxsize=4096)
def coo_sum_summary(pa: CooPattern, pb: CooPattern, a_val: bool, b_val: bool):
    """`(pattern, has_val, adds)` of `coo_sum_plan(pa, pb, a_val, b_val)`, without
    its gathers (for simulating an elimination)."""
    pa2, _, pb2, _, ka, kb = _sum_keys(pa, pb)
    uniq = _distinct(np.concatenate([ka, kb]))
    overlap = pa2.nnz + pb2.nnz - len(uniq)
    has_val = a_val or b_val or overlap > 0
    coo = _sum_pattern(pa, pa2, pb2, uniq, has_val, a_val, b_val)
    densify = _store_dense(coo)
    pattern = labeled_pattern(coo)[0] if densify else coo
    return pattern, True if densify else has_val, _sum_adds(coo, overlap)


@functools.lru_cache(maxsize=65536)
def coo_sum_plan(pa: CooPattern, pb: CooPattern, a_val: bool, b_val: bool):
    pa2, untie_a, pb2, untie_b, ka, kb = _sum_keys(pa, pb)
    uniq, order, group = _sort_unique(np.concatenate([ka, kb]))
    source = np.arange(len(group)) if order is None else order
    # Where each distinct entry comes from, read in sorted order (sequential writes).
    from_a = source < pa2.nnz
    pos_a = np.full(len(uniq), pa2.nnz, np.int64)
    pos_a[group[from_a]] = source[from_a]
    pos_b = np.full(len(uniq), pb2.nnz, np.int64)
    pos_b[group[~from_a]] = source[~from_a] - pa2.nnz
    overlap = pa2.nnz + pb2.nnz - len(uniq)
    counts = None
    if not a_val and not b_val and overlap:
        counts = (pos_a < pa2.nnz).astype(np.int64) + (pos_b < pb2.nnz)
    has_val = a_val or b_val or counts is not None
    coo = _sum_pattern(pa, pa2, pb2, uniq, has_val, a_val, b_val)
    res_vary = [t for t, v in enumerate(coo.varying) if v]
    a_dims = tuple(res_vary.index(t) for t, v in enumerate(pa2.varying) if v and a_val)
    b_dims = tuple(res_vary.index(t) for t, v in enumerate(pb2.varying) if v and b_val)
    densify = _store_dense(coo)
    pattern = labeled_pattern(coo)[0] if densify else coo
    return CooSumPlan(
        pattern,
        coo,
        _sum_adds(coo, overlap),
        True if densify else has_val,
        untie_a,
        untie_b,
        pos_a,
        pos_b,
        a_dims,
        b_dims,
        counts,
        densify,
        pa2.nnz,
        pb2.nnz,
    )


def _live_entries(x: CooTensor) -> CooTensor:
    """One where `x` stores an entry that is not selected away, zero elsewhere."""
    if x.val is None:
        return CooTensor(None, x.pattern, jnp.dtype(np.float32))
    mask = x.mask
    live = jnp.ones(x.val.shape, np.float32)
    if mask is not None:
        live = lax.bitwise_not(jnp.broadcast_to(mask, x.val.shape)).astype(np.float32)
    return CooTensor(live, x.pattern, jnp.dtype(np.float32))


def coo_add(a: CooTensor, b: CooTensor, plan: CooSumPlan, dtype):
    p = plan.coo
    res_vary = tuple(p.tie_sizes[t] for t, v in enumerate(p.varying) if v)
    shape = res_vary + (p.nnz,)
    if a.val is None and b.val is None:
        val = None
        if plan.counts is not None:
            val = jnp.asarray(plan.counts.astype(np.dtype(dtype)))
    else:
        terms = []
        # Operands gathered into the result as they are (no broadcast), with the
        # gathers they stand for (see `sums_as_gathers`).
        gathered: list[tuple[Array, np.ndarray]] = []
        composed: list[tuple[Array, np.ndarray]] = []
        for x, untie, pos, dims, n in (
            (a, plan.untie_a, plan.pos_a, plan.a_dims, plan.nnz_a),
            (b, plan.untie_b, plan.pos_b, plan.b_dims, plan.nnz_b),
        ):
            if x.val is None:
                present = (pos < n).astype(np.dtype(dtype))
                terms.append(jnp.broadcast_to(jnp.asarray(present), shape))
                continue
            v = _cast(untie.compact(x.val), dtype)
            pos = untie.index(pos)
            if tuple(v.shape[:-1]) == shape[:-1]:
                gathered.append((v, pos))
                if _SUMS.depth and shape[-1] >= MIN_FLAT_NNZ:
                    composed.extend(_gathered_terms(v, pos))
                continue
            v = _emit_terms(((v, pos),))
            if tuple(v.shape) != shape:
                v = lax.broadcast_in_dim(v, shape, tuple(dims) + (len(shape) - 1,))
            terms.append(v)
        flat = bool(composed) and len(composed) <= MAX_SUM_TERMS
        joins: list[Array] = []
        if gathered:
            terms.append(_emit_terms(tuple(composed if flat else gathered), joins))
        val = terms[0] if len(terms) == 1 else lax.add(*terms)
        nested = max(_nested_joins(x.val) for x in (a, b)) + len(joins)
        if nested > MAX_NESTED_JOINS:
            val, nested = jp.write_apart(val), 0
        if nested and _SUMS.depth:
            _SUMS.joined[id(val)] = (val, nested)
        if flat and len(terms) == 1:
            _SUMS.terms[id(val)] = (val, tuple(composed))
    mask = None
    if a.mask is not None or b.mask is not None:
        # Selected away where neither term stores a live entry.
        unstored = dataclasses.replace(plan, densify=False)
        live = coo_add(_live_entries(a), _live_entries(b), unstored, np.float32)
        assert live.val is not None
        mask = lax.eq(live.val, lax.full_like(live.val, 0))
    out = CooTensor(val, p, jnp.dtype(dtype), mask)
    if plan.densify:
        return to_labeled(out)
    return out


#
# Meeting the other partials.
#

# A labeled partial is converted to static coordinates only up to this many entries;
# past it, the sparse partial is stored densely instead.
MAX_CONVERT = 1 << 22


@dataclasses.dataclass(frozen=True, eq=False)
class ConvertPlan:
    """Convert one operand (`"coo"`: to coordinates, `"labeled"`: dense free axes),
    then run `inner`, the plan of the converted operands. `picked`, when given, is a
    coordinate pattern and, for each of its entries, the position in the result's
    dense free part to read it from (see `_structural_result`)."""

    pattern: Any
    kind: str
    muls: int
    adds: int
    has_val: bool
    conv_a: str | None
    conv_b: str | None
    inner: Any
    picked: tuple[CooPattern, np.ndarray] | None = None


def _free_entries(p: Pattern) -> int:
    nout = len(p.out_shape)
    free = [
        label
        for label in range(p.num_labels)
        if not (label in p.labels[:nout] and label in p.labels[nout:])
    ]
    return math.prod(p.sizes[label] for label in free)


def _converted(pa, pb, a_val: bool, b_val: bool):
    """Which operand to convert, and the converted patterns."""
    conv_a = conv_b = None
    if isinstance(pa, CooPattern) and not isinstance(pb, CooPattern):
        if isinstance(pb, Pattern) and _free_entries(pb) <= MAX_CONVERT:
            conv_b, pb = "coo", coo_pattern_of(pb, b_val)
        else:
            conv_a, pa, a_val = "labeled", labeled_pattern(pa)[0], True
    elif isinstance(pb, CooPattern) and not isinstance(pa, CooPattern):
        if isinstance(pa, Pattern) and _free_entries(pa) <= MAX_CONVERT:
            conv_a, pa = "coo", coo_pattern_of(pa, a_val)
        else:
            conv_b, pb, b_val = "labeled", labeled_pattern(pb)[0], True
    return conv_a, conv_b, pa, pb, a_val, b_val


def coo_pattern_of(p: Pattern, has_val: bool) -> CooPattern:
    coo = _coo_of_labeled(p)[0]
    return coo if has_val else coo.with_varying((False,) * len(coo.ties))


# A product that runs densely (`dense_is_better`) but whose result is smaller than
# this keeps its structural nonzeros only: its exact pattern is found from the
# operands' coordinates (at most `MAX_PICK_PAIRS` entry pairs) and read off the dense
# result by one gather. Small banded Jacobians then never come out as dense squares.
MAX_PICK_PAIRS = 1 << 20


@functools.lru_cache(maxsize=4096)
def _structural_result(
    pa: CooPattern, pb: CooPattern, dense: Pattern, val: bool
) -> tuple[CooPattern, np.ndarray] | None:
    """The coordinate pattern of the structural nonzeros of `A · B`, laid out as
    `to_coo` lays out the dense product (pattern `dense`), and where each entry lies
    in that layout; `None` where the dense product should stay dense."""
    if not isinstance(dense, Pattern):
        return None
    full, _ = _coo_of_labeled(dense)
    size = full.n_out_free * full.n_in_free
    if size >= DENSE_MIN_SIZE:
        return None
    pairs, pa2, pb2 = _pair_count(pa, pb)
    if pairs > MAX_PICK_PAIRS:
        return None
    ia, ib = _join(pa2.cols, pb2.rows, pa2.n_in_free)
    n_u = pb2.n_in_free
    keys = np.unique(pa2.rows[ia] * n_u + pb2.cols[ib])
    b_in_of = dict(pb2.ties)  # B's output axis → its tied input axis
    exact_ties = tuple((o, b_in_of[j]) for o, j in pa2.ties)
    if exact_ties != full.ties or n_u != full.n_in_free or len(keys) == size:
        return None
    lookup = np.empty(size, np.int64)
    lookup[full.rows * n_u + full.cols] = np.arange(size)
    varying = full.varying if val else (False,) * len(full.ties)
    picked = CooPattern(
        full.out_shape, full.in_shape, full.ties, varying, keys // n_u, keys % n_u
    )
    return picked, lookup[keys]


def _pick(x, picked: tuple[CooPattern, np.ndarray] | None):
    """`x` (a dense free part) reduced to the coordinates `picked` lists."""
    if picked is None:
        return x
    pattern, idx = picked
    ct = to_coo(x)
    assert ct.pattern.ties == pattern.ties, (ct.pattern, pattern)
    if ct.val is None:
        return CooTensor(None, pattern, ct.dtype)
    mask = None if ct.mask is None else _take_last(ct.mask, idx)
    return CooTensor(_take_last(ct.val, idx), pattern, ct.dtype, mask)


def _routed(pa, pb, a_val: bool, b_val: bool):
    """How a product with coordinates on a side, and no band product, is planned:
    `(entrywise, conv_a, conv_b, pa, pb, a_val, b_val, coo)` with the operands
    converted for the plan, entry by entry over coordinates when `entrywise`, else by
    `product_plan` over dense free parts. `coo` holds the coordinate operands
    `(pa, pb)` of a product that runs densely although both sides have
    coordinates, else `None`."""
    from ._band import unbanded

    # A band meeting anything else goes back to its exact coordinates.
    pa, a_val, pb, b_val = unbanded(pa, a_val, pb, b_val)
    originals = (pa, pb, a_val, b_val)
    conv_a = conv_b = None
    if not (isinstance(pa, CooPattern) and isinstance(pb, CooPattern)):
        conv_a, conv_b, pa, pb, a_val, b_val = _converted(pa, pb, a_val, b_val)
    if isinstance(pa, CooPattern) and isinstance(pb, CooPattern):
        if not dense_is_better(pa, pb):
            return True, conv_a, conv_b, pa, pb, a_val, b_val, None
        coo = (pa, pb)
        # Dense free parts: sparse operands go to labeled form, labeled ones stay.
        pa, pb, a_val, b_val = originals
        conv_a = conv_b = None
        if isinstance(pa, CooPattern):
            conv_a, pa, a_val = "labeled", labeled_pattern(pa)[0], True
        if isinstance(pb, CooPattern):
            conv_b, pb, b_val = "labeled", labeled_pattern(pb)[0], True
        return False, conv_a, conv_b, pa, pb, a_val, b_val, coo
    return False, conv_a, conv_b, pa, pb, a_val, b_val, None


# A product over coordinates gathers both factors for each entry pair and sums the
# pairs by segment; a convolution applied as a map runs as one XLA convolution. On
# CPU the pair costs this many times a multiplication of the convolution (measured
# with the convolutions of a small CNN; see benchmarks/NOTES.md).
GATHER_COST = 8


def _map_form(pa, pb, a_map: bool, b_map: bool):
    """The operands of `A · B` with the mapped ones taken as their maps (the others
    as plain coordinates)."""
    qa = pa.linear if a_map else plain(pa)
    qb = pb.linear if b_map else plain(pb)
    return qa, qb


def _map_cost(qa, qb, a_val: bool, b_val: bool) -> int | None:
    """The cost of `A · B` with a map on one side (`qa` or `qb` a `LinearPattern`):
    its multiplications and the entries a coordinate operand is scattered into to
    meet the map; `None` where the product would stay a lazy map (a map applied
    nowhere yet, whose cost the product cannot see)."""
    from ._sparse import _ProductPlan, product_plan

    plan = product_plan(qa, qb, a_val, b_val)
    inner = plan.inner if isinstance(plan, ConvertPlan) else plan
    if not isinstance(inner, _ProductPlan):
        return None
    if inner.kind not in ("linear-apply", "apply-linear"):
        return None
    cost = plan.muls
    if isinstance(plan, ConvertPlan):
        for how, p in ((plan.conv_a, qa), (plan.conv_b, qb)):
            if how == "labeled":
                cost += _free_entries(labeled_pattern(p)[0])
    return cost


@functools.lru_cache(maxsize=4096)
def mapped_choice(pa, pb, a_val: bool, b_val: bool) -> tuple[bool, bool]:
    """Which operands of `A · B` with a `MappedPattern` are applied as maps: the
    form of least cost, a multiplication over coordinates counting `GATHER_COST`
    times one of a map. A band keeps the coordinates."""
    from ._band import BandPattern

    qa, qb = plain(pa), plain(pb)
    if isinstance(qa, BandPattern) or isinstance(qb, BandPattern):
        return False, False
    cost = GATHER_COST * mixed_product_muls(qa, qb, a_val, b_val)
    if isinstance(qa, CooPattern) and isinstance(qb, CooPattern):
        # Too many entry pairs to find the result's entries from (seconds of
        # tracing, a mostly dense result): the map, where one applies.
        if _pair_count(qa, qb)[0] > MAX_PICK_PAIRS:
            cost = math.inf
    best = (False, False)
    stored = None
    for choice, p in (((True, False), pa), ((False, True), pb)):
        if not isinstance(p, MappedPattern):
            continue
        form = _map_form(pa, pb, *choice)
        c = _map_cost(*form, a_val, b_val)
        if c is None or c >= cost:
            continue
        # A map keeps no tie on the side it is applied to (every axis of the block
        # it meets is dense there): where the coordinates' result stores fewer
        # entries, its structure is worth more downstream than this product costs.
        # (A convolution's map is weighed by its cost alone: calibrated so.)
        if not p.copies:
            best, cost = choice, c
            continue
        if stored is None:
            stored = _stored(mixed_product_summary(qa, qb, a_val, b_val)[0])
        if _stored(_map_result(*form, a_val, b_val)) > stored:
            continue
        best, cost = choice, c
    return best


def _map_result(qa, qb, a_val: bool, b_val: bool):
    """The pattern of `A · B` with a map on one side (see `_map_cost`)."""
    from ._sparse import product_plan

    return product_plan(qa, qb, a_val, b_val).pattern


def _stored(p) -> float:
    """Entries a block of pattern `p` stores."""
    if isinstance(p, (CooPattern, Pattern)):
        return p.val_size
    return math.inf


def _structural_muls(p, has_val: bool) -> int | None:
    """The multiplications of applying a partial of pattern `p` to one vector, where
    it is cheap and structural enough to fold into a map it meets: a value-free
    index map, or a labeled partial with no more entries than its larger side (an
    elementwise derivative, a broadcast, a unit axis added or removed). `None`
    otherwise."""
    from ._sparse import _matvec_muls

    if isinstance(p, CooPattern):
        return None if has_val else 0
    if isinstance(p, Pattern):
        entries = math.prod(p.sizes)
        if entries <= max(math.prod(p.out_shape), math.prod(p.in_shape)):
            return _matvec_muls(p, has_val)
    return None


def _carried_side(pa, pb, a_val: bool, b_val: bool) -> tuple[bool, int] | None:
    """Whether `A · B` taken over coordinates carries the map of `A` (`True`) or of
    `B` composed with the other operand, and that operand's multiplications per
    application (see `_carried`); `None` where it carries no map. The map of a
    mapped operand is carried where the other is structural (`_structural_muls`);
    of two mapped operands, that of the one the other is structural for, `A`'s
    where both are (two copies)."""
    a_map, b_map = isinstance(pa, MappedPattern), isinstance(pb, MappedPattern)
    if a_map:
        extra = _structural_muls(pb, b_val)
        if extra is not None:
            return True, extra
    if b_map:
        extra = _structural_muls(pa, a_val)
        if extra is not None:
            return False, extra
    return None


def _carried(pa, pb, a_val: bool, b_val: bool, result):
    """The `MappedPattern` of `A · B` taken over coordinates (pattern `result`),
    when a mapped operand meets a structural one (`_carried_side`): the result is
    also the map composed with that operand. Else `None`."""
    from ._sparse import _MAX_UNFOLDED, LinearPattern

    side = _carried_side(pa, pb, a_val, b_val)
    if not isinstance(result, CooPattern) or side is None:
        return None
    carry_a, extra = side
    carried = pa if carry_a else pb
    lin = carried.linear
    if lin.size >= _MAX_UNFOLDED:
        return None
    linear = LinearPattern(
        result.out_shape, result.in_shape, lin.muls + extra, lin.size + 1
    )
    r = result
    return MappedPattern(
        r.out_shape,
        r.in_shape,
        r.ties,
        r.varying,
        r.rows,
        r.cols,
        linear,
        carried.copies,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class CarriedPlan:
    """A product over coordinates whose result carries a map (see `_carried`):
    `inner` plans the coordinates; `carry_a` says whose map is carried."""

    pattern: MappedPattern
    muls: int
    has_val: bool
    inner: Any
    carry_a: bool = True


def _mapped_plan(pa, pb, a_val: bool, b_val: bool):
    """`mixed_product_plan` where an operand has a `MappedPattern`."""
    from ._sparse import plan_has_val, product_plan

    choice = mapped_choice(pa, pb, a_val, b_val)
    qa, qb = _map_form(pa, pb, *choice)
    if not any(choice):
        plan = mixed_product_plan(qa, qb, a_val, b_val)
        carried = _carried(pa, pb, a_val, b_val, plan.pattern)
        if carried is None:
            return plan
        side = _carried_side(pa, pb, a_val, b_val)
        assert side is not None
        return CarriedPlan(carried, plan.muls, plan.has_val, plan, side[0])
    plan = product_plan(qa, qb, a_val, b_val)
    conv_a = "map" if choice[0] else None
    conv_b = "map" if choice[1] else None
    if isinstance(plan, ConvertPlan):
        # The other operand converted as well (coordinates to their labeled form).
        conv_a, conv_b = conv_a or plan.conv_a, conv_b or plan.conv_b
        plan = plan.inner
    has_val = plan_has_val(plan, a_val, b_val)
    return ConvertPlan(
        plan.pattern, "convert", plan.muls, 0, has_val, conv_a, conv_b, plan
    )


def _is_mapped(pa, pb) -> bool:
    return isinstance(pa, MappedPattern) or isinstance(pb, MappedPattern)


def _counted_product(pa, pb, a_val: bool, b_val: bool) -> tuple[int, int, int]:
    """`(multiplications, gathered ones, ones by rows)` of `mixed_product_plan(pa,
    pb, a_val, b_val)`. Products of coordinates are counted without being planned
    (scoring an elimination needs no more, and a product of millions of entry pairs
    takes seconds to plan). Gathered: made entry pair by entry pair over
    coordinates, each gathering both factors and summing the pairs by segment,
    several times the cost of a multiplication of a dense `dot_general` or a
    convolution (`GATHER_COST`); none where the product runs as a band, over dense
    free parts or as a map. By rows: made over coordinates against a full block,
    whose rows are gathered whole (`RowsPlan`)."""
    from ._band import band_product_plan
    from ._sparse import product_plan

    if _is_mapped(pa, pb):
        if any(mapped_choice(pa, pb, a_val, b_val)):
            return _mapped_plan(pa, pb, a_val, b_val).muls, 0, 0
        pa, pb = plain(pa), plain(pb)
    band = band_product_plan(pa, pb)
    if band is not None:
        return band.muls, 0, 0
    entrywise, _, _, pa, pb, a_val, b_val, _ = _routed(pa, pb, a_val, b_val)
    if entrywise:
        assert isinstance(pa, CooPattern) and isinstance(pb, CooPattern)
        muls = coo_product_muls(pa, pb, a_val, b_val)
        if by_rows(pa, pb, a_val, b_val):
            return muls, 0, muls
        return muls, muls, 0
    return product_plan(pa, pb, a_val, b_val).muls, 0, 0


def mixed_product_muls(pa, pb, a_val: bool, b_val: bool) -> int:
    """The multiplications of `mixed_product_plan(pa, pb, a_val, b_val)` (see
    `_counted_product`)."""
    return _counted_product(pa, pb, a_val, b_val)[0]


def gathered_muls(pa, pb, a_val: bool, b_val: bool) -> int:
    """The multiplications of `mixed_product_plan(pa, pb, a_val, b_val)` made over
    coordinates, gathering both factors per entry pair (see `_counted_product`)."""
    return _counted_product(pa, pb, a_val, b_val)[1]


def rows_muls(pa, pb, a_val: bool, b_val: bool) -> int:
    """The multiplications of `mixed_product_plan(pa, pb, a_val, b_val)` made over
    coordinates by the rows of a full block (see `_counted_product`)."""
    return _counted_product(pa, pb, a_val, b_val)[2]


def mixed_product_summary(pa, pb, a_val: bool, b_val: bool):
    """`(pattern, has_val, muls)` of `mixed_product_plan(pa, pb, a_val, b_val)`; a
    product of coordinates entry by entry is summarised without its entry pairs."""
    from ._band import band_product_plan

    if _is_mapped(pa, pb):
        if any(mapped_choice(pa, pb, a_val, b_val)):
            plan = _mapped_plan(pa, pb, a_val, b_val)
            return plan.pattern, plan.has_val, plan.muls
        pattern, has_val, muls = mixed_product_summary(
            plain(pa), plain(pb), a_val, b_val
        )
        carried = _carried(pa, pb, a_val, b_val, pattern)
        return (pattern if carried is None else carried), has_val, muls
    band = band_product_plan(pa, pb)
    if band is None:
        entrywise, _, _, pa2, pb2, a2, b2, _ = _routed(pa, pb, a_val, b_val)
        if entrywise:
            return coo_product_summary(pa2, pb2, a2, b2)
    plan = mixed_product_plan(pa, pb, a_val, b_val)
    return plan.pattern, plan.has_val, plan.muls


def mixed_product_plan(pa, pb, a_val: bool, b_val: bool):
    """Plan `A · B` where at least one side is a static sparse pattern (coordinates
    or a band)."""
    from ._band import band_product_plan
    from ._sparse import plan_has_val, product_plan

    if _is_mapped(pa, pb):
        return _mapped_plan(pa, pb, a_val, b_val)
    band = band_product_plan(pa, pb)
    if band is not None:
        return band
    routed = _routed(pa, pb, a_val, b_val)
    entrywise, conv_a, conv_b, pa, pb, a_val, b_val, coo = routed
    if entrywise:
        plan = coo_product_plan(pa, pb, a_val, b_val)
        if conv_a is None and conv_b is None:
            return plan
        return ConvertPlan(
            plan.pattern, "convert", plan.muls, 0, plan.has_val, conv_a, conv_b, plan
        )
    inner = product_plan(pa, pb, a_val, b_val)
    has_val = plan_has_val(inner, a_val, b_val)
    picked = None if coo is None else _structural_result(*coo, inner.pattern, has_val)
    return ConvertPlan(
        inner.pattern if picked is None else picked[0],
        "convert",
        inner.muls,
        0,
        has_val,
        conv_a,
        conv_b,
        inner,
        picked,
    )


def mixed_sum_summary(pa, pb, a_val: bool, b_val: bool):
    """`(pattern, has_val, adds)` of `mixed_sum_plan(pa, pb, a_val, b_val)`; a sum
    of coordinates is summarised without its gathers."""
    from ._band import band_sum_plan, unbanded

    pa, pb = plain(pa), plain(pb)
    if band_sum_plan(pa, pb) is None:
        pa2, a2, pb2, b2 = unbanded(pa, a_val, pb, b_val)
        if not (isinstance(pa2, CooPattern) and isinstance(pb2, CooPattern)):
            _, _, pa2, pb2, a2, b2 = _converted(pa2, pb2, a2, b2)
        if isinstance(pa2, CooPattern) and isinstance(pb2, CooPattern):
            return coo_sum_summary(pa2, pb2, a2, b2)
    plan = mixed_sum_plan(pa, pb, a_val, b_val)
    return plan.pattern, plan.has_val, plan.adds


def spread_entries(pa, pb, a_val: bool, b_val: bool) -> int:
    """Entries `mixed_sum_plan(pa, pb, a_val, b_val)` gathers into a result it stores
    densely: a sum of coordinates gathers each operand storing values into the union
    of their entries (unless it holds exactly those entries in their order already),
    and where the union is dense enough to be stored densely, that writes every
    entry of the dense array, most of them zeros."""
    from ._band import band_sum_plan, unbanded

    pa, pb = plain(pa), plain(pb)
    if band_sum_plan(pa, pb) is not None:
        return 0
    pa2, a2, pb2, b2 = unbanded(pa, a_val, pb, b_val)
    if not (isinstance(pa2, CooPattern) and isinstance(pb2, CooPattern)):
        _, _, pa2, pb2, a2, b2 = _converted(pa2, pb2, a2, b2)
    if not (isinstance(pa2, CooPattern) and isinstance(pb2, CooPattern)):
        return 0
    return _coo_spread(pa2, pb2, a2, b2)


@functools.lru_cache(maxsize=4096)
def _coo_spread(pa: CooPattern, pb: CooPattern, a_val: bool, b_val: bool) -> int:
    pa2, _, pb2, _, ka, kb = _sum_keys(pa, pb)
    uniq = _distinct(np.concatenate([ka, kb]))
    coo = _sum_pattern(pa, pa2, pb2, uniq, True, a_val, b_val)
    if not _store_dense(coo):
        return 0
    vary = math.prod(coo.tie_sizes[t] for t, v in enumerate(coo.varying) if v)
    total = 0
    for keys, stores in ((ka, a_val), (kb, b_val)):
        if stores and not (len(keys) == len(uniq) and np.array_equal(keys, uniq)):
            total += len(uniq) * vary
    return total


def mixed_sum_plan(pa, pb, a_val: bool, b_val: bool):
    """Plan `A + B` where at least one side is a static sparse pattern (coordinates
    or a band)."""
    from ._band import band_sum_plan, unbanded
    from ._sparse import sum_plan

    pa, pb = plain(pa), plain(pb)
    band = band_sum_plan(pa, pb)
    if band is not None:
        return band
    pa, a_val, pb, b_val = unbanded(pa, a_val, pb, b_val)
    if isinstance(pa, CooPattern) and isinstance(pb, CooPattern):
        return coo_sum_plan(pa, pb, a_val, b_val)
    conv_a, conv_b, pa, pb, a_val, b_val = _converted(pa, pb, a_val, b_val)
    if isinstance(pa, CooPattern) and isinstance(pb, CooPattern):
        inner = coo_sum_plan(pa, pb, a_val, b_val)
        pattern, adds, has_val = inner.pattern, inner.adds, inner.has_val
    else:
        inner = None
        pattern, adds = sum_plan(pa, pb, a_val, b_val)
        has_val = True
    return ConvertPlan(pattern, "convert", 0, adds, has_val, conv_a, conv_b, inner)


def _unband(x):
    from ._band import BandTensor, to_coo as band_to_coo

    return band_to_coo(x) if isinstance(x, BandTensor) else x


def _convert(x, how: str | None):
    if how == "map":
        return as_map(x)
    # A plan over coordinates was made for plain ones.
    x = _unband(plain_tensor(x))
    if how == "coo" and not isinstance(x, CooTensor):
        return to_coo(x)
    if how == "labeled":
        return to_labeled(x)
    return x


def run_product(a, b, plan, dtype, final: bool = False):
    from ._band import BandProductPlan, band_product
    from ._sparse import product

    if isinstance(plan, BandProductPlan):
        return band_product(a, b, plan, dtype), plan.muls
    if isinstance(plan, CooProductPlan):
        return coo_product(a, b, plan, dtype), plan.muls
    if isinstance(plan, CarriedPlan):
        return _carried_product(a, b, plan, dtype, final), plan.muls
    out, _ = product(_convert(a, plan.conv_a), _convert(b, plan.conv_b), final)
    return _pick(out, plan.picked), plan.muls


def _carried_product(a, b, plan: CarriedPlan, dtype, final: bool):
    """`A · B` over coordinates, carrying the map of its mapped operand composed
    with the other (see `_carried`)."""
    from ._sparse import LinearMap

    out, _ = run_product(plain_tensor(a), plain_tensor(b), plan.inner, dtype, final)
    assert isinstance(out, CooTensor) and out.pattern == plan.pattern.plain
    if plan.carry_a:
        ma, (b_fn, b_tfn) = as_map(a), _applied(b)
        fn = lambda t: ma.fn(b_fn(t))  # noqa: E731
        tfn = lambda y: b_tfn(ma.tfn(y))  # noqa: E731
    else:
        (a_fn, a_tfn), mb = _applied(a), as_map(b)
        fn = lambda t: a_fn(mb.fn(t))  # noqa: E731
        tfn = lambda y: mb.tfn(a_tfn(y))  # noqa: E731
    linear = LinearMap(fn, tfn, plan.pattern.linear, jnp.dtype(dtype))
    return MappedCooTensor(out.val, plan.pattern, out.dtype, out.mask, linear=linear)


def _applied(x):
    """A structural partial met by a carried map, applied (and its transpose): a
    copy by its own map (a slice, a pad), anything else through what it stores."""
    if isinstance(x, MappedCooTensor) and x.val is None and x.linear is not None:
        return x.linear.fn, x.linear.tfn
    return (lambda t: apply_partial(x, t)), (lambda y: apply_partial_t(x, y))


def run_add(a, b, plan, dtype):
    from ._band import BandSumPlan, band_add
    from ._sparse import add

    if isinstance(plan, BandSumPlan):
        return band_add(a, b, plan, dtype), plan.adds
    a, b = _unband(a), _unband(b)
    if isinstance(plan, CooSumPlan):
        return coo_add(a, b, plan, dtype), plan.adds
    a, b = _convert(a, plan.conv_a), _convert(b, plan.conv_b)
    if isinstance(plan.inner, CooSumPlan):
        assert isinstance(a, CooTensor) and isinstance(b, CooTensor)
        return coo_add(a, b, plan.inner, dtype), plan.adds
    out, _ = add(a, b)
    return out, plan.adds
