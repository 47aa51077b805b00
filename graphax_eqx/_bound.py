"""A lower bound on the multiplications of every elimination order of a scalar graph.

Where every partial is a scalar, each edge is either *valued* or a *unit* (a ±1 that
stores no value). Then a product costs one multiplication when both factors are
valued and none otherwise, a product is valued when either factor is, and a sum is
valued. Eliminating a vertex therefore costs its valued in-edges times its valued
out-edges at that moment.

Those counts cannot be made small. Take a path into `x`, from a vertex that is never
eliminated, whose last edge is valued. When `x` is eliminated, the last vertex of the
path that is still there has an edge to `x` summing the path's product, so a valued
in-edge. Vertex-disjoint paths end at distinct such vertices, so `x` then has at least
as many valued in-edges as there are vertex-disjoint paths of this kind (a maximum
flow), and likewise valued out-edges. The graph left after eliminating a set of
vertices does not depend on the order within the set, so a bound taken on that graph
holds whenever `x` is eliminated later.

Summing `in × out` over the vertices bounds every order. For two vertices `x` and `y`
one of the two is eliminated first, so together they cost at least the smaller of
`bound(x) + bound(y | x eliminated)` and the same with `x` and `y` swapped; over
disjoint pairs these sharper bounds add up too.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ._simulator import Simulator, State
from ._sparse import Pattern


# Each vertex's bound is a flow over its ancestors (or descendants), so the work grows
# about quadratically: 0.2 s at 287 vertices. Larger graphs get no bound.
MAX_VERTICES = 1000


def scalar_lower_bound(sim: Simulator) -> int | None:
    """A lower bound on the multiplications of every order of `sim`'s graph, or
    `None` when the graph is not one of scalar partials (see the module docstring)
    or has more than `MAX_VERTICES` intermediate vertices."""
    if len(sim.intermediates) > MAX_VERTICES:
        return None
    state = sim.start()
    valued = _scalar_kinds(sim, state)
    if valued is None:
        return None
    remaining = sorted(state.remaining)
    base = {x: _vertex_bound(state, x, valued) for x in remaining}
    total = sum(base.values())
    # Sharper bounds for pairs of nearby vertices, then disjoint pairs, greedily.
    after: dict[int, dict[int, int]] = {}
    for x in remaining:
        near = _near(state, x)
        if not near:
            continue
        child = state.copy()
        sim.eliminate(child, x)
        after[x] = {y: _vertex_bound(child, y, valued) for y in near}
    gains = []
    for x, row in after.items():
        for y, bound_y in row.items():
            if y <= x or x not in after.get(y, {}):
                continue
            pair = min(base[x] + bound_y, base[y] + after[y][x])
            gain = pair - base[x] - base[y]
            if gain > 0:
                gains.append((-gain, x, y))
    gains.sort()
    used: set[int] = set()
    for neg, x, y in gains:
        if x not in used and y not in used:
            used.update((x, y))
            total -= neg
    return total


def _scalar_kinds(sim: Simulator, state: State) -> dict[int, bool] | None:
    """`{edge id: valued}` for the edge kinds of a scalar graph, checked to combine
    as the module docstring says, or `None`."""
    kinds: dict[int, bool] = {}
    for row in state.succ:
        for k in row.values():
            edge = sim.edge(k)
            pattern = edge.pattern
            if type(pattern) is not Pattern or pattern.shape != ():
                return None
            kinds[k] = edge.has_val
    # Products and sums of the kinds must stay among them, costing as assumed.
    pending = list(kinds)
    while pending:
        a = pending.pop()
        for b in list(kinds):
            for first, second in ((a, b), (b, a)):
                c, muls = sim.product(first, second)
                if muls != int(kinds[first] and kinds[second]):
                    return None
                c_sum = sim.add(first, second)
                for k, val in ((c, kinds[first] or kinds[second]), (c_sum, True)):
                    edge = sim.edge(k)
                    if edge.pattern.shape != () or edge.has_val != val:
                        return None
                    if k not in kinds:
                        kinds[k] = val
                        pending.append(k)
    return kinds


def _near(state: State, x: int, limit: int = 48) -> list[int]:
    """Remaining vertices within two edges of `x` (in either direction), neighbours
    first, at most `limit` of them (any pairs give a valid bound; the cap keeps hubs,
    a sum of hundreds of terms, from costing a flow per pair)."""
    rem = state.remaining
    first = sorted((state.pred[x].keys() | state.succ[x].keys()) & rem)
    out = dict.fromkeys(first)
    for v in first:
        if len(out) >= limit:
            break
        out.update(
            dict.fromkeys(sorted((state.pred[v].keys() | state.succ[v].keys()) & rem))
        )
    out.pop(x, None)
    return list(out)[:limit]


def _vertex_bound(state: State, x: int, valued: dict[int, bool]) -> int:
    """At least `x`'s valued in-edges times its valued out-edges whenever it is
    eliminated from `state` or a later state."""
    ins = _disjoint_paths(state.pred, state.remaining, x, valued)
    if not ins:
        return 0
    return ins * _disjoint_paths(state.succ, state.remaining, x, valued)


def _disjoint_paths(back, remaining, x, valued) -> int:
    """The largest number of vertex-disjoint paths into `x` along `back` edges (row
    `back[v]`: the `u` with an edge `u → v`), each starting at a vertex that is never
    eliminated and entering `x` by a valued edge: a maximum flow with unit vertex
    capacities, each vertex split into an entry and an exit."""
    reach = _reach(back, x)
    ends = [u for u, k in back[x].items() if valued[k]]
    starts = [u for u in reach if u not in remaining]
    if not ends or not starts:
        return 0
    source, sink = ("source",), ("sink",)
    residual: dict[Any, dict[Any, int]] = {}

    def edge(a, b):
        residual.setdefault(a, {})[b] = 1
        residual.setdefault(b, {}).setdefault(a, 0)

    for u in starts:
        edge(source, (u, 0))
    for v in reach:
        edge((v, 0), (v, 1))
        for u in back[v]:
            edge((u, 1), (v, 0))
    for u in ends:
        edge((u, 1), sink)
    flow = 0
    while True:
        parent: dict[Any, Any] = {source: None}
        queue = deque([source])
        while queue and sink not in parent:
            a = queue.popleft()
            for b, cap in residual[a].items():
                if cap > 0 and b not in parent:
                    parent[b] = a
                    queue.append(b)
        if sink not in parent:
            return flow
        b = sink
        while parent[b] is not None:
            a = parent[b]
            residual[a][b] -= 1
            residual[b][a] += 1
            b = a
        flow += 1


def _reach(back, x) -> set[int]:
    """The vertices with a path to `x` along `back` edges, `x` excluded."""
    seen = {x}
    queue = deque([x])
    while queue:
        v = queue.popleft()
        for u in back[v]:
            if u not in seen:
                seen.add(u)
                queue.append(u)
    seen.discard(x)
    return seen
