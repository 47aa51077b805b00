"""Vertex elimination, on real partials or on their patterns alone.

Eliminating `v` adds `∂w/∂v · ∂v/∂u` to the edge `u → w` for every predecessor `u`
and successor `w`, then removes `v`. The same loop runs on
[`graphax_eqx._eliminate.SimEdge`][]s (pattern only, no arrays) to count the cost of
an order without doing any arithmetic, and on real partials to compute the Jacobian;
both use the same plans, so counts agree exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ._band import BandTensor
from ._graph import EdgeGraph
from ._indexed import (
    CooPattern,
    CooTensor,
    coo_pattern_of,
    gathered_muls,
    mixed_product_summary,
    mixed_sum_summary,
    rows_muls,
    spread_entries,
)
from ._sparse import (
    AnyPattern,
    LinearMap,
    LinearPattern,
    SparseTensor,
    _coordinates,
    add,
    plan_has_val,
    product,
    product_muls,
    product_plan,
    separating_sum,
    sum_plan,
)


@dataclasses.dataclass(frozen=True)
class SimEdge:
    """The static part of a partial: its pattern and whether it stores values."""

    pattern: AnyPattern
    has_val: bool


def sim_edge(partial) -> SimEdge:
    if isinstance(partial, LinearMap):
        return SimEdge(partial.pattern, True)
    if isinstance(partial, BandTensor):
        return SimEdge(partial.pattern, True)
    assert isinstance(partial, (SparseTensor, CooTensor))
    return SimEdge(partial.pattern, partial.val is not None)


def sim_product(a: SimEdge, b: SimEdge, final: bool = False) -> tuple[SimEdge, int]:
    if _coordinates(a.pattern) or _coordinates(b.pattern):
        # What the plan gives, without planning every entry pair.
        pattern, has_val, muls = mixed_product_summary(
            a.pattern, b.pattern, a.has_val, b.has_val
        )
        return SimEdge(pattern, has_val), muls
    plan = product_plan(a.pattern, b.pattern, a.has_val, b.has_val)
    return SimEdge(plan.pattern, plan_has_val(plan, a.has_val, b.has_val)), plan.muls


def sim_product_muls(a: SimEdge, b: SimEdge) -> int:
    """The multiplications of `sim_product(a, b)`, without its result's pattern."""
    return product_muls(a.pattern, b.pattern, a.has_val, b.has_val)


def sim_gathered(a: SimEdge, b: SimEdge) -> int:
    """The multiplications of `sim_product(a, b)` made over coordinates, gathering
    both factors per entry pair (see [`graphax_eqx._indexed.gathered_muls`][])."""
    if _coordinates(a.pattern) or _coordinates(b.pattern):
        return gathered_muls(a.pattern, b.pattern, a.has_val, b.has_val)
    return 0


def sim_by_rows(a: SimEdge, b: SimEdge) -> int:
    """The multiplications of `sim_product(a, b)` made over coordinates against a
    full block read by rows (see [`graphax_eqx._indexed.rows_muls`][])."""
    if _coordinates(a.pattern) or _coordinates(b.pattern):
        return rows_muls(a.pattern, b.pattern, a.has_val, b.has_val)
    return 0


def sim_contracted(a: SimEdge, b: SimEdge) -> int:
    """The multiplications of `sim_product(a, b)` beyond one per result entry of a
    product run as a contraction (a matrix product)."""
    if _coordinates(a.pattern) or _coordinates(b.pattern):
        return 0
    return product_plan(a.pattern, b.pattern, a.has_val, b.has_val).contracted


def sim_spread(a: SimEdge, b: SimEdge) -> int:
    """The entries `sim_add(a, b)` gathers into a result it stores densely (see
    [`graphax_eqx._indexed.spread_entries`][])."""
    if separating_sum(a.pattern, b.pattern):
        a = SimEdge(coo_pattern_of(a.pattern, a.has_val), a.has_val)
        b = SimEdge(coo_pattern_of(b.pattern, b.has_val), b.has_val)
    if _coordinates(a.pattern) or _coordinates(b.pattern):
        return spread_entries(a.pattern, b.pattern, a.has_val, b.has_val)
    return 0


