"""Order search and order costs: `elimination_cost`, `search_order`, `load_order`."""

from __future__ import annotations

import dataclasses
import datetime
import heapq
import itertools
import json
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ._bound import scalar_lower_bound
from ._eliminate import sim_edge
from ._graph import EdgeGraph, Structure
from ._jacve import _normalise_argnums, abstract_graph, jacve
from ._orders import (
    Order,
    candidates,
    graph_fingerprint,
    greedy,
    normalise_order,
    predicted_time,
    resolve,
    safe_preeliminations,
)
from ._simulator import Cost, Simulator, State


_FORMAT = "graphax_eqx.order"
_FORMAT_VERSION = 1
OBJECTIVES = ("muls", "time")


@dataclasses.dataclass
class _Patterns:
    graph: EdgeGraph
    structure: Structure
    graph_adds: int
    fingerprint: str


def _patterns(fun, argnums, has_aux, args, kwargs, name) -> _Patterns:
    """The pattern graph of `fun` at `args`, built abstractly (no FLOPs)."""
    argnums_t, _ = _normalise_argnums(argnums, name)
    structure, graph, adds = abstract_graph(fun, args, kwargs, argnums_t, has_aux, name)
    graph = graph.copy_with(sim_edge)
    return _Patterns(graph, structure, adds, graph_fingerprint(graph, structure))


#
# Costs of one order.
#


@dataclasses.dataclass(frozen=True)
class EliminationCost:
    """The cost of one elimination order, computed from the graph's structure alone.

    **Attributes:**

    - `order`: the vertex ids, in elimination order (an [`graphax_eqx.Order`][]).
    - `num_muls`, `num_adds`: exactly what `jacve(..., count_ops=True)` reports.
    - `order_counts`: multiplications per eliminated vertex.
    - `traffic`: entries written by the elimination's products and sums (a measure of
        memory traffic).
    - `products`: products emitted (operations before XLA fuses them).
    - `fill`: edges the elimination created that the graph did not have.
    - `gathered`: multiplications (of `num_muls`) made entry pair by entry pair over
        coordinates, gathering both factors (see `docs/orders.md`).
    - `contracted`: multiplications (of `num_muls`) beyond one per result entry of
        products run as contractions (matrix products).
    - `spread`: entries sums of coordinate partials gather into results stored
        densely (mostly zeros; see `docs/orders.md`).
    - `by_rows`: multiplications (of `num_muls`) made over coordinates against a
        full block, whose rows are gathered whole (see `docs/orders.md`).
    - `predicted_time`: the run-time model's estimate in arbitrary units (see
        `docs/orders.md`), comparable between orders of one function only.
    """

    order: Order
    num_muls: int
    num_adds: int
    order_counts: tuple[int, ...]
    traffic: int
    products: int
    fill: int
    gathered: int
    contracted: int
    spread: int
    by_rows: int
    predicted_time: float


def _full_cost(sim: Simulator, ids: Sequence[int], graph_adds: int, fp: str):
    state = sim.start()
    total = (0,) * len(dataclasses.fields(Cost))
    per = []
    for v in ids:
        step = sim.eliminate(state, sim.index[v])
        total = tuple(t + s for t, s in zip(total, step, strict=True))
        per.append(step[0])
    cost = Cost(*total)
    return EliminationCost(
        Order(tuple(int(v) for v in ids), fp),
        cost.muls,
        cost.adds + graph_adds,
        tuple(per),
        cost.traffic,
        cost.products,
        cost.fill,
        cost.gathered,
        cost.contracted,
        cost.spread,
        cost.by_rows,
        predicted_time(cost),
    )


