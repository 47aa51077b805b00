"""Elimination orders: forward, reverse, Markowitz, automatic, and validation."""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _jax_private as jp
from ._graph import EdgeGraph
from ._simulator import Cost, Simulator, State


_ALIASES = {
    "fwd": "fwd",
    "forward": "fwd",
    "rev": "rev",
    "reverse": "rev",
    "markowitz": "markowitz",
    "relative_markowitz": "relative_markowitz",
    "min_fill": "min_fill",
    "auto": "auto",
}
ORDER_NAMES = tuple(_ALIASES)


@dataclasses.dataclass(frozen=True)
class Order(Sequence[int]):
    """An explicit elimination order tied to the graph it was made for.

    Returned by [`graphax_eqx.search_order`][] (as `result.order`) and
    [`graphax_eqx.load_order`][]. Pass it as `jacve(..., order=order)`: it behaves as
    its vertex ids, and `jacve` first checks that the function's graph has the same
    fingerprint, raising a `ValueError` if the function changed since the order was
    made. `tuple(order)` (or `order.ids`) gives the plain ids, which skip that check.
    """

    ids: tuple[int, ...]
    fingerprint: str

    def __iter__(self):
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):  # pyright: ignore[reportIncompatibleMethodOverride]
        # Sequence's overloads (int -> int, slice -> Sequence) hold: ids is a tuple.
        return self.ids[i]

    def __repr__(self) -> str:
        return f"Order({len(self.ids)} vertices, fingerprint={self.fingerprint[:12]})"


def _pattern_digest(pattern) -> str:
    rows = getattr(pattern, "rows", None)
    if rows is None:
        return repr(pattern)
    cols = pattern.cols
    arrays = hashlib.sha256(
        np.ascontiguousarray(rows, np.int64).tobytes()
        + b"|"
        + np.ascontiguousarray(cols, np.int64).tobytes()
    ).hexdigest()
    return repr(
        (
            type(pattern).__name__,
            pattern.out_shape,
            pattern.in_shape,
            pattern.ties,
            pattern.varying,
            arrays,
        )
    )


def graph_fingerprint(sim_graph: EdgeGraph, structure) -> str:
    """A digest of the graph's vertices (with their shapes and dtypes), primitives,
    edges and partial patterns.

    Equal for equal programs in any process (no Python `hash`, which is salted).
    """
    h = hashlib.sha256()
    h.update(repr((structure.inputs, structure.intermediates)).encode())
    h.update(repr(tuple(o for o in structure.outputs if o is not None)).encode())
    for v in sorted(structure.shape_of):
        dtype = structure.dtype_of.get(v)
        h.update(f"{v}:{structure.shape_of[v]}:{jnp.dtype(dtype).name};".encode())
    for v in structure.intermediates:
        h.update(f"{v}:{structure.primitive_of.get(v)}".encode())
    for u in sorted(sim_graph.succ):
        for w in sorted(sim_graph.succ[u]):
            e = sim_graph.succ[u][w]
            h.update(f"{u}>{w}:{e.has_val}:{_pattern_digest(e.pattern)};".encode())
    return h.hexdigest()