def sim_add(a: SimEdge, b: SimEdge) -> tuple[SimEdge, int]:
    if separating_sum(a.pattern, b.pattern):
        a = SimEdge(coo_pattern_of(a.pattern, a.has_val), a.has_val)
        b = SimEdge(coo_pattern_of(b.pattern, b.has_val), b.has_val)
    if _coordinates(a.pattern) or _coordinates(b.pattern):
        pattern, has_val, adds = mixed_sum_summary(
            a.pattern, b.pattern, a.has_val, b.has_val
        )
        return SimEdge(pattern, has_val), adds
    pattern, adds = sum_plan(a.pattern, b.pattern, a.has_val, b.has_val)
    return SimEdge(pattern, True), adds


def real_product(a, b, final: bool = False):
    return product(a, b, final)


def real_add(a, b):
    return add(a, b)


Mul = Callable[..., tuple[Any, int]]


def written(edge) -> int:
    """Entries a pattern-only edge stores: what computing it writes to memory."""
    p = edge.pattern
    if isinstance(p, LinearPattern) or not edge.has_val:
        return 0
    return p.val_size


def structurally_zero(edge) -> bool:
    """Whether a partial (or its `SimEdge`) has no structural nonzeros: static
    coordinates with no entries, as where index maps select disjoint parts. Such a
    product is no edge at all: it is dropped rather than stored and added."""
    p = edge.pattern
    return isinstance(p, CooPattern) and p.nnz == 0


def _value_free(edge) -> bool:
    """Whether a partial (or its `SimEdge`) stores no values: a pure index map."""
    if isinstance(edge, SimEdge):
        return not edge.has_val
    return isinstance(edge, (SparseTensor, CooTensor)) and edge.val is None


def _meets_no_values(graph: EdgeGraph, u: int) -> bool:
    """Whether an edge from `u` can only be multiplied by pure index maps from now
    on: `u` is an input, or every edge into it comes from an input (those edges
    never change, inputs not being eliminated) and stores no values."""
    return u < 0 or all(p < 0 and _value_free(e) for p, e in graph.pred[u].items())


Prepare = Callable[[dict, dict], None]


def eliminate_vertex(
    graph: EdgeGraph, v: int, mul: Mul, plus: Mul, prepare: Prepare | None = None
) -> tuple[int, int]:
    """Eliminate `v` in place; returns (multiplications, additions).

    `prepare(ins, outs)`, if given, may replace `v`'s in- and out-edges (keyed by
    the vertex at their other end) before they are multiplied."""
    ins = graph.pred.pop(v)
    outs = graph.succ.pop(v)
    for u in ins:
        del graph.succ[u][v]
    for w in outs:
        del graph.pred[w][v]
    if prepare is not None:
        prepare(ins, outs)
    muls = adds = 0
    for u, e_uv in ins.items():
        # An edge from `u` to an output (no successors) is never multiplied again
        # by a factor with values (infinite ones, say), so which of its entries are
        # selected away need not be known (`final`).
        last = _meets_no_values(graph, u)
        for w, e_vw in outs.items():
            edge, m = mul(e_vw, e_uv, final=last and not graph.succ[w])
            muls += m
            if structurally_zero(edge):
                continue
            old = graph.succ[u].get(w)
            if old is not None:
                edge, a = plus(old, edge)
                adds += a
            graph.set(u, w, edge)
    return muls, adds


def run_order(
    graph: EdgeGraph,
    order: Sequence[int],
    mul: Mul,
    plus: Mul,
    prepare: Prepare | None = None,
) -> tuple[int, int, list[int]]:
    """Eliminate `order` in place; returns (muls, adds, muls per vertex)."""
    muls = adds = 0
    per_vertex = []
    for v in order:
        m, a = eliminate_vertex(graph, v, mul, plus, prepare)
        muls += m
        adds += a
        per_vertex.append(m)
    return muls, adds, per_vertex


def simulate(graph: EdgeGraph, order: Sequence[int]) -> tuple[int, int, list[int]]:
    """The counts of `order` on a pattern graph (the graph is not modified)."""
    g = graph.copy_with(lambda e: e)
    return run_order(g, order, sim_product, sim_add)
