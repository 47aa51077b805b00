"""The structural simulator, the greedy heuristics, order search and saved orders."""

import itertools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import graphax_eqx as gx
from benchmarks import sparse_tasks as sparse_registry, tasks as task_registry
from graphax_eqx import _search
from graphax_eqx._orders import AUTO_MARGIN, HEURISTICS, graph_fingerprint
from graphax_eqx._simulator import _SHIFT, Simulator

from .helpers import assert_tree_matches, graph_of, reference_jacobians


NAMED = ("fwd", "rev", "markowitz", "relative_markowitz", "min_fill", "auto")


def _counted(fun, args, order, argnums=0):
    """What `jacve(..., count_ops=True)` reports, from an abstract evaluation."""
    box = {}

    def run(*a):
        jac, counts = gx.jacve(fun, order=order, argnums=argnums, count_ops=True)(*a)
        box.update(counts)
        return jac

    jax.eval_shape(run, *args)
    return box


def _assert_cost_matches(cost, counted):
    assert cost.num_muls == counted["num_muls"]
    assert cost.num_adds == counted["num_adds"]
    assert list(cost.order) == counted["order"]
    assert list(cost.order_counts) == counted["order_counts"]


def _task_args(name):
    task = task_registry.TASKS[name]
    return task, task.make_args(jax.random.key(0), jnp.float32)


@pytest.mark.parametrize("order", NAMED)
@pytest.mark.parametrize("name", list(task_registry.TASKS))
def test_simulator_equals_count_ops_on_tasks(name, order):
    task, args = _task_args(name)
    cost = gx.elimination_cost(task.fn, order=order, argnums=task.argnums)(*args)
    _assert_cost_matches(cost, _counted(task.fn, args, order, task.argnums))


