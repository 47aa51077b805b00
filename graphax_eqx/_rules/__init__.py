"""Elemental partial rules, one module per family, and the exact fallback."""

from . import (
    control as control,
    custom as custom,
    elementwise as elementwise,
    linalg as linalg,
    reductions as reductions,
    structural as structural,
)
from ._base import (
    register as register,
    register_zero as register_zero,
    rules as rules,
    zero_derivative as zero_derivative,
)
from .fallback import fallback_rule as fallback_rule


def get_rule(prim):
    """The rule for `prim`: its registered rule, else the exact dense fallback."""
    rule = rules.get(prim)
    if rule is not None:
        return rule
    from .._complex import RealView, realview_rule  # `_complex` builds on this package

    if isinstance(prim, RealView):
        return realview_rule(prim)

    def fallback(primals, active, **params):
        return fallback_rule(prim, primals, active, params)

    return fallback
