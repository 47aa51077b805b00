"""Conventions users bring from JAX and the original graphax, and small faults:
closed-over values re-read eagerly, argnums as `jax.jacrev`, orders that leave out
output vertices, weak types, and clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import graphax_eqx as gx

from .helpers import assert_tree_matches, tree_allclose as _tree_allclose


def tree_allclose(a, b):
    return _tree_allclose(a, b, rtol=1e-5, atol=1e-6)


_X = jnp.array([0.3, -1.2, 2.0])


def test_closed_over_scalar_is_read_on_every_eager_call():
    c = 1.0
    jac = gx.jacve(lambda x: jnp.sin(x) * c)
    first = jac(_X)
    c = 2.0
    second = jac(_X)
    assert tree_allclose(first, jax.jacrev(lambda x: jnp.sin(x) * 1.0)(_X))
    assert tree_allclose(second, jax.jacrev(lambda x: jnp.sin(x) * 2.0)(_X))


def test_closed_over_array_is_read_on_every_eager_call():
    jacs = []
    for w in [jnp.eye(3), 2.0 * jnp.eye(3), jnp.arange(9.0).reshape(3, 3)]:
        jac = gx.jacve(lambda x: jnp.tanh(w @ x), order="markowitz")
        jacs.append((jac(_X), jax.jacrev(lambda x: jnp.tanh(w @ x))(_X)))
    for ours, theirs in jacs:
        assert tree_allclose(ours, theirs)


def test_closed_over_value_is_fixed_under_jit_like_jit():
    box = {"c": 1.0}
    jitted = jax.jit(gx.jacve(lambda x: jnp.sin(x) * box["c"]))
    reference = jax.jit(jax.jacrev(lambda x: jnp.sin(x) * box["c"]))
    first = jitted(_X), reference(_X)
    box["c"] = 3.0
    second = jitted(_X), reference(_X)
    assert tree_allclose(first[0], first[1])
    assert tree_allclose(second[0], second[1])  # both keep the traced value
    assert tree_allclose(second[0], first[0])


@pytest.mark.parametrize(
    "argnums", [range(2), [0, 1], (1, 0), np.int64(1), np.array(0), 1, (1,)]
)
def test_argnums_like_jax(argnums):
    def f(x, y):
        return jnp.sin(x) * y

    ours = gx.jacve(f, argnums=argnums)(_X, 2.0 * _X)
    theirs = jax.jacrev(f, argnums=argnums)(_X, 2.0 * _X)
    assert type(ours) is type(theirs)
    assert tree_allclose(ours, theirs)


def test_order_may_leave_out_output_producers():
    def f(x):
        y = jnp.sin(x) * x
        return jnp.exp(y), jnp.cos(y)

    graph = gx.make_graph(f)(_X)
    producers = {
        v.id
        for e in graph.edges
        for v in graph.vertices
        if e.dst in graph.outputs and v.id == e.src
    }
    assert producers
    partial_order = [v for v in graph.intermediates if v not in producers][::-1]
    ours = gx.jacve(f, order=partial_order)(_X)
    assert tree_allclose(ours, jax.jacrev(f)(_X))
    counts = graph.counts(partial_order)
    assert counts["order"][-len(producers) :] == sorted(producers)


def test_order_missing_other_vertices_is_refused():
    f = lambda x: jnp.exp(jnp.sin(x) * x)
    graph = gx.make_graph(f)(_X)
    with pytest.raises(ValueError, match="missing vertices"):
        gx.jacve(f, order=list(graph.intermediates)[1:])(_X)


@pytest.mark.parametrize("order", [{1, 2, 3}, {1: 0, 2: 0, 3: 0}, frozenset({1})])
def test_unordered_orders_are_refused(order):
    with pytest.raises(TypeError, match="no order of its own"):
        gx.jacve(jnp.sin, order=order)
    with pytest.raises(TypeError, match="no order of its own"):
        gx.filter_jacve(jnp.sin, order=order)


def test_order_names_are_case_insensitive():
    f = lambda x: jnp.sin(x) * jnp.sum(x)
    assert tree_allclose(gx.jacve(f, order="Markowitz")(_X), jax.jacrev(f)(_X))
    assert tree_allclose(gx.jacve(f, order="REV")(_X), jax.jacrev(f)(_X))


def test_python_scalars_keep_weak_type():
    f = lambda x, y: x * y
    for args in [(1.0, 2.0), (1.0, jnp.float32(2.0)), (jnp.float32(1.0), 2.0)]:
        ours = gx.jacve(f, argnums=(0, 1))(*args)
        theirs = jax.jacrev(f, argnums=(0, 1))(*args)
        assert [o.weak_type for o in ours] == [t.weak_type for t in theirs]
        assert [o.dtype for o in ours] == [t.dtype for t in theirs]
    value, _ = gx.value_and_jacve(lambda x: 2 * x)(1.0)
    assert value.weak_type == jax.value_and_grad(lambda x: 2 * x)(1.0)[0].weak_type


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz"])
@pytest.mark.parametrize("jit", [False, True])
def test_structured_results_of_python_scalars_are_weak_when_dense(order, jit):
    # `.dense()` of a structured block types its entries as `jax.jacrev` does, so
    # that they promote alike (with a float16 array, say).
    f = lambda x, y: (jnp.sin(x) * y, {"a": x * jnp.ones(3) + y})
    args = (0.4, jnp.float32(2.0))
    jac = gx.jacve(f, order=order, argnums=(0, 1), sparse_representation=True)
    jac = jax.jit(jac) if jit else jac
    ours = jax.tree.leaves(jac(*args), is_leaf=lambda b: isinstance(b, gx.SparseTensor))
    theirs = jax.tree.leaves(jax.jacrev(f, argnums=(0, 1))(*args))
    dense = [b.dense() for b in ours]
    assert [d.weak_type for d in dense] == [t.weak_type for t in theirs]
    assert [d.weak_type for d in dense] == [True, False, True, False]
    assert tree_allclose(dense, theirs)


def test_has_aux_single_output_message():
    with pytest.raises(TypeError, match=r"pair `\(output, aux\)`.*single array"):
        gx.jacve(jnp.sin, has_aux=True)(_X)


def test_string_output_is_an_output_problem():
    with pytest.raises(TypeError, match="output of type str"):
        gx.jacve(lambda x: "abc")(_X)


def test_graph_counts_names_itself():
    graph = gx.make_graph(jnp.sin)(_X)
    with pytest.raises(ValueError, match="`Graph.counts`"):
        graph.counts("bogus")


def test_constant_scaled_identity_is_shown_as_such():
    graph = gx.make_graph(lambda x: 2.0 * x + x)(_X)
    structures = [e.structure for e in graph.edges]
    assert any("c·identity" in s for s in structures)
    assert any("val=1; a: identity" in s for s in structures)
    st = gx.jacve(lambda x: 2.0 * x, sparse_representation=True)(_X)
    assert "identity" in repr(st)


def test_string_in_a_differentiated_argument_is_an_argument_problem():
    with pytest.raises(TypeError, match="leaf of argument 1 of type str"):
        gx.jacve(lambda x, y: x * y[0], argnums=1)(_X, (1.0, "b"))


def test_arguments_not_differentiated_reach_the_function_as_passed():
    # As with `jax.jacrev`: Python numbers stay Python numbers (they can size a loop
    # or a shape), strings and other objects pass through, keyword arguments too.
    def f(x, n, shape, flag, scale=1.0, label="a"):
        for _ in range(n):
            x = jnp.sin(x) * x
        x = x.reshape(shape) if flag else x
        return x * scale * len(label) + jnp.arange(shape[0])[:, None]

    x = jnp.linspace(0.2, 0.9, 4)
    args = (x, 3, (2, 2), True)
    kwargs = {"scale": 0.5, "label": "abc"}
    expected = jax.jacrev(f)(*args, **kwargs)
    for order in ("fwd", "rev", "markowitz"):
        got = gx.jacve(f, order=order)(*args, **kwargs)
        assert_tree_matches(got, expected)
        jitted = jax.jit(gx.jacve(f, order=order), static_argnums=(1, 2, 3, 4, 5))
        assert_tree_matches(jitted(*args, *kwargs.values()), expected)
    # A closed-over array argument is read anew on every call.
    g = lambda x, w: jnp.tanh(w * x)
    jac = gx.jacve(g)
    for w in (1.0, 2.0, 3.0):
        wa = jnp.full(4, w)
        assert_tree_matches(jac(x, wa), jax.jacrev(g)(x, wa))


def test_aux_objects_the_function_did_not_compute_come_back_as_they_are():
    # Outside `jit`, `jax.jacrev` returns aux leaves that the trace never touched
    # (NumPy arrays and scalars, Python objects, strings) as they are; under `jit`
    # and `vmap` they become arrays, as there.
    index = np.arange(3)

    def f(x):
        aux = {"index": index, "scale": np.float32(2.0), "tag": "run", "y": x * 2.0}
        return jnp.sin(x), aux

    x = jnp.linspace(0.1, 0.5, 3)
    want_jac, want_aux = jax.jacrev(f, has_aux=True)(x)
    (_, aux_of_value), jac_of_value = gx.value_and_jacve(f, has_aux=True)(x)
    for jac, aux in (gx.jacve(f, has_aux=True)(x), (jac_of_value, aux_of_value)):
        assert_tree_matches(jac, want_jac)
        assert aux["index"] is index and aux["tag"] == "run"
        assert type(aux["scale"]) is np.float32
        assert isinstance(aux["y"], jax.Array)
        np.testing.assert_allclose(aux["y"], want_aux["y"])
    g = lambda x: (f(x)[0], {k: v for k, v in f(x)[1].items() if k != "tag"})
    got = jax.jit(gx.jacve(g, has_aux=True))(x)[1]
    want = jax.jit(jax.jacrev(g, has_aux=True))(x)[1]
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert isinstance(a, jax.Array) and a.dtype == b.dtype
        np.testing.assert_allclose(a, b)


def test_outputs_the_function_did_not_compute_come_back_as_they_are():
    # `jax.value_and_grad` and `eqx.filter_value_and_grad` return an output the trace
    # never touched (a Python float, a NumPy scalar) as it is, outside `jit`.
    import equinox as eqx

    scale = np.float32(3.0)
    for value_and_jac, reference in (
        (gx.value_and_jacve, jax.value_and_grad),
        (gx.filter_value_and_jacve, eqx.filter_value_and_grad),
    ):
        for f in (lambda x: 2.0, lambda x: scale):
            value, jac = value_and_jac(f)(_X)
            want_value, want_grad = reference(f)(_X)
            assert type(value) is type(want_value) and value == want_value
            assert_tree_matches(jac, want_grad)
    f = lambda x: (2.0, jnp.sin(x).sum())
    (const, y), (jconst, jy) = gx.value_and_jacve(f)(_X)
    assert type(const) is float and isinstance(y, jax.Array)
    assert_tree_matches((jconst, jy), jax.jacrev(f)(_X))
    (const, _), _ = jax.jit(gx.value_and_jacve(f))(_X)
    assert isinstance(const, jax.Array) and const.weak_type


def _branchy(x):
    if x.sum() > 0:
        return jnp.sin(x) * x[0]
    return jnp.cos(x)


def _sized(x):
    n = int(jnp.argmax(x)) + 1
    return jnp.cumsum(x[:n] ** 2)


def _selected(x):
    idx = jnp.nonzero(x > 0.5)[0]
    return jnp.exp(x[idx]) * x[0]


@pytest.mark.parametrize("fun", [_branchy, _sized, _selected])
@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz", "auto"])
def test_eager_python_may_read_differentiated_values(fun, order):
    # As eager `jax.jacrev`: `fun` is linearised at the values and the linear
    # function's graph eliminated; both branches are reached across the inputs.
    for x in (jnp.array([0.3, 0.9, 0.7, 0.2]), jnp.array([-0.3, 0.6, -0.7, 0.2])):
        want = jax.jacrev(fun)(x)
        assert tree_allclose(gx.jacve(fun, order=order)(x), want)
        sparse = gx.jacve(fun, order=order, sparse_representation=True)(x)
        np.testing.assert_allclose(sparse.dense(), want, rtol=1e-5, atol=1e-6)
        (value, jac), counts = gx.value_and_jacve(fun, order=order, count_ops=True)(x)
        assert tree_allclose(value, fun(x)) and tree_allclose(jac, want)
        assert set(counts) >= {"num_muls", "num_adds", "order"}
        aux_fun = lambda x: (fun(x), {"total": x.sum(), "tag": "run"})
        jac, aux = gx.jacve(aux_fun, order=order, has_aux=True)(x)
        assert tree_allclose(jac, want) and aux["tag"] == "run"
        np.testing.assert_allclose(aux["total"], x.sum())


def test_eager_python_on_values_with_pytrees_and_argnums():
    def f(x, y):
        if (x * y["b"]).sum() > 0:
            return {"p": jnp.sin(x) * y["b"], "q": y["b"] ** 2}
        return {"p": x, "q": y["b"]}

    x, y = jnp.array([0.3, 0.9, -0.7]), {"b": jnp.array([1.0, 2.0, -1.0])}
    for argnums in (0, 1, (0, 1), (1,)):
        assert_tree_matches(
            gx.jacve(f, argnums=argnums)(x, y), jax.jacrev(f, argnums=argnums)(x, y)
        )


def test_eager_python_on_values_of_an_equinox_model():
    import equinox as eqx

    class Gate(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            if self.w @ x > 0:
                return jnp.tanh(self.w * x)
            return self.w * x

    for w in (jnp.array([0.5, -0.2, 0.1]), jnp.array([-0.5, -0.2, 0.1])):
        model, x = Gate(w), jnp.array([0.4, 0.3, 0.8])
        got = gx.filter_jacve(lambda m, x: m(x))(model, x)
        want = eqx.filter_jacrev(lambda m, x: m(x))(model, x)
        assert tree_allclose(got.w, want.w)
        value, grads = gx.filter_value_and_jacve(lambda m, x: jnp.sum(m(x)))(model, x)
        want_value, want_grads = eqx.filter_value_and_grad(lambda m, x: jnp.sum(m(x)))(
            model, x
        )
        assert tree_allclose(value, want_value)
        assert tree_allclose(grads.w, want_grads.w)


def test_python_on_differentiated_values_where_no_graph_exists():
    x = jnp.array([0.3, 0.9, 0.7])
    # Under `jit`, JAX's own error, as `jax.jit(jax.jacrev(f))` raises.
    with pytest.raises(jax.errors.TracerBoolConversionError):
        jax.jit(gx.jacve(_branchy))(x)
    with pytest.raises(jax.errors.TracerBoolConversionError):
        jax.vmap(gx.jacve(_branchy))(x[:, None])
    with pytest.raises(ValueError, match="explicit order.*depends on the values"):
        gx.jacve(_branchy, order=[1, 2])(x)
    for api in (gx.make_graph, gx.elimination_cost):
        with pytest.raises(TypeError, match="depends on the values"):
            api(_branchy)(x)
    with pytest.raises(TypeError, match="depends on the values"):
        gx.search_order(_branchy, budget_s=0.1, progress=False)(x)


def test_eager_python_on_values_with_custom_vjp_and_static_sizes():
    # A `custom_vjp` function in the linearisation is a step that can only be
    # transposed (`custom_lin`): its Jacobian is read off its transpose. Sizes
    # computed from values (`jnp.zeros(n)`) raise `TypeError` in tracing, not a
    # tracer error, and are linearised too.
    @jax.custom_vjp
    def wave(x, y):
        return jnp.sin(x) * y, x.sum() * y

    wave.defvjp(
        lambda x, y: (wave(x, y), (x, y)),
        lambda r, g: (
            jnp.cos(r[0]) * r[1] * g[0] + g[1] * r[1].sum(),
            jnp.sin(r[0]) * g[0] + g[1] * r[0].sum(),
        ),
    )

    def f(x, y):
        n = int((x > 0).sum())
        a, b = wave(x, y)
        return {"a": a, "b": b[:n] + jnp.zeros(n), "c": jnp.tile(y, n) * x[0]}

    x, y = jnp.array([0.5, -0.2, 0.9]), jnp.array([1.5, 2.0, -0.7])
    for argnums in (0, 1, (0, 1)):
        want = jax.jacrev(f, argnums=argnums)(x, y)
        for order in ("fwd", "rev", "auto"):
            got = gx.jacve(f, order=order, argnums=argnums)(x, y)
            assert_tree_matches(got, want)
    value, _ = gx.value_and_jacve(f)(x, y)
    assert_tree_matches(value, f(x, y))


def test_eager_python_on_values_checks_what_the_function_returns():
    def counted(x):
        n = int((x > 0).sum())
        return jnp.arange(n)  # integer output

    with pytest.raises(TypeError, match="real floating-point outputs.*int"):
        gx.jacve(counted)(jnp.array([0.5, 1.0]))

    def single(x):
        return x[: int((x > 0).sum())]

    with pytest.raises(TypeError, match="expects the function to return a pair"):
        gx.jacve(single, has_aux=True)(jnp.array([0.5, 1.0]))
