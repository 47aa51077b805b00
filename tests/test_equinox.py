import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import graphax_eqx as gx

from .helpers import tree_allclose as _tree_allclose


ORDERS = ("fwd", "rev", "markowitz", "auto")
# The conftest enables x64; keep models in float32 like most user code.
F32 = jnp.float32


def tree_allclose(x, y):
    return _tree_allclose(x, y, rtol=1e-4, atol=1e-5)


def _f32(*shape, seed=0):
    return jr.normal(jr.PRNGKey(seed), shape, dtype=F32)


class Custom(eqx.Module):
    """A module mixing differentiable and non-differentiable leaves."""

    weight: jax.Array
    bias: jax.Array
    counts: jax.Array
    scale: float
    activation: Callable
    dropout: eqx.nn.Dropout
    name: str = eqx.field(static=True)

    def __init__(self, key):
        self.weight = jr.normal(key, (3, 4), dtype=F32)
        self.bias = jnp.arange(3, dtype=F32) / 3
        self.counts = jnp.array([1, 2, 3], dtype=jnp.int32)
        self.scale = 0.5
        self.activation = jnp.tanh
        self.dropout = eqx.nn.Dropout(0.3, inference=True)
        self.name = "custom"

    def __call__(self, x):
        y = self.weight @ x + self.bias
        y = self.activation(self.scale * y) * self.counts
        return self.dropout(y)


def _mlp():
    model = eqx.nn.MLP(3, 2, width_size=4, depth=2, key=jr.PRNGKey(0), dtype=F32)
    return model, (_f32(3),), lambda m, x: m(x)


def _linear():
    model = eqx.nn.Linear(3, 2, key=jr.PRNGKey(1), dtype=F32)
    return model, (_f32(3),), lambda m, x: jnp.sin(m(x))


def _conv1d():
    model = eqx.nn.Conv1d(2, 2, kernel_size=3, key=jr.PRNGKey(2), dtype=F32)
    return model, (_f32(2, 5),), lambda m, x: m(x).ravel()


def _conv2d():
    model = eqx.nn.Conv2d(1, 2, kernel_size=2, key=jr.PRNGKey(3), dtype=F32)
    return model, (_f32(1, 3, 3),), lambda m, x: jnp.tanh(m(x))


def _conv_pool():
    # Four input features: more kernel entries than the kernel's own pattern takes,
    # so its partial is a linear map while the input's is a pattern.
    conv = eqx.nn.Conv2d(4, 3, kernel_size=3, padding=1, key=jr.PRNGKey(12), dtype=F32)
    pool = eqx.nn.AvgPool2d(2, 1)
    return conv, (_f32(4, 4, 5),), lambda m, x: pool(jax.nn.relu(m(x)))


def _conv_max_pool():
    conv = eqx.nn.Conv2d(2, 3, kernel_size=3, padding=1, key=jr.PRNGKey(14), dtype=F32)
    pool = eqx.nn.MaxPool2d(2, 2)
    return conv, (_f32(2, 4, 6),), lambda m, x: pool(jnp.tanh(m(x)))


def _conv_transpose():
    model = eqx.nn.ConvTranspose1d(
        4, 2, kernel_size=3, stride=2, groups=2, key=jr.PRNGKey(13), dtype=F32
    )
    return model, (_f32(4, 5),), lambda m, x: jnp.tanh(m(x))


def _layer_norm():
    model = eqx.nn.LayerNorm(4, dtype=F32)
    model = eqx.tree_at(lambda m: m.weight, model, _f32(4, seed=4) + 1.0)
    return model, (_f32(4, seed=5),), lambda m, x: m(x)


def _attention():
    model = eqx.nn.MultiheadAttention(2, 4, key=jr.PRNGKey(6), dtype=F32)
    q = _f32(3, 4, seed=7)
    kv = _f32(2, 4, seed=8)
    return model, (q, kv), lambda m, q, kv: m(q, kv, kv)


def _gru():
    model = eqx.nn.GRUCell(3, 2, key=jr.PRNGKey(9), dtype=F32)
    return model, (_f32(3), _f32(2, seed=10)), lambda m, x, h: m(x, h)


def _custom():
    return Custom(jr.PRNGKey(11)), (_f32(4, seed=12),), lambda m, x: m(x)


