"""`lax.scan` and `lax.cond` as linear maps.

A scan's local Jacobian couples every input to every output through all its steps,
and is mostly dense. Stored, it costs one JAX pass per row or column (`jax.jacrev`
of a recurrent network's last state needs one backward pass per state entry). Kept
as the linear map it is, it costs what JAX's own modes pay: the scan is linearised
once where it runs, and each partial applies the linearised scan (forward) or its
transpose (reverse) to whatever its neighbour in the elimination holds. The maps
from one input to every output, and from every input to one output, are siblings
(`graphax_eqx._sparse.SharedApply`): met by the same array, they run one pass
between them. A training loss's single cotangent then costs one backward pass per
scan output, as JAX's own reverse mode, against one per state entry stored.
`lax.cond` (and `lax.switch`) get the same treatment: the linearised branch taken.

Small ones, whose dense Jacobian has at most `_MAX_DENSE_ENTRIES` entries, keep the
dense fallback: stored partials combine with their neighbours more cheaply than maps.
So do loops holding a `custom_vjp` function, which has no forward mode to linearise
with (the fallback differentiates those in reverse mode).
`lax.while_loop` has no transpose and keeps the fallback (`jax.jacfwd`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from .. import _jax_private as jp
from .._sparse import SharedApply, linear_map
from ._base import active_indices, is_float, register, shape_of
from .fallback import dense_jacobian


_MAX_DENSE_ENTRIES = 1 << 14


def _size(v) -> int:
    return math.prod(shape_of(v.aval)) if hasattr(v.aval, "shape") else 1


def jaxpr_muls(jaxpr) -> int:
    """Multiplications one evaluation of `jaxpr` performs, counting products,
    quotients, contractions and convolutions (a loop body once per step)."""
    total = 0
    for eqn in jaxpr.eqns:
        prim = eqn.primitive
        if prim in (lax.mul_p, lax.div_p):
            total += _size(eqn.outvars[0])
        elif prim is lax.dot_general_p:
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = shape_of(eqn.invars[0].aval)
            total += _size(eqn.outvars[0]) * math.prod(lhs[d] for d in lc)
        elif prim is lax.conv_general_dilated_p:
            rhs = shape_of(eqn.invars[1].aval)
            out_feat = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
            total += _size(eqn.outvars[0]) * (math.prod(rhs) // max(out_feat, 1))
        elif prim is lax.scan_p:
            total += eqn.params["length"] * jaxpr_muls(eqn.params["jaxpr"].jaxpr)
        elif prim is lax.cond_p:
            # One branch runs.
            total += max(jaxpr_muls(b.jaxpr) for b in eqn.params["branches"])
        else:
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, jp.ClosedJaxpr):
                        sub = sub.jaxpr
                    if isinstance(sub, jp.Jaxpr):
                        total += jaxpr_muls(sub)
    return total


def _holds(jaxpr, prim) -> bool:
    """Whether `jaxpr`, or any jaxpr inside it, has an equation of `prim`."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is prim:
            return True
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jp.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jp.Jaxpr) and _holds(sub, prim):
                    return True
    return False


def _bodies(params) -> list:
    if "jaxpr" in params:
        return [params["jaxpr"].jaxpr]
    return [b.jaxpr for b in params.get("branches", ())]


def _loop_rule(prim):
    """Partials of `prim` as linear maps of its linearisation (dense when small)."""

    def rule(primals, active, **params):
        idx = [i for i in active_indices(active) if is_float(primals[i])]
        n_in = sum(math.prod(shape_of(primals[i])) for i in idx)

        def run(*xs):
            args = list(primals)
            for i, x in zip(idx, xs, strict=True):
                args[i] = x
            return jp.bind(prim, params, *args)

        out_types = jax.eval_shape(run, *[primals[i] for i in idx])
        float_outs = [k for k, o in enumerate(out_types) if is_float(o)]
        n_out = sum(math.prod(out_types[k].shape) for k in float_outs)
        has_complex = any(
            jnp.issubdtype(jnp.result_type(x), jnp.complexfloating)
            for x in [*primals, *out_types]
        )
        # A `custom_vjp` inside has no forward mode: the maps' `fn` could not run.
        reverse_only = any(_holds(b, jp.custom_vjp_call_p) for b in _bodies(params))
        if (
            has_complex
            or reverse_only
            or not idx
            or not float_outs
            or n_in * n_out <= _MAX_DENSE_ENTRIES
        ):
            outs = jp.bind(prim, params, *primals)
            return outs, dense_jacobian(prim, params, primals, active, outs)
        # One run gives the outputs and what the linearisation keeps of it.
        outs, tangent = jax.linearize(run, *[primals[i] for i in idx])
        zeros = [jnp.zeros_like(primals[i]) for i in idx]
        muls = jaxpr_muls(jax.make_jaxpr(tangent)(*zeros).jaxpr)

        def forwards(a, i):
            # Every output's tangent from input `i`'s, in one pass.
            def fn(t):
                tangents = list(zeros)
                tangents[a] = t.astype(primals[i].dtype)
                ys = tangent(*tangents)
                return tuple(ys[k].astype(outs[k].dtype) for k in float_outs)

            return SharedApply(fn)

        def transposes(k):
            # Every input's cotangent from output `k`'s, in one pass: one transposed
            # loop where separate maps would run one per input.
            def fn(*ts):
                ts = [t.astype(primals[i].dtype) for t, i in zip(ts, idx, strict=True)]
                return tangent(*ts)[k].astype(outs[k].dtype)

            types = [
                jax.ShapeDtypeStruct(shape_of(primals[i]), outs[k].dtype) for i in idx
            ]
            return SharedApply(lambda ct: tuple(jax.linear_transpose(fn, *types)(ct)))

        fwd_groups = {i: forwards(a, i) for a, i in enumerate(idx)}
        rev_groups = {k: transposes(k) for k in float_outs}
        partials = {}
        for a, i in enumerate(idx):
            for slot, k in enumerate(float_outs):

                def fn(t, group=fwd_groups[i], slot=slot):
                    return group.fn(t)[slot]

                def tfn(ct, group=rev_groups[k], a=a):
                    return group.fn(ct)[a]

                partials[(k, i)] = dataclasses.replace(
                    linear_map(
                        fn,
                        shape_of(primals[i]),
                        shape_of(outs[k]),
                        outs[k].dtype,
                        tfn,
                        muls,
                    ),
                    shared_fn=(fwd_groups[i], slot),
                    shared_tfn=(rev_groups[k], a),
                )
        return list(outs), partials

    return rule


register(lax.scan_p)(_loop_rule(lax.scan_p))
register(lax.cond_p)(_loop_rule(lax.cond_p))
