"""Structural primitives: they move, copy or select entries.

Those whose Jacobian is a tie pattern (transpose, broadcast, squeeze, unit reshapes)
become pure-delta partials. Index-moving ones whose Jacobian is a permutation,
selection or embedding (slice, gather, pad, concatenate, scatter-add, ...) become
static sparse patterns (`graphax_eqx.CooTensor`) when their indices are known at
trace time: the primitive is run once on an array of positions to read off where each
entry comes from, and the axes it does not move become ties. With indices computed at
run time, they stay `graphax_eqx._sparse.LinearMap`s: the primitive itself, applied
to a neighbouring partial during elimination, never an `n × n` matrix.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from .. import _jax_private as jp
from .._indexed import (
    CooPattern,
    CooTensor,
    _take_last,
    entry_pattern,
    finish,
    from_entries,
    mapped,
)
from .._sparse import diagonal, from_labeled, linear_map
from ._base import as_monoid_rule, is_float, per_slice_blocks, register, shape_of
from .fallback import fallback_rule


# Index maps are read off at trace time up to this many entries on either side.
_MAX_INDEX_MAP = 1 << 26


def _small_enough(*shapes) -> bool:
    return all(0 < math.prod(s) <= _MAX_INDEX_MAP for s in shapes)


def _sources(prim, params, args, i):
    """Where each output of `prim` comes from in `args[i]`: a flat index, or -1.

    For primitives that copy entries of `args[i]` (at most one source per output,
    zero elsewhere). The other arguments must be known now; float ones are zeroed.
    `None` when they are not known.
    """
    if i == 0:
        src = _numpy_sources(prim, params, shape_of(args[0]))
        if src is not None:
            return [src]
    if prim is jp.stack_p or prim is jp.unstack_p:
        return _stack_sources(prim, params["axis"], [shape_of(a) for a in args], i)
    call = []
    for k, a in enumerate(args):
        if k == i:
            n = math.prod(shape_of(a))
            call.append(np.arange(1, n + 1, dtype=np.int32).reshape(shape_of(a)))
        elif is_float(a):
            call.append(np.zeros(shape_of(a), np.int32))
        elif not jp.is_concrete(a):
            return None
        else:
            call.append(a)
    with jax.ensure_compile_time_eval():
        outs = jp.bind(prim, params, *call)
    return [np.asarray(o).reshape(-1).astype(np.int64) - 1 for o in outs]


def _stack_sources(prim, axis, in_shapes, i):
    """`_sources` of operand `i` of a `stack` or `unstack`, in NumPy: one call of JAX
    per operand would stack all of them, quadratic in their number."""
    pos = np.arange(math.prod(in_shapes[i]), dtype=np.int64).reshape(in_shapes[i])
    if prim is jp.unstack_p:
        return [pos.take(k, axis=axis).reshape(-1) for k in range(pos.shape[axis])]
    out = np.full((len(in_shapes),) + in_shapes[i], -1, np.int64)
    out[i] = pos
    return [np.moveaxis(out, 0, axis).reshape(-1)]


def _numpy_sources(prim, params, in_shape):
    """`_sources` of the operand for slices, reversals, plain reshapes and pads,
    computed in NumPy (no JAX computation to compile at trace time); else `None`."""
    n = math.prod(in_shape)
    pos = np.arange(n, dtype=np.int64).reshape(in_shape)
    if prim is lax.slice_p:
        strides = params["strides"] or (1,) * len(in_shape)
        index = tuple(
            slice(lo, hi, st)
            for lo, hi, st in zip(
                params["start_indices"], params["limit_indices"], strides, strict=True
            )
        )
        return pos[index].reshape(-1)
    if prim is lax.rev_p:
        return np.flip(pos, tuple(params["dimensions"])).reshape(-1)
    if prim.name == "tile":
        return np.tile(pos, tuple(params["reps"])).reshape(-1)
    if prim is lax.reshape_p and params.get("dimensions") is None:
        return pos.reshape(-1)
    if prim is lax.pad_p:
        out = pos
        for axis, (lo, hi, interior) in enumerate(params["padding_config"]):
            size = out.shape[axis]
            full = max(0, size + (size - 1) * interior) if size else 0
            grown = np.full(
                out.shape[:axis]
                + (full + max(lo, 0) + max(hi, 0),)
                + out.shape[axis + 1 :],
                -1,
                np.int64,
            )
            where = [slice(None)] * out.ndim
            where[axis] = slice(max(lo, 0), max(lo, 0) + full, interior + 1)
            grown[tuple(where)] = out
            keep = [slice(None)] * out.ndim
            keep[axis] = slice(-min(lo, 0), grown.shape[axis] - (-min(hi, 0)))
            out = grown[tuple(keep)]
        return out.reshape(-1)
    return None


def _copy_partial(src, out_shape, in_shape, dtype, linear=None):
    """The partial of a copy: output entry `k` is input entry `src[k]` (none where
    `src[k] < 0`), by coordinates, and also the map `linear` (a `LinearMap`; a gather
    of `src` unless given).

    The map is what a product with a dense neighbour applies (`_indexed.mapped`):
    rows of a dense block sliced or padded as the primitive does, where coordinates
    would gather each entry (or materialise the copy as a matrix of zeros and ones
    where the neighbour is large)."""
    rows = np.nonzero(src >= 0)[0]
    partial = from_entries(out_shape, in_shape, rows, src[rows], dtype)
    if linear is None:
        linear = _gather_map(src, in_shape, out_shape, dtype)
    return mapped(partial, linear, copies=True)


def _gather_map(src, in_shape, out_shape, dtype):
    """The copy `t ↦ t.flat[src]` (zero where `src < 0`) as a linear map."""

    def fn(t):
        # The index arrays are built where the map is applied (most copies never
        # are), as constants of that program.
        keep = src >= 0
        kind = np.int32 if math.prod(in_shape) < 2**31 else np.int64
        out = jnp.reshape(t, (-1,))[np.where(keep, src, 0).astype(kind)]
        if not keep.all():
            out = jnp.where(keep, out, jnp.zeros((), out.dtype))
        return jnp.reshape(out, out_shape)

    return linear_map(fn, in_shape, out_shape, dtype)


def _index_map_in(prim, params, args, i, out_shape, dtype):
    """The static sparse partial of `prim` w.r.t. `args[i]`, or `None`; also the
    primitive itself as a map (see `_copy_partial`)."""
    in_shape = shape_of(args[i])
    if not _small_enough(in_shape, out_shape):
        return None
    srcs = _sources(prim, params, args, i)
    if srcs is None:
        return None
    linear = None
    if prim in _OWN_MAPS:
        # The other float operands (an update overwriting entries, a padding value)
        # do not enter the derivative: zero, as `_sources` reads the map.
        zeroed = [
            jnp.zeros_like(a) if k != i and is_float(a) else a
            for k, a in enumerate(args)
        ]
        linear = _linear_in(prim, params, zeroed, i, out_shape, dtype)
    return _copy_partial(srcs[0], out_shape, in_shape, dtype, linear)


# Copies applied as maps by the primitive itself (JAX transposes each of them); any
# other copy by a gather of its sources (a scatter's kept operand: JAX transposes a
# scatter only where its indices are unique).
_OWN_MAPS = frozenset(
    p
    for p in (
        lax.slice_p,
        lax.rev_p,
        lax.reshape_p,
        lax.pad_p,
        lax.dynamic_slice_p,
        lax.dynamic_update_slice_p,
        lax.gather_p,
    )
    if p is not None
)


def _linear_in(prim, params, args, i, out_shape, dtype, tfn=None, muls=0, probe=None):
    """The linear map `t ↦ prim(args with args[i] = t)`; other args keep it linear.
    `probe`: see [`graphax_eqx._sparse.LinearMap`][]."""
    args = list(args)
    in_shape = shape_of(args[i])
    in_dtype = args[i].dtype

    def fn(t):
        call = list(args)
        # In the operand's dtype: a tangent computed in float32 meeting a bfloat16
        # convolution, whose operands must share a dtype.
        call[i] = t if t.dtype == in_dtype else lax.convert_element_type(t, in_dtype)
        return prim.bind(*call, **params)

    return linear_map(fn, in_shape, out_shape, dtype, tfn=tfn, muls=muls, probe=probe)


@register(lax.broadcast_in_dim_p)
def _broadcast_in_dim(primals, active, **params):
    out = lax.broadcast_in_dim_p.bind(*primals, **params)
    shape, dims = shape_of(out), params["broadcast_dimensions"]
    in_shape = shape_of(primals[0])
    labels = [("o", k) for k in range(len(shape))]
    for i, d in enumerate(dims):
        labels.append(("o", d) if in_shape[i] == shape[d] else ("i", i))
    partial = from_labeled(None, (), shape, in_shape, labels, out.dtype)
    return [out], {(0, 0): partial} if active[0] else {}


def _unit_reshape_labels(in_shape, out_shape):
    """Labels if the reshape only adds/removes unit axes, else None."""
    in_big = [i for i, s in enumerate(in_shape) if s != 1]
    out_big = [k for k, s in enumerate(out_shape) if s != 1]
    if [in_shape[i] for i in in_big] != [out_shape[k] for k in out_big]:
        return None
    labels = [("o", k) for k in range(len(out_shape))]
    in_labels = [("i", i) for i in range(len(in_shape))]
    for i, k in zip(in_big, out_big, strict=True):
        in_labels[i] = ("o", k)
    return labels + in_labels


@register(lax.reshape_p)
def _reshape(primals, active, **params):
    out = lax.reshape_p.bind(*primals, **params)
    if not active[0]:
        return [out], {}
    x = primals[0]
    in_shape, out_shape = shape_of(x), shape_of(out)
    labels = None
    if params.get("dimensions") is None:
        labels = _unit_reshape_labels(in_shape, out_shape)
    if labels is not None:
        partial = from_labeled(None, (), out_shape, in_shape, labels, out.dtype)
    elif (
        partial := _index_map_in(
            lax.reshape_p, params, primals, 0, out_shape, out.dtype
        )
    ) is not None:
        pass
    elif params.get("dimensions") is None:
        partial = linear_map(
            lambda t: jnp.reshape(t, out_shape),
            in_shape,
            out_shape,
            out.dtype,
            tfn=lambda c: jnp.reshape(c, in_shape),
        )
    else:
        partial = _linear_in(lax.reshape_p, params, primals, 0, out_shape, out.dtype)
    return [out], {(0, 0): partial}


@register(lax.squeeze_p)
def _squeeze(primals, active, **params):
    out = lax.squeeze_p.bind(*primals, **params)
    in_shape, out_shape = shape_of(primals[0]), shape_of(out)
    dims = {d % len(in_shape) for d in params["dimensions"]}
    labels = [("o", k) for k in range(len(out_shape))]
    k = 0
    for i in range(len(in_shape)):
        if i in dims:
            labels.append(("i", i))
        else:
            labels.append(("o", k))
            k += 1
    partial = from_labeled(None, (), out_shape, in_shape, labels, out.dtype)
    return [out], {(0, 0): partial} if active[0] else {}


@register(lax.transpose_p)
def _transpose(primals, active, **params):
    out = lax.transpose_p.bind(*primals, **params)
    perm = params["permutation"]
    out_shape, in_shape = shape_of(out), shape_of(primals[0])
    labels = [("o", k) for k in range(len(perm))] + [None] * len(perm)
    for k, p in enumerate(perm):
        labels[len(perm) + p] = ("o", k)
    partial = from_labeled(None, (), out_shape, in_shape, labels, out.dtype)
    return [out], {(0, 0): partial} if active[0] else {}


def _single_linear(prim):
    """Rule for a primitive linear in its first operand, other operands integers."""

    def rule(primals, active, **params):
        out = prim.bind(*primals, **params)
        if not active[0]:
            return [out], {}
        partial = _index_map_in(prim, params, primals, 0, shape_of(out), out.dtype)
        if partial is None:
            partial = _linear_in(prim, params, primals, 0, shape_of(out), out.dtype)
        return [out], {(0, 0): partial}

    return rule


for _prim in (
    lax.slice_p,
    lax.rev_p,
    lax.dynamic_slice_p,
    getattr(lax, "tile_p", None),
):
    if _prim is not None:
        register(_prim)(_single_linear(_prim))


@register(lax.gather_p)
def _gather(primals, active, **params):
    out = lax.gather_p.bind(*primals, **params)
    if not active[0]:
        return [out], {}
    linear_params = dict(params)
    if "fill_value" in linear_params:
        # Out-of-bounds entries are constants: zero derivative.
        linear_params["fill_value"] = 0
    if linear_params.get("mode") == lax.GatherScatterMode.PROMISE_IN_BOUNDS:
        # The gather clamps out-of-bounds starts (XLA's gather always does), as an
        # index map of known indices does; said explicitly, so that a map of traced
        # indices is transposed to a scatter that clamps them too, rather than one
        # that drops them. (`jax.jacfwd` clamps; `jax.jacrev` drops.)
        linear_params["mode"] = lax.GatherScatterMode.CLIP
    partial = _index_map_in(
        lax.gather_p, linear_params, primals, 0, shape_of(out), out.dtype
    )
    if partial is None:
        partial = _linear_in(
            lax.gather_p, linear_params, primals, 0, shape_of(out), out.dtype
        )
    return [out], {(0, 0): partial}


@register(lax.cumsum_p)
def _cumsum(primals, active, **params):
    out = lax.cumsum_p.bind(*primals, **params)
    if not active[0]:
        return [out], {}
    axis, reverse = params["axis"], params["reverse"]
    shape = shape_of(out)
    partial = _tied_cumsum(shape, axis, reverse, out.dtype)
    if partial is not None:
        return [out], {(0, 0): partial}
    partial = linear_map(
        functools.partial(_cumulative_sum, axis=axis, reverse=reverse),
        shape,
        shape,
        out.dtype,
        tfn=functools.partial(_cumulative_sum, axis=axis, reverse=not reverse),
    )
    return [out], {(0, 0): partial}


# A cumulative sum along one axis of a larger array is a static pattern of ones (a
# triangle per slice) up to this many entries per slice.
_MAX_CUMSUM_ENTRIES = 1 << 22


def _tied_cumsum(shape, axis, reverse, dtype):
    """A cumulative sum along `axis` of an array with other axes longer than 1: a
    triangle of ones on the summed axis, tied on every other axis, so a batch of
    cumulative sums has a block-diagonal Jacobian. `None` for a single axis (the sum
    itself is the map: applied at run time it costs `n` a column, a triangle `n²/2`)
    or a triangle of more than `_MAX_CUMSUM_ENTRIES` entries."""
    n = shape[axis]
    if all(d == 1 for a, d in enumerate(shape) if a != axis):
        return None
    if not 0 < n * (n + 1) // 2 <= _MAX_CUMSUM_ENTRIES:
        return None
    # Output `o` sums the inputs up to `o` (from `o` on, reversed): ascending rows,
    # then columns.
    rows, cols = np.tril_indices(n) if not reverse else np.triu_indices(n)
    others = tuple(a for a in range(len(shape)) if a != axis)
    p = CooPattern(
        shape,
        shape,
        tuple((a, a) for a in others),
        (False,) * len(others),
        rows.astype(np.int64),
        cols.astype(np.int64),
    )
    return finish(CooTensor(None, p, jnp.dtype(dtype)))


def _cumulative_sum(t, *, axis, reverse):
    """`lax.cumsum` behind an optimisation barrier.

    Applied to a constant (a product with a pure index map: `jnp.cumsum(u)[::3]`),
    XLA would fold the cumulative sum at compile time with an evaluator that takes
    time quadratic in the axis length: 3 s for 400 rows of 1,200, where computing it
    at run time takes milliseconds.
    """
    return lax.cumsum(lax.optimization_barrier(t), axis=axis, reverse=reverse)


@register(lax.dynamic_update_slice_p)
def _dynamic_update_slice(primals, active, **params):
    operand, update, *indices = primals
    out = lax.dynamic_update_slice_p.bind(*primals, **params)
    shape = shape_of(out)
    partials = {}
    if active[0]:
        # Known starts: the entries kept, as an index map (the overwritten ones are
        # not stored). Else the primitive itself masks them: `lax.dynamic_update_slice`
        # would wrap negative starts a second time (they are wrapped once before the
        # primitive).
        prim = lax.dynamic_update_slice_p
        partial = _index_map_in(prim, params, primals, 0, shape, out.dtype)
        if partial is None:
            mask = prim.bind(
                jnp.ones_like(operand), jnp.zeros_like(update), *indices, **params
            )
            partial = diagonal(mask, shape, out.dtype)
        partials[(0, 0)] = partial
    if active[1]:
        args = [jnp.zeros_like(operand), update, *indices]
        prim = lax.dynamic_update_slice_p
        partial = _index_map_in(prim, params, args, 1, shape, out.dtype)
        if partial is None:
            partial = _linear_in(prim, params, args, 1, shape, out.dtype)
        partials[(0, 1)] = partial
    return [out], partials


@register(lax.scatter_add_p)
def _scatter_add(primals, active, **params):
    operand, indices, updates = primals
    out = lax.scatter_add_p.bind(*primals, **params)
    shape = shape_of(out)
    partials = {}
    if active[0]:
        partials[(0, 0)] = diagonal(None, shape, out.dtype)
    if active[2]:
        partial = _scatter_add_map(params, indices, shape_of(updates), shape, out.dtype)
        if partial is None:
            args = [jnp.zeros_like(operand), indices, updates]
            partial = _linear_in(lax.scatter_add_p, params, args, 2, shape, out.dtype)
        partials[(0, 2)] = partial
    return [out], partials


def _scatter_add_map(params, indices, upd_shape, out_shape, dtype):
    """The static sparse partial of a scatter-add w.r.t. its updates, or `None`."""
    dst = _scatter_destinations(params, indices, upd_shape, out_shape)
    if dst is None:
        return None
    cols = np.nonzero(dst >= 0)[0]
    return from_entries(out_shape, upd_shape, dst[cols], cols, dtype)


def _scatter_destinations(params, indices, upd_shape, out_shape):
    """For each update entry of a scatter, the flat output position it lands on (-1
    where it is dropped); `None` where the indices are not known now or the arrays
    are too large.

    Each update lands on at most one output: read the destinations off the transpose
    of the scatter-add with the same indices and mode (a gather of the output
    positions), in two exact float32 halves.
    """
    if not jp.is_concrete(indices) or not _small_enough(upd_shape, out_shape):
        return None
    zeros = np.zeros(out_shape, np.float32)
    upd = jax.ShapeDtypeStruct(upd_shape, np.float32)
    position = np.arange(1, math.prod(out_shape) + 1, dtype=np.int64)
    halves = []
    with jax.ensure_compile_time_eval():
        transposed = jax.linear_transpose(
            lambda u: lax.scatter_add(
                zeros,
                indices,
                u,
                params["dimension_numbers"],
                indices_are_sorted=params["indices_are_sorted"],
                unique_indices=params["unique_indices"],
                mode=params["mode"],
            ),
            upd,
        )
        for half in (position >> 12, position & 4095):
            (ct,) = transposed(half.astype(np.float32).reshape(out_shape))
            halves.append(np.asarray(ct).reshape(-1).astype(np.int64))
    return (halves[0] << 12) + halves[1] - 1


def _scatter_extremum(prim, primals, active, params):
    """`x.at[idx].max(v)`, `jax.ops.segment_max` (and `min`) with indices known now:
    each update's partial sits at its static destination, the operand's on the
    diagonal. Where several values reach the result (the operand's entry and the
    updates equal to it), they share the derivative equally, as in JAX's own rule."""
    operand, indices, updates = primals
    out = prim.bind(operand, indices, updates, **params)
    out_shape, upd_shape = shape_of(out), shape_of(updates)
    dst = _scatter_destinations(params, indices, upd_shape, out_shape)
    if dst is None:
        return fallback_rule(prim, primals, active, params)
    (cols,) = np.nonzero(dst >= 0)
    rows = dst[cols]
    dtype = out.dtype
    n_out = math.prod(out_shape)
    flat_out = jnp.reshape(out, (-1,))
    reached = jnp.reshape(updates, (-1,))[cols] == flat_out[rows]
    one, zero = jnp.ones((), dtype), jnp.zeros((), dtype)
    count = jax.ops.segment_sum(
        jnp.where(reached, one, zero), rows, n_out, indices_are_sorted=False
    )
    retained = jnp.reshape(operand, (-1,)) == flat_out
    hit = np.bincount(rows, minlength=n_out) > 0
    partials = {}
    if active[0]:
        shared = jnp.where(retained, one / (count + one), zero)
        coef = jnp.where(jnp.asarray(hit), shared, one)
        partials[(0, 0)] = diagonal(jnp.reshape(coef, out_shape), out_shape, dtype)
    if active[2]:
        normaliser = jnp.where(retained, one / (count + one), one / count)
        coef = jnp.where(reached, normaliser[rows], zero)
        partials[(0, 2)] = from_entries(
            out_shape,
            upd_shape,
            rows,
            cols,
            dtype,
            weights=(np.arange(len(cols)), coef),
        )
    return [out], partials


