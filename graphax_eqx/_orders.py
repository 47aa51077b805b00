"""Elimination orders: forward, reverse, Markowitz, automatic, and validation."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from ._eliminate import (
    eliminate_vertex,
    estimated_cost,
    sim_add,
    sim_product,
    vertex_cost,
)
from ._graph import EdgeGraph


_ALIASES = {
    "fwd": "fwd",
    "forward": "fwd",
    "rev": "rev",
    "reverse": "rev",
    "markowitz": "markowitz",
    "auto": "auto",
}
ORDER_NAMES = tuple(_ALIASES)


def normalise_order(order, api: str = "jacve"):
    """Check an `order` argument early; returns a canonical name or a tuple of ids.

    Names are case-insensitive. `api` names the function in error messages.
    """
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
    if isinstance(order, (set, frozenset, dict)) or not isinstance(
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
    ids = (
        tuple(np.asarray(order).reshape(-1).tolist())
        if isinstance(order, np.ndarray)
        else tuple(order)
    )
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


def validate(order: tuple[int, ...], intermediates: Sequence[int], outputs, inputs):
    """Raise a `ValueError` naming what is wrong with an explicit order."""
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
            "`jacve` got an invalid elimination order: "
            + "; ".join(problems)
            + f". An explicit order must list each intermediate vertex exactly once: "
            f"here {span} (vertices that produce an output may be left out; they are "
            "eliminated last). `graphax_eqx.make_graph(fun)(*args)` shows them."
        )


def markowitz(graph: EdgeGraph, intermediates: Sequence[int]) -> list[int]:
    """Greedy order: eliminate the currently cheapest vertex (ties: lowest id)."""
    g = graph.copy_with(lambda e: e)
    remaining = set(intermediates)
    version = dict.fromkeys(remaining, 0)
    heap = [(vertex_cost(g, v), v, 0) for v in remaining]
    heapq.heapify(heap)
    order = []
    while heap:
        cost, v, ver = heapq.heappop(heap)
        if v not in remaining or ver != version[v]:
            continue
        neighbours = (set(g.pred[v]) | set(g.succ[v])) & remaining
        eliminate_vertex(g, v, sim_product, sim_add)
        remaining.discard(v)
        order.append(v)
        for n in neighbours - {v}:
            version[n] += 1
            heapq.heappush(heap, (vertex_cost(g, n), n, version[n]))
    return order


def resolve(name_or_ids, sim_graph: EdgeGraph, structure) -> list[int]:
    """The explicit vertex order for an order argument."""
    inter = list(structure.intermediates)
    if isinstance(name_or_ids, tuple):
        ids = complete(name_or_ids, structure)
        validate(ids, inter, structure.outputs, structure.inputs)
        return list(ids)
    if name_or_ids == "fwd":
        return inter
    if name_or_ids == "rev":
        return inter[::-1]
    if name_or_ids == "markowitz":
        return markowitz(sim_graph, inter)
    assert name_or_ids == "auto"
    # Fewest multiplications; among equals, the least estimated memory traffic.
    candidates = [inter, inter[::-1], markowitz(sim_graph, inter)]
    keys = [estimated_cost(sim_graph, c) for c in candidates]
    return candidates[keys.index(min(keys))]
