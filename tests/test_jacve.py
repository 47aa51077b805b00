"""The public interface of `jacve`, `value_and_jacve` and `make_graph`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import graphax_eqx

from .helpers import ORDERS, assert_tree_matches, check_jacve, graph_of


def _f(x, y):
    return {"p": jnp.sin(x) * y, "q": (jnp.sum(x * x), jnp.exp(y))}


def _args():
    return jnp.array([0.1, -0.4, 0.7]), jnp.array([1.5, -0.2, 0.3])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("argnums", [0, 1, (0,), (1, 0), (0, 1)])
def test_structure_like_jacrev(order, argnums):
    check_jacve(_f, _args(), order, argnums=argnums)


def test_default_order_is_auto():
    x, y = _args()
    default = graphax_eqx.jacve(_f)(x, y)
    auto = graphax_eqx.jacve(_f, order="auto")(x, y)
    assert_tree_matches(default, auto)
    assert_tree_matches(default, jax.jacrev(_f)(x, y))


@pytest.mark.parametrize("alias, canonical", [("forward", "fwd"), ("reverse", "rev")])
def test_order_aliases(alias, canonical):
    x, y = _args()
    a = graphax_eqx.jacve(_f, order=alias, argnums=(0, 1))(x, y)
    b = graphax_eqx.jacve(_f, order=canonical, argnums=(0, 1))(x, y)
    assert_tree_matches(a, b)


@pytest.mark.parametrize("order", ORDERS)
def test_python_scalar_argument(order):
    result = check_jacve(lambda x: jnp.sin(x) * x, (0.5,), order)
    assert result.shape == ()
    assert float(result) == pytest.approx(np.cos(0.5) * 0.5 + np.sin(0.5))


# Python reading values computed from arguments that are not differentiated: eager
# `jax.jacrev` computes them on the spot, so they are concrete there.
_READS_A_VALUE = {
    "if": lambda x, y: jnp.sin(x) * (2.0 if y > 0 else -1.0),
    "float": lambda x, y: jnp.sin(x) * float(y * 2),
    "range": lambda x, y: sum(jnp.sin(x) * k for k in range(int(abs(y)) + 1)),
    "numpy": lambda x, y: jnp.sin(x) * np.asarray(jnp.abs(y)),
}


@pytest.mark.parametrize(
    "order", ["fwd", "rev", "markowitz", "relative_markowitz", "min_fill", "auto"]
)
@pytest.mark.parametrize("name", list(_READS_A_VALUE))
def test_python_reads_arguments_not_differentiated(name, order):
    fun = _READS_A_VALUE[name]
    x = jnp.array([0.1, -0.4, 0.7])
    for y in (jnp.array(2.0), jnp.array(-1.0)):
        want = jax.jacrev(fun)(x, y)
        got = graphax_eqx.jacve(fun, order=order)(x, y)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    # Under `jit` the argument is traced, and the error is JAX's own.
    if name == "if":
        with pytest.raises(jax.errors.TracerBoolConversionError):
            jax.jit(graphax_eqx.jacve(fun, order=order))(x, y)


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz", "auto"])
def test_eager_calls_run_fun_once(order):
    # Eager `jax.jacrev` runs `fun`'s Python once per call, also where it reads a
    # value computed from constants only; so does `jacve`, so side effects (a
    # counter, keys drawn from an iterator) happen as often as there.
    flag = jnp.array(1.0)
    calls = []

    def fun(x):
        calls.append(None)
        scale = 2.0 if flag > 0 else -1.0
        steps = int(jnp.sum(jnp.ones(3)))
        return jnp.sin(x) * scale * steps

    x = jnp.array([0.1, -0.4, 0.7])
    want = jax.jacrev(fun)(x)
    assert len(calls) == 1
    for k in range(2):
        calls.clear()
        got = graphax_eqx.jacve(fun, order=order)(x)
        assert len(calls) == 1, f"call {k}: `fun` ran {len(calls)} times"
        np.testing.assert_allclose(got, want, rtol=1e-6)
    # So do `vmap` and a `jacve` of `jacve` (JAX computes such values there too).
    xs = jnp.stack([x, 2.0 * x])
    calls.clear()
    got = jax.vmap(graphax_eqx.jacve(fun, order=order))(xs)
    assert len(calls) == 1
    np.testing.assert_allclose(got, jax.vmap(jax.jacrev(fun))(xs), rtol=1e-6)
    calls.clear()
    got = graphax_eqx.jacve(graphax_eqx.jacve(fun, order=order), order=order)(x)
    assert len(calls) == 1
    np.testing.assert_allclose(got, jax.jacfwd(jax.jacrev(fun))(x), rtol=1e-6)


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz", "auto"])
def test_constant_work_nested_in_fun_runs_as_eagerly(order):
    # Values computed from constants are concrete in `fun` itself, as eagerly, but
    # the bodies of the `jit` and `cond` nested in it are staged as usual: what their
    # untaken branches would do (an `eqx.error_if` that does not fire, a callback)
    # does not run while `fun` is traced.
    flag = jnp.array(1.0)
    ts = jnp.linspace(0.0, 1.0, 4)
    called = []

    def fun(x):
        scale = 2.0 if flag > 0 else 1.0
        t = eqx.error_if(ts, ts[1:] < ts[:-1], "times must increase")

        def untaken(x):
            jax.debug.callback(lambda: called.append(None))
            return x

        y = lax.cond(flag > 0, jnp.sin, untaken, x)
        return y * scale * t[1]

    x = jnp.array([0.1, -0.4, 0.7])
    want = jax.jacrev(fun)(x)
    got = graphax_eqx.jacve(fun, order=order)(x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert not called


def test_constant_work_meets_named_axes_and_keeps_effects_in_order(capfd):
    # What `fun` computes from constants is handed to the trace `jacve` runs under,
    # as JAX's own transformations hand it on: under `vmap` it meets the named axis
    # (`axis_index`, collectives). Ordered effects stay in program order.
    c = jnp.arange(4.0)
    xs = jnp.linspace(0.1, 1.2, 12).reshape(3, 4)
    for fun in (
        lambda x: jnp.sin(x) * lax.axis_index("i"),
        lambda x: jnp.sin(x) * lax.pmax(c[1] * 2.0, "i"),
        lambda x: jnp.sin(x) + jax.jit(lambda: lax.axis_index("i"))(),
    ):
        got = jax.vmap(graphax_eqx.jacve(fun), axis_name="i")(xs)
        want = jax.vmap(jax.jacrev(fun), axis_name="i")(xs)
        np.testing.assert_allclose(got, want, rtol=1e-6)

    def printing(x):
        jax.debug.print("first {}", x[0], ordered=True)
        jax.debug.print("second {}", c[1], ordered=True)
        return jnp.sin(x)

    capfd.readouterr()
    jax.effects_barrier()
    graphax_eqx.jacve(printing)(xs[0])
    jax.effects_barrier()
    out = capfd.readouterr().out
    assert out.index("first") < out.index("second"), out


@pytest.mark.parametrize("order", ORDERS)
def test_numpy_argument(order):
    x = np.array([0.2, -0.3, 0.9])
    check_jacve(lambda v: jnp.tanh(v) @ v, (x,), order)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_dtype_preserved(dtype):
    x = jnp.array([0.2, -0.3, 0.9], dtype)
    result = graphax_eqx.jacve(lambda v: jnp.sin(v) * 2.0)(x)
    assert result.dtype == dtype
    assert result.shape == (3, 3)


def test_leaf_shapes_are_out_then_in():
    x = jnp.ones((2, 3))
    y = jnp.ones((4,))
    f = lambda a, b: (jnp.sum(a, axis=1), jnp.outer(a[0], b))
    result = graphax_eqx.jacve(f, argnums=(0, 1))(x, y)
    assert result[0][0].shape == (2, 2, 3)
    assert result[0][1].shape == (2, 4)
    assert result[1][0].shape == (3, 4, 2, 3)
    assert result[1][1].shape == (3, 4, 4)


@pytest.mark.parametrize("order", ORDERS)
def test_has_aux(order):
    def f(x):
        h = jnp.cos(x)
        return jnp.sum(h * x), {"h": h, "n": 3}

    x = jnp.array([0.3, 0.6])
    references = {
        "fwd": jax.jacfwd(f, has_aux=True)(x),
        "rev": jax.jacrev(f, has_aux=True)(x),
    }
    jac, aux = check_jacve(f, (x,), order, has_aux=True, references=references)
    assert aux["n"] == 3
    assert_tree_matches(aux["h"], jnp.cos(x))


def test_count_ops_false_returns_jacobian_only():
    x = jnp.array([0.3, 0.6])
    result = graphax_eqx.jacve(jnp.sin, count_ops=False)(x)
    assert isinstance(result, jax.Array)


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz", "auto"])
def test_value_and_jacve(order):
    x, y = _args()
    value, jac = graphax_eqx.value_and_jacve(_f, order=order, argnums=(0, 1))(x, y)
    assert_tree_matches(value, _f(x, y))
    assert_tree_matches(jac, jax.jacrev(_f, argnums=(0, 1))(x, y))


def test_value_and_jacve_has_aux():
    def f(x):
        return jnp.sin(x) * x, {"x2": x * 2.0}

    x = jnp.array([0.3, -0.6, 1.1])
    (value, aux), jac = graphax_eqx.value_and_jacve(f, has_aux=True)(x)
    expected_jac, expected_aux = jax.jacrev(f, has_aux=True)(x)
    assert_tree_matches(value, f(x)[0])
    assert_tree_matches(aux, expected_aux)
    assert_tree_matches(jac, expected_jac)


def test_value_and_jacve_default_argnums():
    x = jnp.array([0.3, -0.6])
    value, jac = graphax_eqx.value_and_jacve(lambda a, b: a * b)(x, 2.0)
    assert_tree_matches(value, x * 2.0)
    assert_tree_matches(jac, jax.jacrev(lambda a, b: a * b)(x, 2.0))


# --------------------------------------------------------------------------------------
# make_graph
# --------------------------------------------------------------------------------------


def _name(primitive):
    return getattr(primitive, "name", str(primitive))


def test_make_graph_vertices():
    def f(x):
        return jnp.sin(x) * 2.0

    x = jnp.ones((3,), jnp.float32)
    graph = graphax_eqx.make_graph(f)(x)
    kinds = {v.kind for v in graph.vertices}
    assert kinds == {"input", "intermediate", "output"}
    by_kind = {k: [v for v in graph.vertices if v.kind == k] for k in kinds}
    assert [v.id for v in by_kind["input"]] == [-1]
    intermediates = sorted(v.id for v in by_kind["intermediate"])
    assert intermediates == [1, 2]
    assert tuple(graph.intermediates) == (1, 2)
    assert [v.id for v in by_kind["output"]] == [3]
    assert [
        _name(v.primitive) for v in sorted(by_kind["intermediate"], key=lambda v: v.id)
    ] == ["sin", "mul"]
    for v in graph.vertices:
        assert tuple(v.shape) == (3,)
        assert np.dtype(v.dtype) == np.float32


def test_make_graph_ids_and_edges():
    def f(x, y):
        a = jnp.sin(x)
        b = a * y
        return b, jnp.cos(a)

    graph = graphax_eqx.make_graph(f, argnums=(0, 1))(jnp.ones(2), jnp.ones(2))
    ids = {v.id for v in graph.vertices}
    assert len(ids) == len(graph.vertices)
    kinds = {v.id: v.kind for v in graph.vertices}
    inter = list(graph.intermediates)
    assert inter == sorted(inter)
    assert inter == list(range(1, len(inter) + 1))
    outputs = sorted(i for i, k in kinds.items() if k == "output")
    assert outputs == list(range(len(inter) + 1, len(inter) + 1 + len(outputs)))
    assert len(outputs) == 2
    inputs = [i for i, k in kinds.items() if k == "input"]
    assert sorted(inputs) == [-2, -1]
    assert graph.edges
    for edge in graph.edges:
        assert edge.src in ids and edge.dst in ids
        assert kinds[edge.src] != "output"
        assert kinds[edge.dst] != "input"
    # Every output is reached from an intermediate by one edge.
    dsts = {edge.dst for edge in graph.edges}
    assert set(outputs) <= dsts


def test_make_graph_str():
    graph = graphax_eqx.make_graph(lambda x: jnp.exp(jnp.sin(x)))(jnp.ones(3))
    text = str(graph)
    assert isinstance(text, str) and text
    assert "sin" in text and "exp" in text


def test_make_graph_prunes_constant_work():
    c = jnp.array([0.5, 0.25])

    def f(x):
        return jnp.sin(x) + jnp.cos(c)

    graph = graphax_eqx.make_graph(f)(jnp.ones(2))
    names = {_name(v.primitive) for v in graph.vertices if v.kind == "intermediate"}
    assert "sin" in names
    assert "cos" not in names


def test_make_graph_inlines_jit():
    inner = jax.jit(lambda v: jnp.sin(v) * v)
    graph = graphax_eqx.make_graph(lambda x: jax.jit(inner)(x) + 1.0)(jnp.ones(2))
    names = {_name(v.primitive) for v in graph.vertices if v.kind == "intermediate"}
    assert "sin" in names
    assert not names & {"pjit", "jit", "closed_call"}


def test_make_graph_intermediates_match_jacve_orders():
    def f(x):
        return jnp.tanh(jnp.sin(x) @ x) * x

    x = jnp.array([0.3, -0.1, 0.8])
    graph = graph_of(f, (x,))
    n = len(graph.intermediates)
    rng = np.random.default_rng(0)
    for _ in range(3):
        order = [int(v) for v in rng.permutation(graph.intermediates)]
        assert len(order) == n
        check_jacve(f, (x,), order)


def _chooses_after_arithmetic(a, b):
    # `d` is `a * 0.9 + 0.05`: XLA may contract it into a fused multiply-add in one
    # kernel and not in another (or in a vectorised loop and not in its remainder),
    # so `d` read back next to `min(d, b)` can differ from the `d` the minimum took
    # by a rounding. A derivative that compares an operand with the result then
    # vanished (this program: Markowitz order, sparse output, under jit).
    d = a * 0.9 + 0.05
    lo, hi = jnp.minimum(d, b), jnp.maximum(d, b)
    near = 0.41 + (0.42 - jax.scipy.special.gammaln(lo + hi))
    ratio = lo / hi
    poly = -0.00165 * (1.0 + (ratio / (1.0 + ratio) + 0.67)) * 0.71
    for c in (0.74, 0.77, 0.8, 0.83):
        poly = (poly + c) * 0.71
    poly = (poly + 0.0833) * 0.87
    far = 0.54 * jnp.log1p(lo / hi)
    far = 0.47 + lax.select(far <= 0.94, 0.96 - far, poly - far - 0.94)
    return lax.select(hi < 8.0, near, far)


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz", "min_fill"])
@pytest.mark.parametrize(
    "fun",
    [
        _chooses_after_arithmetic,
        lambda a, b: jax.scipy.special.betaln(a * 0.9 + 0.05, b),
        lambda a, b: jnp.maximum(a * 0.9 + 0.05, b) * jnp.minimum(b * 1.1 - 0.3, a),
    ],
    ids=["reduced", "betaln", "min_max"],
)
@pytest.mark.parametrize("argnums", [0, (0, 1)])
def test_min_max_derivatives_under_jit(fun, order, argnums):
    a = jnp.array([0.2, 0.6, 0.7])
    b = jnp.array([0.3, 0.63, 0.74])
    expected = jax.jacrev(fun, argnums=argnums)(a, b)
    for sparse in (False, True):
        jac = jax.jit(
            graphax_eqx.jacve(
                fun, order=order, argnums=argnums, sparse_representation=sparse
            )
        )(a, b)
        if sparse:
            jac = jax.tree_util.tree_map(
                lambda s: s.dense(), jac, is_leaf=lambda s: hasattr(s, "dense")
            )
        assert_tree_matches(jac, expected)


def _planar_arm(q1, q2, q3, q4):
    # Every joint's sine and cosine is read by the rotations of all later links.
    c, s = jnp.ones_like(q1), jnp.zeros_like(q1)
    x = y = 0.0
    for length, q in zip((1.0, 0.8, 0.6, 0.4), (q1, q2, q3, q4), strict=True):
        cq, sq = jnp.cos(q), jnp.sin(q)
        c, s = c * cq - s * sq, s * cq + c * sq
        x, y = x + length * c, y + length * s
    return x, y, jnp.tan(0.5 * q4) * c


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz"])
def test_sines_are_computed_once(order):
    # XLA CPU counts sines and cosines as cheap and would compute each again inside
    # every kernel that reads it; the compiled program holds each one once.
    key = jax.random.split(jax.random.PRNGKey(0), 4)
    qs = tuple(jax.random.uniform(k, (64,), minval=-3.0, maxval=3.0) for k in key)
    argnums = (0, 1, 2, 3)
    jac = graphax_eqx.jacve(_planar_arm, order=order, argnums=argnums)
    jac = jax.jit(jax.vmap(jac))
    assert_tree_matches(jac(*qs), jax.vmap(jax.jacfwd(_planar_arm, argnums))(*qs))
    if jax.default_backend() == "cpu":
        text = jac.lower(*qs).compile().as_text()
        assert text.count(" sine(") <= 4
        assert text.count(" cosine(") <= 4
        assert text.count(" tan(") <= 1


def test_sines_of_arguments_not_differentiated_are_computed_once():
    # The joint angles are fixed; the Jacobian is taken with respect to the lengths.
    def arm(lengths, q):
        c, s = jnp.cos(jnp.cumsum(q)), jnp.sin(jnp.cumsum(q))
        return lengths * c, lengths * s, jnp.sum(lengths * lengths * c * s)

    lengths = jnp.linspace(0.5, 1.0, 64).reshape(16, 4)
    q = jnp.linspace(-2.0, 2.0, 64).reshape(16, 4)
    jac = jax.jit(jax.vmap(graphax_eqx.jacve(arm)))
    assert_tree_matches(jac(lengths, q), jax.vmap(jax.jacfwd(arm))(lengths, q))
    if jax.default_backend() == "cpu":
        text = jac.lower(lengths, q).compile().as_text()
        assert text.count(" sine(") <= 1
        assert text.count(" cosine(") <= 1


def test_shared_sines_keep_values_and_derivatives():
    # Values as `jax.jit` computes them; derivatives through every transformation.
    x = jnp.linspace(-7.0, 7.0, 29, dtype=jnp.float32)

    def f(x):
        return jnp.sin(x), jnp.cos(x), jnp.tan(0.2 * x)

    values, _ = jax.jit(graphax_eqx.value_and_jacve(f))(x)
    for a, b in zip(values, jax.jit(f)(x), strict=True):
        np.testing.assert_array_equal(a, b)

    def g(x):
        return jnp.sum(jnp.sin(x) * jnp.cos(2 * x))

    xd = x.astype(jnp.float64)
    expected = jax.hessian(g)(xd)
    for order in ("fwd", "rev"):
        inner = graphax_eqx.jacve(g, order=order)
        assert_tree_matches(graphax_eqx.jacve(inner, order=order)(xd), expected)
        assert_tree_matches(jax.jit(jax.jacfwd(inner))(xd), expected)
        assert_tree_matches(jax.jit(jax.jacrev(inner))(xd), expected)
        batch = jnp.stack([xd, 0.5 * xd])
        assert_tree_matches(jax.vmap(inner)(batch), jax.vmap(jax.grad(g))(batch))