def normalise_order(order, api: str = "jacve"):
    """Check an `order` argument early; returns a canonical name or a tuple of ids.

    Names are case-insensitive. `api` names the function in error messages.
    """
    if isinstance(order, Order):
        return order
    if isinstance(getattr(order, "order", None), Order):  # a `search_order` result
        return order.order
    if isinstance(order, str):
        name = _ALIASES.get(order.lower())
        if name is None:
            raise ValueError(
                f"`{api}` got `order={order!r}`, which is not a known order. Use "
                f"one of {', '.join(repr(n) for n in ORDER_NAMES)}, or a sequence "
                "of vertex ids "
                "(see `graphax_eqx.make_graph`)."
            )
        return name
    if isinstance(order, jax.Array) and not isinstance(order, jp.Tracer):
        order = np.asarray(order)  # concrete ids, as a NumPy array would hold them
    if isinstance(order, (set, frozenset, dict, bytes, bytearray)) or not isinstance(
        order, (Sequence, np.ndarray)
    ):
        kind = type(order).__name__
        raise TypeError(
            f"`{api}` got `order` of type {kind}, which "
            + (
                "has no order of its own. "
                if isinstance(order, (set, frozenset, dict))
                else "is not a sequence. "
            )
            + "Pass a string such as 'rev' or a list or tuple of vertex ids in "
            "elimination order (see `graphax_eqx.make_graph`)."
        )
    if isinstance(order, np.ndarray) and order.ndim != 1:
        raise TypeError(
            f"`{api}` got an explicit order of shape {order.shape}; pass a flat "
            "sequence of vertex ids in elimination order (see "
            "`graphax_eqx.make_graph`)."
        )
    ids = tuple(order.tolist()) if isinstance(order, np.ndarray) else tuple(order)
    bad = [i for i in ids if isinstance(i, bool) or not _is_int(i)]
    if bad:
        raise TypeError(
            f"`{api}` got an explicit order with non-integer entries {bad!r}; vertex "
            "ids are Python ints as listed by `graphax_eqx.make_graph`."
        )
    return tuple(int(i) for i in ids)


def _is_int(x) -> bool:
    try:
        return int(x) == x and not isinstance(x, float)
    except (TypeError, ValueError):
        return False


def complete(order: tuple[int, ...], structure) -> tuple[int, ...]:
    """`order` with unlisted output-producing vertices appended, in ascending order.

    Orders written for the original graphax (and AlphaGrad's published orders) do not
    list the vertices whose values are outputs; those are eliminated last.
    """
    listed = set(order)
    producers = sorted(
        v for v in set(structure.output_sources.values()) if v > 0 and v not in listed
    )
    return tuple(order) + tuple(producers)


def validate(
    order: tuple[int, ...],
    intermediates: Sequence[int],
    outputs,
    inputs,
    api: str = "jacve",
):
    """Raise a `ValueError` naming what is wrong with an explicit order (`api` names
    the function in the message)."""
    expected = set(intermediates)
    seen, duplicates = set(), []
    for v in order:
        if v in seen and v not in duplicates:
            duplicates.append(v)
        seen.add(v)
    outputs = [o for o in outputs if o is not None]
    output_ids = sorted(v for v in seen if v in set(outputs))
    input_ids = sorted(v for v in seen if v in set(inputs))
    unknown = sorted(
        v
        for v in seen
        if v not in expected and v not in set(outputs) and v not in set(inputs)
    )
    missing = sorted(expected - seen)
    problems = []
    if missing:
        problems.append(f"missing vertices {missing}")
    if duplicates:
        problems.append(f"duplicate vertices {sorted(duplicates)}")
    if unknown:
        problems.append(f"unknown vertices {unknown}")
    if output_ids:
        problems.append(f"output vertices {output_ids} (outputs cannot be eliminated)")
    if input_ids:
        problems.append(f"input vertices {input_ids} (inputs cannot be eliminated)")
    if problems:
        lo, hi = (min(expected), max(expected)) if expected else (None, None)
        span = f"the ids {lo}..{hi}" if expected else "no ids (the graph has none)"
        raise ValueError(
            f"`{api}` got an invalid elimination order: "
            + "; ".join(problems)
            + f". An explicit order must list each intermediate vertex exactly once: "
            f"here {span} (vertices that produce an output may be left out; they are "
            "eliminated last). `graphax_eqx.make_graph(fun)(*args)` shows them."
        )


#
# Greedy heuristics. Each one repeatedly eliminates the remaining vertex with the
# smallest score, recomputing the scores of the neighbours of the vertex just
# eliminated (only their edges changed). Ties go to the lowest vertex id.
#

Score = Callable[[Simulator, State, int], Any]


def _markowitz_score(sim: Simulator, state: State, i: int):
    return sim.vertex_muls(state, i)


def _relative_markowitz_score(sim: Simulator, state: State, i: int):
    removed = len(state.pred[i]) + len(state.succ[i])
    return sim.vertex_muls(state, i) / max(removed, 1)


def _min_fill_score(sim: Simulator, state: State, i: int):
    new, entries = sim.vertex_fill(state, i)
    return (entries, new, sim.vertex_muls(state, i))


