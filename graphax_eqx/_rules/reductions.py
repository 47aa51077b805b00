"""Reductions and cumulative reductions.

A reduction ties each kept axis to its input axis; the reduced input axes are a
broadcast (`reduce_sum`) or carry a value (`reduce_max`, `reduce_prod`). Cumulative
ops tie every axis but the scanned one, which carries a small dense block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .. import _jax_private as jp
from .._sparse import from_labeled
from ._base import as_monoid_rule, per_slice_blocks, register, shape_of


def _reduce_labels(in_shape, axes):
    axes = {a % len(in_shape) for a in axes}
    kept = [i for i in range(len(in_shape)) if i not in axes]
    out_labels = [("k", i) for i in kept]
    in_labels = [("k", i) if i not in axes else ("r", i) for i in range(len(in_shape))]
    return out_labels + in_labels, in_labels


@register(lax.reduce_sum_p)
def _reduce_sum(primals, active, **params):
    out = lax.reduce_sum_p.bind(*primals, **params)
    if not active[0]:
        return [out], {}
    in_shape = shape_of(primals[0])
    labels, _ = _reduce_labels(in_shape, params["axes"])
    partial = from_labeled(None, (), shape_of(out), in_shape, labels, out.dtype)
    return [out], {(0, 0): partial}


def _chooser_rule(prim):
    def rule(primals, active, **params):
        (x,) = primals
        if not active[0]:
            return [prim.bind(x, **params)], {}
        in_shape = shape_of(x)
        axes = tuple(a % x.ndim for a in params["axes"])
        kept = [i for i in range(x.ndim) if i not in axes]
        # The entries are compared with a maximum taken from the same stored copy of
        # them. XLA may compute `x` anew inside each kernel that reads it, rounded
        # differently in each (a fused multiply-add in one, not in the other), and
        # then no entry would equal a maximum taken apart: the derivative came out
        # NaN, or went to an entry far from the maximum. XLA CPU removes
        # optimisation barriers before it fuses; `compute_once` keeps it from
        # recomputing `x` there, and the barrier does elsewhere.
        stored = lax.optimization_barrier(jp.compute_once(x))
        out = prim.bind(stored, **params)
        expanded = lax.broadcast_in_dim(out, in_shape, kept)
        # Ties share the derivative equally, as JAX's own rule does.
        mask = (stored == expanded).astype(x.dtype)
        count = jnp.sum(mask, axis=axes, keepdims=True)
        # Where no entry equals the result (a NaN among them), JAX's rule divides 0
        # by 0. XLA rewrites `mask / count` as a select of `1 / count`, which would
        # leave 0 there, so the NaN is written explicitly.
        val = jnp.where(count == 0, jnp.nan, mask / count).astype(x.dtype)
        labels, in_labels = _reduce_labels(in_shape, axes)
        partial = from_labeled(
            val, in_labels, shape_of(out), in_shape, labels, out.dtype
        )
        return [out], {(0, 0): partial}

    return rule


register(lax.reduce_max_p)(_chooser_rule(lax.reduce_max_p))
register(lax.reduce_min_p)(_chooser_rule(lax.reduce_min_p))


# `lax.reduce` with an array initial value, which `make_jaxpr` stages.
register(lax.reduce_p)(
    as_monoid_rule(
        lax.reduce_p,
        lambda params, v, i, op: lax.reduce(v, i, op, params["dimensions"]),
    )
)


@register(lax.reduce_prod_p)
def _reduce_prod(primals, active, **params):
    (x,) = primals
    out = lax.reduce_prod_p.bind(x, **params)
    if not active[0]:
        return [out], {}
    in_shape = shape_of(x)
    axes = tuple(sorted(a % x.ndim for a in params["axes"]))
    kept = [i for i in range(x.ndim) if i not in axes]
    # Product of all other entries, without dividing (safe at zeros).
    moved = jnp.transpose(x, kept + list(axes))
    if 0 in moved.shape:
        # No entries: an empty partial (a product over nothing is a constant one).
        val = jnp.zeros(moved.shape, x.dtype)
    else:
        flat = moved.reshape(tuple(in_shape[i] for i in kept) + (-1,))
        ones = jnp.ones(flat.shape[:-1] + (1,), x.dtype)
        before = jnp.concatenate([ones, flat[..., :-1]], axis=-1)
        after = jnp.concatenate([ones, flat[..., :0:-1]], axis=-1)
        before = jnp.cumprod(before, axis=-1)
        after = jnp.cumprod(after, axis=-1)[..., ::-1]
        val = (before * after).reshape(moved.shape)
    labels, in_labels = _reduce_labels(in_shape, axes)
    val_labels = [in_labels[i] for i in kept + list(axes)]
    partial = from_labeled(val, val_labels, shape_of(out), in_shape, labels, out.dtype)
    return [out], {(0, 0): partial}


def _cumulative_rule(prim):
    """Every axis but the scanned one is tied; the scanned pair is a dense block."""

    def rule(primals, active, **params):
        (x,) = primals
        out = prim.bind(x, **params)
        if not active[0]:
            return [out], {}
        axis, shape = params["axis"] % x.ndim, shape_of(x)
        n = shape[axis]
        other = [i for i in range(x.ndim) if i != axis]
        if 0 in shape:
            # No entries: an empty partial.
            blocks = jnp.zeros(tuple(shape[i] for i in other) + (n, n), out.dtype)
        else:
            rows = jnp.moveaxis(x, axis, -1).reshape((-1, n))

            def scan_row(r):
                return prim.bind(r, **dict(params, axis=0))

            blocks = jax.vmap(jax.jacfwd(scan_row))(rows)  # (rows, n_out, n_in)
        blocks = blocks.reshape(tuple(shape[i] for i in other) + (n, n))
        return [out], {(0, 0): per_slice_blocks(blocks, shape, axis, out.dtype)}

    return rule


for _prim in (lax.cumprod_p, lax.cummax_p, lax.cummin_p, lax.cumlogsumexp_p):
    register(_prim)(_cumulative_rule(_prim))