@register(lax.scatter_max_p)
def _scatter_max(primals, active, **params):
    return _scatter_extremum(lax.scatter_max_p, primals, active, params)


@register(lax.scatter_min_p)
def _scatter_min(primals, active, **params):
    return _scatter_extremum(lax.scatter_min_p, primals, active, params)


@register(lax.scatter_p)
def _scatter(primals, active, **params):
    operand, indices, updates = primals
    if params.get("update_jaxpr") is not None:
        # `x.at[idx].apply(fn)`: the scattered values are `fn` of the operand's, not
        # the updates. JAX's own rule decides (JAX 0.10 has none).
        try:
            return fallback_rule(lax.scatter_p, primals, active, params)
        except TypeError as error:
            raise TypeError(
                "`x.at[idx].apply(fn)` has no derivative in JAX (`jax.jacfwd` and "
                "`jax.jacrev` refuse it too). Write it as "
                "`x.at[idx].set(fn(x[idx]))`, which has one."
            ) from error
    shape = shape_of(primals[0])
    dtype = primals[0].dtype
    partials = {}
    kept = None
    if active[2]:
        args = [jnp.zeros_like(operand), indices, updates]
        partial, kept = _kept_updates(params, args, shape, dtype)
        partials[(0, 2)] = partial
    kept_operand = None
    if active[0]:
        # Known indices: the entries kept, as an index map (the overwritten ones are
        # not stored); else the operand's diagonal, masked where updates land.
        kept_operand = _index_map_in(lax.scatter_p, params, primals, 0, shape, dtype)
    needs_mask = (active[0] and kept_operand is None) or kept is not None
    mask = _scatter_mask(params, indices, updates, shape) if needs_mask else None
    if kept is None or mask is None:
        out = lax.scatter_p.bind(*primals, **params)
    else:
        # Updates that collide: the value is built from the same kept updates as
        # the partial, so value and Jacobian agree on backends (GPUs) where which
        # colliding write wins is unspecified. Adding -0.0 is exact for every value.
        minus_zero = lax.full_like(updates, -0.0)
        out = _add_scattered(
            params,
            lax.select(mask, operand, lax.full_like(operand, -0.0)),
            indices,
            lax.select(kept, updates, minus_zero),
        )
    if kept_operand is not None:
        partials[(0, 0)] = kept_operand
    elif active[0] and mask is not None:
        partials[(0, 0)] = diagonal(mask.astype(dtype), shape, dtype)
    return [out], partials