# One elimination of a named order: the vertex id and what `Simulator.eliminate`
# returned for it.
Step = tuple[int, tuple[int, ...]]


def greedy(sim: Simulator, score: Score, state: State | None = None) -> list[int]:
    """The greedy order of `score` from `state` (default: the start), as vertex ids."""
    state = sim.start() if state is None else state
    return [v for v, _ in _greedy_steps(sim, score, state)]


def _greedy_steps(sim: Simulator, score: Score, state: State) -> Iterator[Step]:
    version = dict.fromkeys(state.remaining, 0)
    heap = [(score(sim, state, i), i, 0) for i in state.remaining]
    heapq.heapify(heap)
    while heap:
        _, i, ver = heapq.heappop(heap)
        if i not in state.remaining or ver != version[i]:
            continue
        neighbours = (state.pred[i].keys() | state.succ[i].keys()) & state.remaining
        costs = sim.eliminate(state, i)
        yield sim.vertices[i], costs
        for n in neighbours:
            version[n] += 1
            heapq.heappush(heap, (score(sim, state, n), n, version[n]))


def safe_preeliminations(sim: Simulator, state: State) -> list[int]:
    """Eliminate, in place, the vertices whose elimination is safe; returns their ids.

    A vertex with one predecessor and one successor (a link in a chain) merges two
    edges into one and adds no edge. It is taken when the merged partial stores no
    more entries than the larger of the two (so diagonal chains stay diagonal, while a
    dense outer product is left for the order to decide). Repeats until no such vertex
    is left.

    With scalar or diagonal partials every order pays the same for such a merge. With
    matrices it need not: a chain of products costs what its bracketing costs, and
    merging two dense partials first can cost more multiplications than carrying a
    smaller partial through each of them later (the MLP's `W2 W1`). Refusing merges
    that cost more multiplications than the smaller partial stores was measured and
    not kept: it saves multiplications on the MLP and the transformer but gives
    RandomWide an order that runs slower than reverse mode (`benchmarks/NOTES.md`).
    """
    return [v for v, _ in _preelimination_steps(sim, state)]


def _preelimination_steps(sim: Simulator, state: State) -> Iterator[Step]:
    changed = True
    while changed:
        changed = False
        for i in sorted(state.remaining):
            ins, outs = state.pred[i], state.succ[i]
            if len(ins) != 1 or len(outs) != 1:
                continue
            b, a = next(iter(ins.values())), next(iter(outs.values()))
            c = sim.product_id(a, b)
            if sim.stored(c) > max(sim.stored(a), sim.stored(b)):
                continue
            yield sim.vertices[i], sim.eliminate(state, i)
            changed = True


def markowitz(sim: Simulator) -> list[int]:
    """Lowest Markowitz cost first: the vertex whose elimination costs the fewest
    multiplications now."""
    return [v for v, _ in _markowitz_steps(sim)]


def relative_markowitz(sim: Simulator) -> list[int]:
    """Safe pre-eliminations, then lowest relative Markowitz cost first.

    The relative cost is the multiplications eliminating the vertex costs now, divided
    by the number of edges the elimination removes (its predecessors plus successors).
    Plain Markowitz keeps postponing well-connected vertices, whose cost then grows
    with every neighbour eliminated; dividing by the degree eliminates them earlier.
    """
    return [v for v, _ in _relative_markowitz_steps(sim)]


def min_fill(sim: Simulator) -> list[int]:
    """Safe pre-eliminations, then lowest fill-in first.

    Eliminates the vertex whose elimination creates the fewest new stored entries
    (edges that did not exist before, counted by the entries their partials store);
    ties go to fewer new edges, then to fewer multiplications. Keeping the graph
    sparse keeps later eliminations cheap and the program's memory small.
    """
    return [v for v, _ in _min_fill_steps(sim)]


def _markowitz_steps(sim: Simulator) -> Iterator[Step]:
    return _greedy_steps(sim, _markowitz_score, sim.start())


def _relative_markowitz_steps(sim: Simulator) -> Iterator[Step]:
    state = sim.start()
    yield from _preelimination_steps(sim, state)
    yield from _greedy_steps(sim, _relative_markowitz_score, state)