def _random_program(seed):
    """A random program over vectors and scalars with reductions, slices, matmuls."""
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(size=(4, 4)))
    unary = (jnp.sin, jnp.tanh, jnp.exp, lambda v: v * v, lambda v: 2.0 * v)
    steps = [
        (
            int(rng.integers(0, 6)),
            int(rng.integers(0, 1 << 30)),
            int(rng.integers(0, 5)),
        )
        for _ in range(int(rng.integers(6, 14)))
    ]

    def f(x, y):
        values = [x, y * x, jnp.roll(x, 1)]
        for kind, pick, u in steps:
            a = values[pick % len(values)]
            b = values[(pick // 7) % len(values)]
            if kind == 0:
                values.append(unary[u](a))
            elif kind == 1:
                values.append(a * b)
            elif kind == 2:
                values.append(a + jnp.sum(b) * y)
            elif kind == 3:
                values.append(w @ a)
            elif kind == 4:
                values.append(jnp.concatenate([a[1:], b[:1]]))
            else:
                values.append(jnp.cumsum(a) - b)
        return values[-1], jnp.sum(values[-2] * values[-3])

    return f, (jnp.linspace(0.1, 0.9, 4), jnp.asarray(0.7))


@pytest.mark.parametrize("seed", range(12))
def test_simulator_equals_count_ops_on_random_graphs(seed):
    f, args = _random_program(seed)
    graph = gx.make_graph(f, argnums=(0, 1))(*args)
    rng = np.random.default_rng(seed)
    ids = [int(v) for v in graph.intermediates]
    orders = [tuple(int(v) for v in rng.permutation(ids)) for _ in range(3)]
    for order in (*NAMED, *orders):
        cost = gx.elimination_cost(f, order=order, argnums=(0, 1))(*args)
        _assert_cost_matches(cost, _counted(f, args, order, (0, 1)))


def _stencil_with_slices(u):
    # Coordinate partials: sums of index maps whose patterns depend on what meets.
    lap = u[2:] - 2.0 * u[1:-1] + u[:-2]
    return jnp.concatenate([lap * jnp.sin(u[1:-1]) ** 2, u[:1] * u[-1:]])


def _objective_graphs():
    task, args = _task_args("RobotArm_6DOF")
    yield task.fn, args, task.argnums
    f, args = _random_program(3)
    yield f, args, (0, 1)
    yield _stencil_with_slices, (jnp.linspace(0.1, 0.9, 40),), 0


@pytest.mark.parametrize("objective", ["muls", "time"])
def test_search_replays_only_the_changed_window(objective):
    # A candidate that permutes positions p..q is scored from the checkpoint before
    # p up to the first checkpoint past q whose state matches; that score, and the
    # checkpoints kept when it is accepted, must equal a replay from scratch.
    for fun, args, argnums in _objective_graphs():
        graph = gx.make_graph(fun, argnums=argnums)(*args)
        sim = Simulator(graph._sim, graph.intermediates)
        windowed = _search._Objective(sim, objective, block=4)
        full = _search._Objective(sim, objective, block=4)
        rng = np.random.default_rng(0)
        order = [sim.index[v] for v in graph.intermediates]
        windowed.set_current(order)
        for step in range(60):
            cand = list(windowed.current)
            n = len(cand)
            i = int(rng.integers(n))
            j = int(min(n - 1, max(0, i + rng.integers(-6, 7))))
            if step % 2:
                cand[i], cand[j] = cand[j], cand[i]
            else:
                cand.insert(j, cand.pop(i))
            p, q = min(i, j), max(i, j)
            assert windowed.score_from(cand, p, q) == full.score(cand)
            if step % 3 == 0:
                value = windowed.set_current(cand, p, q)
                assert value == full.score(cand)
                for k, (state, acc) in enumerate(windowed.checkpoints):
                    replay = _search._Objective(sim, objective, block=4)
                    replay.set_current(cand)
                    assert state.succ == replay.checkpoints[k][0].succ
                    assert acc == replay.checkpoints[k][1]


def test_state_copies_share_rows_until_written():
    # A copy shares its rows with the original; whichever is eliminated through
    # copies the rows it writes, and the other keeps its graph.
    task, args = _task_args("RobotArm_6DOF")
    graph = gx.make_graph(task.fn, argnums=task.argnums)(*args)
    sim = Simulator(graph._sim, graph.intermediates)
    order = [sim.index[v] for v in graph.intermediates]
    half = len(order) // 2
    base = sim.start()
    sim.muls(order[:half], base)
    snapshot = ([dict(r) for r in base.pred], [dict(r) for r in base.succ])
    first, second = base.copy(), base.copy()
    assert all(a is b for a, b in zip(first.succ, base.succ, strict=True))
    rest = sim.muls(order[half:], first)
    # Rows the elimination did not reach are still shared.
    assert any(a is b for a, b in zip(first.succ, base.succ, strict=True))
    assert ([dict(r) for r in base.pred], [dict(r) for r in base.succ]) == snapshot
    assert sim.muls(list(reversed(order[half:])), base) >= 0
    assert sim.muls(order[half:], second) == rest
    assert second.succ == first.succ


def test_simulator_rate_on_a_150_vertex_graph():
    # Correctness of the fast path on a large graph; speed is measured by
    # `python -m benchmarks.orders`, not here.
    task, args = _task_args("RoeFlux_3d")
    graph = gx.make_graph(task.fn, argnums=task.argnums)(*args)
    sim = Simulator(graph._sim, graph.intermediates)
    rng = np.random.default_rng(0)
    for _ in range(5):
        ids = [int(v) for v in rng.permutation(graph.intermediates)]
        fast = sim.muls([sim.index[v] for v in ids])
        assert fast == sim.cost(ids).muls == graph.counts(ids)["num_muls"]


@pytest.mark.parametrize("name", ["relative_markowitz", "min_fill"])
def test_heuristics_are_valid_permutations(name):
    task, args = _task_args("RobotArm_6DOF")
    graph = gx.make_graph(task.fn, argnums=task.argnums)(*args)
    order = gx.elimination_cost(task.fn, order=name, argnums=task.argnums)(*args).order
    assert sorted(order) == sorted(graph.intermediates)


def test_heuristics_beat_markowitz_somewhere():
    # The new heuristics are not Markowitz in disguise: on these tasks each needs
    # fewer multiplications than plain Markowitz.
    for name, order in [
        ("RobotArm_6DOF", "relative_markowitz"),
        ("RoeFlux_1d", "min_fill"),
    ]:
        task, args = _task_args(name)
        cost = gx.elimination_cost(task.fn, order=order, argnums=task.argnums)
        mark = gx.elimination_cost(task.fn, order="markowitz", argnums=task.argnums)
        assert cost(*args).num_muls < mark(*args).num_muls


@pytest.mark.parametrize(
    "name, picked",
    [("RobotArm_6DOF", "rev"), ("TransformerEncoder", "min_fill"), ("MLP", "rev")],
)
def test_auto_leaves_fwd_and_rev_only_for_a_clear_saving(name, picked):
    task, args = _task_args(name)
    costs = {
        o: gx.elimination_cost(task.fn, order=o, argnums=task.argnums)(*args)
        for o in NAMED
    }
    assert costs["auto"].order == costs[picked].order
    plain = min(costs["fwd"].predicted_time, costs["rev"].predicted_time)
    auto = costs["auto"].predicted_time
    assert auto == plain or auto <= (1 - AUTO_MARGIN) * plain


def _stencil(u):
    return u[2:] - 2 * u[1:-1] + u[:-2] + jnp.sin(u[1:-1]) ** 3


_TAPS = jnp.array([0.5, -1.0, 2.0])


def _smoothed(x):
    y = jax.lax.conv_general_dilated(
        jnp.sin(x)[None, None], _TAPS[None, None], (1,), "VALID"
    )
    return jnp.cos(y[0, 0])


@pytest.mark.parametrize("n", [12, 50])
def test_gathered_multiplications_by_hand(n):
    # Either order multiplies the convolution's 3 (n - 2) coordinate entries by an
    # elementwise derivative twice (cos x on one side, -sin y on the other). Neither
    # product can run as the convolution (a map meeting a diagonal stays a lazy map,
    # applied nowhere), so all 2 · 3 (n - 2) multiplications gather pairs: each
    # counts `GATHERED_COST` in the time model.
    from graphax_eqx._orders import GATHERED_COST, TRAFFIC_COST

    x = jnp.linspace(0.1, 1.0, n)
    for order in ("fwd", "rev", "markowitz"):
        cost = gx.elimination_cost(_smoothed, order=order)(x)
        assert cost.num_muls == cost.gathered == 6 * (n - 2)
        assert (cost.contracted, cost.spread) == (0, 0)
        expected = GATHERED_COST * cost.num_muls + TRAFFIC_COST * cost.traffic
        assert cost.predicted_time == pytest.approx(expected)


@pytest.mark.parametrize("n", [16, 64])
def test_contracted_multiplications_by_hand(n):
    # `W @ sin(W.T @ x)`: either plain order multiplies a diagonal into a dense
    # n × n partial (n² multiplications, one per entry written), then two dense
    # n × n partials (n³, contracting n per entry). From `MIN_CONTRACTED_MULS`
    # multiplications on, the product's n³ - n² beyond the first per entry run as a
    # matrix product and count `1 / CONTRACTION_SPEEDUP` each.
    from graphax_eqx._orders import CONTRACTION_SPEEDUP, TRAFFIC_COST
    from graphax_eqx._sparse import MIN_CONTRACTED_MULS

    w = jax.random.normal(jax.random.PRNGKey(0), (n, n))
    x = jnp.linspace(0.1, 1.0, n)
    for order in ("fwd", "rev"):
        cost = gx.elimination_cost(lambda x: w @ jnp.sin(w.T @ x), order=order)(x)
        assert cost.num_muls == n**2 + n**3
        contracted = n**3 - n**2 if n**3 >= MIN_CONTRACTED_MULS else 0
        assert (cost.contracted, cost.gathered, cost.spread) == (contracted, 0, 0)
        expected = cost.num_muls - contracted * (1 - 1 / CONTRACTION_SPEEDUP)
        expected += TRAFFIC_COST * cost.traffic
        assert cost.predicted_time == pytest.approx(expected)


def test_spread_entries_by_hand():
    # `sin(W @ x + roll(x, 1))`, n = 128. Forward order adds the roll (an index map,
    # no values) to the dense partial `W`: nothing is gathered. Reverse order first
    # multiplies the cosine into both: the roll's n entries, now valued, are
    # gathered into the dense n × n sum, n² entries written for n values.
    from graphax_eqx._orders import SPREAD_COST, TRAFFIC_COST

    n = 128
    w = jax.random.normal(jax.random.PRNGKey(0), (n, n))

    def f(x):
        return jnp.sin(w @ x + jnp.roll(x, 1))

    x = jnp.linspace(0.1, 1.0, n)
    fwd = gx.elimination_cost(f, order="fwd")(x)
    rev = gx.elimination_cost(f, order="rev")(x)
    assert (fwd.spread, rev.spread) == (0, n * n)
    assert (fwd.num_muls, rev.num_muls) == (n * n, n * n)
    written = TRAFFIC_COST * (rev.traffic - fwd.traffic)
    assert rev.predicted_time - fwd.predicted_time == SPREAD_COST * n * n + written
    # `auto` keeps off reverse order (measured 2.3x slower than forward order);
    # Markowitz's order, eliminating the sum before the sine, writes fewer entries
    # than forward order and runs as fast.
    auto = gx.elimination_cost(f, order="auto")(x)
    assert auto.spread == 0 and auto.predicted_time <= fwd.predicted_time
    assert_tree_matches(
        jax.jit(gx.jacve(f, order="rev"))(x), jax.jacrev(f)(x), rtol=1e-5, atol=1e-5
    )


def test_auto_ranks_the_orders_of_an_attention_layer_as_measured():
    # 8-head attention over 16 tokens of 64 features, input Jacobian. Measured
    # (`jax.jit`, one process): reverse order 2.0 ms, forward 4.9 ms, min fill
    # 9.3 ms, Markowitz 13.7 ms. Counting multiplications alone ranks them the
    # other way round but for Markowitz: forward order needs 40% fewer than
    # reverse, but most of reverse order's are in large matrix products, and
    # forward order spreads 2 M entries into dense sums; min fill and Markowitz
    # gather 2-3 M entry pairs.
    import equinox as eqx

    k = jax.random.split(jax.random.PRNGKey(0), 2)
    attention = eqx.nn.MultiheadAttention(8, 64, key=k[0])
    x = jax.random.normal(k[1], (16, 64))

    def f(x):
        return attention(x, x, x)

    costs = {o: gx.elimination_cost(f, o)(x) for o in NAMED}
    assert costs["fwd"].num_muls < 0.7 * costs["rev"].num_muls
    assert costs["rev"].contracted > 0.9 * costs["rev"].num_muls
    assert costs["fwd"].spread > 1_000_000
    assert min(costs["min_fill"].gathered, costs["markowitz"].gathered) > 1_000_000
    ranked = sorted(
        ("rev", "fwd", "min_fill", "markowitz"), key=lambda o: costs[o].predicted_time
    )
    assert ranked == ["rev", "fwd", "min_fill", "markowitz"]
    assert costs["auto"].order == costs["rev"].order


@pytest.mark.parametrize("n", [12, 200])
def test_gathered_multiplications_of_a_stencil_by_hand(n):
    # Forward order multiplies values held at the slices' coordinates: -1 into the
    # n - 2 entries of ∂(2s)/∂u, and 3 sin(s)² into the n - 2 entries of cos(s)
    # gathered onto the slice: all 2 (n - 2) multiplications gather. Reverse order
    # multiplies the elementwise derivatives (and two scalars) before any slice
    # moves them: none gathers.
    u = jnp.linspace(0.5, 1.5, n)
    fwd = gx.elimination_cost(_stencil, order="fwd")(u)
    rev = gx.elimination_cost(_stencil, order="rev")(u)
    assert (fwd.num_muls, fwd.gathered) == (2 * (n - 2), 2 * (n - 2))
    assert (rev.num_muls, rev.gathered) == ((n - 2) + 1, 0)


def test_no_gathers_in_dense_programs():
    task, args = _task_args("RoeFlux_1d")
    for order in NAMED:
        assert gx.elimination_cost(task.fn, order, task.argnums)(*args).gathered == 0


def test_auto_weighs_gathered_pairs_in_a_transformer_block():
    # The input Jacobian of a transformer block (16 tokens of 64 features, 8
    # heads): `min_fill` keeps the per-token structure of the layer norms and the
    # heads as coordinates and needs 26% fewer multiplications than reverse mode,
    # but 32.5 M of them are made over coordinates (half of them entry pair by entry
    # pair, half reading a block diagonal by rows): it ran in 224 ms against reverse
    # mode's 5.6 ms (`jax.jacrev`: 43 ms), and 118 ms once half of it ran by rows.
    # Counting multiplications only, `auto` picked it.
    import equinox as eqx

    k = jax.random.split(jax.random.PRNGKey(0), 3)
    attention = eqx.nn.MultiheadAttention(8, 64, key=k[0])
    norm = eqx.nn.LayerNorm(64)
    mlp = eqx.nn.MLP(64, 64, 256, 1, activation=jax.nn.gelu, key=k[1])

    def block(x):
        h = jax.vmap(norm)(x)
        x = x + attention(h, h, h)
        return x + jax.vmap(mlp)(jax.vmap(norm)(x))

    x = jax.random.normal(k[2], (16, 64))
    costs = {o: gx.elimination_cost(block, o)(x) for o in ("rev", "min_fill", "auto")}
    assert costs["min_fill"].num_muls < (1 - AUTO_MARGIN) * costs["rev"].num_muls
    over_coordinates = costs["min_fill"].gathered + costs["min_fill"].by_rows
    assert over_coordinates > costs["min_fill"].num_muls / 5
    assert costs["min_fill"].gathered > 0 and costs["min_fill"].by_rows > 0
    assert costs["auto"].order == costs["rev"].order


def test_auto_weighs_gathered_pairs_against_convolutions():
    # A strided convolution, its transpose and a small head. The cross-country
    # orders need 48k multiplications against reverse order's 417k, but 7.2k of
    # theirs gather entry pairs over coordinates, where reverse order and
    # Markowitz's order apply the convolutions as XLA convolutions (no gathers):
    # measured, the cross-country orders ran about 3x slower than reverse order and
    # Markowitz's (0.061 ms against 0.019 and 0.018). Counting gathered
    # multiplications at `GATHER_COST` steers `auto` off them.
    import equinox as eqx

    k = jax.random.split(jax.random.PRNGKey(0), 4)
    conv = eqx.nn.Conv2d(3, 8, 3, stride=2, key=k[0])
    up = eqx.nn.ConvTranspose2d(8, 4, 3, stride=2, key=k[1])
    head = eqx.nn.Linear(4, 10, key=k[2])

    def net(x):
        return head(jnp.mean(up(jax.nn.gelu(conv(x))), axis=(1, 2)))

    x = jax.random.normal(k[3], (3, 12, 12))
    costs = {o: gx.elimination_cost(net, o)(x) for o in NAMED}
    assert costs["relative_markowitz"].num_muls < costs["rev"].num_muls / 5
    assert costs["relative_markowitz"].gathered > 0
    assert costs["auto"].gathered == 0
    assert costs["auto"].predicted_time <= costs["rev"].predicted_time
    assert_tree_matches(
        jax.jit(gx.jacve(net, "auto"))(x), jax.jacrev(net)(x), rtol=1e-4, atol=1e-5
    )


def _auto_by_full_costs(sim):
    """`auto`'s rule with every candidate simulated to the end."""
    from graphax_eqx._orders import (
        HEURISTICS,
        candidates,
        plain_weights,
        predicted_time,
    )

    weights = plain_weights(sim)

    def key(order, name):
        c = sim.cost(order)
        return (predicted_time(c) * weights.get(name, 1.0), c.adds + c.traffic)

    named = candidates(sim)
    plain = min(("fwd", "rev"), key=lambda name: key(named[name], name))
    plain_key = key(named[plain], plain)
    best_key, best = plain_key, named[plain]
    for name in HEURISTICS:
        if sim.densified:
            break
        k = key(named[name], name)
        if k[0] <= (1 - AUTO_MARGIN) * plain_key[0] and k < best_key:
            best_key, best = k, named[name]
    return best


def _auto_cases():
    for name in task_registry.TASKS:
        task, args = _task_args(name)
        yield name, task.fn, args, task.argnums
    for name, sparse in sparse_registry.SPARSE_TASKS.items():
        yield name, sparse.function(small=True), (sparse.make_input(small=True),), 0
    # Full size: fwd and rev need about six times the heuristics' multiplications.
    heat = sparse_registry.SPARSE_TASKS["HeatSteps"]
    yield "HeatSteps", heat.function(), (heat.make_input(),), 0
    for seed in range(6):
        f, args = _random_program(seed)
        yield f"random {seed}", f, args, (0, 1)
    # A training loss: reverse mode is cheap, and the heuristics are dropped early.
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    w1, w2 = jax.random.normal(k[0], (16, 32)), jax.random.normal(k[1], (32, 8))
    x = jax.random.normal(k[2], (64, 16))

    def loss(w1, w2):
        return jnp.mean(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2)

    yield "loss", loss, (w1, w2), (0, 1)


def test_auto_picks_what_full_simulations_pick():
    # `auto` builds and costs its candidates side by side and drops each as soon as
    # its cost so far shows it cannot be picked; its pick must be the one full
    # simulations of every candidate give.
    from graphax_eqx._orders import auto

    for name, fun, args, argnums in _auto_cases():
        graph = gx.make_graph(fun, argnums=argnums)(*args)
        sim = Simulator(graph._sim, graph.intermediates)
        assert auto(sim) == _auto_by_full_costs(sim), name


def test_searched_order_is_valid_and_gives_the_jacobian():
    task, args = _task_args("RoeFlux_1d")
    found = gx.search_order(
        task.fn, argnums=task.argnums, budget_s=60.0, max_evals=400, progress=False
    )(*args)
    graph = gx.make_graph(task.fn, argnums=task.argnums)(*args)
    assert sorted(found.order) == sorted(graph.intermediates)
    assert found.cost.num_muls <= min(
        found.baselines[k].num_muls for k in ("fwd", "rev", "markowitz")
    )
    assert found.evaluations == 400
    assert found.trace and found.trace[-1][2] == found.cost.num_muls
    jac, counts = gx.jacve(
        task.fn, order=found.order, argnums=task.argnums, count_ops=True
    )(*args)
    assert counts["num_muls"] == found.cost.num_muls
    refs = reference_jacobians(task.fn, args, argnums=task.argnums)
    assert_tree_matches(jac, refs["rev"])


def _small(x):
    y = jnp.sin(x[0] * x[1]) + jnp.cos(x[1] * x[2])
    z = jnp.exp(y) * x[0]
    return jnp.stack([y * x[0], z * x[2], jnp.tanh(z + y), x[1] * z])


def test_search_is_deterministic_for_a_seed():
    x = jnp.array([0.3, -0.2, 0.5])

    def search(seed):
        return gx.search_order(
            _small, budget_s=60.0, max_evals=300, seed=seed, progress=False
        )(x)

    a, b = search(1), search(1)
    assert tuple(a.order) == tuple(b.order)
    assert [t[1:] for t in a.trace] == [t[1:] for t in b.trace]


def test_search_stops_at_the_budget():
    task, args = _task_args("RoeFlux_3d")
    start = time.perf_counter()
    found = gx.search_order(
        task.fn, argnums=task.argnums, budget_s=0.5, progress=False
    )(*args)
    # Building the graph and the baselines comes on top of the budget.
    assert time.perf_counter() - start < 20.0
    assert found.elapsed_s < 10.0


def test_search_progress_bar(capsys):
    x = jnp.array([0.3, -0.2, 0.5])
    gx.search_order(_small, budget_s=60.0, max_evals=50, progress=True)(x)
    err = capsys.readouterr().err
    assert "search_order" in err and "best muls=" in err


def _measured_search(fun, x, max_evals, **options):
    """`search_order` by the time objective, timing its candidates."""
    return gx.search_order(
        fun,
        budget_s=60.0,
        max_evals=max_evals,
        objective="time",
        measure=True,
        progress=False,
        **options,
    )(x)


def test_time_objective_and_measure():
    x = jnp.array([0.3, -0.2, 0.5])
    found = _measured_search(_small, x, 100)
    assert found.objective == "time"
    assert found.measured is not None and "searched" in found.measured
    assert found.measured[min(found.measured, key=found.measured.__getitem__)] > 0
    assert found.machine is not None and found.machine["jax"] == jax.__version__
    # The order returned is the fastest one timed, and the result says which.
    assert found.chosen == min(found.measured, key=found.measured.__getitem__)
    assert f"{found.chosen:<14}" in str(found) and "(returned)" in str(found)
    jac = gx.jacve(_small, order=found.order)(x)
    assert_tree_matches(jac, jax.jacfwd(_small)(x))


def test_measure_times_the_sparse_layout(monkeypatch):
    # With `sparse_representation=True` the candidates run as structured results,
    # the layout the order is searched for; every named order is among them.
    layouts = []
    original = gx.jacve

    def recording(*args, sparse_representation=False, **kwargs):
        layouts.append(sparse_representation)
        return original(*args, sparse_representation=sparse_representation, **kwargs)

    monkeypatch.setattr(_search, "jacve", recording)
    x = jnp.linspace(0.1, 1.0, 40)

    def stencil(u):
        return jnp.sin(u[2:] - 2.0 * u[1:-1] + u[:-2])

    found = _measured_search(stencil, x, 50, sparse_representation=True)
    assert layouts and all(layouts)
    names = ("fwd", "rev", "markowitz", "relative_markowitz", "min_fill", "auto")
    assert found.measured is not None and set(names) <= set(found.measured)
    jac = gx.jacve(stencil, order=found.order, sparse_representation=True)(x)
    assert_tree_matches(jac.dense(), jax.jacfwd(stencil)(x))


def _saved_and_loaded(tmp_path, max_evals):
    """Search `_small`, save the result, load it back: (x, search result, path,
    loaded order)."""
    x = jnp.array([0.3, -0.2, 0.5])
    found = gx.search_order(_small, budget_s=60.0, max_evals=max_evals, progress=False)(
        x
    )
    path = tmp_path / "order.json"
    found.save(path)
    return x, found, path, gx.load_order(path)


def test_save_and_load_round_trip(tmp_path):
    x, found, path, loaded = _saved_and_loaded(tmp_path, 100)
    assert loaded == found.order
    assert json.loads(path.read_text())["num_muls"] == found.cost.num_muls
    jac = jax.jit(gx.jacve(_small, order=loaded))(x)
    assert_tree_matches(jac, jax.jacrev(_small)(x))
    cost = gx.elimination_cost(_small, order=loaded)(x)
    assert cost.num_muls == found.cost.num_muls
    # The search's result itself is an order too.
    assert_tree_matches(gx.jacve(_small, order=found)(x), jac)


def test_loaded_order_on_another_graph_is_refused(tmp_path):
    x, found, path, loaded = _saved_and_loaded(tmp_path, 50)

    def changed(x):
        # The same vertices and edges, one primitive differs.
        y = jnp.sin(x[0] * x[1]) + jnp.sin(x[1] * x[2])
        z = jnp.exp(y) * x[0]
        return jnp.stack([y * x[0], z * x[2], jnp.tanh(z + y), x[1] * z])

    with pytest.raises(ValueError, match="different computational graph"):
        gx.jacve(changed, order=loaded)(x)
    with pytest.raises(ValueError, match="different computational graph"):
        gx.jacve(_small, order=loaded)(jnp.array([0.3, -0.2, 0.5, 1.0]))
    # Another dtype is another program (its run time, for one).
    with pytest.raises(ValueError, match="shapes or dtypes"):
        gx.jacve(_small, order=loaded)(x.astype(jnp.float32))
    # The plain ids skip the check (and are still validated).
    jac = gx.jacve(changed, order=tuple(loaded))(x)
    assert_tree_matches(jac, jax.jacfwd(changed)(x))


def test_load_order_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(ValueError, match="not a saved order"):
        gx.load_order(bad)
    bad.write_bytes(b"\xff\xfe\x00 not text")
    with pytest.raises(ValueError, match="not a saved order"):
        gx.load_order(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"order": [1, 2]}))
    with pytest.raises(ValueError, match="not an order written by"):
        gx.load_order(other)
    # A saved order with a field missing or mangled.
    _, _, path, _ = _saved_and_loaded(tmp_path, 20)
    saved = json.loads(path.read_text())
    for field, value in (
        ("fingerprint", None),
        ("order", None),
        ("order", ["a"]),
        ("order", [True, 2.7]),  # not read as ids 1 and 2
        ("order", 7),
    ):
        broken = dict(saved)
        if value is None:
            del broken[field]
        else:
            broken[field] = value
        path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match="not a complete saved order"):
            gx.load_order(path)