MODELS = {
    "mlp": _mlp,
    "linear": _linear,
    "conv1d": _conv1d,
    "conv2d": _conv2d,
    "conv_pool": _conv_pool,
    "conv_max_pool": _conv_max_pool,
    "conv_transpose": _conv_transpose,
    "layer_norm": _layer_norm,
    "attention": _attention,
    "gru": _gru,
    "custom": _custom,
}


def _scalar(fn):
    return lambda m, *args: jnp.sum(jnp.tanh(fn(m, *args)))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", MODELS)
def test_scalar_loss_matches_filter_grad(name, order):
    model, args, fn = MODELS[name]()
    loss = _scalar(fn)
    grads = gx.filter_jacve(loss, order=order)(model, *args)
    expected = eqx.filter_grad(loss)(model, *args)
    assert tree_allclose(grads, expected)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", MODELS)
def test_vector_output_matches_filter_jacrev(name, order):
    model, args, fn = MODELS[name]()
    jac = gx.filter_jacve(fn, order=order)(model, *args)
    expected = eqx.filter_jacrev(fn)(model, *args)
    assert tree_allclose(jac, expected)


def test_non_differentiated_leaves_are_none():
    model, (x,), fn = _custom()
    jac = gx.filter_jacve(fn)(model, x)
    assert jac.weight.shape == (3, 3, 4)
    assert jac.bias.shape == (3, 3)
    assert jac.counts is None
    assert jac.scale is None
    assert jac.activation is None
    assert jac.dropout.p is None and jac.dropout.inference is None
    assert jac.name == "custom"


@pytest.mark.parametrize("name", ["mlp", "attention", "custom"])
def test_filter_value_and_jacve_matches_filter_value_and_grad(name):
    model, args, fn = MODELS[name]()
    loss = _scalar(fn)
    value, grads = gx.filter_value_and_jacve(loss)(model, *args)
    expected_value, expected_grads = eqx.filter_value_and_grad(loss)(model, *args)
    assert tree_allclose(value, expected_value)
    assert tree_allclose(grads, expected_grads)


def test_pytree_output():
    model, (x,), fn = _mlp()

    def f(m, x):
        y = fn(m, x)
        return {"y": y, "total": jnp.sum(y**2), "none": None}

    jac = gx.filter_jacve(f, order="markowitz")(model, x)
    assert tree_allclose(jac, eqx.filter_jacrev(f)(model, x))
    assert jac["none"] is None
    assert jac["total"].layers[0].weight.shape == model.layers[0].weight.shape


def test_numpy_and_integer_leaves():
    params = {
        "w": np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(2, 3),
        "n": np.arange(3, dtype=np.int32),
        "flag": True,
        "label": "not an array",
    }
    x = np.ones(3, dtype=np.float32)

    def f(p, x):
        return jnp.cos(p["w"] @ (x * p["n"]))

    jac = gx.filter_jacve(f)(params, x)
    assert jac["w"].shape == (2, 2, 3)
    assert jac["n"] is None and jac["flag"] is None and jac["label"] is None
    assert tree_allclose(jac, eqx.filter_jacrev(f)(params, x))


def test_other_arguments_may_be_anything():
    model, (x,), fn = _mlp()

    class Opaque:
        scale = 2.0

    def f(m, opaque, x, *, name, power, shift):
        assert name == "kw"
        return jnp.sum(opaque.scale * (fn(m, x) + shift) ** power)

    kwargs = dict(name="kw", power=2, shift=jnp.array([0.5, -0.5], dtype=F32))
    grads = gx.filter_jacve(f)(model, Opaque(), x, **kwargs)
    expected = eqx.filter_grad(f)(model, Opaque(), x, **kwargs)
    assert tree_allclose(grads, expected)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Batch:
    """Data that checks what it is built from, as a user's batch class may."""

    x: jax.Array

    def __post_init__(self):
        if jnp.ndim(self.x) != 1:
            raise ValueError("a batch holds a vector")