def _scatter_mask(params, indices, updates, out_shape):
    """Where a scatter keeps its operand: `True` except at written positions."""
    ones = jnp.ones(out_shape, np.int8)
    written = lax.scatter_p.bind(
        ones, indices, jnp.zeros(shape_of(updates), np.int8), **params
    )
    return written == 1


def _kept_updates(params, args, out_shape, dtype):
    """A scatter's partial w.r.t. its updates, and which updates it keeps.

    The kept updates are `None` when no two updates can land on one output (every
    update is kept), else a boolean array shaped like the updates.
    """
    indices, upd_shape = args[1], shape_of(args[2])
    if _small_enough(upd_shape, out_shape) and jp.is_concrete(indices):
        with jax.ensure_compile_time_eval():
            won = _written_ids(params, indices, out_shape, upd_shape)
        src = np.asarray(won).reshape(-1).astype(np.int64) - 1
        partial = _copy_partial(src, out_shape, upd_shape, dtype)
        n_upd = math.prod(upd_shape)
        landed = src[src >= 0]
        if landed.size == n_upd or params.get("unique_indices"):
            return partial, None
        kept = np.zeros(n_upd, bool)
        kept[landed] = True
        return partial, kept.reshape(upd_shape)
    partial, kept = _kept_updates_map(params, indices, args[2], out_shape, dtype)
    return partial, None if params.get("unique_indices") else kept