def _min_fill_steps(sim: Simulator) -> Iterator[Step]:
    state = sim.start()
    yield from _preelimination_steps(sim, state)
    yield from _greedy_steps(sim, _min_fill_score, state)


def _plain_steps(sim: Simulator, order: Sequence[int]) -> Iterator[Step]:
    state = sim.start()
    for v in order:
        yield v, sim.eliminate(state, sim.index[v])


HEURISTICS: dict[str, Callable[[Simulator], list[int]]] = {
    "markowitz": markowitz,
    "relative_markowitz": relative_markowitz,
    "min_fill": min_fill,
}
_HEURISTIC_STEPS: dict[str, Callable[[Simulator], Iterator[Step]]] = {
    "markowitz": _markowitz_steps,
    "relative_markowitz": _relative_markowitz_steps,
    "min_fill": _min_fill_steps,
}


def resolve(
    name_or_ids,
    sim_graph: EdgeGraph,
    structure,
    api: str = "jacve",
    abstract_fingerprint: Callable[[], str] | None = None,
) -> list[int]:
    """The explicit vertex order for an order argument (`api` names the function in
    error messages). `abstract_fingerprint` gives the fingerprint of the graph built
    abstractly, as `search_order` builds it, where `sim_graph` was built from
    values of the differentiated inputs (indices from an `argsort`, read by value
    in an eager call): an `Order` made for either graph is accepted."""
    inter = list(structure.intermediates)
    if isinstance(name_or_ids, Order):
        found = graph_fingerprint(sim_graph, structure)
        if found != name_or_ids.fingerprint and (
            abstract_fingerprint is None
            or abstract_fingerprint() != name_or_ids.fingerprint
        ):
            raise ValueError(
                f"`{api}` got an order made for a different computational graph "
                f"(the order's fingerprint is {name_or_ids.fingerprint[:12]}, this "
                f"function's graph has {found[:12]}). The function, its argument "
                "shapes or dtypes, or `argnums` changed since the order was searched, "
                "or values "
                "that shape the graph (indices computed from an integer argument) "
                "were constants then and are traced now, under `jax.jit`, or the "
                "other way round. Search again on the function as you call it, or "
                "pass `tuple(order)` to use the vertex ids anyway (they are still "
                "validated)."
            )
        name_or_ids = name_or_ids.ids
    if isinstance(name_or_ids, tuple):
        ids = complete(name_or_ids, structure)
        validate(ids, inter, structure.outputs, structure.inputs, api)
        return list(ids)
    if name_or_ids == "fwd":
        return inter
    if name_or_ids == "rev":
        return inter[::-1]
    sim = Simulator(sim_graph, inter)
    if name_or_ids in HEURISTICS:
        return HEURISTICS[name_or_ids](sim)
    assert name_or_ids == "auto"
    return auto(sim)


def candidates(sim: Simulator) -> dict[str, list[int]]:
    """The named orders `auto` chooses from."""
    inter = list(sim.intermediates)
    out = {"fwd": inter, "rev": inter[::-1]}
    for name, heuristic in HEURISTICS.items():
        out[name] = heuristic(sim)
    return out