def test_other_arguments_reach_fun_untouched():
    # As in `eqx.filter_jacrev`, arguments not differentiated are neither taken apart
    # nor rebuilt: a class that checks its fields works, containers are the caller's
    # own (updates in place reach them), as positional and as keyword arguments.
    model, (x,), fn = _mlp()
    seen = []

    def f(m, batch, log, *, extra):
        seen.append((log, extra))
        log["called"] = True
        return fn(m, batch.x) + extra.x[:2]

    batch, extra = _Batch(x), _Batch(jnp.ones(3, F32))
    expected = eqx.filter_jacrev(f)(model, batch, {}, extra=extra)
    apis = {
        "filter_jacve": gx.filter_jacve(f),
        "eqx_jacve": gx.eqx_jacve(f),
        "filter_value_and_jacve": lambda *a, **k: gx.filter_value_and_jacve(
            lambda *a, **k: jnp.sum(f(*a, **k))
        )(*a, **k)[1],
    }
    for name, jac in apis.items():
        log = {}
        seen.clear()
        got = jac(model, batch, log, extra=extra)
        assert log == {"called": True}, name
        assert all(l is log and e is extra for l, e in seen), name
        if name == "filter_value_and_jacve":
            want = eqx.filter_grad(lambda *a, **k: jnp.sum(f(*a, **k)))(
                model, batch, {}, extra=extra
            )
        else:
            want = expected
        assert tree_allclose(got, want), name
    # Under `eqx.filter_jit` too (which itself hands `fun` rebuilt containers).
    got = eqx.filter_jit(gx.filter_jacve(f))(model, batch, {}, extra=extra)
    assert tree_allclose(got, expected)


def test_has_aux_by_position():
    model, (x,), fn = _mlp()

    def f(m, x):
        return fn(m, x), "aux"

    jac, aux = gx.filter_jacve(f, True)(model, x)
    want, want_aux = eqx.filter_jacrev(f, True)(model, x)
    assert aux == want_aux == "aux"
    assert tree_allclose(jac, want)
    with pytest.raises(TypeError, match="second argument is `has_aux`.*by keyword"):
        gx.filter_jacve(fn, "fwd")  # pyright: ignore[reportArgumentType]


def test_old_state_is_refused_as_equinox_refuses_it():
    # An `eqx.nn.State` passed through untouched is marked used by the layer that
    # reads it, so passing the same state again raises Equinox's own error.
    x = jnp.ones(3)

    def f(m, x, state):
        out, state = m(x, state)
        return out, state

    for transform in (eqx.filter_jacrev, gx.filter_jacve):
        model, state = eqx.nn.make_with_state(eqx.nn.SpectralNorm)(
            eqx.nn.Linear(3, 3, key=jr.PRNGKey(0)), "weight", key=jr.PRNGKey(1)
        )
        jac = transform(f, has_aux=True)
        jac(model, x, state)
        with pytest.raises(ValueError, match="old state"):
            jac(model, x, state)


class _Token:
    pass


@pytest.mark.parametrize("aux_kind", ["string", "dict", "object", "mixed"])
def test_has_aux_returns_aux_untouched(aux_kind):
    model, (x,), fn = _mlp()
    token = _Token()
    aux_values = {
        "string": "hello",
        "dict": {"steps": 3, "name": "run"},
        "object": token,
        "mixed": ("tag", token),
    }

    def f(m, x):
        out = fn(m, x)
        aux = aux_values[aux_kind]
        if aux_kind == "mixed":
            aux = aux + (out * 2, 7)
        return out, aux

    jac, aux = gx.filter_jacve(f, has_aux=True)(model, x)
    assert tree_allclose(jac, eqx.filter_jacrev(f, has_aux=True)(model, x)[0])
    if aux_kind == "string":
        assert aux == "hello"
    elif aux_kind == "dict":
        assert aux == {"steps": 3, "name": "run"}
        assert type(aux["steps"]) is int
    elif aux_kind == "object":
        assert aux is token
    else:
        assert aux[0] == "tag" and aux[1] is token and aux[3] == 7
        assert tree_allclose(aux[2], fn(model, x) * 2)

    loss = lambda m, x: (jnp.sum(f(m, x)[0]), f(m, x)[1])
    (value, aux2), grads = gx.filter_value_and_jacve(loss, has_aux=True)(model, x)
    (exp_value, _), exp_grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, x)
    assert tree_allclose(value, exp_value)
    assert tree_allclose(grads, exp_grads)
    if aux_kind == "object":
        assert aux2 is token


