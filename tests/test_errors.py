"""Errors raised by `jacve` at its API boundary."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import graphax_eqx

from .helpers import graph_of


def _f(x):
    return jnp.sin(jnp.exp(x)) * jnp.cos(x)


def _x():
    return jnp.linspace(0.1, 0.9, 3)


@pytest.mark.parametrize(
    "arg, pattern",
    [
        (jnp.arange(3), r"int"),
        (jnp.arange(3, dtype=jnp.int32), r"int32|int"),
        (np.arange(3, dtype=np.int8), r"int8|int"),
        (jnp.array([True, False]), r"bool"),
        (jnp.array([1.0 + 2.0j, 0.5j]), r"complex"),
        (3, r"int"),
    ],
    ids=["int64", "int32", "numpy_int8", "bool", "complex", "python_int"],
)
def test_non_float_argument_type_error(arg, pattern):
    with pytest.raises(TypeError, match=pattern):
        graphax_eqx.jacve(lambda x: x * 2)(arg)


def test_key_argument_type_error():
    f = lambda key, x: x * jax.random.normal(key, (3,))
    with pytest.raises(TypeError, match=r"PRNG key.*argnums"):
        graphax_eqx.jacve(f, argnums=0)(jax.random.key(0), _x())
    # Left undifferentiated it is fine.
    graphax_eqx.jacve(f, argnums=1)(jax.random.key(0), _x())


def test_float0_argument_type_error():
    z = np.zeros(3, dtype=jax.dtypes.float0)
    with pytest.raises(TypeError, match=r"dtype float0.*argnums"):
        graphax_eqx.jacve(lambda x: x)(z)


def test_non_float_leaf_in_pytree_type_error():
    tree = {"w": jnp.ones(2), "n": jnp.arange(2)}
    with pytest.raises(TypeError, match=r"int"):
        graphax_eqx.jacve(lambda t: t["w"] * t["n"])(tree)


def test_non_float_second_argnum_type_error():
    f = lambda x, n: x * n
    with pytest.raises(TypeError, match=r"int"):
        graphax_eqx.jacve(f, argnums=(0, 1))(jnp.ones(2), jnp.arange(2))
    # Left undifferentiated it is fine.
    graphax_eqx.jacve(f, argnums=0)(jnp.ones(2), jnp.arange(2))


@pytest.mark.parametrize(
    "fun, pattern",
    [
        (lambda x: x * 1j, r"complex64.*jnp\.real"),
        (lambda x: (x > 0).astype(jnp.int32), r"int32.*has_aux"),
    ],
    ids=["complex", "int"],
)
def test_non_float_output_type_error(fun, pattern):
    with pytest.raises(TypeError, match=pattern):
        graphax_eqx.jacve(fun)(jnp.ones(2, jnp.float32))


def test_value_and_jacve_non_float_type_error():
    with pytest.raises(TypeError, match=r"int"):
        graphax_eqx.value_and_jacve(lambda x: x * 2)(jnp.arange(3))


@pytest.mark.parametrize("argnums", [2, 5, (0, 2), (3,)])
def test_argnums_out_of_range(argnums):
    f = lambda x, y: x * y
    with pytest.raises(ValueError, match=r"argnums|[25]"):
        graphax_eqx.jacve(f, argnums=argnums)(jnp.ones(2), jnp.ones(2))


def test_no_positional_arguments():
    with pytest.raises(ValueError, match=r"without positional arguments"):
        graphax_eqx.jacve(lambda: jnp.ones(3))()


def _branches_on_its_input(x):
    if x[0] > 0:
        return 2.0 * x
    return x


class _Branching(eqx.Module):
    weight: jax.Array

    def __call__(self, x):
        return _branches_on_its_input(self.weight * x)


@pytest.mark.parametrize(
    "api", ["jacve", "filter_jacve", "filter_value_and_jacve", "eqx_jacve"]
)
def test_tracing_errors_name_the_function(api):
    # Under `jit`, JAX's error for Python control flow on a traced value names the
    # user's function (not an internal wrapper), as `jax.jit` of that function would.
    # Eagerly such Python runs on the values, as in `jax.jacrev`.
    differentiate = getattr(graphax_eqx, api)
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        jax.jit(differentiate(_branches_on_its_input))(jnp.ones(3))
    assert "_branches_on_its_input" in str(info.value)
    assert "flat_fun" not in str(info.value)
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        eqx.filter_jit(differentiate(_Branching(jnp.ones(3))))(jnp.ones(3))
    assert "flat_fun" not in str(info.value)
    for x in (jnp.ones(3), -jnp.ones(3)):
        got = differentiate(_branches_on_its_input)(x)
        want = eqx.filter_jacrev(_branches_on_its_input)(x)
        if api == "filter_value_and_jacve":
            got, want = got[1], (_branches_on_its_input(x), want)[1]
        np.testing.assert_allclose(got, want)


@pytest.mark.parametrize("order", ["forwards", "sideways", "", "markowitz2"])
def test_bad_order_string(order):
    with pytest.raises(ValueError, match=r"order"):
        graphax_eqx.jacve(_f, order=order)(_x())


def _intermediates():
    graph = graph_of(_f, (_x(),))
    ids = [int(v) for v in graph.intermediates]
    assert len(ids) >= 3
    return graph, ids


def test_explicit_order_valid():
    _, ids = _intermediates()
    graphax_eqx.jacve(_f, order=ids[::-1])(_x())
    graphax_eqx.jacve(_f, order=tuple(ids))(_x())
    graphax_eqx.jacve(_f, order=np.asarray(ids))(_x())


def test_explicit_order_missing_id():
    _, ids = _intermediates()
    missing = ids[1]
    order = [v for v in ids if v != missing]
    with pytest.raises(ValueError, match=rf"\b{missing}\b"):
        graphax_eqx.jacve(_f, order=order)(_x())


def test_explicit_order_duplicate_id():
    _, ids = _intermediates()
    duplicate = ids[0]
    order = ids + [duplicate]
    with pytest.raises(ValueError, match=rf"\b{duplicate}\b"):
        graphax_eqx.jacve(_f, order=order)(_x())


def test_explicit_order_unknown_id():
    _, ids = _intermediates()
    unknown = 9999
    with pytest.raises(ValueError, match=rf"\b{unknown}\b"):
        graphax_eqx.jacve(_f, order=ids + [unknown])(_x())


def test_explicit_order_several_problems_all_named():
    _, ids = _intermediates()
    order = ids[1:] + [ids[1], 777]
    with pytest.raises(ValueError) as info:
        graphax_eqx.jacve(_f, order=order)(_x())
    message = str(info.value)
    for offending in (ids[0], ids[1], 777):
        assert str(offending) in message


def test_explicit_order_output_vertex():
    graph, ids = _intermediates()
    outputs = [int(v.id) for v in graph.vertices if v.kind == "output"]
    assert outputs
    with pytest.raises(ValueError, match=rf"\b{outputs[0]}\b"):
        graphax_eqx.jacve(_f, order=ids + [outputs[0]])(_x())


def test_explicit_order_input_vertex():
    graph, ids = _intermediates()
    inputs = [int(v.id) for v in graph.vertices if v.kind == "input"]
    assert inputs and all(v < 0 for v in inputs)
    with pytest.raises(ValueError, match=rf"{inputs[0]}\b"):
        graphax_eqx.jacve(_f, order=ids + [inputs[0]])(_x())


def test_explicit_order_errors_name_the_function_called():
    _, ids = _intermediates()
    order = ids[1:]
    with pytest.raises(ValueError, match=r"^`elimination_cost` got an invalid"):
        graphax_eqx.elimination_cost(_f, order=order)(_x())
    with pytest.raises(ValueError, match=r"^`Graph.counts` got an invalid"):
        graphax_eqx.make_graph(_f)(_x()).counts(order)


def test_explicit_order_must_be_flat():
    _, ids = _intermediates()
    with pytest.raises(TypeError, match=r"shape \(1, \d+\).*flat"):
        graphax_eqx.jacve(_f, order=np.asarray([ids]))(_x())


def test_integer_output_type_error():
    # As with `jax.jacrev`, only real floating outputs have a Jacobian.
    with pytest.raises(TypeError, match=r"int"):
        graphax_eqx.jacve(lambda x: jnp.argmax(x))(_x())


@pytest.mark.parametrize("jit", [False, True])
def test_scatter_apply_has_no_derivative(jit):
    # `x.at[idx].apply(fn)` has no JVP in JAX; `jacve` must not treat it as a
    # scatter of its (dummy) updates.
    def f(x):
        return x.at[jnp.array([1, 3])].apply(jnp.sin)

    with pytest.raises(NotImplementedError):
        jax.jacrev(f)(_x())
    jac = graphax_eqx.jacve(f)
    with pytest.raises(TypeError, match=r"at\[idx\]\.set\(fn\(x\[idx\]\)\)"):
        (jax.jit(jac) if jit else jac)(_x())


@pytest.mark.parametrize("order", ["fwd", "rev", "auto"])
def test_collectives_over_a_mapped_axis_are_refused(order):
    # Inside `vmap(..., axis_name=...)` each batch element holds one piece of the
    # function, and JAX's two modes disagree on the Jacobian of a collective there:
    # `psum(sin(x)) * x` gives three different answers (jacfwd, jacrev, and a
    # product of local partials). `jacve` refuses instead of picking one.
    def f(x):
        return jax.lax.psum(jnp.sin(x), "i") * x

    x = jnp.linspace(0.1, 0.8, 8).reshape(8, 1)
    rev = jax.vmap(jax.jacrev(f), axis_name="i")(x)
    fwd = jax.vmap(jax.jacfwd(f), axis_name="i")(x)
    assert not np.allclose(rev, fwd)
    with pytest.raises(TypeError, match=r"collective `psum`.*jax\.lax\.psum\("):
        jax.vmap(graphax_eqx.jacve(f, order=order), axis_name="i")(x)
    # A collective the differentiated input does not reach is no obstacle.
    g = lambda x, w: jnp.sin(x) * jax.lax.psum(w, "i")
    got = jax.vmap(graphax_eqx.jacve(g, order=order), axis_name="i")(x, x)
    want = jax.vmap(jax.jacrev(g), axis_name="i")(x, x)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def _vmapped(fn):
    return lambda x: jax.vmap(fn, axis_name="b")(x)


_INNER_COLLECTIVES = [
    # (function, the same function written with reductions)
    (
        _vmapped(lambda v: jnp.sin(v) - jax.lax.pmean(v**2, "b")),
        lambda x: jnp.sin(x) - jnp.mean(x**2),
    ),
    (
        _vmapped(lambda v: jnp.sin(v) - jax.lax.pmax(v**2, "b") + jax.lax.pmin(v, "b")),
        lambda x: jnp.sin(x) - jnp.max(x**2) + jnp.min(x),
    ),
    (
        _vmapped(lambda v: v * sum(jax.lax.psum((v**2, jnp.cos(v)), "b"))),
        lambda x: x * (jnp.sum(x**2) + jnp.sum(jnp.cos(x))),
    ),
    (
        lambda x: jax.vmap(
            jax.vmap(lambda v: v * jax.lax.psum(v**2, ("i", "j")), axis_name="j"),
            axis_name="i",
        )(x.reshape(2, 3)).reshape(-1),
        lambda x: x * jnp.sum(x**2),
    ),
    (
        lambda x: jax.lax.scan(
            lambda c, _: (
                _vmapped(lambda v: jnp.sin(v) * jax.lax.pmean(v, "b"))(c),
                None,
            ),
            x,
            length=3,
        )[0],
        lambda x: jax.lax.scan(
            lambda c, _: (jnp.sin(c) * jnp.mean(c), None), x, length=3
        )[0],
    ),
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz", "auto"])
@pytest.mark.parametrize("fun, plain", _INNER_COLLECTIVES)
def test_collectives_over_an_axis_mapped_inside_are_reductions(fun, plain, order, jit):
    # A `vmap(..., axis_name=...)` traced inside the function leaves collectives
    # over positional axes: plain sums, maxima and minima (`eqx.nn.BatchNorm` in
    # training mode). JAX has no derivative of `pmax`/`pmin`; compare with the
    # reductions they are.
    x = jnp.array([1.0, 2.0, 0.5, -1.5, 0.25, 3.0])
    jac = graphax_eqx.jacve(fun, order=order)
    got = (jax.jit(jac) if jit else jac)(x)
    np.testing.assert_allclose(got, jax.jacfwd(plain)(x), rtol=1e-6, atol=1e-6)


def test_order_arguments_of_other_types():
    _, ids = _intermediates()
    # A bytes object is not read as the ids of its characters.
    with pytest.raises(TypeError, match="type bytes"):
        graphax_eqx.jacve(_f, order=b"rev")(_x())
    # Concrete JAX arrays of ids are accepted as NumPy arrays are.
    jac = graphax_eqx.jacve(_f, order=jnp.asarray(ids))(_x())
    assert np.allclose(jac, jax.jacrev(_f)(_x()))


@pytest.mark.parametrize("seed", [None, 1.5, "1", True])
def test_search_seed_must_be_an_int(seed):
    with pytest.raises(TypeError, match=r"`search_order` got `seed="):
        graphax_eqx.search_order(_f, seed=seed, budget_s=0.1, progress=False)
    found = graphax_eqx.search_order(
        _f, seed=np.int64(3), budget_s=0.0, max_evals=5, progress=False
    )(_x())
    assert found.seed == 3 and type(found.seed) is int


@pytest.mark.parametrize(
    "make", ["filter_jacve", "filter_value_and_jacve", "eqx_jacve"]
)
def test_equinox_layer_errors_name_the_function_called(make):
    transform = getattr(graphax_eqx, make)
    with pytest.raises(TypeError, match=rf"^`{make}` expects a callable, got int"):
        transform(3)
    with pytest.raises(TypeError, match=rf"^`{make}` needs real floating-point"):
        transform(lambda x: jnp.argmax(x))(_x())
    with pytest.raises(
        TypeError, match=rf"^`{make}\(\.\.\., has_aux=True\)`.*a single array of shape"
    ):
        transform(lambda x: x * 2.0, has_aux=True)(_x())
    with pytest.raises(TypeError, match=r"returned a tuple of 3 elements, not 2"):
        transform(lambda x: (x, x, x), has_aux=True)(_x())


@pytest.mark.parametrize("out", [(1.0, 2.0, 3.0), [1.0]])
def test_has_aux_output_of_wrong_length_is_named(out):
    fun = lambda x: tuple(x * v for v in out) if isinstance(out, tuple) else [x]
    kind = type(out).__name__
    with pytest.raises(TypeError, match=rf"returned a {kind} of {len(out)} elements"):
        graphax_eqx.jacve(fun, has_aux=True)(_x())


def test_equinox_runtime_errors_raise_as_in_equinox(caplog):
    # An `eqx.error_if` that fires raises `eqx.EquinoxRuntimeError` with its message
    # in every eager call, as eager `jax.jacfwd` does, not the runtime error of the
    # callback it runs as. (Its check reads the differentiated input, so such a
    # program always runs operation by operation: it is never compiled eagerly.)
    def f(x):
        x = eqx.error_if(x, x < 0, "negative input")
        return jnp.sin(x)

    with pytest.raises(eqx.EquinoxRuntimeError, match="negative input"):
        jax.jacfwd(f)(-jnp.ones(3))
    for jac in (
        graphax_eqx.jacve(f),
        graphax_eqx.filter_jacve(f),
        graphax_eqx.filter_value_and_jacve(f),
    ):
        for _ in range(3):
            with pytest.raises(eqx.EquinoxRuntimeError, match="^negative input$"):
                jac(-jnp.ones(3))
        np.testing.assert_allclose(
            np.asarray(graphax_eqx.jacve(f)(jnp.ones(3))), np.diag(np.cos(np.ones(3)))
        )
    with pytest.raises(eqx.EquinoxRuntimeError, match="negative input"):
        eqx.filter_jit(graphax_eqx.filter_jacve(f))(-jnp.ones(3))
    # JAX's log of the failed callback, with its traceback, is left out, as
    # `eqx.filter_jit` leaves it out.
    assert not [r for r in caplog.records if "pure_callback" in r.getMessage()]


def test_equinox_runtime_errors_after_calls_that_passed():
    # Calls that pass first, then one that fails: the same `EquinoxRuntimeError`,
    # whichever way the failing call runs.
    def f(x):
        x = eqx.error_if(x, x > 5.0, "too big")
        return jnp.sin(x)

    x = jnp.linspace(0.1, 1.0, 4)
    jac = graphax_eqx.jacve(f)
    for _ in range(3):
        np.testing.assert_allclose(jac(x), jax.jacrev(f)(x), rtol=1e-6)
    for fresh in (jac, graphax_eqx.jacve(f), graphax_eqx.filter_jacve(f)):
        with pytest.raises(eqx.EquinoxRuntimeError, match="^too big$"):
            fresh(10 * x)
