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

    # ∂out/∂lhs: lhs free axes are pure ties and the value is rhs; and symmetrically.
    partials = {}
    sides = [(lhs, lhs_label, rhs, rhs_label), (rhs, rhs_label, lhs, lhs_label)]
    for i, (x, x_label, other, other_label) in enumerate(sides):
        if active[i]:
            labels = out_labels + [x_label(k) for k in range(x.ndim)]
            val_labels = [other_label(k) for k in range(other.ndim)]
            partials[(0, i)] = from_labeled(
                other, val_labels, out_shape, shape_of(x), labels, out.dtype
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
    for i in (0, 1):
        if active[i]:
            partials[(0, i)] = _linear_in(
                lax.conv_general_dilated_p,
                params,
                primals,
                i,
                out_shape,
                out.dtype,
                muls=muls,
            )
    return [out], partials