def test_has_aux_requires_a_pair():
    model, (x,), fn = _mlp()
    with pytest.raises(TypeError, match="has_aux=True"):
        gx.filter_jacve(fn, has_aux=True)(model, x)


def test_count_ops():
    model, (x,), fn = _mlp()
    jac, counts = gx.filter_jacve(fn, order="rev", count_ops=True)(model, x)
    assert tree_allclose(jac, eqx.filter_jacrev(fn)(model, x))
    assert isinstance(counts["num_muls"], int) and counts["num_muls"] > 0
    assert isinstance(counts["num_adds"], int)

    f = lambda m, x: (fn(m, x), "aux")
    (jac, aux), counts = gx.filter_jacve(f, has_aux=True, count_ops=True)(model, x)
    assert aux == "aux"
    assert isinstance(counts["num_muls"], int)


def test_sparse_representation():
    model, (x,), fn = _mlp()
    jac = gx.filter_jacve(fn, sparse_representation=True)(model, x)
    is_sparse = lambda leaf: isinstance(leaf, gx.SparseTensor)
    assert is_sparse(jac.layers[0].weight)
    assert jac.activation is None
    dense = jax.tree.map(lambda s: s.dense(), jac, is_leaf=is_sparse)
    assert tree_allclose(dense, eqx.filter_jacrev(fn)(model, x))


def test_decorator_forms():
    model, (x,), fn = _mlp()
    expected = eqx.filter_jacrev(fn)(model, x)

    @gx.filter_jacve
    def bare(m, x):
        return fn(m, x)

    @gx.filter_jacve(order="fwd")
    def with_args(m, x):
        return fn(m, x)

    @gx.filter_value_and_jacve
    def value_bare(m, x):
        return jnp.sum(fn(m, x))

    @gx.filter_value_and_jacve(order="rev", has_aux=True)
    def value_with_args(m, x):
        return jnp.sum(fn(m, x)), "aux"

    assert tree_allclose(bare(model, x), expected)
    assert tree_allclose(with_args(model, x), expected)
    assert bare.__name__ == "bare"
    value, grads = value_bare(model, x)
    (value2, aux), grads2 = value_with_args(model, x)
    assert aux == "aux"
    assert tree_allclose(value, value2) and tree_allclose(grads, grads2)
    assert tree_allclose(
        grads, eqx.filter_grad(lambda m, x: jnp.sum(fn(m, x)))(model, x)
    )


class _Net(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, 2, key=key, dtype=F32)

    def forward(self, x):
        return jnp.tanh(self.linear(x))

    @gx.filter_jacve
    def jac(self, x):
        return self.forward(x)

    @gx.filter_value_and_jacve(order="markowitz")
    def value_and_grad(self, x):
        return jnp.sum(self.forward(x))


def test_methods():
    net = _Net(jr.PRNGKey(0))
    x = _f32(3)
    expected = eqx.filter_jacrev(_Net.forward)(net, x)
    assert tree_allclose(gx.filter_jacve(_Net.forward)(net, x), expected)
    assert tree_allclose(net.jac(x), expected)
    value, grads = net.value_and_grad(x)
    exp_value, exp_grads = eqx.filter_value_and_grad(
        lambda n, x: jnp.sum(n.forward(x))
    )(net, x)
    assert tree_allclose(value, exp_value)
    assert tree_allclose(grads, exp_grads)


def test_argnums_is_refused():
    f = lambda x, y: x * y
    for make in (
        lambda: gx.filter_jacve(f, argnums=1),
        lambda: gx.filter_jacve(argnums=(0, 1)),
        lambda: gx.filter_value_and_jacve(f, argnums=1),
    ):
        with pytest.raises(ValueError, match="tuple"):
            make()


def test_first_argument_must_be_positional():
    wrapped = gx.filter_jacve(lambda x: x)
    with pytest.raises(TypeError, match="positional"):
        wrapped(x=jnp.ones(2))