def test_fingerprint_is_stable_across_traces():
    x = jnp.array([0.3, -0.2, 0.5])
    a = graph_of(_small, (x,))
    b = graph_of(_small, (2.0 * x,))
    assert graph_fingerprint(a._sim, a._structure) == graph_fingerprint(
        b._sim, b._structure
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(objective="flops"), "objective"),
        (dict(measure=True), "measure=True"),
        (dict(budget_s=-1.0), "budget_s"),
        (dict(max_evals=0), "max_evals"),
        (dict(max_evals=True), "max_evals"),
        (dict(budget_s=True), "budget_s"),
        (dict(budget_s=float("nan")), "budget_s"),
    ],
)
def test_search_order_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gx.search_order(_small, **kwargs)


def test_search_order_takes_numpy_numbers():
    x = jnp.array([0.3, -0.2, 0.5])
    a = gx.search_order(_small, max_evals=np.int64(30), progress=False)(x)
    b = gx.search_order(_small, max_evals=30, budget_s=np.float32(60), progress=False)(
        x
    )
    assert a.order == b.order and a.evaluations == b.evaluations


@pytest.mark.parametrize("api", ["search_order", "elimination_cost", "make_graph"])
def test_order_tools_need_a_callable(api):
    with pytest.raises(TypeError, match=f"`{api}` expects a callable, got str"):
        getattr(gx, api)("not a function")