def elimination_cost(
    fun: Callable,
    order: str | Sequence[int] = "auto",
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., EliminationCost]:
    """What eliminating `fun`'s graph in `order` costs, without running any FLOPs.

    The graph is built abstractly (`jax.eval_shape`) and the order is simulated on
    the partials' sparsity patterns alone, with the same plans the engine runs.
    Arguments not in `argnums` are read by value, as an eager call of `jacve` reads
    them (an integer array of indices gives fixed index maps), and values computed
    from the differentiated arguments are abstract, as under `jax.jit`. So the counts
    equal those of `jax.jit(jacve(fun, order, argnums, count_ops=True))` where the
    arguments not differentiated are closed over rather than passed through `jit`,
    and an eager call can count fewer where indices are computed from the
    differentiated input (an `argsort`): it reads them as fixed index maps.

    **Arguments:**

    - `fun`, `argnums`, `has_aux`: as for [`graphax_eqx.jacve`][].
    - `order`: any order `jacve` accepts, including an [`graphax_eqx.Order`][].

    **Returns:**

    A function taking `fun`'s arguments and returning an
    [`graphax_eqx.EliminationCost`][].

    Example:

    ```python
    import jax.numpy as jnp
    import graphax_eqx as gx

    f = lambda x: jnp.sin(x) * jnp.sum(x**2)
    cost = gx.elimination_cost(f, order="rev")(jnp.ones(4))
    assert cost.num_muls == gx.jacve(f, order="rev", count_ops=True)(jnp.ones(4))[1][
        "num_muls"
    ]
    ```
    """
    if not callable(fun):
        raise TypeError(
            f"`elimination_cost` expects a callable, got {type(fun).__name__}."
        )
    spec = normalise_order(order, "elimination_cost")

    def cost(*args, **kwargs) -> EliminationCost:
        pat = _patterns(fun, argnums, has_aux, args, kwargs, "elimination_cost")
        ids = resolve(spec, pat.graph, pat.structure, "elimination_cost")
        sim = Simulator(pat.graph, pat.structure.intermediates)
        return _full_cost(sim, ids, pat.graph_adds, pat.fingerprint)

    return cost


#
# The search.
#