@pytest.mark.parametrize("order", ["fwd", "auto"])
def test_eqx_jacve_argnums(order):
    model, (x,), fn = _mlp()
    scale = jnp.float32(1.5)
    f = lambda m, x, s, n: fn(m, x) * s * n

    jac_m, jac_x = gx.eqx_jacve(f, order=order, argnums=(0, 1))(model, x, scale, 3)
    expected = eqx.filter_jacrev(lambda mx: f(mx[0], mx[1], scale, 3))((model, x))
    assert tree_allclose((jac_m, jac_x), expected)
    assert jac_x.shape == (2, 3)

    jac_s = gx.eqx_jacve(f, order=order, argnums=-2)(model, x, scale, 3)
    assert tree_allclose(jac_s, jax.jacrev(f, argnums=2)(model, x, scale, 3))
    (jac_x2,) = gx.eqx_jacve(f, argnums=(1,))(model, x, scale, 3)
    assert tree_allclose(jac_x2, jac_x)


def test_eqx_jacve_bad_argnums():
    f = lambda x, y: x * y
    with pytest.raises(ValueError, match="argnums"):
        gx.eqx_jacve(f, argnums=2)(jnp.ones(2), jnp.ones(2))
    with pytest.raises(ValueError, match="more than once"):
        gx.eqx_jacve(f, argnums=(0, 0))(jnp.ones(2), jnp.ones(2))


def test_vmap_per_example_jacobians():
    model, (x,), fn = _mlp()
    xs = jr.normal(jr.PRNGKey(1), (4, 3), dtype=F32)
    expected = jax.vmap(lambda x: eqx.filter_jacrev(fn)(model, x))(xs)

    jacs = jax.vmap(lambda x: gx.filter_jacve(fn, order="markowitz")(model, x))(xs)
    assert jacs.layers[0].weight.shape == (4, 2, 4, 3)
    assert tree_allclose(jacs, expected)

    filtered = eqx.filter_vmap(gx.filter_jacve(fn), in_axes=(None, 0))(model, xs)
    assert tree_allclose(filtered, expected)

    jitted = eqx.filter_jit(eqx.filter_vmap(gx.filter_jacve(fn), in_axes=(None, 0)))
    assert tree_allclose(jitted(model, xs), expected)


def test_nested_jacve():
    model, (x,), fn = _linear()
    inner = lambda m, x: jnp.sum(fn(m, x))
    # Differentiate the gradient with respect to the input: a mixed second
    # derivative, computed by vertex elimination inside reverse mode.
    mixed = jax.jacrev(lambda x: gx.filter_jacve(inner)(model, x).weight)(x)
    expected = jax.jacrev(lambda x: eqx.filter_grad(inner)(model, x).weight)(x)
    assert tree_allclose(mixed, expected)
    # The Hessian with respect to the parameters, by elimination twice.
    hessian = gx.filter_jacve(gx.filter_jacve(inner, order="rev"))(model, x)
    assert tree_allclose(hessian, eqx.filter_hessian(inner)(model, x))


def test_no_retrace_under_filter_jit():
    model, (x,), fn = _mlp()
    calls = 0

    def loss(m, x):
        nonlocal calls
        calls += 1
        return jnp.sum(fn(m, x) ** 2)

    step = eqx.filter_jit(gx.filter_value_and_jacve(loss))
    step(model, x)
    traced = calls
    assert traced > 0
    for i in range(3):
        value, grads = step(model, x + i)
    assert calls == traced
    assert tree_allclose(grads, eqx.filter_grad(loss)(model, x + 2))


def test_no_differentiable_leaves():
    params = {"n": jnp.arange(3), "name": "ints only"}

    def f(p):
        return jnp.sin(jnp.sum(p["n"]) * jnp.ones(2)), p["name"]

    (jac, aux), counts = gx.filter_jacve(f, has_aux=True, count_ops=True)(params)
    assert jac == {"n": None, "name": None}
    assert aux == "ints only"
    assert counts["num_muls"] == 0
    value, jac = gx.filter_value_and_jacve(lambda p: f(p)[0])(params)
    assert tree_allclose(value, f(params)[0])
    assert jac == {"n": None, "name": None}