def _sorted_gather(x):
    y = jnp.sin(x) * x[0]
    return jnp.cos(y[jnp.argsort(x)]) * y


def test_searched_order_where_the_input_shapes_the_graph(tmp_path):
    # An eager call reads indices computed from the differentiated input as fixed
    # index maps, and so builds other patterns than the search (which builds the
    # graph as `jit` does): the order is accepted either way, for any input.
    x = jnp.array([0.3, -0.2, 0.5, 0.1])
    found = gx.search_order(_sorted_gather, max_evals=40, progress=False)(x)
    path = tmp_path / "sorted.json"
    found.save(path)
    loaded = gx.load_order(path)
    for point in (x, jnp.array([0.1, 0.7, -0.5, 0.2])):
        want = jax.jacrev(_sorted_gather)(point)
        for order in (found.order, loaded):
            assert_tree_matches(gx.jacve(_sorted_gather, order=order)(point), want)
            jitted = jax.jit(gx.jacve(_sorted_gather, order=order))
            assert_tree_matches(jitted(point), want)
    with pytest.raises(ValueError, match="different computational graph"):
        gx.jacve(lambda v: _sorted_gather(v) * v, order=loaded)(x)


def test_named_heuristics_accept_any_case():
    x = jnp.array([0.3, -0.2, 0.5])
    a = gx.jacve(_small, order="Min_Fill")(x)
    b = gx.jacve(_small, order="RELATIVE_MARKOWITZ")(x)
    assert_tree_matches(a, b)


