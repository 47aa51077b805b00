"""The exact fallback: a dense local Jacobian from JAX's own autodiff.

Used for every primitive without a structured rule that JAX can differentiate
(`cond`, `scan`, `while`, linear solves, decompositions, future primitives). The local
Jacobian comes from `jax.jacfwd` or `jax.jacrev` of a function that binds the
primitive with its params, whichever needs fewer passes; primitives that support only
one mode (`while` is forward-only) use that one.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_private as jp
from .._sparse import dense
from ._base import Same, active_indices, is_float, needed_outputs, shape_of


_FORWARD_ONLY = {lax.while_p}
_REVERSE_ONLY = {jp.custom_vjp_call_p}
# Linear in their active operands and only transposable: their Jacobian is read off
# the transpose (`_transposed_only_rule`).
_TRANSPOSE_ONLY = {jp.custom_lin_p} - {None}


def dense_jacobian(prim, params, primals, active, outs, modes=None):
    """Dense partials `{(k, i): ∂out_k/∂in_i}` of one equation."""
    idx = active_indices(active)
    needed = needed_outputs(prim, len(outs))
    float_outs = [k for k, o in enumerate(outs) if is_float(o) and needed[k]]
    if not idx or not float_outs:
        return {}

    if modes is None:
        n_in = sum(math.prod(shape_of(primals[i])) for i in idx)
        n_out = sum(math.prod(shape_of(outs[k])) for k in float_outs)
        modes = ("fwd", "rev") if n_in <= n_out else ("rev", "fwd")
        if prim in _FORWARD_ONLY:
            modes = ("fwd",)
        elif prim in _REVERSE_ONLY:
            modes = ("rev",)
    if "fwd" in modes:
        # Some batching rules batch the primal result along with the tangents (the
        # generic `reduce_window`, whose JVP reduces both in one window), which
        # `jax.jacfwd` refuses: pushing tangents alone forward still works.
        modes = (*modes, "tangents")
    error = None
    for mode in modes:
        try:
            jac = _compiled_when_seen(prim, params, idx, float_outs, mode, primals)
            break
        except Exception as e:  # the other mode may still work (custom rules)
            if _raised_by_check(e):
                raise  # an `eqx.error_if` that fired: the user's own error
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


_CHECK_ERRORS = ("EquinoxRuntimeError", "JaxRuntimeError", "XlaRuntimeError")


def _raised_by_check(error: Exception) -> bool:
    """Whether `error` is a runtime check firing (`eqx.error_if`, a callback that
    raised), which no other mode of differentiation would avoid."""
    return any(c.__name__ in _CHECK_ERRORS for c in type(error).__mro__)


def _local_jacobian(prim, params, idx, float_outs, mode, primals):
    """The Jacobian of outputs `float_outs` of the `prim` equation with respect to
    its operands `idx`, at `primals`, by `mode`."""

    def f(*xs):
        args = list(primals)
        for i, x in zip(idx, xs, strict=True):
            args[i] = x
        res = jp.bind(prim, params, *args)
        return [res[k] for k in float_outs]

    xs = [primals[i] for i in idx]
    if mode == "tangents":
        return _jacobian_by_tangents(f, xs)
    if mode == "transpose":
        return _jacobian_by_transpose(f, xs)
    jacobian = jax.jacfwd if mode == "fwd" else jax.jacrev
    return jacobian(f, argnums=tuple(range(len(idx))))(*xs)


# Eager calls evaluate the graph one operation at a time. A dense local Jacobian
# through a loop (diffrax's checkpointed solve: a `custom_vjp` around a `while_loop`)
# then runs the loop's transpose under `vmap` primitive by primitive, which took 1.2 s
# where `jax.jacrev`, which keeps the solve's `jax.jit`, took 8 ms. From the second
# eager call with the same equation (its params the same objects: the body of a
# jitted function, which JAX traces once) the local Jacobian runs compiled instead;
# params traced anew on every call never repeat, and run eagerly as before.
_SEEN: OrderedDict = OrderedDict()  # key -> sightings, or the compiled function
_MAX_SEEN = 256


def _params_key(params) -> tuple:
    parts = []
    for name, value in sorted(params.items()):
        try:
            hash(value)
        except TypeError:
            value = Same(value)
        parts.append((name, value))
    return tuple(parts)


def _rules_state(prim, params) -> tuple:
    """What the custom rules of the equation (itself, or nested in its bodies) read
    besides their arguments: an eager call runs them afresh, as eager JAX would, so
    the compiled Jacobian is keyed on it (see `custom._state_read`)."""
    from .custom import rules_state  # `custom` differentiates through this module

    return rules_state(prim, params)


def _compiled_when_seen(prim, params, idx, float_outs, mode, primals):
    args = (prim, params, idx, float_outs, mode)
    if any(isinstance(p, jp.Tracer) for p in primals) or not all(
        isinstance(p, (jax.Array, np.ndarray, np.generic, int, float, bool))
        for p in primals
    ):
        return _local_jacobian(*args, primals)
    try:
        key = (
            prim,
            _params_key(params),
            tuple(idx),
            tuple(float_outs),
            mode,
            _rules_state(prim, params),
        )
        hash(key)
    except TypeError:
        return _local_jacobian(*args, primals)
    found = _SEEN.get(key)
    if found is None or isinstance(found, int):
        _SEEN[key] = (found or 0) + 1
        _SEEN.move_to_end(key)
        if len(_SEEN) > _MAX_SEEN:
            _SEEN.popitem(last=False)
        if found is None:
            return _local_jacobian(*args, primals)
        compiled = jax.jit(
            lambda primals: _local_jacobian(
                prim, params, idx, float_outs, mode, primals
            )
        )
        _SEEN[key] = compiled
        found = compiled
    _SEEN.move_to_end(key)
    return found(list(primals))


def _jacobian_by_transpose(f, xs):
    """`jax.jacrev(f, argnums=all)(*xs)` for `f` linear in `xs`, by a `vmap` of its
    transpose over a basis of cotangents (no JVP: `f` may have none)."""
    outs = jax.eval_shape(f, *xs)
    transpose = jax.linear_transpose(f, *xs)
    sizes = [math.prod(o.shape) for o in outs]
    eye = jnp.eye(sum(sizes), dtype=jnp.float32)

    def pull(row):
        cts, start = [], 0
        for o, n in zip(outs, sizes, strict=True):
            cts.append(row[start : start + n].reshape(o.shape).astype(o.dtype))
            start += n
        return transpose(cts)

    rows = jax.vmap(pull)(eye)  # per input: (sum of output sizes, *input shape)
    jac, start = [], 0
    for o, n in zip(outs, sizes, strict=True):
        jac.append([r[start : start + n].reshape(o.shape + r.shape[1:]) for r in rows])
        start += n
    return jac


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
    if prim in _TRANSPOSE_ONLY:
        return _transposed_only_rule(prim, primals, active, params)
    outs = jp.bind(prim, params, *primals)
    return outs, dense_jacobian(prim, params, primals, active, outs)


def _transposed_only_rule(prim, primals, active, params):
    """A primitive linear in its active operands that can only be transposed (a
    `custom_vjp` function's step in a linearisation): its Jacobian from the
    transpose, and as its value that Jacobian applied to its active operands. (Such
    steps occur in linear programs, whose values no partial reads.)"""
    idx = active_indices(active)
    outs = [
        jnp.zeros(a.shape, a.dtype)
        for a in jax.eval_shape(lambda *xs: jp.bind(prim, params, *xs), *primals)
    ]
    if not idx:
        return outs, {}
    partials = dense_jacobian(prim, params, primals, active, outs, ("transpose",))
    for k, o in enumerate(outs):
        for i in idx:
            block = partials.get((k, i))
            if block is not None:
                x = primals[i]
                val = (
                    jnp.tensordot(block.dense(), x, axes=jnp.ndim(x))
                    if jnp.ndim(x)
                    else block.dense() * x
                )
                outs[k] = outs[k] + val.astype(o.dtype)
    return outs, partials