def test_explicit_order():
    model, (x,), fn = _mlp()
    # Vertex ids come from the graph of the function of the floating-point leaves.
    params, static = eqx.partition(model, eqx.is_inexact_array)
    graph = gx.make_graph(lambda p, x: fn(eqx.combine(p, static), x))(params, x)
    order = list(reversed(graph.intermediates))
    jac, counts = gx.filter_jacve(fn, order=order, count_ops=True)(model, x)
    assert tree_allclose(jac, eqx.filter_jacrev(fn)(model, x))
    assert counts["order"] == order
    jitted = eqx.filter_jit(gx.filter_jacve(fn, order=order))
    assert tree_allclose(jitted(model, x), jac)


def test_optax_training_matches_filter_value_and_grad():
    model = eqx.nn.MLP(2, 1, width_size=8, depth=2, key=jr.PRNGKey(0), dtype=F32)
    xs = jr.normal(jr.PRNGKey(1), (16, 2), dtype=F32)
    ys = jnp.sin(xs[:, :1]) + xs[:, 1:] ** 2
    optim = optax.adam(1e-2)

    def loss(m, x, y):
        pred = jax.vmap(m)(x)
        return jnp.mean((pred - y) ** 2)

    def train(value_and_grad):
        @eqx.filter_jit
        def step(m, opt_state):
            value, grads = value_and_grad(loss)(m, xs, ys)
            updates, opt_state = optim.update(grads, opt_state, m)
            return eqx.apply_updates(m, updates), opt_state, value

        m = model
        opt_state = optim.init(eqx.filter(m, eqx.is_inexact_array))
        values = []
        for _ in range(20):
            m, opt_state, value = step(m, opt_state)
            values.append(value)
        return m, jnp.stack(values)

    trained, values = train(gx.filter_value_and_jacve)
    expected, expected_values = train(eqx.filter_value_and_grad)
    assert values[-1] < values[0]
    assert tree_allclose(values, expected_values)
    assert tree_allclose(trained, expected)


def test_eager_calls_read_closed_over_values_afresh():
    """Outside `jit` every call sees the current closed-over values, as eager JAX."""
    model = eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0))
    batch = jnp.ones(3)

    def loss(m):
        return jnp.sum(m(batch) ** 2)

    for batch in [jnp.ones(3), 2 * jnp.ones(3), -jnp.arange(3.0)]:
        value, grads = gx.filter_value_and_jacve(loss)(model)
        ref_value, ref_grads = eqx.filter_value_and_grad(loss)(model)
        assert tree_allclose(value, ref_value)
        assert tree_allclose(grads, ref_grads)
        assert tree_allclose(gx.filter_jacve(loss)(model), ref_grads)
        assert tree_allclose(gx.eqx_jacve(loss)(model), ref_grads)


class _Gated(eqx.Module):
    linear: eqx.nn.Linear
    step: jax.Array  # an integer leaf: not differentiated

    def __call__(self, x):
        return self.linear(x) if self.step > 0 else -self.linear(x)


@pytest.mark.parametrize("order", ORDERS)
def test_eager_python_reads_values_not_differentiated(order):
    """Eagerly, `eqx.filter_jacrev` leaves the arguments and leaves it does not
    differentiate concrete, so Python may branch on values computed from them."""
    linear = eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0))
    x = jnp.arange(3.0, dtype=F32)
    cases = [
        (lambda m, x, y: m(x) * (2.0 if y > 0 else 1.0), (linear, x, jnp.array(-1.0))),
        (lambda m, x: m(x), (_Gated(linear, jnp.array(1)), x)),
        (lambda m, x, y: m(x) * float(y * 2), (linear, x, jnp.array(1.5))),
    ]
    for fun, args in cases:
        assert tree_allclose(
            gx.filter_jacve(fun, order=order)(*args), eqx.filter_jacrev(fun)(*args)
        )
        assert tree_allclose(
            gx.eqx_jacve(fun, order=order)(*args), eqx.filter_jacrev(fun)(*args)
        )

        def loss(*a, fun=fun):
            return jnp.sum(fun(*a))

        assert tree_allclose(
            gx.filter_value_and_jacve(loss, order=order)(*args),
            eqx.filter_value_and_grad(loss)(*args),
        )


