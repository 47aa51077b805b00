"""The rule registry.

A rule receives the primal inputs of one equation, a mask saying which inputs need a
partial, and the equation's params. It returns the primal outputs and a dict
`{(output index, input index): partial}`; a missing entry is a zero partial.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from .._sparse import Partial, from_labeled


Partials = dict[tuple[int, int], Partial]
Rule = Callable[..., tuple[list[Array], Partials]]

# Rules keyed by primitive object, filled in by the family modules.
rules: dict[Any, Rule] = {}

# Primitives whose outputs have zero derivative with respect to every input.
zero_derivative: set[Any] = set()


# Which outputs of the equation being evaluated lead to a differentiated output, as
# `(primitive, mask)`: a rule that differentiates the whole equation by JAX's own
# modes (`dense_jacobian`) leaves the others out, as a reverse pass for each of
# their entries would cost as much as one for a needed entry.
_NEEDED: contextvars.ContextVar[tuple[Any, tuple[bool, ...]] | None] = (
    contextvars.ContextVar("graphax_eqx_needed_outputs", default=None)
)


@contextlib.contextmanager
def outputs_needed(prim, mask: Sequence[bool]):
    """Within the block, rules for `prim` may read `mask` (see `needed_outputs`)."""
    token = _NEEDED.set((prim, tuple(mask)))
    try:
        yield
    finally:
        _NEEDED.reset(token)


def needed_outputs(prim, n: int) -> tuple[bool, ...]:
    """Which of the `n` outputs of the `prim` equation being evaluated are needed
    (all of them outside `outputs_needed`, or for another equation)."""
    found = _NEEDED.get()
    if found is None or found[0] is not prim or len(found[1]) != n:
        return (True,) * n
    return found[1]


class Same:
    """A cache-key part equal only to the same object. It keeps the object alive, so
    that its `id` is not reused while the key exists."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other) -> bool:
        return isinstance(other, Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def register(*primitives) -> Callable[[Rule], Rule]:
    """Register the decorated rule for each of `primitives` (those that exist)."""

    def decorator(rule: Rule) -> Rule:
        for prim in primitives:
            if prim is not None:
                rules[prim] = rule
        return rule

    return decorator


def register_zero(*primitives) -> None:
    for prim in primitives:
        if prim is not None:
            zero_derivative.add(prim)


# The operations a generic reduction's body may be, as the `lax` functions that JAX
# recognises as monoids when it picks a reduction primitive.
_MONOID_OPS = {lax.max_p: lax.max, lax.min_p: lax.min, lax.add_p: lax.add}


def as_monoid(primals, active, params, reduce: Callable) -> Any:
    """The equation `(primitive, params)` that JAX binds for a generic reduction of
    one operand (`lax.reduce_p`, `lax.reduce_window_p`) whose body is one `max`,
    `min` or `add` of its two arguments and whose initial value is known now and is
    that operation's identity; else `None`.

    `lax.reduce(x, init, lax.max, ...)` binds `reduce_max` when `init` is a concrete
    `-inf`, but the generic primitive when `init` is an array built inside the
    traced function: `make_jaxpr` stages it, so its value is not known where JAX
    chooses. The two differentiate differently where entries tie (JAX's rule for
    `reduce_max` shares the derivative equally, the generic one splits it pair by
    pair in XLA's order; `reduce_window_max` gives it to the first maximum, the
    generic one cannot be linearised at all), and eager JAX, whose initial values
    are concrete, takes the monoid's. `reduce(x, init, op)` makes the reduction with
    the equation's own window or axes: it is traced with the initial value's
    concrete value, and JAX's own test picks the primitive."""
    body = params["jaxpr"]
    jaxpr = getattr(body, "jaxpr", body)
    if (
        len(primals) != 2
        or any(active[1:])
        or params.get("consts")
        or getattr(body, "consts", None)
        or jaxpr.constvars
        or len(jaxpr.eqns) != 1
        or len(jaxpr.invars) != 2
    ):
        return None
    (eqn,) = jaxpr.eqns
    op = _MONOID_OPS.get(eqn.primitive)
    if (
        op is None
        or set(eqn.invars) != set(jaxpr.invars)
        or list(jaxpr.outvars) != list(eqn.outvars)
    ):
        return None
    x, init = primals
    try:
        init = np.asarray(init)
    except (TypeError, jax.errors.ConcretizationTypeError):  # traced: not known now
        return None
    spec = jax.ShapeDtypeStruct(shape_of(x), jnp.result_type(x))
    found = jax.make_jaxpr(lambda v: reduce(v, init, op))(spec).jaxpr.eqns
    if len(found) != 1 or found[0].primitive in (lax.reduce_p, lax.reduce_window_p):
        return None
    return found[0].primitive, found[0].params


def as_monoid_rule(prim, reduce: Callable) -> Rule:
    """The rule of a generic reduction `prim`: that of the monoid reduction JAX binds
    for it where `as_monoid` finds one, else the exact fallback."""

    def rule(primals, active, **params):
        from .fallback import fallback_rule  # builds on this module

        found = as_monoid(primals, active, params, functools.partial(reduce, params))
        if found is None:
            return fallback_rule(prim, primals, active, params)
        monoid, monoid_params = found
        if monoid not in rules:
            return fallback_rule(monoid, primals[:1], active[:1], monoid_params)
        return rules[monoid](primals[:1], active[:1], **monoid_params)

    return rule


def is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def shape_of(x) -> tuple[int, ...]:
    return tuple(int(s) for s in jnp.shape(x))


def active_indices(active: Sequence[bool]) -> list[int]:
    return [i for i, a in enumerate(active) if a]


def per_slice_blocks(
    blocks: Array, shape: tuple[int, ...], axis: int, dtype
) -> Partial:
    """The partial of a map that acts on each slice along `axis` of an array of
    `shape` on its own: tied on every other axis, with `blocks` (shaped like the
    other axes, then `(n, n)`, output before input) its dense block per slice."""
    others = [a for a in range(len(shape)) if a != axis]
    out_labels = [("t", a) if a != axis else ("out",) for a in range(len(shape))]
    in_labels = [("t", a) if a != axis else ("in",) for a in range(len(shape))]
    val_labels = [("t", a) for a in others] + [("out",), ("in",)]
    return from_labeled(blocks, val_labels, shape, shape, out_labels + in_labels, dtype)
