"""Eager calls run compiled from the second call with the same key on (from the first,
for array programs of a structure not seen before): closed-over values are still read
afresh on every call, results match an eager run and JAX."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax import lax

import graphax_eqx as gx
from graphax_eqx import _jacve

from .helpers import tree_allclose as _tree_allclose


def tree_allclose(a, b):
    return _tree_allclose(a, b, rtol=1e-6, atol=1e-7)


_X = jnp.array([0.3, -1.2, 2.0, 0.7])


@pytest.fixture(autouse=True)
def fresh_caches():
    _jacve._COMPILED.clear()
    _jacve._SIGHTINGS.clear()
    _jacve._ANALYSES.clear()
    yield
    _jacve._COMPILED.clear()
    _jacve._SIGHTINGS.clear()
    _jacve._ANALYSES.clear()


@pytest.fixture
def eager_only(monkeypatch):
    """Runs every call through the engine operation by operation."""

    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(_jacve, "_run_compiled", lambda *_: None)
            return fn(*args)

    return run


def _compiled() -> int:
    return len(_jacve._COMPILED)


_SCALE = 1.0


def test_global_float_is_read_on_every_call():
    global _SCALE
    jac = gx.jacve(lambda x: jnp.sin(x) * _SCALE)
    for c in [1.0, 2.0, 2.0, 1.0, 3.0, 3.0]:
        _SCALE = c
        assert tree_allclose(jac(_X), jax.jacrev(lambda x: jnp.sin(x) * c)(_X))
    assert _compiled() == 3


_WEIGHT = jnp.eye(4)


def test_global_array_is_read_on_every_call():
    global _WEIGHT
    jac = gx.jacve(lambda x: jnp.tanh(_WEIGHT @ x), order="rev")
    for k in range(4):
        _WEIGHT = jr.normal(jr.PRNGKey(k), (4, 4))
        w = _WEIGHT
        assert tree_allclose(jac(_X), jax.jacrev(lambda x: jnp.tanh(w @ x))(_X))
    assert _compiled() == 1  # the weight is an argument, not part of the key


def test_loop_variable_batch_is_read_on_every_call():
    def loss(w, batch):
        return jnp.mean(jnp.tanh(batch @ w) ** 2, axis=0)

    w = jr.normal(jr.PRNGKey(0), (3, 2))
    for k in range(4):
        batch = jr.normal(jr.PRNGKey(k + 1), (5, 3))
        ours = gx.jacve(lambda w: loss(w, batch))(w)
        assert tree_allclose(ours, jax.jacrev(lambda w: loss(w, batch))(w))
    assert _compiled() == 1


def test_equinox_model_with_closed_over_batch():
    model = eqx.nn.MLP(3, 2, 8, 2, key=jr.PRNGKey(0))
    for k in range(4):
        batch = jr.normal(jr.PRNGKey(k + 1), (6, 3))

        def loss(m):
            return jnp.mean(jax.vmap(m)(batch) ** 2)

        ours = gx.filter_jacve(loss)(model)
        assert tree_allclose(ours, eqx.filter_grad(loss)(model))
        value, jac = gx.filter_value_and_jacve(loss)(model)
        ref_value, ref_grad = eqx.filter_value_and_grad(loss)(model)
        assert tree_allclose(value, ref_value)
        assert tree_allclose(jac, ref_grad)
    assert _compiled() == 1  # one compiled function gives values and Jacobians


def test_custom_jvp_rule_reads_a_changing_closure():
    scale = 1.0

    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), scale * jnp.cos(x) * t

    jac = gx.jacve(lambda x: f(x) * x)
    # With custom rules, the third call compiles (see `_jacve`).
    for scale in [1.0, 1.0, 1.0, 2.0, 2.0, 5.0, 5.0, 1.0]:
        expected = jax.jacfwd(lambda x: f(x) * x)(_X)
        assert tree_allclose(jac(_X), expected)
    assert _compiled() == 3


def test_custom_jvp_rule_reads_a_changing_global_array():
    global _WEIGHT

    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), _WEIGHT[0] * t

    jac = gx.jacve(lambda x: f(x) + x)
    for k in range(6):
        _WEIGHT = jr.normal(jr.PRNGKey(k // 3), (4, 4))
        assert tree_allclose(jac(_X), jax.jacfwd(lambda x: f(x) + x)(_X))
    assert _compiled() == 2


def test_custom_vjp_rule_reads_a_changing_closure():
    scale = 1.0

    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def fwd(x):
        return f(x), x

    def bwd(x, g):
        return (scale * jnp.cos(x) * g,)

    f.defvjp(fwd, bwd)
    jac = gx.jacve(lambda x: jnp.exp(f(x)))
    for scale in [1.0, 1.0, 1.0, 3.0, 3.0, 1.0]:
        assert tree_allclose(jac(_X), jax.jacrev(lambda x: jnp.exp(f(x)))(_X))
    assert _compiled() == 2


def _scaled_sin(c):
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), c * jnp.cos(p[0]) * t[0]))
    return f


def test_rules_with_one_qualname_and_other_closures():
    fs = [_scaled_sin(1.0), _scaled_sin(4.0)]
    for _ in range(3):
        for f in fs:
            ours = gx.jacve(lambda x: f(x) * 2.0)(_X)
            assert tree_allclose(ours, jax.jacfwd(lambda x: f(x) * 2.0)(_X))
    assert _compiled() == 2


def test_rules_are_traced_from_the_second_call_on(monkeypatch):
    traced = []
    rule = _jacve._ValueKey.rule
    monkeypatch.setattr(
        _jacve._ValueKey, "rule", lambda *a: traced.append(1) or rule(*a)
    )
    f = lambda x: jax.nn.relu(x) * x
    # A function of scalars runs eagerly on its first two calls, and traces its rules
    # into the key from the second on.
    x = jnp.asarray(0.3)
    for calls in range(1, 5):
        assert tree_allclose(gx.jacve(f)(x), jax.jacrev(f)(x))
        assert len(traced) == calls - 1
        assert _compiled() == (calls >= 3)
    # A function on arrays, of a structure not seen before, compiles on its first
    # call, with its rules in the key.
    traced.clear()
    _jacve._COMPILED.clear()
    for calls in range(1, 4):
        assert tree_allclose(gx.jacve(f)(_X), jax.jacrev(f)(_X))
        assert len(traced) == calls
        assert _compiled() == 1


def _callback_scale(c):
    def host(x):
        return np.asarray(c * np.ones_like(x))

    def f(x):
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jnp.sin(x) * jax.pure_callback(host, shape, jax.lax.stop_gradient(x))

    return f


def test_callbacks_with_one_qualname_and_other_closures():
    fs = [_callback_scale(1.0), _callback_scale(3.0)]
    for _ in range(3):
        for c, f in zip([1.0, 3.0], fs):
            expected = jnp.diag(c * jnp.cos(_X))
            assert tree_allclose(gx.jacve(f)(_X), expected)


def _literal_power(c):
    return lambda x: jnp.sin(x) * c + x**2


@pytest.mark.parametrize("sparse", [False, True])
def test_literal_values_are_part_of_the_key(sparse):
    for _ in range(3):
        for c in [2.0, 3.0]:
            f = _literal_power(c)
            ours = gx.jacve(f, sparse_representation=sparse)(_X)
            if sparse:
                ours = ours.dense()
            assert tree_allclose(ours, jax.jacrev(f)(_X))
    assert _compiled() == 2


def test_python_int_index_is_part_of_the_key():
    for _ in range(2):
        for k in range(3):
            f = lambda x: jnp.sin(x[k]) * x
            assert tree_allclose(gx.jacve(f)(_X), jax.jacrev(f)(_X))


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz"])
def test_closed_over_indices_shape_the_pattern_as_eagerly(order, eager_only):
    # Index arrays known now give static patterns; a compiled run knows them too.
    for idx in [[2, 0, 1, 1], [3, 3, 0, 2], [2, 0, 1, 1]]:
        idx = jnp.array(idx)

        def f(x):
            return jnp.cumsum(jnp.sin(x)[idx]) * x[idx]

        jac = gx.jacve(f, order=order, count_ops=True, sparse_representation=True)
        reference, reference_counts = eager_only(jac, _X)
        for _ in range(2):
            ours, counts = jac(_X)
            assert counts == reference_counts
            assert type(ours) is type(reference)
            assert repr(ours) == repr(reference)
            assert tree_allclose(ours.dense(), jax.jacrev(f)(_X))
    assert _compiled() == 2


def test_indices_computed_from_closed_over_floats_as_eagerly(eager_only):
    for where in [[0.2, 2.7, 1.1], [3.5, 0.0, 0.9], [0.2, 2.7, 1.1]]:
        where = jnp.array(where)

        def f(x):
            return jnp.sin(x[jnp.floor(where * 1.0).astype(jnp.int32)]) * 2.0

        jac = gx.jacve(f, count_ops=True, sparse_representation=True)
        reference, reference_counts = eager_only(jac, _X)
        assert "Coo" in type(reference).__name__
        for _ in range(2):
            ours, counts = jac(_X)
            assert counts == reference_counts
            assert repr(ours) == repr(reference)
            assert tree_allclose(ours.dense(), jax.jacrev(f)(_X))
    assert _compiled() == 2


def test_integer_argument_shapes_the_pattern_as_eagerly(eager_only):
    def f(x, idx):
        return jnp.sin(x[idx]) * 2.0

    jac = gx.jacve(f, count_ops=True, sparse_representation=True)
    for idx in [jnp.array([1, 0]), jnp.array([3, 1]), jnp.array([1, 0])]:
        reference, reference_counts = eager_only(jac, _X, idx)
        for _ in range(2):
            ours, counts = jac(_X, idx)
            assert counts == reference_counts
            assert repr(ours) == repr(reference)
            assert tree_allclose(ours.dense(), jax.jacrev(f)(_X, idx))
    assert _compiled() == 2


def test_index_computed_from_differentiated_input_stays_eager():
    f = lambda x: x[jnp.argmax(x)] * jnp.sin(x)
    jac = gx.jacve(f, count_ops=True)
    for x in [_X, _X[::-1], _X]:
        for _ in range(2):
            ours, _ = jac(x)
            assert tree_allclose(ours, jax.jacrev(f)(x))
    assert _compiled() == 0


@pytest.mark.parametrize("sparse", [False, True])
def test_same_results_as_an_eager_run(sparse, eager_only):
    def f(x, y):
        z = jnp.sin(x) * y[0] + jnp.roll(x, 1) ** 2
        return {"a": z, "b": jnp.sum(z * y[1])}, jnp.max(z)

    y = (jnp.float32(2.0), 3.0)
    x = _X.astype(jnp.float32)
    jac = gx.jacve(
        f, argnums=(1, 0), has_aux=True, count_ops=True, sparse_representation=sparse
    )
    reference = eager_only(jac, x, y)
    jac(x, y)
    ours = jac(x, y)
    assert _compiled() == 1
    assert jax.tree.structure(ours) == jax.tree.structure(reference)
    assert ours[1] == reference[1]
    leaves = zip(jax.tree.leaves(ours[0]), jax.tree.leaves(reference[0]), strict=True)
    for a, b in leaves:
        assert a.dtype == b.dtype
        assert a.weak_type == b.weak_type
        assert a.sharding == b.sharding
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    if not sparse:
        theirs = jax.jacrev(f, argnums=(1, 0), has_aux=True)(x, y)
        assert jax.tree.structure(ours[0]) == jax.tree.structure(theirs)
        assert [a.weak_type for a in jax.tree.leaves(ours[0])] == [
            a.weak_type for a in jax.tree.leaves(theirs)
        ]


def test_aux_and_values_are_read_on_every_call():
    box = {"c": 1.0}
    vjac = gx.value_and_jacve(lambda x: (jnp.sin(x) * box["c"], box["c"]), has_aux=True)
    for c in [1.0, 2.0, 2.0, 4.0, 4.0]:
        box["c"] = c
        (value, aux), jac = vjac(_X)
        assert tree_allclose(value, jnp.sin(_X) * c)
        assert aux == c
        assert tree_allclose(jac, jnp.diag(jnp.cos(_X) * c))


def test_jit_keeps_its_trace_time_values():
    box = {"c": 1.0}
    jitted = jax.jit(gx.jacve(lambda x: jnp.sin(x) * box["c"]))
    first = jitted(_X)
    box["c"] = 3.0
    second = jitted(_X)
    assert tree_allclose(first, second)
    assert tree_allclose(first, jnp.diag(jnp.cos(_X)))
    assert _compiled() == 0 and len(_jacve._SIGHTINGS) == 0


def test_caches_are_bounded(monkeypatch):
    monkeypatch.setattr(_jacve, "_MAX_COMPILED", 2)
    monkeypatch.setattr(_jacve, "_MAX_SIGHTINGS", 3)
    for c in range(1, 6):
        f = lambda x: jnp.sin(x) * float(c)
        for _ in range(2):
            assert tree_allclose(gx.jacve(f)(_X), jnp.diag(jnp.cos(_X) * c))
        assert len(_jacve._COMPILED) <= 2
        assert len(_jacve._SIGHTINGS) <= 3
    assert len(_jacve._COMPILED) == 2


_INDEX = {"value": np.arange(6)}


def _indexed(x):
    idx = _INDEX["value"]
    a = jnp.sin(x)[idx]
    b = jnp.cos(a * x[idx[::-1]])
    c = jnp.cumsum(b)[idx] * a
    return jnp.tanh(c) * jnp.sum(b)


@pytest.mark.parametrize("order", ["markowitz", "min_fill", "auto"])
def test_orders_follow_the_indices_of_each_call(order):
    # Calls whose closed-over indices differ share one analysis of the program; the
    # order a heuristic picks from the partials' patterns must be picked again.
    # (`auto` picks reverse order for both index patterns, at other costs.)
    x = jnp.arange(1.0, 7.0)
    jac = gx.jacve(_indexed, order=order, count_ops=True)
    picked = set()
    for idx in [np.arange(6), np.zeros(6, int), np.arange(6)]:
        _INDEX["value"] = idx
        cost = gx.elimination_cost(_indexed, order=order)(x)
        for _ in range(2):  # eager, then compiled
            ours, counts = jac(x)
            assert counts["order"] == list(cost.order)
            assert counts["num_muls"] == cost.num_muls
            assert tree_allclose(ours, jax.jacrev(_indexed)(x))
        picked.add((tuple(cost.order), cost.num_muls))
    assert len(picked) == 2


def test_searched_order_is_checked_against_the_indices_of_each_call():
    x = jnp.arange(1.0, 7.0)
    _INDEX["value"] = np.arange(6)
    order = gx.search_order(_indexed, budget_s=0.2, progress=False)(x).order
    gx.jacve(_indexed, order=order)(x)
    _INDEX["value"] = np.zeros(6, int)
    with pytest.raises(ValueError, match="different computational graph"):
        gx.jacve(_indexed, order=order)(x)
    _INDEX["value"] = np.arange(6)


def _array_program(x):
    # Enough distinct operations on arrays to compile on the first call.
    y = jnp.pad(x, (1, 1), mode="reflect")
    return jnp.cumsum(jnp.sin(y[1:] * y[:-1]))[::2] + jnp.outer(x, x).sum(0)[:4]


def test_array_program_compiles_on_its_first_call():
    x = jnp.linspace(0.1, 1.0, 6)
    jac = gx.jacve(_array_program)
    assert tree_allclose(jac(x), jax.jacfwd(_array_program)(x))
    assert _compiled() == 1
    assert tree_allclose(jac(2 * x), jax.jacfwd(_array_program)(2 * x))
    assert _compiled() == 1


def test_scalar_program_runs_eagerly_on_its_first_call():
    def f(a, b):
        return jnp.sin(a * b) + jnp.cos(a) / b, a * jnp.exp(b)

    jac = gx.jacve(f, argnums=(0, 1))
    want = jax.jacrev(f, argnums=(0, 1))(0.3, 1.2)
    assert tree_allclose(jac(0.3, 1.2), want)
    assert _compiled() == 0
    assert tree_allclose(jac(0.3, 1.2), want)
    assert _compiled() == 1


def test_loop_over_closed_over_floats_compiles_once():
    # Every call has a new literal, so a new key: only the first call compiles, the
    # rest run eagerly (as they did before), and each reads its own value.
    x = jnp.linspace(0.1, 1.0, 6)
    for i in range(4):
        t = 0.25 * (i + 1)

        def f(u):
            return jnp.cumsum(jnp.sin(t * u[1:]) * jnp.pad(u, 1)[2:-1]) + t * u[:-1]

        assert tree_allclose(gx.jacve(f)(x), jax.jacfwd(f)(x))
        assert _compiled() == 1


def test_array_program_with_custom_rules_compiles_on_its_first_call():
    # `jax.nn.relu` has a custom JVP: its rule is traced into the first call's key.
    model = eqx.nn.MLP(4, 3, 8, 2, key=jr.key(0))
    x = jnp.array([0.3, -1.2, 2.0, 0.7])
    jac = gx.filter_jacve(lambda m, x: m(x))
    want = eqx.filter_jacrev(lambda m, x: m(x))(model, x)
    assert tree_allclose(jac(model, x), want)
    assert _compiled() == 1
    assert tree_allclose(jac(model, x), want)
    assert _compiled() == 1


@pytest.mark.parametrize("sparse", [False, True])
def test_each_order_compiles_on_its_first_call(sparse):
    # Trying several orders on one function: each order's first eager call compiles,
    # rather than running operation by operation; a repeat call reuses it.
    x = jnp.linspace(0.1, 1.0, 6)
    want = jax.jacfwd(_array_program)(x)
    orders = ["fwd", "rev", "markowitz"]
    for i, order in enumerate(orders):
        jac = gx.jacve(_array_program, order=order, sparse_representation=sparse)
        got = jac(x)
        assert tree_allclose(got.todense() if sparse else got, want)
        assert _compiled() == i + 1
    for order in orders:
        jac = gx.jacve(_array_program, order=order, sparse_representation=sparse)
        got = jac(2 * x)
        want2 = jax.jacfwd(_array_program)(2 * x)
        assert tree_allclose(got.todense() if sparse else got, want2)
    assert _compiled() == len(orders)
    # The other output kind is a first call of its own.
    gx.jacve(_array_program, order="fwd", sparse_representation=not sparse)(x)
    assert _compiled() == len(orders) + 1


@jax.custom_vjp
def _iterated(x, w):
    return jnp.tanh(w @ x), jnp.sum(x)


def _iterated_fwd(x, w):
    return _iterated(x, w), (x, w)


def _iterated_bwd(res, ct):
    # A transpose that loops, as checkpointed solves do: applied to every row of a
    # dense local Jacobian, eagerly, it runs primitive by primitive.
    x, w = res
    a, b = ct
    y = jnp.tanh(w @ x)
    g = w.T @ (a * (1 - y**2))

    def body(k, acc):
        return acc + b / 4.0

    return lax.fori_loop(0, 4, body, g), jnp.outer(a * (1 - y**2), x)


_iterated.defvjp(_iterated_fwd, _iterated_bwd)


@jax.jit
def _solved(x, w):
    value, total = _iterated(jnp.sin(x), w)
    return value * total


def _solve_like(x, w):
    # Indices computed from `x` shape the graph, read by value as eager JAX reads
    # them: the engine runs one operation at a time (no whole-program compile).
    return _solved(x, w)[jnp.argsort(x)]


def test_eager_dense_jacobians_of_jitted_bodies_are_compiled():
    # From the second eager call on, the local Jacobian of a call inside a jitted
    # function (the same equation objects every trace) runs compiled; values are
    # its arguments, so every call reads them anew.
    from graphax_eqx._rules import fallback

    w = jr.normal(jr.PRNGKey(0), (6, 6))
    jac = gx.jacve(_solve_like, order="rev")
    for k in range(3):
        x = jnp.linspace(-1.0, 1.0, 6) * (k + 1)
        np.testing.assert_allclose(
            jac(x, w), jax.jacrev(_solve_like)(x, w), rtol=1e-5, atol=1e-6
        )
        w = w * 0.5
    compiled = [v for v in fallback._SEEN.values() if not isinstance(v, int)]
    assert compiled, "no local Jacobian was compiled"


_BWD_SCALE = {"value": 1.0}


@jax.custom_vjp
def _scaled(x, w):
    return jnp.tanh(w @ x)


def _scaled_fwd(x, w):
    return _scaled(x, w), (x, w)


def _scaled_bwd(res, g):
    x, w = res
    a = g * (1 - jnp.tanh(w @ x) ** 2)
    return _BWD_SCALE["value"] * (w.T @ a), jnp.outer(a, x)


_scaled.defvjp(_scaled_fwd, _scaled_bwd)


@jax.jit
def _scaled_twice(x, w):
    return _scaled(x, w) * 2.0


def test_compiled_local_jacobians_follow_what_rules_read():
    # The rule reads a value that changes between eager calls: each call runs it
    # as it is now, as an eager `jax.jacrev` of the unjitted function would.
    def f(x, w):
        return _scaled_twice(x, w)[jnp.argsort(x)]

    def unjitted(x, w):
        return (_scaled(x, w) * 2.0)[jnp.argsort(x)]

    w = jr.normal(jr.PRNGKey(0), (5, 5))
    x = jnp.linspace(-1.0, 1.0, 5)
    try:
        for scale in (1.0, 2.0, 3.0, 4.0, 4.0):
            _BWD_SCALE["value"] = scale
            np.testing.assert_allclose(
                gx.jacve(f, order="rev")(x, w),
                jax.jacrev(unjitted)(x, w),
                rtol=1e-5,
                atol=1e-6,
            )
    finally:
        _BWD_SCALE["value"] = 1.0
