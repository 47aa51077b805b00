"""`custom_jvp_call` and `custom_vjp_call`: derivatives from the user's rule.

When the call is elementwise (every variable of its body has the output's shape or is
a scalar, and every equation is elementwise) one JVP (or VJP) with a ones tangent
gives the diagonal exactly. Otherwise the local Jacobian is computed densely through
the custom rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .. import _jax_private as jp
from ._base import register, shape_of, zero_derivative
from .elementwise import _broadcast_partial, elementwise_primitives
from .fallback import dense_jacobian


_ELEMENTWISE_EXTRA = {lax.broadcast_in_dim_p, lax.stop_gradient_p}


def _is_elementwise_jaxpr(jaxpr, out_shape) -> bool:
    allowed = elementwise_primitives | zero_derivative | _ELEMENTWISE_EXTRA
    for var in list(jaxpr.invars) + list(jaxpr.constvars):
        if tuple(var.aval.shape) not in (out_shape, ()):
            return False
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            if tuple(var.aval.shape) not in (out_shape, ()):
                return False
        inner = jp.inner_jaxpr(eqn)
        if inner is not None:
            if not _is_elementwise_jaxpr(inner[0], out_shape):
                return False
        elif eqn.primitive in (jp.custom_jvp_call_p, jp.custom_vjp_call_p):
            if not _is_elementwise_jaxpr(jp.custom_call_jaxpr(eqn)[0], out_shape):
                return False
        elif eqn.primitive not in allowed:
            return False
    return True


def _elementwise_call(params, primals, outs) -> bool:
    if len(outs) != 1:
        return False
    out_shape = shape_of(outs[0])
    if any(shape_of(x) not in (out_shape, ()) for x in primals):
        return False  # degenerate broadcasting: use the dense path
    closed = params["call_jaxpr"]
    jaxpr = closed.jaxpr if hasattr(closed, "jaxpr") else closed
    return _is_elementwise_jaxpr(jaxpr, out_shape)


def _custom_rule(prim, use_vjp):
    def rule(primals, active, **params):
        outs = jp.bind(prim, params, *primals)
        if not _elementwise_call(params, primals, outs):
            modes = ("rev", "fwd") if use_vjp else None
            return outs, dense_jacobian(prim, params, primals, active, outs, modes)
        out = outs[0]
        out_shape = shape_of(out)
        partials = {}
        for i, a in enumerate(active):
            if not a:
                continue

            def f(xi, i=i):
                args = list(primals)
                args[i] = xi
                return jp.bind(prim, params, *args)[0]

            x = primals[i]
            if use_vjp or shape_of(x) == () and out_shape != ():
                # A scalar operand's column is a VJP; custom_vjp has only VJPs.
                if shape_of(x) == () and out_shape != ():
                    diag = jax.jacrev(f)(x) if use_vjp else jax.jacfwd(f)(x)
                else:
                    _, pullback = jax.vjp(f, x)
                    (diag,) = pullback(jnp.ones_like(out))
            else:
                _, diag = jax.jvp(f, (x,), (jnp.ones_like(x),))
            partials[(0, i)] = _broadcast_partial(
                diag.astype(out.dtype), out_shape, shape_of(x), out.dtype
            )
        return outs, partials

    return rule


register(jp.custom_jvp_call_p)(_custom_rule(jp.custom_jvp_call_p, use_vjp=False))
register(jp.custom_vjp_call_p)(_custom_rule(jp.custom_vjp_call_p, use_vjp=True))