def test_keys_drawn_inside_fun_as_equinox_draws_them():
    # A key drawn from an iterator inside `fun` is drawn once per call, as by
    # `eqx.filter_jacrev`, also where Python reads a value computed from constants
    # (which a staged trace cannot give): the same dropout mask, the same Jacobian.
    dropout = eqx.nn.Dropout(0.5)
    x = jnp.linspace(0.1, 1.6, 16, dtype=F32)

    def make_fun():
        keys = iter(jr.split(jr.PRNGKey(0), 4))

        def fun(x):
            y = dropout(jnp.sin(x), key=next(keys))
            repeats = int(jnp.sum(jnp.ones(2)))
            return y * repeats

        return fun

    want = eqx.filter_jacrev(make_fun())(x)
    for transform in (gx.filter_jacve, gx.eqx_jacve):
        got = transform(make_fun())(x)
        assert _tree_allclose(got, want), transform.__name__
    value, got = gx.filter_value_and_jacve(make_fun())(x)
    assert _tree_allclose(got, want)
    assert _tree_allclose(value, make_fun()(x))


def test_eager_calls_with_static_arguments():
    """A changed static argument (and its type) gives the new Jacobian."""
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.PRNGKey(0))

    def loss(m, x, scale):
        return jnp.sum(m(x)) * scale

    x = jnp.ones(3)
    for scale in (2, 3.0, 2):
        grads = gx.filter_jacve(loss)(model, x, scale)
        assert eqx.tree_equal(grads, eqx.filter_grad(loss)(model, x, scale), rtol=1e-5)


@pytest.mark.parametrize("order", ["fwd", "rev", "auto"])
def test_complex_leaves_are_differentiated_as_equinox_does(order):
    # `eqx.is_inexact_array` holds for complex arrays, so `eqx.filter_grad` and
    # `eqx.filter_jacrev` differentiate them: `d/d(real) - 1j d/d(imag)`.
    params = {
        "w": (jnp.arange(1.0, 4.0) * (1 + 0.5j)).astype(jnp.complex64),
        "r": jnp.linspace(0.2, 0.9, 3),
        "n": 3,
    }

    def loss(p):
        return jnp.sum(jnp.abs(p["w"] * p["r"]) ** 2 + jnp.real(p["w"] ** 2) * p["r"])

    def field(p):
        return jnp.abs(p["w"] * p["r"]) ** 2 + jnp.imag(jnp.exp(p["w"])) * p["r"][::-1]

    for got, want in (
        (
            gx.filter_value_and_jacve(loss, order=order)(params),
            eqx.filter_value_and_grad(loss)(params),
        ),
        (gx.filter_jacve(field, order=order)(params), eqx.filter_jacrev(field)(params)),
        (
            eqx.filter_jit(gx.filter_jacve(field, order=order))(params),
            eqx.filter_jacrev(field)(params),
        ),
    ):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="complex leaves"):
        gx.filter_jacve(field, sparse_representation=True)(params)


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz", "auto"])
def test_batch_norm_in_training_mode(order):
    # `BatchNorm` normalises over `vmap(..., axis_name=...)` with `pmean`: its
    # batch statistics depend on every parameter before it.
    class Model(eqx.Module):
        linear: eqx.nn.Linear
        norm: eqx.nn.BatchNorm

        def __init__(self, key):
            self.linear = eqx.nn.Linear(3, 4, key=key)
            self.norm = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch")

        def __call__(self, x, state):
            y, state = self.norm(self.linear(x), state)
            return jnp.tanh(y), state

    model, state = eqx.nn.make_with_state(Model)(jr.PRNGKey(0))
    x = jr.normal(jr.PRNGKey(1), (8, 3))

    def loss(model, x, state):
        out, state = jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(x, state)
        return jnp.sum(out**2), state

    (value, _), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, x, state)
    (got_value, _), got = gx.filter_value_and_jacve(loss, order=order, has_aux=True)(
        model, x, state
    )
    np.testing.assert_allclose(got_value, value, rtol=1e-6)
    assert _tree_allclose(got, grads, rtol=1e-5, atol=1e-6)
    wrt_x = gx.jacve(lambda x: loss(model, x, state)[0], order=order)(x)
    want = jax.grad(lambda x: loss(model, x, state)[0])(x)
    np.testing.assert_allclose(wrt_x, want, rtol=1e-5, atol=1e-6)