def _tiny(a, b):
    y = jnp.sin(a * b)
    return jnp.exp(y) * a + y * b


def test_small_graphs_are_searched_exhaustively():
    import itertools

    args = (jnp.asarray(0.3), jnp.asarray(-0.2))
    graph = gx.make_graph(_tiny, argnums=(0, 1))(*args)
    inter = list(graph.intermediates)
    assert 2 <= len(inter) <= 8
    found = gx.search_order(_tiny, argnums=(0, 1), budget_s=60.0, progress=False)(*args)
    # Every order scored, or stopped early at one meeting the lower bound.
    assert found.optimal
    assert found.exhaustive or found.cost.num_muls == found.lower_bound
    assert "optimal" in str(found)
    best = min(
        gx.elimination_cost(_tiny, order=list(p), argnums=(0, 1))(*args).num_muls
        for p in itertools.permutations(inter)
    )
    assert found.cost.num_muls == best
    assert sorted(found.order) == sorted(inter)
    # Larger graphs are not, and a spent budget stops the enumeration.
    task, targs = _task_args("RoeFlux_1d")
    big = gx.search_order(
        task.fn, argnums=task.argnums, budget_s=60.0, max_evals=50, progress=False
    )(*targs)
    assert not big.exhaustive
    cut = gx.search_order(
        _tiny, argnums=(0, 1), budget_s=60.0, max_evals=3, progress=False
    )(*args)
    assert not cut.exhaustive


