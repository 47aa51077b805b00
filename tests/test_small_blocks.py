"""Vectorised batches of small Jacobians are computed densely per batch entry
(`graphax_eqx._indexed.densify_small_blocks`), with the same values, stored entries
and operation counts as the engine reports."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import graphax_eqx as gx
from graphax_eqx import _indexed

from .helpers import ORDERS, check_jacve


B = 24


def _flux(x):
    # A Roe-like flux on a batch: columns in, elementwise formulas, columns out;
    # every output depends on every input.
    rho, u, p = x[:, 0], x[:, 1], x[:, 2]
    c = jnp.sqrt(1.4 * p / rho)
    mass = rho * u + 0.1 * c
    momentum = rho * u * u + p
    energy = (p / 0.4 + 0.5 * rho * u * u + p) * u / c
    return jnp.stack([mass, momentum, energy], axis=1)


def _sparse_per_row(x):
    # Output 0 reads column 0 only: each row's 2 × 3 block has structural zeros.
    return jnp.stack([jnp.sin(x[:, 0]), x[:, 1] * jnp.cos(x[:, 2])], axis=1)


def _rolled(x):
    # Rolls along the batch axis: its partials have large free parts.
    return jnp.stack([jnp.roll(x[:, 0], 1) * x[:, 1], x[:, 2]], axis=1)


def _input(dtype=jnp.float32):
    rng = np.random.default_rng(3)
    x = np.stack(
        [rng.uniform(0.5, 2.0, B), rng.uniform(-0.5, 0.5, B), rng.uniform(0.5, 2.0, B)],
        axis=1,
    )
    return jnp.asarray(x, dtype)


@pytest.fixture
def spy(monkeypatch):
    calls = []
    original = _indexed.densify_small_blocks

    def spied(graph, structure):
        done = original(graph, structure)
        calls.append(done)
        return done

    import graphax_eqx._graph as graph_module

    monkeypatch.setattr(graph_module, "densify_small_blocks", spied)
    return calls


def _wide(x):
    # Forty columns per row: more entries per batch entry than `SMALL_BLOCK`.
    wide = jnp.concatenate([x] * 14, axis=1)[:, :40]
    return jnp.stack([jnp.sum(jnp.sin(wide), axis=1), wide[:, 0] * wide[:, 39]], axis=1)


@pytest.mark.parametrize(
    ("fun", "dense"),
    [(_flux, True), (_sparse_per_row, True), (_rolled, False), (_wide, False)],
)
def test_which_graphs_are_densified(spy, fun, dense):
    x = _input()
    gx.jacve(fun)(x)
    assert spy and all(done == dense for done in spy)
    np.testing.assert_allclose(
        np.asarray(gx.jacve(fun, sparse_representation=True)(x).dense()),
        np.asarray(jax.jacfwd(fun)(x)),
        rtol=2e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("fun", [_flux, _sparse_per_row])
def test_values_and_stored_entries(fun, order):
    x = _input(jnp.float64)
    check_jacve(fun, (x,), order)
    ref = np.asarray(jax.jacfwd(fun)(x))
    if order == "random":
        return
    sparse = jax.jit(gx.jacve(fun, order=order, sparse_representation=True))(x)
    np.testing.assert_allclose(np.asarray(sparse.dense()), ref, rtol=1e-12)
    # Computed densely per row, read back to the exact entries: the second
    # function's blocks keep out their structural zeros.
    assert sparse.to_bcoo().nse == np.count_nonzero(ref)


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz", "min_fill"])
@pytest.mark.parametrize("fun", [_flux, _sparse_per_row])
def test_counts_match_the_simulator(fun, order):
    x = _input()
    _, counts = gx.jacve(fun, order=order, count_ops=True)(x)
    cost = gx.elimination_cost(fun, order=order)(x)
    assert counts["num_muls"] == cost.num_muls
    assert counts["num_adds"] == cost.num_adds


def test_under_jit_vmap_and_float32():
    x = _input()
    xs = jnp.stack([x, 2.0 * x])
    got = jax.jit(jax.vmap(gx.jacve(_flux)))(xs)
    want = jax.vmap(jax.jacfwd(_flux))(xs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5)


def _root_fusion_ops(compiled_text: str) -> str:
    """The instructions of the computation the ROOT fusion of ENTRY calls."""
    entry = compiled_text[compiled_text.index("\nENTRY ") :]
    root = next(line for line in entry.splitlines() if "ROOT " in line)
    callee = root.split("calls=%")[1].split(",")[0].split(" ")[0]
    body = compiled_text[compiled_text.index(f"%{callee} (") :]
    return body[: body.index("\n}")]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="reads XLA CPU's fusions")
@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz"])
def test_dense_result_writes_values_computed_once(order):
    # The dense (B, 3, B, 3) result holds B · 9 values; the kernel that writes its
    # B² · 9 entries reads them instead of recomputing the elimination per entry
    # (forward mode took 2.1 s on the sparse suite's 4,096 rows, 0.33 s since).
    x = _input()
    compiled = jax.jit(gx.jacve(_flux, order=order)).lower(x).compile()
    ops = _root_fusion_ops(compiled.as_text())
    assert " multiply(" not in ops and " divide(" not in ops, ops
    np.testing.assert_allclose(
        np.asarray(compiled(x)), np.asarray(jax.jacfwd(_flux)(x)), rtol=2e-5
    )


@pytest.mark.parametrize("order", ["fwd", "rev"])
def test_dense_result_keeps_infinities(order):
    # Spread onto a dense diagonal, values computed once keep their infinities and
    # NaNs: -1/x² is -inf at x = 0.
    x = jnp.array([0.0, 1.0, -2.0, jnp.nan] * 4)
    got = np.asarray(jax.jit(gx.jacve(lambda x: 1.0 / x, order=order))(x))
    with np.errstate(divide="ignore"):
        want = np.diag(-1.0 / np.asarray(x) ** 2)
    np.testing.assert_array_equal(got, want)


def _restacked(x):
    # A state vector stacked and read back by index twice, with partials that are
    # infinite or NaN at some rows (x ** 1.5 of a negative entry, 1/x at 0): a read
    # entry comes from the stack exactly, never times the other entries' partials.
    a, b, c = x[:, 0], x[:, 1], x[:, 2]
    s = jnp.stack([c**1.5, jnp.abs(b + c), a], axis=1)
    t = jnp.stack([s[:, 2] * s[:, 1], 1.0 / s[:, 0], s[:, 2]], axis=1)
    return jnp.stack([jnp.maximum(t[:, 0], t[:, 2]), t[:, 1], jnp.sin(t[:, 2])], axis=1)


def _singular_input():
    return jnp.array(
        [[0.0, -0.5, 2.0], [-0.5, 0.0, 2.0], [1.0, -1.0, -0.5], [0.0, 2.0, 0.0]],
        jnp.float64,
    )


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz", "min_fill", "auto"])
@pytest.mark.parametrize("sparse", [False, True])
def test_index_maps_of_a_batch_at_singular_points(spy, order, sparse):
    from .test_nan import _check

    x = _singular_input()
    fun = functools.partial(_restacked)  # a new function: its graph is built
    with np.errstate(all="ignore"):
        fwd, rev = jax.jacfwd(fun)(x), jax.jacrev(fun)(x)
        for fn in (gx.jacve, lambda f, **kw: jax.jit(gx.jacve(f, **kw))):
            got = fn(fun, order=order, sparse_representation=sparse)(x)
            got = got.dense() if sparse else got
            _check(got, fwd, rev, order)
    assert spy and all(spy)


@pytest.mark.parametrize("order", ["fwd", "rev"])
def test_index_maps_of_a_batch_are_selections(order):
    # Forward and reverse mode apply the index maps of a vectorised batch as
    # selections: no matrix products with their blocks of zeros and ones, and no
    # masks of their structural zeros.
    def lorenz(x):
        for _ in range(3):
            u, v, w = x[:, 0], x[:, 1], x[:, 2]
            dx = jnp.stack([10.0 * (v - u), u * (28.0 - w) - v, u * v - 2.5 * w], 1)
            x = x + 0.01 * dx
        return x

    x = _input()
    fn = gx.jacve(lorenz, order=order, sparse_representation=True)
    jaxpr = jax.make_jaxpr(fn)(x).jaxpr
    names = {eqn.primitive.name for eqn in jaxpr.eqns}
    assert not names & {"dot_general", "and", "or", "not", "reduce_and"}, names
    np.testing.assert_allclose(
        np.asarray(fn(x).dense()), np.asarray(jax.jacfwd(lorenz)(x)), rtol=2e-5
    )


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz", "min_fill", "auto"])
def test_results_that_are_index_maps_hold_arrays(order):
    # A Jacobian block that is an index map no elimination multiplies: its values
    # come back as arrays, eagerly and under `jit`.
    def swap(x):
        return jnp.stack([x[:, 1], x[:, 0], jnp.sin(x[:, 2])], axis=1)

    x = _input()
    for fn in (gx.jacve, lambda f, **kw: jax.jit(gx.jacve(f, **kw))):
        got = fn(swap, order=order, sparse_representation=True)(x)
        assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(got))
        np.testing.assert_allclose(
            np.asarray(got.dense()), np.asarray(jax.jacfwd(swap)(x)), rtol=1e-6
        )


def _selected_and_restacked(x):
    # `1/k` stored twice in a stack beside a selection (`where`); `abs` of one copy
    # is -inf at k = 0 in both JAX modes. Summing the selected-away terms of the
    # read-back block against that infinite partial would give NaN.
    g, k = x[:, 0], x[:, 2]
    p = 1.0 / k
    v = jnp.stack([p, jnp.where(k > 0, k, 0.0), p, g], axis=1)
    return jnp.stack([jnp.sin(v[:, 3]), v[:, 3] * v[:, 1], jnp.abs(v[:, 2])], axis=1)


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz", "min_fill", "auto"])
def test_masked_products_of_small_blocks_at_singular_points(spy, order):
    from .test_nan import _check

    rows = [[1.0, 2.0, 0.0], [0.5, -1.0, 2.0], [-1.0, 0.0, 0.0], [2.0, 1.0, -0.5]]
    x = jnp.array(rows * 2, jnp.float64)
    fun = functools.partial(_selected_and_restacked)  # its graph is built
    with np.errstate(all="ignore"):
        fwd, rev = jax.jacfwd(fun)(x), jax.jacrev(fun)(x)
        for sparse in (False, True):
            got = gx.jacve(fun, order=order, sparse_representation=sparse)(x)
            _check(got.dense() if sparse else got, fwd, rev, order)
    assert spy and all(spy)


@pytest.mark.parametrize("fun", [_flux, _sparse_per_row, _restacked])
def test_auto_picks_a_plain_order_on_small_blocks(fun):
    # Only forward and reverse mode apply a batch's index maps by selection (the
    # three graphs are densified: `test_which_graphs_are_densified` and the tests
    # at singular points above).
    x = _input()
    picked = gx.jacve(fun, count_ops=True)(x)[1]["order"]
    plain = [
        gx.jacve(fun, order=o, count_ops=True)(x)[1]["order"] for o in ("fwd", "rev")
    ]
    assert picked in plain
    assert tuple(gx.elimination_cost(fun)(x).order) == tuple(picked)


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_index_maps_of_a_batch_in_half_precision(order, dtype):
    # Index maps composed when the program is traced, in a dtype NumPy's einsum
    # does not take.
    def fun(x):
        s = jnp.stack([x[:, 2], x[:, 0] * x[:, 1], x[:, 0]], axis=1)
        return jnp.stack([s[:, 2], jnp.sin(s[:, 0]) * s[:, 1]], axis=1)

    x = _input(dtype)
    got = gx.jacve(fun, order=order)(x)
    assert got.dtype == dtype
    want = jax.jacrev(fun)(x.astype(jnp.float32))
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2
    )


def _multiplies(fn, x) -> int:
    return jax.jit(fn).lower(x).compile().as_text().count(" multiply(")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="reads XLA CPU's fusions")
@pytest.mark.parametrize(
    ("order", "jax_mode"), [("fwd", jax.jacfwd), ("rev", jax.jacrev)]
)
def test_state_derivatives_are_computed_once(order, jax_mode):
    # The derivative of a stacked state, read back by component, is computed once
    # rather than inside each component's kernel: XLA CPU duplicated it into every
    # reader, stage after stage (forward mode compiled to 4,527 multiplications,
    # 8x `jax.jacfwd`'s, and ran 20x slower at B = 4,096).
    from benchmarks.batched import pendulum_rk4

    x = jnp.asarray(np.random.default_rng(5).uniform(-1, 1, (B, 4)), jnp.float32)
    fn = gx.jacve(pendulum_rk4, order=order, sparse_representation=True)
    per_example = jax.vmap(jax_mode(lambda s: pendulum_rk4(s[None])[0]))
    assert _multiplies(lambda x: fn(x).val, x) <= 2 * _multiplies(per_example, x)
    np.testing.assert_allclose(
        np.einsum("bibj->bij", np.asarray(fn(x).dense())),
        np.asarray(per_example(x)),
        rtol=1e-4,
        atol=1e-6,
    )


@pytest.mark.parametrize("order", ["fwd", "rev"])
def test_computed_once_keeps_infinities(monkeypatch, order):
    # `_restacked` reads each stacked state back more than once, so its derivative
    # is computed once; that passes infinite and NaN partials through exactly.
    from .test_nan import _check

    x = _singular_input()

    def run():
        fun = functools.partial(_restacked)  # a new function: its graph is built
        jaxpr = jax.make_jaxpr(gx.jacve(fun, order=order))(x).jaxpr
        once = sum(eqn.primitive.name == "compute_once" for eqn in jaxpr.eqns)
        return np.asarray(jax.jit(gx.jacve(fun, order=order))(x)), once

    with np.errstate(all="ignore"):
        got, once = run()
        _check(got, jax.jacfwd(_restacked)(x), jax.jacrev(_restacked)(x), order)
        monkeypatch.setattr(
            "graphax_eqx._jacve.compute_selected_once", lambda ins, outs: None
        )
        plain, fewer = run()
    assert once > fewer
    np.testing.assert_array_equal(got, plain)


def _two_of_six(x):
    # Six columns in, two out: reverse mode multiplies less than forward mode.
    a = [x[:, i] for i in range(6)]
    r = a[0] * a[1] + jnp.sin(a[2]) * a[3] + a[4] / (1.0 + a[5] ** 2)
    s = jnp.exp(-r) * a[0] + a[5] * r
    return jnp.stack([r * s, jnp.cos(s) + r], axis=1)


def test_auto_weighs_the_modes_by_the_entries_of_a_batch_block():
    # XLA computes each entry of such a Jacobian apart: forward mode's products
    # count once per output column, reverse mode's once per input column, and
    # reverse mode must win by `BATCHED_REV_MARGIN`.
    from benchmarks.tasks import robot_arm_6dof
    from graphax_eqx._orders import BATCHED_REV_MARGIN

    def robot(x):
        return jnp.stack(robot_arm_6dof(*(x[:, i] for i in range(6))), axis=1)

    x = jnp.asarray(np.random.default_rng(6).uniform(0.5, 1.5, (B, 6)), jnp.float32)
    for fun, sizes in ((_two_of_six, (6, 2)), (robot, (6, 6))):
        assert gx.make_graph(fun)(x)._sim.block_sizes == sizes
        cost = {o: gx.elimination_cost(fun, o)(x) for o in ("fwd", "rev", "auto")}
        # Fewer products in reverse mode, ...
        assert cost["rev"].num_muls < cost["fwd"].num_muls
        n_in, n_out = sizes
        fwd = n_out * cost["fwd"].predicted_time
        rev = n_in * cost["rev"].predicted_time
        # ... but not enough: forward mode runs faster.
        assert not rev < (1 - BATCHED_REV_MARGIN) * fwd
        assert cost["auto"].order == cost["fwd"].order


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="reads XLA CPU's fusions")
@pytest.mark.parametrize("order", ["fwd", "rev"])
def test_blocks_are_written_before_their_nonzeros_are_read(order):
    # The dense blocks are written by a kernel of their own before the structural
    # nonzeros are read out of them: fused with that read, XLA evaluated the whole
    # elimination entry by entry (a heart-dipole model 4x slower at B = 4,096).
    x = _input()
    fn = jax.jit(
        lambda x: (
            gx.jacve(_sparse_per_row, order=order, sparse_representation=True)(x).val
        )
    )
    compiled = fn.lower(x).compile()
    ops = _root_fusion_ops(compiled.as_text())
    assert not any(op in ops for op in (" multiply(", " sine(", " cosine(")), ops
    got = gx.jacve(_sparse_per_row, order=order, sparse_representation=True)(x)
    assert got.to_bcoo().nse == B * 3  # a 2 x 3 block with 3 structural nonzeros
    np.testing.assert_allclose(
        np.asarray(got.dense()), np.asarray(jax.jacfwd(_sparse_per_row)(x)), rtol=2e-5
    )


_COLUMN_UNARY = (
    lambda a: 1.0 / a,
    jnp.log,
    jnp.sqrt,
    jnp.sin,
    jnp.abs,
    lambda a: jnp.where(a > 0, a, 0.0),
    lambda a: a**1.5,
    jnp.tanh,
)
_COLUMN_BINARY = (
    lambda a, b: a * b,
    lambda a, b: a / b,
    lambda a, b: a - b,
    jnp.maximum,
    lambda a, b: jnp.hypot(a, b),
)


def _random_batch_program(seed: int):
    # Steps that read a (B, n) state by column, combine the columns and stack some
    # of them as the next state: the stacks are read back, often more than once.
    rng = np.random.default_rng(seed)
    n, steps = int(rng.integers(2, 5)), int(rng.integers(1, 4))
    plan = []
    for s in range(steps):
        ops, width = [], n
        for _ in range(int(rng.integers(2, 6))):
            if rng.random() < 0.5:
                ops.append((0, int(rng.integers(8)), int(rng.integers(width)), 0))
            else:
                pick = rng.integers(width, size=2)
                ops.append((1, int(rng.integers(5)), int(pick[0]), int(pick[1])))
            width += 1
        size = n if s < steps - 1 else int(rng.integers(1, 4))
        plan.append((ops, [int(k) for k in rng.integers(width, size=size)]))

    def fun(x):
        for ops, outs in plan:
            vals = [x[:, i] for i in range(x.shape[1])]
            for binary, k, i, j in ops:
                if binary:
                    vals.append(_COLUMN_BINARY[k](vals[i], vals[j]))
                else:
                    vals.append(_COLUMN_UNARY[k](vals[i]))
            x = jnp.stack([vals[k] for k in outs], axis=1)
        return x

    rows = int(rng.integers(5, 9))
    x = rng.choice([0.0, 1.0, -1.0, 0.5, -0.5, 2.0], size=(rows, n))
    return fun, jnp.asarray(x, jnp.float64)


@pytest.mark.parametrize("seed", range(12))
def test_random_batch_programs_at_singular_points(spy, seed):
    # Selections, values computed once and blocks written apart keep every value
    # and NaN where JAX's two modes put them.
    from .test_nan import _check

    fun, x = _random_batch_program(seed)
    with np.errstate(all="ignore"):
        fwd, rev = jax.jacfwd(fun)(x), jax.jacrev(fun)(x)
        for order in ("fwd", "rev", "markowitz", "auto"):
            for sparse in (False, True):
                got = jax.jit(gx.jacve(fun, order=order, sparse_representation=sparse))(
                    x
                )
                got = got.dense() if sparse else got
                _check(got, fwd, rev, f"{order}, sparse={sparse}")
    assert spy and all(spy)  # computed as dense blocks


def _lorenz96(n: int):
    def rhs(x):
        c = [x[:, i] for i in range(n)]
        return jnp.stack(
            [(c[(i + 1) % n] - c[i - 2]) * c[i - 1] - c[i] + 8.0 for i in range(n)],
            axis=1,
        )

    return rhs


def _euler(x):
    rhs = _lorenz96(x.shape[1])
    for _ in range(3):
        x = x + 0.01 * rhs(x)
    return x


def _heun_loop(x):
    rhs = _lorenz96(x.shape[1])

    def step(_, x):
        k1 = rhs(x)
        return x + 0.005 * (k1 + rhs(x + 0.01 * k1))

    return jax.lax.fori_loop(0, 3, step, x)


@pytest.mark.parametrize("fun", [_euler, _heun_loop], ids=["euler", "heun_fori"])
@pytest.mark.parametrize("n", [4, 5])
@pytest.mark.parametrize("order", ["fwd", "auto"])
@pytest.mark.parametrize("sparse", [False, True])
def test_state_read_through_a_transposed_view(fun, n, order, sparse):
    # Each component of a state block computed once was read through a transposed
    # view of it, in the kernel that XLA CPU let write the next state over the
    # block: entries were read after being overwritten (Lorenz-96 steps on a batch,
    # errors of 1e-3 in float32 and float64 alike).
    x = jnp.asarray(np.random.default_rng(n).uniform(0.5, 2.0, (64, n)), jnp.float32)
    want = np.asarray(jax.jacfwd(fun)(x))
    for jac in (
        gx.jacve(fun, order=order, sparse_representation=sparse),
        jax.jit(gx.jacve(fun, order=order, sparse_representation=sparse)),
    ):
        got = jac(x)
        got = np.asarray(got.dense() if sparse else got)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