# The run-time model: a weighted sum of what the simulator counts, in units of one
# multiplication of a broadcast product (an elementwise product of two partials,
# limited by the memory it writes). The weights of multiplications, additions,
# entries written and products were fitted by `python -m benchmarks.orders --fit` to
# the measured run times of every named order on the benchmark suite (see
# `docs/orders.md`); beyond multiplications, none improved the fit. The suite's
# programs are scalar functions batched by `jax.vmap`, so three kinds of work are
# rare there, and their weights come from `python -m benchmarks.models` instead
# (every named order of an 8-head attention layer and a transformer block, whose
# run times they rank as measured; see `benchmarks/NOTES.md`):
#
# - a multiplication over coordinates, both factors gathered entry pair by entry
#   pair, costs `GATHERED_COST` (a random access each, where a broadcast product
#   streams);
# - a multiplication of a large contraction (a matrix product of at least
#   `_sparse.MIN_CONTRACTED_MULS` multiplications) beyond the first per result entry
#   costs `1 / CONTRACTION_SPEEDUP`: the matrix product reuses what it loads;
# - an entry a sum of coordinate partials gathers into a result stored densely costs
#   `SPREAD_COST`;
# - a multiplication over coordinates against a full block, whose rows are gathered
#   whole (`_indexed.RowsPlan`), costs `ROWS_COST`.
#
# Every entry a product or sum writes costs `TRAFFIC_COST` on top. The fit gives it
# no weight, but the suite's TransformerEncoder needs it: its reverse and min fill
# orders multiply about as much (40,160 and 39,362), and XLA reports 59 MB accessed
# against 46 MB for the same flops; min fill, writing 16,484 entries against
# 30,848, runs 1.4x faster. `TRAFFIC_COST` is the smallest quarter step that ranks
# the two as measured past `AUTO_MARGIN`; it changes no other pick on the suites
# beyond noise (see `benchmarks/NOTES.md`).
#
# Under `jax.vmap` every entry is a row of the batch, so a gathered multiplication
# gathers rows and costs less; the picks on the benchmark suite, the sparse suite and
# the training steps are the same with `GATHERED_COST` 8 as with 32.
GATHERED_COST = 32.0
CONTRACTION_SPEEDUP = 16.0
SPREAD_COST = 8.0
ROWS_COST = 8.0
TRAFFIC_COST = 0.75

TIME_WEIGHTS = {
    "muls": 1.0,
    "adds": 0.0,
    "traffic": TRAFFIC_COST,
    "products": 0.0,
    "gathered": GATHERED_COST - 1.0,
    "contracted": 1.0 / CONTRACTION_SPEEDUP - 1.0,
    "spread": SPREAD_COST,
    "by_rows": ROWS_COST - 1.0,
}

# `auto` leaves forward/reverse mode for a heuristic order only when the model
# predicts this much saving: smaller savings were within noise or lost to XLA's
# recomputation of shared partials (RobotArm_6DOF: 8% fewer multiplications than
# reverse mode, 10-20% slower; SpringNetwork's min fill, when it counted 10% fewer,
# 10-15% slower; RoeFlux_1d's min fill: 13% fewer, within 3%). See
# `benchmarks/NOTES.md`.
AUTO_MARGIN = 0.15


# On a vectorised batch of small blocks (`graphax_eqx._indexed.densify_small_blocks`),
# XLA CPU fuses most of an elimination into the kernels that write the Jacobian's
# blocks and computes each of their entries apart. An entry of forward mode's result
# computes the tangents of its input component (1 / n_in of the products), an entry
# of reverse mode's the cotangents of its output component (1 / n_out), and there
# are n_in * n_out entries per batch entry: forward mode costs its products times
# n_out, reverse mode its products times n_in. Even so, reverse mode ran 1.2-2.1x
# slower than forward mode on ten of the eleven programs of `python -m
# benchmarks.batched` (the robot arm's, predicted 9% cheaper, 1.8x slower), so it is
# picked only when predicted `BATCHED_REV_MARGIN` cheaper; by products alone, `auto`
# took it on eight of the eleven. The eleventh, a double pendulum's right-hand side,
# ran reverse mode 1.3x faster, which no count foresees. Functions of 12 to 24
# columns summed into one or two outputs, where the scaled predictions tie, ran both
# modes within noise of each other (`benchmarks/NOTES.md`).
BATCHED_REV_MARGIN = 0.25


def plain_weights(sim: Simulator) -> dict[str, float]:
    """The factors `auto` scales the predicted times of fwd and rev by."""
    if sim.block_sizes is None:
        return {"fwd": 1.0, "rev": 1.0}
    n_in, n_out = sim.block_sizes
    return {"fwd": float(n_out), "rev": n_in / (1.0 - BATCHED_REV_MARGIN)}


def predicted_time(cost) -> float:
    """The run-time model's estimate for a [`graphax_eqx._simulator.Cost`][]."""
    w = TIME_WEIGHTS
    return (
        w["muls"] * cost.muls
        + w["adds"] * cost.adds
        + w["traffic"] * cost.traffic
        + w["products"] * cost.products
        + w["gathered"] * cost.gathered
        + w["contracted"] * cost.contracted
        + w["spread"] * cost.spread
        + w["by_rows"] * cost.by_rows
    )