class _Objective:
    """Scores orders of internal vertex indices, replaying from checkpoints.

    The current order's states are saved every `block` eliminations, so a candidate
    that differs from it only from position `p` on replays only from the checkpoint
    at or before `p`. The graph left after eliminating a set of vertices does not
    depend on the order they were eliminated in (an edge `u → w` is the sum over the
    paths from `u` to `w` through the set). So when a candidate differs from the
    current order only in positions `p..q`, a permutation of the same vertices, its
    replay stops at the first checkpoint past `q` whose state equals the current
    one's, and the rest of its cost is the current order's: moves that change a few
    nearby positions cost a few eliminations. The states are compared, not assumed
    equal, so scores stay exact even where a pattern depends on the order (a product
    stored densely past a size threshold, say).
    """

    def __init__(self, sim: Simulator, objective: str, block: int = 8):
        self.sim = sim
        self.objective = objective
        self.block = block
        self.evaluations = 0
        self.current: list[int] = []
        self.checkpoints: list[tuple[State, Any]] = []
        self.total: Any = None
        self.value = math.inf

    def _run(self, order: Sequence[int], state: State, acc):
        sim = self.sim
        if self.objective == "muls":
            return acc + sim.muls(order, state)
        for i in order:
            step = sim.eliminate(state, i)
            acc = tuple(a + s for a, s in zip(acc, step, strict=True))
        return acc

    def _zero(self):
        return 0 if self.objective == "muls" else (0,) * len(dataclasses.fields(Cost))

    def _shift(self, acc, new, old):
        """`acc + new - old`, for either kind of accumulator."""
        if self.objective == "muls":
            return acc + new - old
        return tuple(a + n - o for a, n, o in zip(acc, new, old, strict=True))

    def _score(self, acc) -> float:
        if self.objective == "muls":
            return float(acc)
        return predicted_time(Cost(*acc))

    def score(self, order: Sequence[int]) -> float:
        """Score a complete order from scratch."""
        self.evaluations += 1
        return self._score(self._run(order, self.sim.start(), self._zero()))

    def _replay(self, order: Sequence[int], p: int, q: int | None, keep: bool):
        """Replay `order` from the checkpoint at or before `p`. Returns the states and
        accumulators at each checkpoint position passed (when `keep`), the final
        accumulator, and the checkpoint index from which the current order's
        checkpoints still hold (`None` if the replay ran to the end)."""
        k = min(p // self.block, len(self.checkpoints) - 1)
        state, acc = self.checkpoints[k]
        state = state.copy()
        passed = []
        for pos in range(k * self.block, len(order), self.block):
            b = pos // self.block
            if pos > k * self.block:
                if (
                    q is not None
                    and pos > q
                    and b < len(self.checkpoints)
                    and state.succ == self.checkpoints[b][0].succ
                ):
                    old = self.checkpoints[b][1]
                    return passed, self._shift(self.total, acc, old), b
                if keep:
                    passed.append((state.copy(), acc))
            acc = self._run(order[pos : pos + self.block], state, acc)
        return passed, acc, None

    def set_current(
        self, order: list[int], start: int = 0, stop: int | None = None
    ) -> float:
        """Make `order` current, rebuilding checkpoints from position `start` on
        (`order` equals the current order outside positions `start..stop`, when
        `stop` is given)."""
        if not start or not self.checkpoints:
            state, acc = self.sim.start(), self._zero()
            self.checkpoints = []
            for pos in range(0, len(order), self.block):
                self.checkpoints.append((state.copy(), acc))
                acc = self._run(order[pos : pos + self.block], state, acc)
            if not self.checkpoints:
                self.checkpoints.append((state.copy(), acc))
            self.total = acc
        else:
            k = min(start // self.block, len(self.checkpoints) - 1)
            passed, total, b = self._replay(order, start, stop, keep=True)
            if b is None:
                self.checkpoints[k + 1 :] = passed
            else:
                # The checkpoints from `b` on hold the same states; their costs so
                # far move by the difference the changed positions made.
                shifted = [
                    (st, self._shift(a, total, self.total))
                    for st, a in self.checkpoints[b:]
                ]
                self.checkpoints[k + 1 :] = passed + shifted
            self.total = total
        self.current = list(order)
        self.value = self._score(self.total)
        return self.value

    def score_from(self, order: Sequence[int], p: int, q: int | None = None) -> float:
        """Score `order`, which equals the current order before position `p` (and,
        when `q` is given, after position `q`)."""
        self.evaluations += 1
        return self._score(self._replay(order, p, q, keep=False)[1])


def _noisy(score, rng: random.Random, noise: float):
    def noisy(sim, state, i):
        s = score(sim, state, i)
        key = s[0] if isinstance(s, tuple) else s
        return key * (1.0 + noise * rng.random()) + noise * rng.random()

    return noisy


@dataclasses.dataclass
class OrderSearch:
    """The result of [`graphax_eqx.search_order`][].

    **Attributes:**

    - `order`: the best order found (an [`graphax_eqx.Order`][]; pass it to
        `jacve(order=...)`).
    - `cost`: its [`graphax_eqx.EliminationCost`][].
    - `baselines`: the costs of the named orders (`"fwd"`, `"rev"`, `"markowitz"`,
        `"relative_markowitz"`, `"min_fill"`, `"auto"`), for comparison.
    - `objective`: `"muls"` or `"time"`.
    - `seed`, `evaluations` (orders scored), `elapsed_s` (search time, seconds).
    - `trace`: `(elapsed seconds, evaluations, best objective value)` at every
        improvement.
    - `measured`: with `measure=True`, the median run time in seconds of each timed
        candidate (`"searched"`, named orders, `"candidate k"`), else `None`.
    - `machine`: with `measure=True`, where the timings were taken (platform, device,
        versions), else `None`.
    - `exhaustive`: whether every order was scored (graphs with at most
        8 intermediate vertices, within the budget), so that `order` is optimal for the
        objective.
    - `lower_bound`: with `objective="muls"` on a graph of scalar partials, a number
        of multiplications no order can go below (see `docs/orders.md`), else `None`.
        The search stops as soon as it finds an order meeting it.
    - `chosen`: with `measure=True`, the label in `measured` of the order returned
        (the fastest: `"searched"`, a named order or `"candidate k"`), else `None`.
    """

    order: Order
    cost: EliminationCost
    baselines: dict[str, EliminationCost]
    objective: str
    seed: int
    evaluations: int
    elapsed_s: float
    trace: list[tuple[float, int, float]]
    measured: dict[str, float] | None = None
    machine: dict[str, str] | None = None
    exhaustive: bool = False
    lower_bound: int | None = None
    chosen: str | None = None

    @property
    def optimal(self) -> bool:
        """Whether `order` is proven optimal: every order was scored, or its
        multiplications meet `lower_bound`."""
        if self.exhaustive:
            return True
        return self.lower_bound is not None and self.cost.num_muls <= self.lower_bound

    @property
    def reduction(self) -> float:
        """Multiplications saved against the best of fwd, rev and markowitz (0..1)."""
        best = min(self.baselines[k].num_muls for k in ("fwd", "rev", "markowitz"))
        return 1.0 - self.cost.num_muls / best if best else 0.0

    def save(self, path: str | os.PathLike) -> None:
        """Write the order, its graph fingerprint and costs as JSON to `path`."""
        data = {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "fingerprint": self.order.fingerprint,
            "order": list(self.order.ids),
            "objective": self.objective,
            "seed": self.seed,
            "num_muls": self.cost.num_muls,
            "num_adds": self.cost.num_adds,
            "baselines": {k: v.num_muls for k, v in self.baselines.items()},
            "measured": self.measured,
            "chosen": self.chosen,
            "machine": self.machine,
            "created": datetime.datetime.now(datetime.UTC).isoformat(),
        }
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")

    def __str__(self) -> str:
        scored = f"{self.evaluations} orders scored"
        if self.exhaustive:
            scored = f"all {self.evaluations} orders scored (optimal)"
        elif self.optimal:
            scored = f"{scored} (optimal: meets the lower bound)"
        elif self.lower_bound is not None:
            scored = f"{scored} (no order needs fewer than {self.lower_bound})"
        if self.chosen in (None, "searched"):
            head = "searched order"
        else:
            head = f"order {self.chosen!r} (the fastest measured)"
        saved = self.reduction
        than = f"{saved:.1%} fewer" if saved >= 0 else f"{-saved:.1%} more"
        lines = [
            f"{head}: {self.cost.num_muls} multiplications "
            f"({than} than the best of fwd/rev/markowitz), "
            f"{scored} in {self.elapsed_s:.1f} s"
        ]
        for name, c in self.baselines.items():
            lines.append(f"  {name:<19} {c.num_muls}")
        if self.measured:
            for name, t in self.measured.items():
                mark = " (returned)" if name == self.chosen else ""
                lines.append(f"  time {name:<14} {t * 1e6:.1f} µs{mark}")
        return "\n".join(lines)


def load_order(path: str | os.PathLike) -> Order:
    """Read an order written by `OrderSearch.save`.

    **Returns:**

    An [`graphax_eqx.Order`][] for `jacve(order=...)`, which checks the graph
    fingerprint when used.
    """
    with open(path) as f:
        try:
            data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{os.fspath(path)!r} is not a saved order: {e}") from None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError(
            f"{os.fspath(path)!r} is not an order written by `OrderSearch.save`."
        )
    if data.get("version") != _FORMAT_VERSION:
        raise ValueError(
            f"{os.fspath(path)!r} has order format version {data.get('version')}; "
            f"this graphax_eqx reads version {_FORMAT_VERSION}."
        )
    try:
        ids = tuple(data["order"])
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in ids):
            raise ValueError("its order holds entries that are not vertex ids")
        fingerprint = data["fingerprint"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{os.fspath(path)!r} is not a complete saved order ({type(e).__name__}: "
            f"{e}); save it again with `OrderSearch.save`."
        ) from None
    if not isinstance(fingerprint, str):
        raise ValueError(
            f"{os.fspath(path)!r} is not a complete saved order: its fingerprint is "
            "not a string; save it again with `OrderSearch.save`."
        )
    return Order(ids, fingerprint)


def _machine() -> dict[str, str]:
    import equinox

    from . import __version__

    dev = jax.devices()[0]
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": str(os.cpu_count()),
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
        "python": platform.python_version(),
        "jax": jax.__version__,
        "equinox": equinox.__version__,
        "numpy": np.__version__,
        "graphax_eqx": __version__,
    }


