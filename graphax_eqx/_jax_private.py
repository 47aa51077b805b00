"""Every use of JAX internals, in one place.

Checked against JAX 0.10.2. Everything else in the package uses public API
(`jax`, `jax.lax`, `jax.extend.core`).
"""

from __future__ import annotations

from typing import Any

import jax.extend.core as jex_core
from jax import lax
from jax._src.lax import lax as _lax_internal
from jax.extend.core import primitives as jex_prims


def bind(primitive, params: dict[str, Any], *args) -> list:
    """Bind `primitive` as the equation with `params` did; always returns a list.

    Equations holding sub-jaxprs (`custom_jvp_call`, `custom_vjp_call`) store them in
    a form that differs from what `bind` takes, and `get_bind_params` converts. JAX
    0.10 returns the params dict; older JAX returned a `(subfuns, params)` pair.
    """
    converted = primitive.get_bind_params(params)
    if isinstance(converted, tuple):
        subfuns, kwargs = converted
        out = primitive.bind(*subfuns, *args, **kwargs)
    else:
        out = primitive.bind(*args, **converted)
    return list(out) if primitive.multiple_results else [out]


def _first(*names):
    for name in names:
        for mod in (lax, jex_prims):
            prim = getattr(mod, name, None)
            if prim is not None:
                return prim
    return None


# Call-like primitives whose body is inlined into the graph.
jit_p = _first("jit_p", "pjit_p")
closed_call_p = _first("closed_call_p")
call_p = _first("call_p")
remat_p = _first("remat_p")
custom_jvp_call_p = _first("custom_jvp_call_p")
custom_vjp_call_p = _first("custom_vjp_call_p")
add_any_p = _first("add_jaxvals_p", "add_any_p")
split_p = _first("split_p")
optimization_barrier_p = _first("optimization_barrier_p")

Literal = jex_core.Literal
Var = jex_core.Var
DropVar = jex_core.DropVar
ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr


def inner_jaxpr(eqn) -> tuple[Any, list] | None:
    """For a call-like equation to inline: its (open jaxpr, consts); else None."""
    prim = eqn.primitive
    if prim is jit_p:
        closed = eqn.params["jaxpr"]
    elif prim is closed_call_p or prim is call_p:
        closed = eqn.params["call_jaxpr"]
    elif prim is remat_p:
        closed = eqn.params["jaxpr"]
    else:
        return None
    if isinstance(closed, ClosedJaxpr):
        return closed.jaxpr, list(closed.consts)
    return closed, []


def custom_call_jaxpr(eqn):
    """The primal body of a custom-derivative call, as (open jaxpr, consts)."""
    closed = eqn.params["call_jaxpr"]
    if isinstance(closed, ClosedJaxpr):
        return closed.jaxpr, list(closed.consts)
    return closed, []


def as_weak_type(x):
    """`x` with a weak type, as JAX gives derivatives w.r.t. Python scalars.

    No public API sets `weak_type`; `jax.jacrev` results carry it for weak inputs.
    """
    return _lax_internal._convert_element_type(x, x.dtype, weak_type=True)