def auto(sim: Simulator) -> list[int]:
    """The best of fwd and rev, unless a heuristic is predicted clearly faster.

    Orders are ranked by the run-time model, ties broken by the estimated memory
    traffic (additions plus entries written). A heuristic order wins only where it is
    predicted at least `AUTO_MARGIN` cheaper than the better of fwd and rev.

    The candidates are built and costed side by side, one elimination at a time,
    always advancing the one predicted cheapest so far (a heuristic's cost divided by
    `1 - AUTO_MARGIN`, the factor it must win by). Costs only grow along an order, so
    a candidate is dropped as soon as its cost so far shows it cannot be picked:
    simulating an order far costlier than the winner in full (forward mode through ten
    banded time steps, Markowitz on a training step whose loss reverse mode handles
    cheaply) is most of the time `auto` would take. The pick is the one full
    simulations of every candidate give.

    On a vectorised batch of small blocks (`graphax_eqx._indexed.
    densify_small_blocks`) only fwd and rev compete: they apply the batch's index
    maps by selection, where other orders carry masks of every structural zero and
    run 1.0–1.6× slower than the faster plain order there (benchmarks/NOTES.md).
    Their predicted times are scaled as XLA computes such Jacobians
    (`plain_weights`).
    """
    plain_names = ("fwd", "rev")
    inter = list(sim.intermediates)
    runs: dict[str, Iterator[Step]] = {
        "fwd": _plain_steps(sim, inter),
        "rev": _plain_steps(sim, inter[::-1]),
    }
    for name, steps in _HEURISTIC_STEPS.items():
        if not sim.densified:
            runs[name] = steps(sim)
    rank = {name: k for k, name in enumerate(runs)}
    totals: dict[str, tuple[int, ...]] = dict.fromkeys(
        runs, (0,) * len(dataclasses.fields(Cost))
    )
    orders: dict[str, list[int]] = {name: [] for name in runs}
    done: dict[str, tuple[float, int]] = {}
    alive = set(runs)
    keep = 1.0 - AUTO_MARGIN
    weights = plain_weights(sim)

    def key(name: str) -> tuple[float, int]:
        c = Cost(*totals[name])
        return predicted_time(c) * weights.get(name, 1.0), c.adds + c.traffic

    def pace(name: str) -> tuple[float, int]:
        time = key(name)[0]
        return (time if name in plain_names else time / keep), rank[name]

    def hopeless(name: str) -> bool:
        # Whether `name`, whose cost so far is `key(name)` and can only grow, cannot
        # be what the full comparison at the end of `auto` picks.
        k = key(name)
        if name in plain_names:
            # Not the better plain order; or so slow that a finished heuristic wins
            # against it, and then the best heuristic is picked whatever it costs.
            return any(
                k > done[p] for p in plain_names if p in done and p != name
            ) or any(k[0] > done[h][0] / keep for h in HEURISTICS if h in done)
        # Not within the margin of a finished plain order; or beaten by a finished
        # heuristic.
        return any(k[0] > keep * done[p][0] for p in plain_names if p in done) or any(
            k > done[h] for h in HEURISTICS if h in done
        )

    while alive:
        name = min(alive, key=pace)
        step = next(runs[name], None)
        if step is None:
            alive.discard(name)
            done[name] = key(name)
            alive -= {other for other in alive if hopeless(other)}
            continue
        vertex, costs = step
        orders[name].append(vertex)
        totals[name] = tuple(a + b for a, b in zip(totals[name], costs, strict=True))
        if hopeless(name):
            alive.discard(name)

    plain = [p for p in plain_names if p in done]
    heuristics = [h for h in HEURISTICS if h in done]
    if not plain:
        return orders[min(heuristics, key=done.__getitem__)]
    best = min(plain, key=done.__getitem__)
    best_key = done[best]
    threshold = keep * best_key[0]
    for name in heuristics:
        if done[name][0] <= threshold and done[name] < best_key:
            best_key, best = done[name], name
    return orders[best]