def _time_candidates(
    fun, argnums, has_aux, args, kwargs, orders, sparse: bool, repeats_s=1.0
):
    """Median run time of `jax.jit(jacve(fun, order))` per order, interleaved."""
    fns = {}
    for label, order in orders.items():
        jac = jacve(
            fun,
            order=tuple(order),
            argnums=argnums,
            has_aux=has_aux,
            sparse_representation=sparse,
        )
        f = jax.jit(jac)
        jax.block_until_ready(f(*args, **kwargs))
        jax.block_until_ready(f(*args, **kwargs))
        fns[label] = f
    times: dict[str, list[float]] = {k: [] for k in fns}
    labels = list(fns)
    deadline = time.perf_counter() + repeats_s * len(fns)
    rep = 0
    while rep < 7 or (time.perf_counter() < deadline and rep < 200):
        for label in labels[rep % len(labels) :] + labels[: rep % len(labels)]:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[label](*args, **kwargs))
            times[label].append(time.perf_counter() - t0)
        rep += 1
    return {k: statistics.median(v) for k, v in times.items()}


def search_order(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    budget_s: float = 30.0,
    objective: str = "muls",
    seed: int = 0,
    progress: bool = True,
    measure: bool = False,
    sparse_representation: bool = False,
    max_evals: int | None = None,
) -> Callable[..., OrderSearch]:
    """Search for a cheap elimination order of `fun`'s graph.

    The search scores complete orders on the structural simulator (no FLOPs, the same
    counts as `count_ops=True`). It starts from the named heuristics, runs randomised
    greedy restarts (Markowitz, relative Markowitz and lowest fill-in with noisy
    scores) for the first fifth of the budget, then improves the best order by
    simulated annealing with swap and insert moves, replaying only the changed tail of
    an order. Graphs with at most 8 intermediate vertices are searched exhaustively
    instead (`OrderSearch.exhaustive`). See `docs/orders.md` for the workflow: search
    once, save, load.

    **Arguments:**

    - `fun`, `argnums`, `has_aux`: as for [`graphax_eqx.jacve`][].
    - `budget_s`: seconds to search for (the search stops at the first scored order
        past it). With `measure=True`, compiling and timing the candidates comes on
        top: about a second per candidate.
    - `objective`: `"muls"` (multiplications) or `"time"` (the calibrated run-time
        model, which weighs multiplications, additions, memory traffic and products).
    - `seed`: the random seed. The search is deterministic for a seed and a number of
        scored orders; pass `max_evals` (and a generous `budget_s`) to make it stop
        at the same point on any machine.
    - `progress`: show a progress bar with the best cost so far.
    - `measure`: with `objective="time"`, also compile and time the best few orders
        and every named order with `jax.jit` on the given arguments, and return the
        fastest. The result records the timings and the machine.
    - `sparse_representation`: with `measure=True`, time the Jacobian in this layout,
        as [`graphax_eqx.jacve`][] will return it. Pass `True` when you will use
        structured sparse results: writing a large dense Jacobian can take far
        longer than computing it and would hide the differences between orders.
    - `max_evals`: stop after this many scored orders. The named orders, which the
        result compares with, are scored first and count among them, so at least
        that many orders are scored.

    **Returns:**

    A function taking `fun`'s arguments and returning an
    [`graphax_eqx.OrderSearch`][].

    Example:

    ```python
    import jax.numpy as jnp
    import graphax_eqx as gx

    def f(x):
        y = jnp.sin(x[0] * x[1]) + jnp.cos(x[1] * x[2])
        return jnp.stack([y * x[0], y * x[2], jnp.exp(y)])

    found = gx.search_order(f, budget_s=1.0, progress=False)(jnp.ones(3))
    jac = gx.jacve(f, order=found.order)(jnp.ones(3))
    ```
    """
    if objective not in OBJECTIVES:
        raise ValueError(
            f"`search_order` got `objective={objective!r}`; use one of "
            f"{', '.join(repr(o) for o in OBJECTIVES)}."
        )
    if measure and objective != "time":
        raise ValueError(
            "`search_order(..., measure=True)` times candidates, which only makes "
            "sense with `objective='time'`."
        )
    if not callable(fun):
        raise TypeError(f"`search_order` expects a callable, got {type(fun).__name__}.")
    if (
        isinstance(budget_s, bool)
        or not isinstance(budget_s, (int, float, np.integer, np.floating))
        or not budget_s >= 0
    ):
        raise ValueError(
            f"`search_order` got `budget_s={budget_s!r}`; use seconds >= 0."
        )
    budget_s = float(budget_s)
    if max_evals is not None and (
        isinstance(max_evals, bool)
        or not isinstance(max_evals, (int, np.integer))
        or max_evals < 1
    ):
        raise ValueError(
            f"`search_order` got `max_evals={max_evals!r}`; use a positive int or None."
        )
    max_evals = None if max_evals is None else int(max_evals)

    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(
            f"`search_order` got `seed={seed!r}`; use an int (the search is "
            "deterministic for a seed)."
        )
    seed = int(seed)

    def run(*args, **kwargs) -> OrderSearch:
        pat = _patterns(fun, argnums, has_aux, args, kwargs, "search_order")
        settings = _Settings(
            budget_s,
            objective,
            seed,
            progress,
            measure,
            bool(sparse_representation),
            max_evals,
        )
        return _search(fun, argnums, has_aux, args, kwargs, pat, settings)

    return run