def _attention_scores(x, w):
    # Scores of 2-head attention on a batch: coordinate partials whose products
    # with the weights' partial pair up many entries.
    q = (x @ w).reshape(3, 5, 2, 4)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, q)
    return jax.nn.softmax(s, axis=-1)


def test_scores_count_products_without_planning_them():
    # Greedy scores count a product's multiplications from its operands alone;
    # the count must be the one the product's full plan gives.
    programs = [
        (_stencil_with_slices, (jnp.linspace(0.1, 0.9, 40),), 0),
        (
            _attention_scores,
            (jnp.linspace(-1, 1, 120).reshape(3, 5, 8), jnp.eye(8) * 0.5),
            (0, 1),
        ),
    ]
    task, args = _task_args("RobotArm_6DOF")
    programs.append((task.fn, args, task.argnums))
    for fun, args, argnums in programs:
        graph = gx.make_graph(fun, argnums=argnums)(*args)
        sim = Simulator(graph._sim, graph.intermediates)
        for heuristic in HEURISTICS.values():
            heuristic(sim)
        assert sim._muls
        for key, muls in sim._muls.items():
            a, b = divmod(key, _SHIFT)
            assert sim._product(a, b)[1] == muls


def _scalar_program(seed: int):
    """A random program of scalar operations: 3 inputs, 4–7 operations, 2 outputs."""
    rng = np.random.default_rng(seed)
    unary = {
        "sin": jnp.sin,
        "exp": lambda x: jnp.exp(0.1 * x),
        "neg": lambda x: -x,
        "scale": lambda x: 2.5 * x,
        "shift": lambda x: x + 1.0,
        "square": lambda x: x * x,
    }
    binary = {
        "mul": lambda x, y: x * y,
        "add": lambda x, y: x + y,
        "sub": lambda x, y: x - y,
        "div": lambda x, y: x / (2.0 + y * y),
    }
    names = sorted(unary) + sorted(binary)
    n_ops = int(rng.integers(4, 8))
    ops = []
    for k in range(n_ops):
        name = names[int(rng.integers(len(names)))]
        ops.append((name, int(rng.integers(3 + k)), int(rng.integers(3 + k))))
    outs = [int(o) for o in rng.choice(np.arange(3, 3 + n_ops), 2, replace=False)]

    def f(a, b, c):
        values = [a, b, c]
        for name, i, j in ops:
            if name in unary:
                values.append(unary[name](values[i]))
            else:
                values.append(binary[name](values[i], values[j]))
        return tuple(values[o] for o in outs)

    return f, tuple(jnp.asarray(0.3 + 0.2 * i) for i in range(3))


