"""The exact fallback: a dense local Jacobian from JAX's own autodiff.

Used for every primitive without a structured rule that JAX can differentiate
(`cond`, `scan`, `while`, linear solves, decompositions, future primitives). The local
Jacobian comes from `jax.jacfwd` or `jax.jacrev` of a function that binds the
primitive with its params, whichever needs fewer passes; primitives that support only
one mode (`while` is forward-only) use that one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from .. import _jax_private as jp
from .._sparse import dense
from ._base import active_indices, is_float, needed_outputs, shape_of


_FORWARD_ONLY = {lax.while_p}
_REVERSE_ONLY = {jp.custom_vjp_call_p}


def dense_jacobian(prim, params, primals, active, outs, modes=None):
    """Dense partials `{(k, i): ∂out_k/∂in_i}` of one equation."""
    idx = active_indices(active)
    needed = needed_outputs(prim, len(outs))
    float_outs = [k for k, o in enumerate(outs) if is_float(o) and needed[k]]
    if not idx or not float_outs:
        return {}

    def f(*xs):
        args = list(primals)
        for i, x in zip(idx, xs, strict=True):
            args[i] = x
        res = jp.bind(prim, params, *args)
        return [res[k] for k in float_outs]

    if modes is None:
        n_in = sum(math.prod(shape_of(primals[i])) for i in idx)
        n_out = sum(math.prod(shape_of(outs[k])) for k in float_outs)
        modes = ("fwd", "rev") if n_in <= n_out else ("rev", "fwd")
        if prim in _FORWARD_ONLY:
            modes = ("fwd",)
        elif prim in _REVERSE_ONLY:
            modes = ("rev",)
    argnums = tuple(range(len(idx)))
    xs = [primals[i] for i in idx]
    if "fwd" in modes:
        # Some batching rules batch the primal result along with the tangents (the
        # generic `reduce_window`, whose JVP reduces both in one window), which
        # `jax.jacfwd` refuses: pushing tangents alone forward still works.
        modes = (*modes, "tangents")
    error = None
    for mode in modes:
        try:
            if mode == "tangents":
                jac = _jacobian_by_tangents(f, xs)
            else:
                jacobian = jax.jacfwd if mode == "fwd" else jax.jacrev
                jac = jacobian(f, argnums=argnums)(*xs)
            break
        except Exception as e:  # the other mode may still work (custom rules)
            if error is None or mode != "tangents":
                error = e  # JAX's own transforms say best what went wrong
    else:
        raise TypeError(
            f"`jacve` could not differentiate the primitive `{prim}`: JAX raised "
            f"{type(error).__name__}: {error}"
        ) from error
    partials = {}
    for pos, k in enumerate(float_outs):
        out_shape = shape_of(outs[k])
        for a, i in enumerate(idx):
            block = jac[pos][a].astype(outs[k].dtype)
            partials[(k, i)] = dense(block, out_shape, shape_of(primals[i]))
    return partials


def _jacobian_by_tangents(f, xs):
    """`jax.jacfwd(f, argnums=all)(*xs)` as a `vmap` of JVPs over a basis of
    tangents that never batches the primal computation's result."""
    sizes = [math.prod(jnp.shape(x)) for x in xs]
    n = sum(sizes)
    eye = jnp.eye(n, dtype=jnp.float32)
    basis, start = [], 0
    for x, size in zip(xs, sizes, strict=True):
        rows = eye[:, start : start + size].reshape((n, *jnp.shape(x)))
        basis.append(rows.astype(jnp.result_type(x)))
        start += size

    def pushforward(*ts):
        return jax.jvp(f, tuple(xs), ts)[1]

    columns = jax.vmap(pushforward)(*basis)  # per output: (n, *out_shape)
    jac = []
    for col in columns:
        out_ndim = col.ndim - 1
        blocks, start = [], 0
        for x, size in zip(xs, sizes, strict=True):
            block = col[start : start + size].reshape((*jnp.shape(x), *col.shape[1:]))
            in_ndim = jnp.ndim(x)
            perm = (*range(in_ndim, in_ndim + out_ndim), *range(in_ndim))
            blocks.append(jnp.transpose(block, perm))
            start += size
        jac.append(tuple(blocks))
    return jac


def fallback_rule(prim, primals, active, params):
    outs = jp.bind(prim, params, *primals)
    return outs, dense_jacobian(prim, params, primals, active, outs)