@dataclasses.dataclass(frozen=True)
class _Settings:
    budget_s: float
    objective: str
    seed: int
    progress: bool
    measure: bool
    sparse: bool
    max_evals: int | None


# Graphs with at most this many intermediate vertices are searched exhaustively.
_EXHAUSTIVE = 8


def _search(fun, argnums, has_aux, args, kwargs, pat: _Patterns, settings: _Settings):
    budget_s, objective, seed = settings.budget_s, settings.objective, settings.seed
    max_evals = settings.max_evals
    t_start = time.perf_counter()
    rng = random.Random(seed)
    inter = list(pat.structure.intermediates)
    sim = Simulator(pat.graph, inter)
    named = candidates(sim)
    named["auto"] = resolve("auto", pat.graph, pat.structure)
    baselines = {
        k: _full_cost(sim, v, pat.graph_adds, pat.fingerprint) for k, v in named.items()
    }
    obj = _Objective(sim, objective)
    index = sim.index
    bound = scalar_lower_bound(sim) if objective == "muls" else None

    def internal(ids):
        return [index[v] for v in ids]

    trace: list[tuple[float, int, float]] = []
    best_value, best = math.inf, []
    # The best few distinct orders seen, for timing with `measure=True`.
    pool: list[tuple[float, tuple[int, ...]]] = []

    def offer(value: float, order: list[int]):
        nonlocal best_value, best
        key = tuple(order)
        if all(key != o for _, o in pool):
            heapq.heappush(pool, (-value, key))
            if len(pool) > 4:
                heapq.heappop(pool)
        if value < best_value:
            best_value, best = value, list(order)
            trace.append((time.perf_counter() - t_start, obj.evaluations, value))
            if bar is not None:
                bar.set_postfix_str(f"best {objective}={_fmt(value, objective)}")

    bar = None
    if settings.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=100, desc="search_order", unit="%", leave=True)

    def fraction() -> float:
        f = (time.perf_counter() - t_start) / budget_s if budget_s > 0 else 1.0
        if max_evals is not None:
            f = max(f, obj.evaluations / max_evals)
        return min(f, 1.0)

    shown = 0

    def tick():
        nonlocal shown
        if bar is not None:
            now = int(100 * fraction())
            if now > shown:
                bar.update(now - shown)
                shown = now

    def done() -> bool:
        if max_evals is not None and obj.evaluations >= max_evals:
            return True
        if bound is not None and best_value <= bound:
            return True  # proven optimal
        return time.perf_counter() - t_start >= budget_s

    exhaustive = False
    try:
        for name in ("fwd", "rev", "markowitz", "relative_markowitz", "min_fill"):
            offer(obj.score(internal(named[name])), internal(named[name]))
        if len(inter) <= _EXHAUSTIVE:
            # Few enough vertices to score every order (8! = 40,320).
            exhaustive = True
            for perm in itertools.permutations(internal(inter)):
                if done():
                    exhaustive = False
                    break
                offer(obj.score(perm), list(perm))
                if obj.evaluations % 256 == 0:
                    tick()
        # Randomised greedy restarts.
        scores = [
            lambda s, st, i: s.vertex_muls(st, i),
            lambda s, st, i: (
                s.vertex_muls(st, i) / max(len(st.pred[i]) + len(st.succ[i]), 1)
            ),
            lambda s, st, i: s.vertex_fill(st, i)[1] + 1e-3 * s.vertex_muls(st, i),
        ]
        while not exhaustive and not done() and fraction() < 0.2:
            state = sim.start()
            pre = (
                [index[v] for v in safe_preeliminations(sim, state)]
                if rng.random() < 0.5
                else []
            )
            noise = rng.choice((0.05, 0.15, 0.4))
            score = _noisy(rng.choice(scores), rng, noise)
            order = pre + internal(greedy(sim, score, state))
            offer(obj.score(order), order)
            tick()
        # Simulated annealing from the best order.
        current_value = obj.set_current(best)
        n = len(best)
        t_sa = fraction()
        stall = 0
        while n > 1 and not exhaustive and not done():
            f = (fraction() - t_sa) / max(1.0 - t_sa, 1e-9)
            temperature = best_value * (0.01 * (0.02**f)) + 1e-9
            cand = list(obj.current)
            i = rng.randrange(n)
            if rng.random() < 0.5:
                j = min(n - 1, max(0, i + rng.randint(-8, 8)))
                cand[i], cand[j] = cand[j], cand[i]
            else:
                j = rng.randrange(n)
                cand.insert(j, cand.pop(i))
            p, q = min(i, j), max(i, j)
            if cand == obj.current:
                continue
            value = obj.score_from(cand, p, q)
            delta = value - current_value
            if delta <= 0 or rng.random() < math.exp(-delta / temperature):
                current_value = obj.set_current(cand, p, q)
                if value < best_value:
                    stall = 0
                offer(value, cand)
            else:
                stall += 1
            if stall > 20 * n:
                # Restart from the best order found so far.
                current_value = obj.set_current(best)
                stall = 0
            if obj.evaluations % 64 == 0:
                tick()
    finally:
        if bar is not None:
            bar.update(100 - shown)
            bar.close()

    best_ids = [sim.vertices[i] for i in best]
    measured = machine = fastest = None
    if settings.measure:
        orders = {"searched": best_ids, **named}
        k = 0
        for _, o in sorted(pool, reverse=True):
            ids = [sim.vertices[i] for i in o]
            if ids not in orders.values():
                k += 1
                orders[f"candidate {k}"] = ids
        measured = _time_candidates(
            fun, argnums, has_aux, args, kwargs, orders, settings.sparse
        )
        machine = _machine()
        fastest = min(measured, key=measured.__getitem__)
        best_ids = orders[fastest]
    elapsed = time.perf_counter() - t_start
    cost = _full_cost(sim, best_ids, pat.graph_adds, pat.fingerprint)
    return OrderSearch(
        cost.order,
        cost,
        baselines,
        objective,
        seed,
        obj.evaluations,
        elapsed,
        trace,
        measured,
        machine,
        exhaustive and not settings.measure,
        bound,
        fastest,
    )


def _fmt(value: float, objective: str) -> str:
    return f"{int(value)}" if objective == "muls" else f"{value:.4g}"