def test_lower_bound_never_exceeds_the_optimum():
    import itertools

    from graphax_eqx._bound import scalar_lower_bound

    tight = 0
    for seed in range(60):
        f, args = _scalar_program(seed)
        pat = _search._patterns(f, (0, 1, 2), False, args, {}, "test")
        inter = list(pat.structure.intermediates)
        sim = Simulator(pat.graph, inter)
        bound = scalar_lower_bound(sim)
        assert bound is not None
        best = min(
            sim.muls(list(p))
            for p in itertools.permutations(sim.index[v] for v in inter)
        )
        assert bound <= best, seed
        tight += bound == best
    # Not vacuous: on most of these small graphs the bound is the optimum.
    assert tight >= 40


def test_search_stops_at_a_proven_optimum():
    task, args = _task_args("PropaneCombustion")
    found = gx.search_order(
        task.fn, argnums=task.argnums, budget_s=60.0, progress=False
    )(*args)
    assert found.lower_bound == found.cost.num_muls == 41
    assert found.optimal and not found.exhaustive
    assert found.elapsed_s < 10.0
    assert "meets the lower bound" in str(found)


def _lower_bound_table() -> list[tuple[str, int, int, int]]:
    """The rows of docs/orders.md's table of lower bounds: task, lower bound, searched
    (60 s), best named."""
    text = (pathlib.Path(__file__).parents[1] / "docs" / "orders.md").read_text()
    head = "| task | lower bound | searched (60 s) | best named |"
    lines = text[text.index(head) :].splitlines()[2:]
    rows = []
    for line in itertools.takewhile(lambda l: l.startswith("|"), lines):
        cells = [c.strip() for c in line.strip("|").split("|")]
        number = lambda c: int(c.split()[0].replace(",", ""))  # noqa: E731
        rows.append((cells[0], number(cells[1]), number(cells[2]), number(cells[3])))
    return rows


def test_lower_bound_of_the_tasks():
    from graphax_eqx._bound import scalar_lower_bound

    rows = _lower_bound_table()
    assert len(rows) == 5
    # The docs' table shows what the engine counts today.
    for name, bound, searched, best_named in rows:
        task, args = _task_args(name)
        pat = _search._patterns(task.fn, task.argnums, False, args, {}, "test")
        sim = Simulator(pat.graph, list(pat.structure.intermediates))
        assert scalar_lower_bound(sim) == bound, name
        named = [
            gx.elimination_cost(task.fn, order, argnums=task.argnums)(*args)
            for order in ("fwd", "rev", "markowitz")
        ]
        assert min(c.num_muls for c in named) == best_named, name
        assert bound <= searched <= best_named, name
    # The MLP's partials are matrices: no bound, and the search says nothing of one.
    task, args = _task_args("MLP")
    found = gx.search_order(task.fn, budget_s=60.0, progress=False)(*args)
    assert found.lower_bound is None
    assert found.optimal == found.exhaustive
