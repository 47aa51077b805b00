"""Linear algebra: `dot_general` as tie patterns, convolutions as linear maps."""

from __future__ import annotations

import math

from jax import lax

from .._sparse import from_labeled
from ._base import register, shape_of
from .structural import _linear_in


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

    partials = {}
    if active[0]:
        # ∂out/∂lhs: lhs free axes are pure ties, the value is rhs.
        labels = out_labels + [lhs_label(i) for i in range(lhs.ndim)]
        val_labels = [rhs_label(j) for j in range(rhs.ndim)]
        partials[(0, 0)] = from_labeled(
            rhs.astype(out.dtype),
            val_labels,
            out_shape,
            shape_of(lhs),
            labels,
            out.dtype,
        )
    if active[1]:
        labels = out_labels + [rhs_label(j) for j in range(rhs.ndim)]
        val_labels = [lhs_label(i) for i in range(lhs.ndim)]
        partials[(0, 1)] = from_labeled(
            lhs.astype(out.dtype),
            val_labels,
            out_shape,
            shape_of(rhs),
            labels,
            out.dtype,
        )
    return [out], partials


@register(lax.conv_general_dilated_p)
def _conv(primals, active, **params):
    lhs, rhs = primals
    out = lax.conv_general_dilated_p.bind(lhs, rhs, **params)
    out_shape = shape_of(out)
    rhs_spec = params["dimension_numbers"].rhs_spec
    # Each output entry is a dot product over one kernel's input window.
    muls = math.prod(out_shape) * math.prod(rhs.shape) // rhs.shape[rhs_spec[0]]
    partials = {}
    if active[0]:
        partials[(0, 0)] = _linear_in(
            lax.conv_general_dilated_p,
            params,
            primals,
            0,
            out_shape,
            out.dtype,
            muls=muls,
        )
    if active[1]:
        partials[(0, 1)] = _linear_in(
            lax.conv_general_dilated_p,
            params,
            primals,
            1,
            out_shape,
            out.dtype,
            muls=muls,
        )
    return [out], partials
