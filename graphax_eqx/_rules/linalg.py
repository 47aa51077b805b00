"""Linear algebra: `dot_general` as tie patterns, convolutions as static sparse patterns
(linear maps past a size)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.sparse import bcoo_dot_general_p

from .. import _jax_private as jp
from .._indexed import from_entries, mapped
from .._sparse import from_labeled
from ._base import register, shape_of
from .fallback import fallback_rule
from .structural import _every_combination, _linear_in, _window_pairs


@register(lax.dot_general_p)
def _dot_general(primals, active, **params):
    lhs, rhs = primals
    out = lax.dot_general_p.bind(lhs, rhs, **params)
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
    out_shape = shape_of(out)
    lfree = [i for i in range(lhs.ndim) if i not in lc and i not in lb]
    rfree = [i for i in range(rhs.ndim) if i not in rc and i not in rb]
    # Output axes: batch, lhs free, rhs free.
    out_labels = (
        [("b", k) for k in range(len(lb))]
        + [("lf", i) for i in lfree]
        + [("rf", j) for j in rfree]
    )

    def lhs_label(i):
        if i in lb:
            return ("b", lb.index(i))
        if i in lc:
            return ("c", lc.index(i))
        return ("lf", i)

    def rhs_label(j):
        if j in rb:
            return ("b", rb.index(j))
        if j in rc:
            return ("c", rc.index(j))
        return ("rf", j)

    # ∂out/∂lhs: lhs free axes are pure ties and the value is rhs; and symmetrically.
    partials = {}
    sides = [(lhs, lhs_label, rhs, rhs_label), (rhs, rhs_label, lhs, lhs_label)]
    for i, (x, x_label, other, other_label) in enumerate(sides):
        if active[i]:
            labels = out_labels + [x_label(k) for k in range(x.ndim)]
            val_labels = [other_label(k) for k in range(other.ndim)]
            partials[(0, i)] = from_labeled(
                other, val_labels, out_shape, shape_of(x), labels, out.dtype
            )
    return [out], partials


# Convolutions get static sparse partials (which are also their linear maps) up to
# this many kernel entries per output (for the input) or in all (for the kernel).
_MAX_CONV_TAPS = 64
# Past `_MAX_CONV_TAPS` per output, the input partial is a pattern up to this many
# entries. Listing and multiplying out the entries of a wide layer costs trace time
# (0.7 s more for the training benchmark's CNN at 2.4 million) that a training loss,
# which meets the map, never repays.
_MAX_WIDE_CONV_ENTRIES = 1 << 20
# Past this many kernel entries the index maps are not found by convolving
# positions (`_conv_maps`), one convolution per entry.
_MAX_PROBED_TAPS = 64
_MAX_CONV_SIZE = 1 << 22


def _conv_maps(params, lhs, rhs):
    """For each kernel entry `t`: the flat lhs index each output reads through it
    (-1 for none), found by convolving positions with a one-hot kernel.

    `None` when the kernel or the arrays are too large for that.
    """
    lhs_shape, rhs_shape = shape_of(lhs), shape_of(rhs)
    taps = math.prod(rhs_shape)
    if taps > _MAX_PROBED_TAPS or math.prod(lhs_shape) > _MAX_CONV_SIZE:
        return None
    conv_params = dict(
        params,
        preferred_element_type=np.dtype(np.float32),
        precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST),
    )
    position = np.arange(1, math.prod(lhs_shape) + 1, dtype=np.int64)
    halves = [
        (position >> 12).astype(np.float32).reshape(lhs_shape),
        (position & 4095).astype(np.float32).reshape(lhs_shape),
    ]
    maps = []
    with jax.ensure_compile_time_eval():
        for t in range(taps):
            onehot = np.zeros(taps, np.float32)
            onehot[t] = 1
            onehot = onehot.reshape(rhs_shape)
            hi, lo = (
                np.asarray(lax.conv_general_dilated_p.bind(h, onehot, **conv_params))
                for h in halves
            )
            src = (hi.astype(np.int64) << 12) + lo.astype(np.int64) - 1
            maps.append(src.reshape(-1))
    return maps


# Convolutions whose index maps have up to this many entries get them in NumPy.
_MAX_CONV_ENTRIES = 1 << 22


def _conv_entries(params, lhs_shape, rhs_shape, out_shape):
    """Every `(output, lhs entry, kernel entry)` triple of a convolution, as flat
    index arrays, computed from its parameters; `None` for batch groups or past
    `_MAX_CONV_ENTRIES`.

    Output `(n, o, x)` sums `lhs[n, c, ·] · rhs[o, i, w]` over the kernel window `w`
    and the input features `c = g·I + i` of the output feature's group `g`, the
    spatial axes read like a windowed sum's (`_window_pairs`).
    """
    if params["batch_group_count"] != 1:
        return None
    lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
    groups = params["feature_group_count"]
    n_batch, n_out_feat = lhs_shape[lhs_spec[0]], rhs_shape[rhs_spec[0]]
    n_in_feat = rhs_shape[rhs_spec[1]]  # per group
    ndim = len(lhs_spec) - 2
    lhs_dilation = params["lhs_dilation"] or (1,) * ndim
    rhs_dilation = params["rhs_dilation"] or (1,) * ndim
    spatial = [
        _window_pairs(
            lhs_shape[lhs_spec[2 + d]],
            rhs_shape[rhs_spec[2 + d]],
            params["window_strides"][d],
            params["padding"][d],
            lhs_dilation[d],
            rhs_dilation[d],
        )
        for d in range(ndim)
    ]
    sizes = [n_batch, n_out_feat, n_in_feat] + [len(o) for o, _, _ in spatial]
    if math.prod(sizes) > _MAX_CONV_ENTRIES:
        return None
    n, o, i, *picks = _every_combination(sizes)
    feature = (o // (n_out_feat // groups)) * n_in_feat + i
    empty = np.zeros(0, np.int64)
    out_c = [empty] * len(out_shape)
    lhs_c = [empty] * len(lhs_shape)
    rhs_c = [empty] * len(rhs_shape)
    out_c[out_spec[0]], out_c[out_spec[1]] = n, o
    lhs_c[lhs_spec[0]], lhs_c[lhs_spec[1]] = n, feature
    rhs_c[rhs_spec[0]], rhs_c[rhs_spec[1]] = o, i
    for d, ((po, pi, pw), k) in enumerate(zip(spatial, picks, strict=True)):
        out_c[out_spec[2 + d]] = po[k]
        lhs_c[lhs_spec[2 + d]] = pi[k]
        rhs_c[rhs_spec[2 + d]] = pw[k]
    return tuple(
        np.asarray(np.ravel_multi_index(c, shape), np.int64)
        for c, shape in ((out_c, out_shape), (lhs_c, lhs_shape), (rhs_c, rhs_shape))
    )


# Convolutions reading one input feature per output feature are evaluated tap by tap
# on the CPU up to this many kernel entries per output.
_MAX_TAP_SUM = 64


def _tap_sum_applies(lhs, rhs, params) -> bool:
    """Whether `_conv_by_taps` evaluates this convolution: on the CPU, whose
    convolution kernels are slow when each output reads one input feature (3-50x
    slower than the sum of shifted slices on a single-feature input), for real
    floating-point operands of one dtype, up to `_MAX_TAP_SUM` taps."""
    if jax.default_backend() != "cpu" or params["batch_group_count"] != 1:
        return False
    dtype = jnp.result_type(lhs)
    if dtype not in (jnp.float32, jnp.float64) or jnp.result_type(rhs) != dtype:
        return False
    preferred = params.get("preferred_element_type")
    if preferred is not None and np.dtype(preferred) != dtype:
        return False
    _, rhs_spec, _ = params["dimension_numbers"]
    rhs_shape = shape_of(rhs)
    taps = math.prod(rhs_shape[d] for d in rhs_spec[2:])
    return rhs_shape[rhs_spec[1]] == 1 and 0 < taps <= _MAX_TAP_SUM


def _conv_by_taps(lhs, rhs, params, out_shape):
    """`conv_general_dilated(lhs, rhs)` where each output feature reads one input
    feature: per kernel entry, a strided slice of the padded input times that entry,
    summed (the same products, added in kernel order)."""
    lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
    nd = len(lhs_spec) - 2
    x = lax.transpose(lhs, tuple(lhs_spec))  # (batch, features, *spatial)
    w = lax.transpose(rhs, tuple(rhs_spec))  # (out features, 1, *kernel)
    n_batch, n_feat = x.shape[:2]
    n_out = w.shape[0]
    per_group = n_out // params["feature_group_count"]
    out_spatial = tuple(out_shape[out_spec[2 + d]] for d in range(nd))
    lhs_dilation = params["lhs_dilation"] or (1,) * nd
    rhs_dilation = params["rhs_dilation"] or (1,) * nd
    strides = params["window_strides"]
    zero = lax.full((), 0, x.dtype)
    x = lax.pad(
        x,
        zero,
        ((0, 0, 0), (0, 0, 0))
        + tuple(
            (lo, hi, lhs_dilation[d] - 1)
            for d, (lo, hi) in enumerate(params["padding"])
        ),
    )
    canonical = (n_batch, n_out) + out_spatial
    total = None
    for tap in np.ndindex(*w.shape[2:]):
        start = (0, 0) + tuple(t * r for t, r in zip(tap, rhs_dilation, strict=True))
        limit = (n_batch, n_feat) + tuple(
            s + (o - 1) * st + 1
            for s, o, st in zip(start[2:], out_spatial, strides, strict=True)
        )
        window = lax.slice(x, start, limit, (1, 1) + tuple(strides))
        if n_feat != 1 and per_group != 1:
            # Output feature `o` reads input feature `o // per_group`.
            window = lax.broadcast_in_dim(
                window,
                (n_batch, n_feat, per_group) + out_spatial,
                (0, 1) + tuple(range(3, 3 + nd)),
            ).reshape(canonical)
        else:
            window = lax.broadcast_in_dim(window, canonical, tuple(range(2 + nd)))
        weight = lax.broadcast_in_dim(w[(slice(None), 0) + tap], canonical, (1,))
        term = lax.mul(window, weight)
        total = term if total is None else lax.add(total, term)
    assert total is not None  # at least one tap
    return lax.transpose(total, tuple(int(i) for i in np.argsort(out_spec)))


def _conv_value(lhs, rhs, params):
    """The convolution's output: by taps where `_tap_sum_applies`, else XLA's."""
    conv = functools.partial(lax.conv_general_dilated_p.bind, **params)
    if _tap_sum_applies(lhs, rhs, params):
        out = jax.eval_shape(conv, lhs, rhs)
        if math.prod(out.shape):
            return _conv_by_taps(lhs, rhs, params, out.shape)
    return conv(lhs, rhs)


def _conv_probe(params, rhs_shape, out_shape):
    """A probe (see [`graphax_eqx._sparse.LinearMap`][]) of the input partial of a
    convolution, `t ↦ conv(t, kernel)`: every output feature reads every input
    feature of its group over its window, so NaN reaches an output wherever some
    input feature of its group holds one in that window. Each group's input features
    are summed first, then each window of those sums (a `reduce_window` with the
    convolution's strides, padding and dilations), broadcast to the group's output
    features: a small fraction of the convolution's work. `None` where
    `batch_group_count` is not 1."""
    if params["batch_group_count"] != 1:
        return None
    lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
    groups = params["feature_group_count"]
    nd = len(lhs_spec) - 2
    lhs_dilation = params["lhs_dilation"] or (1,) * nd
    rhs_dilation = params["rhs_dilation"] or (1,) * nd
    window = (1, 1) + tuple(rhs_shape[rhs_spec[2 + d]] for d in range(nd))
    strides = (1, 1) + tuple(params["window_strides"])
    padding = ((0, 0), (0, 0)) + tuple(tuple(p) for p in params["padding"])
    base = (1, 1) + tuple(lhs_dilation)
    dilation = (1, 1) + tuple(rhs_dilation)
    # Canonical layout (batch, features, *spatial), back to the output's at the end.
    n_out = out_shape[out_spec[1]]
    canonical = tuple(out_shape[out_spec[k]] for k in range(nd + 2))
    back = tuple(int(k) for k in np.argsort(out_spec))

    def probe(t):
        x = lax.transpose(t, tuple(lhs_spec))
        n, c = x.shape[:2]
        x = lax.reshape(x, (n, groups, c // groups) + tuple(x.shape[2:]))
        summed = jnp.sum(x, axis=2, dtype=t.dtype)
        reached = lax.reduce_window(
            summed,
            np.array(0, t.dtype),
            lax.add,
            window,
            strides,
            padding,
            base,
            dilation,
        )
        per_group = (n, groups, n_out // groups) + canonical[2:]
        dims = (0, 1) + tuple(range(3, nd + 3))
        reached = lax.broadcast_in_dim(reached, per_group, dims)
        return lax.transpose(lax.reshape(reached, canonical), back)

    return probe


@register(lax.conv_general_dilated_p)
def _conv(primals, active, **params):
    lhs, rhs = primals
    out = _conv_value(lhs, rhs, params)
    out_shape = shape_of(out)
    rhs_spec = params["dimension_numbers"].rhs_spec
    # Each output entry is a dot product over one kernel's input window.
    fan_in = math.prod(rhs.shape) // rhs.shape[rhs_spec[0]]
    muls = math.prod(out_shape) * fan_in
    # Coordinates pay off against sparse neighbours; against a dense one, a gather
    # per entry costs far more than a convolution applying the partial as a linear
    # map. A partial stored by coordinates is therefore also that map, and each
    # product picks its form (`_indexed.mapped_choice`). The input partial
    # qualifies by its fan-in or, past it, by its entries; the kernel partial by its
    # size.
    coordinates = (
        active[0] and (fan_in <= _MAX_CONV_TAPS or muls <= _MAX_WIDE_CONV_ENTRIES),
        active[1] and math.prod(rhs.shape) <= _MAX_CONV_TAPS,
    )
    entries = maps = None
    if any(coordinates):
        entries = _conv_entries(params, shape_of(lhs), shape_of(rhs), out_shape)
        if entries is None:
            maps = _conv_maps(params, lhs, rhs)
    if maps is not None:
        rows = [np.nonzero(src >= 0)[0] for src in maps]
        srcs = [src[r] for src, r in zip(maps, rows, strict=True)]
        taps = [np.full(len(r), t) for t, r in enumerate(rows)]
        entries = tuple(np.concatenate(x) for x in (rows, srcs, taps))
    linear = [
        _linear_in(
            lax.conv_general_dilated_p,
            params,
            primals,
            i,
            out_shape,
            out.dtype,
            muls=muls,
            probe=_conv_probe(params, rhs.shape, out_shape) if i == 0 else None,
        )
        if active[i]
        else None
        for i in (0, 1)
    ]
    partials = {}
    if entries is not None:
        rows, srcs, taps = entries
        if coordinates[0]:
            partials[(0, 0)] = from_entries(
                out_shape,
                shape_of(lhs),
                rows,
                srcs,
                out.dtype,
                weights=(taps, jnp.reshape(rhs, (-1,))),
            )
        if coordinates[1]:
            partials[(0, 1)] = from_entries(
                out_shape,
                shape_of(rhs),
                rows,
                taps,
                out.dtype,
                weights=(srcs, jnp.reshape(lhs, (-1,))),
            )
    for i in (0, 1):
        if not active[i]:
            continue
        if (0, i) in partials:
            partials[(0, i)] = mapped(partials[(0, i)], linear[i])
        else:
            partials[(0, i)] = linear[i]
    return [out], partials


# A product with a `jax.experimental.sparse.BCOO` matrix gets static sparse partials
# up to this many entries.
_MAX_BCOO_ENTRIES = 1 << 22


def _bcoo_entries(params, indices, rhs_shape):
    """The entries of `bcoo_dot_general(data, indices, rhs)` as a sparse matrix
    times `rhs`: for each stored element `e` the matrix holds in bounds and each
    index `j` over `rhs`'s free axes, the flat output position, the flat `rhs`
    position it reads, and `e`. `None` past `_MAX_BCOO_ENTRIES`.

    The output's axes are the matrix's free axes, then `rhs`'s.
    """
    (lc, rc), _ = params["dimension_numbers"]
    shape = tuple(params["lhs_spinfo"].shape)
    bounds = np.asarray(shape, np.int64)
    idx = np.asarray(indices, np.int64)
    # Negative indices count from the end, as in NumPy and JAX's own BCOO operations;
    # indices still out of bounds mark padding, which every BCOO operation ignores.
    idx = np.where(idx < 0, idx + bounds, idx)
    (elements,) = np.nonzero(np.all((idx >= 0) & (idx < bounds), axis=1))
    idx = idx[elements]
    lf = [d for d in range(len(shape)) if d not in lc]
    rf = [d for d in range(len(rhs_shape)) if d not in rc]
    rf_shape = tuple(rhs_shape[d] for d in rf)
    n_rf = math.prod(rf_shape)
    if len(elements) * n_rf > _MAX_BCOO_ENTRIES:
        return None
    n = len(elements)
    if lf:
        lhs_pos = np.ravel_multi_index(
            tuple(idx[:, d] for d in lf), tuple(shape[d] for d in lf)
        )
    else:  # every axis of the matrix contracted: one output row
        lhs_pos = np.zeros(n, np.int64)
    rows = np.asarray(lhs_pos, np.int64)[:, None] * n_rf + np.arange(n_rf)[None, :]
    free = np.unravel_index(np.arange(n_rf), rf_shape) if rf_shape else ()
    coords = [np.zeros((n, n_rf), np.int64)] * len(rhs_shape)
    for k, d in enumerate(rc):
        coords[d] = np.broadcast_to(idx[:, lc[k]][:, None], (n, n_rf))
    for k, d in enumerate(rf):
        coords[d] = np.broadcast_to(free[k][None, :], (n, n_rf))
    if rhs_shape:
        cols = np.ravel_multi_index(tuple(coords), tuple(rhs_shape))
    else:
        cols = np.zeros((n, n_rf), np.int64)
    which = np.broadcast_to(elements[:, None], (n, n_rf))
    return rows.reshape(-1), np.asarray(cols, np.int64).reshape(-1), which.reshape(-1)


@register(bcoo_dot_general_p)
def _bcoo_dot_general(primals, active, **params):
    """`bcoo_dot_general(data, indices, rhs)`, a `BCOO` matrix (no batch or dense
    axes) times a dense array, with the indices known now: the partial with respect
    to `rhs` is the matrix itself (its stored values at static coordinates,
    duplicates summed), the partial with respect to `data` the entries of `rhs` each
    stored value multiplies."""
    data, indices, rhs = primals
    _, (lb, rb) = params["dimension_numbers"]
    entries = None
    if jp.is_concrete(indices) and jnp.ndim(data) == 1 and jnp.ndim(indices) == 2:
        if not lb and not rb:
            entries = _bcoo_entries(params, indices, shape_of(rhs))
    if entries is None:
        return fallback_rule(bcoo_dot_general_p, primals, active, params)
    out = bcoo_dot_general_p.bind(data, indices, rhs, **params)
    out_shape, rhs_shape = shape_of(out), shape_of(rhs)
    rows, cols, which = entries
    partials = {}
    if active[2]:
        n_in = max(1, math.prod(rhs_shape))
        key = rows * n_in + cols
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        if len(first) == len(key):
            weights = (which, jnp.reshape(data, (-1,)))
        else:
            # Stored duplicates add up.
            summed = jax.ops.segment_sum(
                jnp.take(data, which), inverse.reshape(-1), len(first)
            )
            rows, cols, weights = (
                rows[first],
                cols[first],
                (np.arange(len(first)), summed),
            )
        partials[(0, 2)] = from_entries(
            out_shape, rhs_shape, rows, cols, out.dtype, weights=weights
        )
        rows, cols, which = entries
    if active[0]:
        partials[(0, 0)] = from_entries(
            out_shape,
            shape_of(data),
            rows,
            which,
            out.dtype,
            weights=(cols, jnp.reshape(rhs, (-1,))),
        )
    return [out], partials
