"""The rule registry.

A rule receives the primal inputs of one equation, a mask saying which inputs need a
partial, and the equation's params. It returns the primal outputs and a dict
`{(output index, input index): partial}`; a missing entry is a zero partial.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array

from .._sparse import Partial, from_labeled


Partials = dict[tuple[int, int], Partial]
Rule = Callable[..., tuple[list[Array], Partials]]

# Rules keyed by primitive object, filled in by the family modules.
rules: dict[Any, Rule] = {}

# Primitives whose outputs have zero derivative with respect to every input.
zero_derivative: set[Any] = set()


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