def _add_scattered(params, operand, indices, updates):
    """A scatter-add with the index layout of a scatter's `params`.

    (Binding `scatter_add_p` with a scatter's own params would not do: their
    `update_jaxpr` is `None`, which lowers to a scatter that overwrites.)
    """
    return lax.scatter_add(
        operand,
        indices,
        updates,
        params["dimension_numbers"],
        indices_are_sorted=params["indices_are_sorted"],
        unique_indices=False,
        mode=params["mode"],
    )


def _written_ids(params, indices, out_shape, upd_shape):
    """The 1-based flat id of the update a scatter writes to each output (0 where
    none lands). Where updates collide, the backend decides which one is written."""
    ids = lax.iota(np.int32, math.prod(upd_shape)).reshape(upd_shape) + 1
    zeros = jnp.zeros(out_shape, np.int32)
    return lax.scatter_p.bind(zeros, indices, ids, **dict(params, unique_indices=False))


def _kept_updates_map(params, indices, updates, out_shape, dtype):
    """A scatter's partial w.r.t. its updates, and the updates it keeps, for indices
    known only at run time.

    Updates that a later one overwrites are dropped first, so the map is a
    scatter-add (which JAX transposes for any indices) of the updates that are kept.
    """
    upd_shape = shape_of(updates)
    ids = lax.iota(np.int32, math.prod(upd_shape)).reshape(upd_shape) + 1
    kept_id = _written_ids(params, indices, out_shape, upd_shape)
    zeros = jnp.zeros(out_shape, np.float32)
    gather = jax.linear_transpose(
        lambda u: _add_scattered(params, zeros, indices, u),
        jax.ShapeDtypeStruct(upd_shape, np.float32),
    )
    # The id kept at each update's destination, read back in two exact halves.
    (high,) = gather((kept_id // 4096).astype(np.float32))
    (low,) = gather((kept_id % 4096).astype(np.float32))
    seen = high.astype(np.int32) * 4096 + low.astype(np.int32)
    kept = seen == ids
    out_zeros = jnp.zeros(out_shape, dtype)

    def fn(t):
        t = lax.select(kept, t, lax.full_like(t, 0))
        return _add_scattered(params, out_zeros, indices, t)

    return linear_map(fn, upd_shape, out_shape, dtype), kept


@register(lax.pad_p)
def _pad(primals, active, **params):
    operand, padding_value = primals
    out = lax.pad_p.bind(*primals, **params)
    shape = shape_of(out)
    partials = {}
    if active[0]:
        args = [operand, jnp.zeros_like(padding_value)]
        partial = _index_map_in(lax.pad_p, params, args, 0, shape, out.dtype)
        if partial is None:
            partial = _linear_in(lax.pad_p, params, args, 0, shape, out.dtype)
        partials[(0, 0)] = partial
    if active[1]:
        mask = lax.pad_p.bind(
            jnp.zeros_like(operand), jnp.ones_like(padding_value), **params
        )
        n = len(shape)
        partials[(0, 1)] = from_labeled(
            mask, tuple(range(n)), shape, (), tuple(range(n)), out.dtype
        )
    return [out], partials


def _embedding(in_shape, out_shape, axis, offset, dtype):
    """The map placing an array at `offset` along `axis` of zeros of `out_shape`
    (a padding), whose transpose is the slice back."""
    n = in_shape[axis]
    config = [(0, 0, 0)] * len(out_shape)
    config[axis] = (offset, out_shape[axis] - offset - n, 0)
    zero = jnp.zeros((), dtype)
    return linear_map(
        lambda t: lax.pad(t, zero.astype(t.dtype), config),
        in_shape,
        out_shape,
        dtype,
        tfn=lambda c: lax.slice_in_dim(c, offset, offset + n, axis=axis),
    )


@register(lax.concatenate_p)
def _concatenate(primals, active, **params):
    out = lax.concatenate_p.bind(*primals, **params)
    dim = params["dimension"]
    shape = shape_of(out)
    partials = {}
    offset = 0
    for i, x in enumerate(primals):
        n = shape_of(x)[dim]
        if active[i] and _small_enough(shape_of(x), shape):
            starts = [0] * len(shape)
            starts[dim] = offset
            in_shape = shape_of(x)
            src = np.full(shape, -1, np.int64)
            region = tuple(slice(s, s + k) for s, k in zip(starts, in_shape))
            src[region] = np.arange(math.prod(in_shape)).reshape(in_shape)
            partials[(0, i)] = _copy_partial(
                src.reshape(-1),
                shape,
                in_shape,
                out.dtype,
                _embedding(shape_of(x), shape, dim, offset, out.dtype),
            )
        elif active[i]:
            partials[(0, i)] = _embedding(shape_of(x), shape, dim, offset, out.dtype)
        offset += n
    return [out], partials


def _piece(in_shape, out_shape, axis, offset, dtype):
    """The map taking the piece of `out_shape` at `offset` along `axis`, whose
    transpose pads it back."""
    n = out_shape[axis]
    config = [(0, 0, 0)] * len(in_shape)
    config[axis] = (offset, in_shape[axis] - offset - n, 0)
    return linear_map(
        lambda t: lax.slice_in_dim(t, offset, offset + n, axis=axis),
        in_shape,
        out_shape,
        dtype,
        tfn=lambda c: lax.pad(c, jnp.zeros((), c.dtype), config),
    )


if jp.split_p is not None:

    @register(jp.split_p)
    def _split(primals, active, **params):
        outs = jp.bind(jp.split_p, params, *primals)
        axis = params["axis"]
        x = primals[0]
        in_shape = shape_of(x)
        partials = {}
        if not active[0]:
            return list(outs), partials
        srcs = _sources(jp.split_p, params, [x], 0) if _small_enough(in_shape) else None
        offset = 0
        for k, out in enumerate(outs):
            linear = _piece(in_shape, shape_of(out), axis, offset, out.dtype)
            if srcs is not None:
                partials[(k, 0)] = _copy_partial(
                    srcs[k], shape_of(out), in_shape, out.dtype, linear
                )
            else:
                partials[(k, 0)] = linear
            offset += shape_of(out)[axis]
        return list(outs), partials


def _copy_rule(prim):
    """Rule for a primitive that copies entries of its operands (`stack`, `unstack`):
    each output entry comes from at most one operand entry."""

    def rule(primals, active, **params):
        outs = jp.bind(prim, params, *primals)
        shapes = [shape_of(o) for o in outs]
        partials = {}
        for i, a in enumerate(active):
            if not a:
                continue
            srcs = None
            if _small_enough(shape_of(primals[i]), *shapes):
                srcs = _sources(prim, params, primals, i)
            if srcs is None:
                return fallback_rule(prim, primals, active, params)
            for k, src in enumerate(srcs):
                if np.any(src >= 0):
                    partials[(k, i)] = _copy_partial(
                        src, shapes[k], shape_of(primals[i]), outs[k].dtype
                    )
        return list(outs), partials

    return rule


for _prim in (jp.stack_p, jp.unstack_p):
    if _prim is not None:
        register(_prim)(_copy_rule(_prim))


if jp.optimization_barrier_p is not None:

    @register(jp.optimization_barrier_p)
    def _optimization_barrier(primals, active, **params):
        outs = jp.bind(jp.optimization_barrier_p, params, *primals)
        partials = {}
        for i, a in enumerate(active):
            if a:
                partials[(i, i)] = diagonal(None, shape_of(outs[i]), outs[i].dtype)
        return list(outs), partials


@register(lax.sort_p)
def _sort(primals, active, **params):
    dim = params["dimension"]
    shape = shape_of(primals[0])
    iota = lax.broadcasted_iota(jnp.int32, shape, dim)
    *outs, perm = lax.sort_p.bind(*primals, iota, **params)
    partials = {}
    n = shape[dim]
    others = [a for a in range(len(shape)) if a != dim]
    # Sorting along one axis of a larger array permutes each slice on its own: tied
    # on the other axes, with one permutation matrix per slice (its values known
    # at run time only), up to `_MAX_SORT_BLOCKS` entries in all.
    blocks = any(shape[a] != 1 for a in others) and 0 < n * math.prod(shape) <= (
        _MAX_SORT_BLOCKS
    )
    for i, a in enumerate(active):
        if not a:
            continue
        dtype = outs[i].dtype
        if blocks:
            # Block entry (o, i) of a slice is one where its output o takes input i.
            moved = jnp.moveaxis(perm, dim, -1)[..., None]
            column = lax.broadcasted_iota(
                perm.dtype, (1,) * len(shape) + (n,), len(shape)
            )
            blocks_val = (moved == column).astype(dtype)
            partials[(i, i)] = per_slice_blocks(blocks_val, shape, dim, dtype)
        else:
            partials[(i, i)] = linear_map(
                lambda t: jnp.take_along_axis(t, perm, axis=dim), shape, shape, dtype
            )
    return list(outs), partials


# Sorts along one axis of a larger array store their per-slice permutations densely
# up to this many entries.
_MAX_SORT_BLOCKS = 1 << 24


def _window_pairs(n, window, stride, padding, base, dilation):
    """`(output, input, window)` index triples of one axis of a windowed sum (or a
    correlation): output `o` reads, through window entry `w < window`, the input at
    dilated position `o·stride + w·dilation - lo` where that falls on an input (every
    `base`-th position of the dilated axis)."""
    lo, hi = padding
    extent = (n - 1) * base + 1 if n else 0
    span = (window - 1) * dilation + 1
    n_out = max(0, (lo + extent + hi - span) // stride + 1)
    o = np.repeat(np.arange(n_out, dtype=np.int64), window)
    w = np.tile(np.arange(window, dtype=np.int64), n_out)
    p = o * stride + w * dilation - lo
    keep = (p >= 0) & (p < extent) & (p % base == 0)
    return o[keep], p[keep] // base, w[keep]


def _every_combination(sizes) -> list[np.ndarray]:
    """Index arrays enumerating every combination of one index per size, the last
    varying fastest."""
    grids = np.meshgrid(*[np.arange(n, dtype=np.int64) for n in sizes], indexing="ij")
    return [g.reshape(-1) for g in grids]


# Windowed sums get static patterns up to this many entries.
_MAX_WINDOW_ENTRIES = 1 << 24


def _window_entries(in_shape, out_shape, params):
    """Flat `(rows, cols, window)` of every (output, input) pair of a windowed
    reduction: the product of each axis's window pairs, with the flat row-major
    position in the window through which the output reads the input. `None` when
    there are none, or more than `_MAX_WINDOW_ENTRIES`."""
    axes = [
        _window_pairs(n, *args)
        for n, *args in zip(
            in_shape,
            params["window_dimensions"],
            params["window_strides"],
            params["padding"],
            params["base_dilation"],
            params["window_dilation"],
            strict=True,
        )
    ]
    entries = math.prod(len(o) for o, _, _ in axes)
    if not 0 < entries <= _MAX_WINDOW_ENTRIES:
        return None
    # Every combination of one pair per axis is an entry.
    picks = _every_combination([len(o) for o, _, _ in axes])
    rows = np.ravel_multi_index([o[k] for (o, _, _), k in zip(axes, picks)], out_shape)
    cols = np.ravel_multi_index([i[k] for (_, i, _), k in zip(axes, picks)], in_shape)
    window = np.ravel_multi_index(
        [w[k] for (_, _, w), k in zip(axes, picks)], params["window_dimensions"]
    )
    return np.asarray(rows), np.asarray(cols), np.asarray(window)


@register(lax.reduce_window_sum_p)
def _reduce_window_sum(primals, active, **params):
    """A windowed sum (average pooling, `lax.reduce_window` with `add`): a static
    pattern of ones, the product of each axis's window pairs; axes with a unit
    window and stride become ties."""
    (x,) = primals
    out = lax.reduce_window_sum_p.bind(x, **params)
    if not active[0]:
        return [out], {}
    in_shape, out_shape = shape_of(x), shape_of(out)
    entries = _window_entries(in_shape, out_shape, params)
    if entries is None:
        # It is linear: past the size, the windowed sum itself is the map.
        partial = _linear_in(
            lax.reduce_window_sum_p, params, primals, 0, out_shape, out.dtype
        )
        return [out], {(0, 0): partial}
    rows, cols, _ = entries
    return [out], {(0, 0): from_entries(out_shape, in_shape, rows, cols, out.dtype)}


# Windows of at most this many entries are folded step by step.
_UNROLLED_WINDOW = 16


def _chosen_in_windows(windows: Array) -> Array:
    """The position each window (last axis, row-major window order) takes, as
    `jax.jacrev` takes it for a windowed maximum: a fold that keeps the entry held
    while it is `>=` the next one and takes the next one otherwise. Equal entries
    keep the first; a NaN is taken when met and given up for the entry after it, so
    the fold ends on the first maximum after the last NaN (or on a final NaN)."""
    k = windows.shape[-1]
    if k <= _UNROLLED_WINDOW:
        # The fold itself, one elementwise step per entry: XLA fuses it into one pass.
        held = lax.index_in_dim(windows, 0, windows.ndim - 1, keepdims=False)
        at = jnp.zeros(held.shape, np.int32)
        for j in range(1, k):
            entry = lax.index_in_dim(windows, j, windows.ndim - 1, keepdims=False)
            take = lax.bitwise_not(lax.ge(held, entry))
            held = lax.select(take, entry, held)
            at = lax.select(take, lax.full_like(at, j), at)
        return at[..., None]
    place = lax.broadcasted_iota(np.int32, windows.shape, windows.ndim - 1)
    last_nan = jnp.max(jnp.where(jnp.isnan(windows), place, -1), -1, keepdims=True)
    after = place > last_nan
    low = jnp.array(-jnp.inf, windows.dtype)
    # One reduction finds the first maximum after the last NaN. Nothing is compared
    # with a maximum computed apart: XLA may recompute an entry in another kernel,
    # rounded differently (a fused multiply-add), and no entry would equal it.
    first = jnp.argmax(jnp.where(after, windows, low), -1, keepdims=True)
    # Where every entry after the last NaN is -inf, the masked positions tie with
    # them and come first: the first entry after the NaN is the one held.
    first = jnp.where(first > last_nan, first, last_nan + 1)
    return jnp.where(last_nan == k - 1, k - 1, first)


def _window_chooser_rule(prim, sign):
    """A windowed maximum (`sign = 1`) or minimum (`sign = -1`; max pooling): the
    windowed sum's pattern, one at the entry each output takes and zero, selected
    away, at the others. The entry taken is the one `jax.jacrev` takes: among equal
    entries the first in row-major window order, with padding and dilation holes
    taking part as the reduction's identity (a window whose entries are all the
    identity takes its padding, and no input). Axes with a unit window and stride
    are ties along which the choice varies."""

    def rule(primals, active, **params):
        (x,) = primals
        out = prim.bind(x, **params)
        if not active[0]:
            return [out], {}
        in_shape, out_shape = shape_of(x), shape_of(out)
        entries = _window_entries(in_shape, out_shape, params)
        if entries is None:
            return fallback_rule(prim, primals, active, params)
        p, window = entry_pattern(out_shape, in_shape, *entries)
        assert window is not None
        p = p.with_varying((True,) * len(p.ties))
        tied_in = [i for _, i in p.ties]
        xs = jnp.transpose(x, tied_in + list(p.in_free))
        xs = _take_last(xs.reshape(p.tie_sizes + (p.n_in_free,)), p.cols)
        # Every output's whole window, padding and holes holding the identity.
        k = math.prod(params["window_dimensions"])
        slot = np.full(p.n_out_free * k, p.nnz, np.int64)
        slot[p.rows * k + window] = np.arange(p.nnz)
        signed = xs if sign > 0 else lax.neg(xs)
        if np.all(slot < p.nnz):  # no padding or holes: every window is full
            windows = _take_last(signed, slot)
        else:
            low = jnp.full(p.tie_sizes + (1,), -jnp.inf, xs.dtype)
            windows = _take_last(lax.concatenate([signed, low], xs.ndim - 1), slot)
        windows = windows.reshape(p.tie_sizes + (p.n_out_free, k))
        taken = _chosen_in_windows(windows).reshape(p.tie_sizes + (p.n_out_free,))
        chosen = _take_last(taken, p.rows) == jnp.asarray(window, taken.dtype)
        val = chosen.astype(out.dtype)
        # The other entries' derivatives are discarded, not multiplied by zero.
        partial = finish(CooTensor(val, p, out.dtype, lax.bitwise_not(chosen)))
        return [out], {(0, 0): partial}

    return rule


register(lax.reduce_window_max_p)(_window_chooser_rule(lax.reduce_window_max_p, 1))
register(lax.reduce_window_min_p)(_window_chooser_rule(lax.reduce_window_min_p, -1))


def _reduce_window(params, v, init, op):
    return lax.reduce_window(
        v,
        init,
        op,
        params["window_dimensions"],
        params["window_strides"],
        params["padding"],
        params["base_dilation"],
        params["window_dilation"],
    )


# `lax.reduce_window` with an array initial value, which `make_jaxpr` stages.
register(lax.reduce_window_p)(as_monoid_rule(lax.reduce_window_p, _reduce_window))
