"""A fast structural simulator of vertex elimination.

[`graphax_eqx._eliminate.simulate`][] eliminates on pattern objects: every product
looks its plan up by hashing two patterns. Scoring thousands of orders needs less. The
[`Simulator`][] interns each distinct edge pattern as a small integer once, memoises the
product and sum of every pair of interned patterns as
`(result id, multiplications or additions)`, and then eliminates on a graph of plain
`dict[int, int]` rows. It runs the same plans as the engine, so its counts are exactly
those `count_ops=True` reports for the same order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from ._eliminate import (
    SimEdge,
    sim_add,
    sim_by_rows,
    sim_contracted,
    sim_gathered,
    sim_product,
    sim_product_muls,
    sim_spread,
    structurally_zero,
    written,
)
from ._graph import EdgeGraph


# Pattern ids stay below this, so that a pair of ids packs into one int key.
_SHIFT = 1 << 24


@dataclasses.dataclass(frozen=True)
class Cost:
    """What eliminating a complete order costs, from patterns alone.

    - `muls`: multiplications (as `count_ops=True` reports them).
    - `adds`: additions of the elimination (without those made while building the
        graph, which do not depend on the order).
    - `traffic`: entries written by the products and sums, a measure of memory traffic.
    - `products`: products emitted (one kernel each before XLA fuses them).
    - `fill`: edges created that did not exist before.
    - `gathered`: the multiplications (of `muls`) made entry pair by entry pair over
        coordinates, gathering both factors (see
        [`graphax_eqx._indexed.gathered_muls`][]).
    - `contracted`: the multiplications (of `muls`) beyond one per result entry of
        products run as contractions (matrix products), far cheaper each than those
        of broadcast products.
    - `spread`: entries sums of coordinate partials gather into results stored
        densely (see [`graphax_eqx._indexed.spread_entries`][]).
    - `by_rows`: the multiplications (of `muls`) made over coordinates against a
        full block, whose rows are gathered whole (see
        [`graphax_eqx._indexed.rows_muls`][]).
    """

    muls: int
    adds: int
    traffic: int
    products: int
    fill: int
    gathered: int = 0
    contracted: int = 0
    spread: int = 0
    by_rows: int = 0


class State:
    """A partly eliminated graph: `pred[i]` / `succ[i]` map neighbours to edge ids.

    Copies share their rows: a copy copies a list of references, and each state copies
    a row before its first write to it (`own_pred` / `own_succ` hold the rows it has
    copied; `None`: all of them). The search copies states far more often than it
    changes most rows.
    """

    __slots__ = ("pred", "succ", "remaining", "own_pred", "own_succ")

    def __init__(self, pred, succ, remaining):
        self.pred: list[dict[int, int]] = pred
        self.succ: list[dict[int, int]] = succ
        self.remaining: set[int] = remaining
        self.own_pred: set[int] | None = set()
        self.own_succ: set[int] | None = set()

    def copy(self) -> State:
        # From now on both states share every row.
        self.own_pred = set()
        self.own_succ = set()
        return State(list(self.pred), list(self.succ), set(self.remaining))

    def owned_copy(self) -> State:
        """A copy that owns all its rows (for eliminating through from the start)."""
        state = State(
            [d.copy() for d in self.pred],
            [d.copy() for d in self.succ],
            set(self.remaining),
        )
        state.own_pred = state.own_succ = None
        return state


def _detach(state: State, i: int, ins: dict, outs: dict) -> None:
    """Remove vertex `i`'s edges from `state`, taking ownership of the rows of its
    neighbours (which the elimination then writes)."""
    state.pred[i] = {}
    state.succ[i] = {}
    _unlink(state.succ, state.own_succ, ins, i)
    _unlink(state.pred, state.own_pred, outs, i)


def _unlink(rows: list[dict], own: set[int] | None, neighbours, i: int) -> None:
    """Delete `i` from the rows of `neighbours`, copying each shared one first."""
    if own is None:
        for v in neighbours:
            del rows[v][i]
        return
    own.add(i)
    for v in neighbours:
        row = rows[v]
        if v not in own:
            row = rows[v] = row.copy()
            own.add(v)
        del row[i]


class Simulator:
    """Eliminates orders on interned patterns; see the module docstring.

    **Arguments:**

    - `graph`: a pattern graph (edges are [`graphax_eqx._eliminate.SimEdge`][]s).
    - `intermediates`: the vertex ids an order eliminates.

    Vertex ids are the graph's own; internally they are numbered `0..n-1`.
    """

    def __init__(self, graph: EdgeGraph, intermediates: Sequence[int]):
        self.vertices: list[int] = sorted(graph.succ)
        self.index = {v: i for i, v in enumerate(self.vertices)}
        self.intermediates = tuple(intermediates)
        # Where the graph is a vectorised batch of dense blocks (see
        # `graphax_eqx._indexed.densify_small_blocks`), the entries per batch entry
        # of all inputs and of all outputs.
        self.block_sizes = graph.block_sizes
        self._edges: list[SimEdge] = []
        self._ids: dict[SimEdge, int] = {}
        self._written: list[int] = []
        self._zero: list[bool] = []
        self._prod: dict[int, tuple[int, int]] = {}
        self._muls: dict[int, int] = {}
        # Gathered and contracted multiplications of the products in `_prod`, and
        # spread entries of the sums in `_sum`, that have any.
        self._gathered: dict[int, int] = {}
        self._contracted: dict[int, int] = {}
        self._spread: dict[int, int] = {}
        self._by_rows: dict[int, int] = {}
        self._sum: dict[int, tuple[int, int]] = {}
        n = len(self.vertices)
        pred: list[dict[int, int]] = [{} for _ in range(n)]
        succ: list[dict[int, int]] = [{} for _ in range(n)]
        for u, row in graph.succ.items():
            iu = self.index[u]
            for w, e in row.items():
                iw = self.index[w]
                k = self._intern(e)
                succ[iu][iw] = k
                pred[iw][iu] = k
        self._initial = State(pred, succ, {self.index[v] for v in self.intermediates})

    @property
    def densified(self) -> bool:
        """Whether the graph is a vectorised batch of dense blocks."""
        return self.block_sizes is not None

    # -- interning ---------------------------------------------------------------

    def _intern(self, edge: SimEdge) -> int:
        k = self._ids.get(edge)
        if k is None:
            k = len(self._edges)
            if k >= _SHIFT:
                raise RuntimeError("too many distinct edge patterns to simulate")
            self._ids[edge] = k
            self._edges.append(edge)
            self._written.append(written(edge))
            self._zero.append(structurally_zero(edge))
        return k

    def _product(self, a: int, b: int) -> tuple[int, int]:
        """`edge[a] · edge[b]` (a: v→w, b: u→v) as (pattern id, multiplications)."""
        key = a * _SHIFT + b
        found = self._prod.get(key)
        if found is None:
            edge, muls = sim_product(self._edges[a], self._edges[b])
            found = (self._intern(edge), int(muls))
            self._prod[key] = found
            if muls:
                gathered = sim_gathered(self._edges[a], self._edges[b])
                if gathered:
                    self._gathered[key] = int(gathered)
                contracted = sim_contracted(self._edges[a], self._edges[b])
                if contracted:
                    self._contracted[key] = int(contracted)
                by_rows = sim_by_rows(self._edges[a], self._edges[b])
                if by_rows:
                    self._by_rows[key] = int(by_rows)
        return found

    def _add(self, a: int, b: int) -> tuple[int, int]:
        key = a * _SHIFT + b
        found = self._sum.get(key)
        if found is None:
            edge, adds = sim_add(self._edges[a], self._edges[b])
            found = (self._intern(edge), int(adds))
            self._sum[key] = found
            spread = sim_spread(self._edges[a], self._edges[b])
            if spread:
                self._spread[key] = int(spread)
        return found

    def _product_muls(self, a: int, b: int) -> int:
        """The multiplications of `edge[a] · edge[b]`, from the product's plan where
        it was made, else counted without making it (scores need no more)."""
        key = a * _SHIFT + b
        found = self._prod.get(key)
        if found is not None:
            return found[1]
        muls = self._muls.get(key)
        if muls is None:
            muls = int(sim_product_muls(self._edges[a], self._edges[b]))
            self._muls[key] = muls
        return muls

    def product_id(self, a: int, b: int) -> int:
        """The pattern id of `edge[a] · edge[b]`."""
        return self._product(a, b)[0]

    def product(self, a: int, b: int) -> tuple[int, int]:
        """`edge[a] · edge[b]` as (pattern id, multiplications)."""
        return self._product(a, b)

    def add(self, a: int, b: int) -> int:
        """The pattern id of `edge[a] + edge[b]`."""
        return self._add(a, b)[0]

    def stored(self, k: int) -> int:
        """Entries pattern `k` stores (0 for pure index maps and lazy maps)."""
        return self._written[k]

    @property
    def num_patterns(self) -> int:
        return len(self._edges)

    def edge(self, k: int) -> SimEdge:
        return self._edges[k]

    # -- states -----------------------------------------------------------------

    def start(self) -> State:
        """A fresh state: nothing eliminated yet."""
        return self._initial.owned_copy()

    def eliminate(
        self, state: State, i: int
    ) -> tuple[int, int, int, int, int, int, int, int, int]:
        """Eliminate internal vertex `i` in place.

        Returns (multiplications, additions, entries written, products, new edges,
        gathered multiplications, contracted multiplications, spread entries,
        multiplications by rows): the fields of a [`Cost`][].
        """
        pred, succ = state.pred, state.succ
        ins = pred[i]
        outs = succ[i]
        _detach(state, i, ins, outs)
        state.remaining.discard(i)
        prod, sums, add, wr = self._prod, self._sum, self._add, self._written
        zero, gath, con = self._zero, self._gathered, self._contracted
        spreads, rows = self._spread, self._by_rows
        muls = adds = traffic = fill = gathered = contracted = spread = by_rows = 0
        outs_items = list(outs.items())
        for u, b in ins.items():
            su = succ[u]
            for w, a in outs_items:
                key = a * _SHIFT + b
                found = prod.get(key)
                if found is None:
                    found = self._product(a, b)
                c, m = found
                if m:
                    muls += m
                    gathered += gath.get(key, 0)
                    contracted += con.get(key, 0)
                    by_rows += rows.get(key, 0)
                if zero[c]:
                    continue
                traffic += wr[c]
                old = su.get(w)
                if old is not None:
                    sum_key = old * _SHIFT + c
                    found = sums.get(sum_key)
                    if found is None:
                        found = add(old, c)
                    spread += spreads.get(sum_key, 0)
                    c, m = found
                    adds += m
                    traffic += wr[c]
                else:
                    fill += 1
                su[w] = c
                pred[w][u] = c
        return (
            muls,
            adds,
            traffic,
            len(ins) * len(outs_items),
            fill,
            gathered,
            contracted,
            spread,
            by_rows,
        )

    def vertex_muls(self, state: State, i: int) -> int:
        """Multiplications eliminating internal vertex `i` would cost now."""
        total = 0
        outs = list(state.succ[i].values())
        for b in state.pred[i].values():
            for a in outs:
                total += self._product_muls(a, b)
        return total

    def vertex_fill(self, state: State, i: int) -> tuple[int, int]:
        """(new edges, entries they store) that eliminating `i` would create now."""
        new = entries = 0
        succ = state.succ
        outs = list(state.succ[i].items())
        for u, b in state.pred[i].items():
            su = succ[u]
            for w, a in outs:
                if w not in su:
                    c = self._product(a, b)[0]
                    if not self._zero[c]:
                        new += 1
                        entries += self._written[c]
        return new, entries

    # -- whole orders -----------------------------------------------------------

    def cost(self, order: Iterable[int], state: State | None = None) -> Cost:
        """The cost of eliminating `order` (graph vertex ids) from `state` or the start.

        `state` is not modified.
        """
        cost = self.cost_until(order, None, state)
        assert cost is not None
        return cost

    def cost_until(
        self,
        order: Iterable[int],
        stop: Callable[[Cost], bool] | None,
        state: State | None = None,
    ) -> Cost | None:
        """[`Simulator.cost`][], or `None` as soon as `stop` (if given) is true of the
        cost so far (for a `stop` that stays true as costs grow, the cost of the whole
        order would satisfy it too)."""
        state = self.start() if state is None else state.copy()
        index = self.index
        total = (0,) * len(dataclasses.fields(Cost))
        for v in order:
            step = self.eliminate(state, index[v])
            total = tuple(t + s for t, s in zip(total, step, strict=True))
            if stop is not None and stop(Cost(*total)):
                return None
        return Cost(*total)

    def muls(self, order: Sequence[int], state: State | None = None) -> int:
        """Multiplications of `order` (internal indices), the search's hot path.

        The same elimination as [`Simulator.eliminate`][], counting products only.
        `state` (default: the start) is consumed.
        """
        if state is None:
            state = self._initial.owned_copy()
        pred, succ = state.pred, state.succ
        prod, sums, zero = self._prod, self._sum, self._zero
        total = 0
        for i in order:
            ins = pred[i]
            outs = succ[i]
            _detach(state, i, ins, outs)
            outs_items = list(outs.items())
            for u, b in ins.items():
                su = succ[u]
                for w, a in outs_items:
                    try:
                        c, m = prod[a * _SHIFT + b]
                    except KeyError:
                        c, m = self._product(a, b)
                    total += m
                    if zero[c]:
                        continue
                    old = su.get(w)
                    if old is not None:
                        try:
                            c = sums[old * _SHIFT + c][0]
                        except KeyError:
                            c = self._add(old, c)[0]
                    su[w] = c
                    pred[w][u] = c
        state.remaining.difference_update(order)
        return total

    def per_vertex(self, order: Sequence[int]) -> tuple[int, int, list[int]]:
        """(multiplications, additions, multiplications per vertex) like `count_ops`."""
        state = self.start()
        muls = adds = 0
        per = []
        for v in order:
            m, a, *_ = self.eliminate(state, self.index[v])
            muls += m
            adds += a
            per.append(m)
        return muls, adds, per
