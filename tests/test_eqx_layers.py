"""Every public layer of `equinox.nn` through the Equinox layer.

Each layer is called as a user would call it (stateful layers with their `State`,
wrappers around a `Linear` or `Conv`), and `jacve` must agree with Equinox's own
transformations: the Jacobian with respect to the layer's parameters
(`filter_jacve` against `eqx.filter_jacrev`), the gradient of a scalar loss
(`filter_value_and_jacve` against `eqx.filter_value_and_grad`) and the Jacobian with
respect to the input (`jacve` against `jax.jacrev`). A layer added to `equinox.nn`
fails `test_every_layer_is_covered` until it has a case here.
"""

import inspect
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import graphax_eqx as gx

from .helpers import tree_allclose


F32 = jnp.float32
_RTOL, _ATOL = 1e-4, 1e-5


def _normal(*shape, seed=0):
    return jr.normal(jr.PRNGKey(seed), shape, dtype=F32)


def _key(seed):
    return jr.PRNGKey(100 + seed)


class _Case(eqx.Module):
    """A layer, the arguments it is called with and how it is called.

    `call(layer, x, *rest)` returns an array, or `(array, state)` when `stateful`.
    """

    layer: eqx.Module
    x: jax.Array
    rest: tuple
    call: Callable = eqx.field(static=True)
    stateful: bool = eqx.field(static=True, default=False)


def _plain(layer, x):
    return _Case(layer, x, (), lambda m, x: m(x))


def _with_state(make, x):
    layer, state = eqx.nn.make_with_state(make)()
    return _Case(layer, x, (state,), lambda m, x, state: m(x, state), stateful=True)


def _gru():
    layer = eqx.nn.GRUCell(3, 2, key=_key(1), dtype=F32)
    return _Case(layer, _normal(3), (_normal(2, seed=1),), lambda m, x, h: m(x, h))


def _lstm():
    layer = eqx.nn.LSTMCell(3, 2, key=_key(2), dtype=F32)
    h = (_normal(2, seed=1), _normal(2, seed=2))

    def call(m, x, h):
        hidden, cell = m(x, h)
        return jnp.concatenate([hidden, cell])

    return _Case(layer, _normal(3), (h,), call)


def _attention():
    layer = eqx.nn.MultiheadAttention(2, 4, key=_key(3), dtype=F32)
    kv = _normal(2, 4, seed=1)
    return _Case(layer, _normal(3, 4), (kv,), lambda m, q, kv: m(q, kv, kv))


def _embedding():
    layer = eqx.nn.Embedding(7, 3, key=_key(4), dtype=F32)
    index = jnp.array(5)
    # The Jacobian with respect to the parameters; the input is an integer.
    return _Case(layer, index, (), lambda m, i: m(i))


class _SharedLinears(eqx.Module):
    """Two linear layers tied to one weight through `eqx.nn.Shared`."""

    shared: eqx.nn.Shared

    def __init__(self, key):
        k1, k2 = jr.split(key)
        first = eqx.nn.Linear(3, 3, key=k1, dtype=F32)
        second = eqx.nn.Linear(3, 3, key=k2, dtype=F32)
        self.shared = eqx.nn.Shared(
            (first, second), lambda p: p[1].weight, lambda p: p[0].weight
        )

    def __call__(self, x):
        first, second = self.shared()
        return second(jnp.tanh(first(x)))


def _batch_norm_inference():
    def make():
        return eqx.nn.BatchNorm(
            3, axis_name="batch", mode="batch", inference=True, dtype=F32
        )

    return _with_state(make, _normal(3))


def _spectral_norm():
    def make():
        linear = eqx.nn.Linear(3, 4, key=_key(5), dtype=F32)
        return eqx.nn.SpectralNorm(linear, "weight", key=_key(6))

    return _with_state(make, _normal(3))


def _spectral_norm_inference():
    def make():
        linear = eqx.nn.Linear(3, 4, key=_key(7), dtype=F32)
        return eqx.nn.SpectralNorm(linear, "weight", inference=True, key=_key(8))

    return _with_state(make, _normal(3))


def _stateful_sequential():
    def make():
        return eqx.nn.Sequential(
            [
                eqx.nn.Linear(3, 4, key=_key(9), dtype=F32),
                eqx.nn.BatchNorm(
                    4, axis_name="batch", mode="batch", inference=True, dtype=F32
                ),
                eqx.nn.Lambda(jnp.tanh),
            ]
        )

    return _with_state(make, _normal(3))


# Layer name -> case builders (several for layers with distinct modes).
CASES: dict[str, list[Callable[[], _Case]]] = {
    "AdaptiveAvgPool1d": [lambda: _plain(eqx.nn.AdaptiveAvgPool1d(3), _normal(2, 7))],
    "AdaptiveAvgPool2d": [
        lambda: _plain(eqx.nn.AdaptiveAvgPool2d((2, 3)), _normal(2, 5, 7))
    ],
    "AdaptiveAvgPool3d": [
        lambda: _plain(eqx.nn.AdaptiveAvgPool3d(2), _normal(1, 4, 5, 3))
    ],
    "AdaptiveMaxPool1d": [lambda: _plain(eqx.nn.AdaptiveMaxPool1d(3), _normal(2, 7))],
    "AdaptiveMaxPool2d": [
        lambda: _plain(eqx.nn.AdaptiveMaxPool2d((2, 3)), _normal(2, 5, 7))
    ],
    "AdaptiveMaxPool3d": [
        lambda: _plain(eqx.nn.AdaptiveMaxPool3d(2), _normal(1, 4, 5, 3))
    ],
    "AdaptivePool": [
        lambda: _plain(eqx.nn.AdaptivePool(3, 1, jnp.max), _normal(2, 8)),
    ],
    "AvgPool1d": [lambda: _plain(eqx.nn.AvgPool1d(3, 2, padding=1), _normal(2, 9))],
    "AvgPool2d": [lambda: _plain(eqx.nn.AvgPool2d(2, 1), _normal(2, 4, 5))],
    "AvgPool3d": [lambda: _plain(eqx.nn.AvgPool3d(2, 2), _normal(1, 4, 4, 5))],
    "BatchNorm": [_batch_norm_inference],
    "Conv": [
        lambda: _plain(
            eqx.nn.Conv(1, 2, 3, 3, padding="SAME", key=_key(10), dtype=F32),
            _normal(2, 6),
        )
    ],
    "Conv1d": [
        lambda: _plain(
            eqx.nn.Conv1d(2, 3, 3, stride=2, dilation=1, key=_key(11), dtype=F32),
            _normal(2, 9),
        )
    ],
    "Conv2d": [
        lambda: _plain(
            eqx.nn.Conv2d(2, 2, (2, 3), padding=1, groups=2, key=_key(12), dtype=F32),
            _normal(2, 4, 5),
        )
    ],
    "Conv3d": [
        lambda: _plain(
            eqx.nn.Conv3d(1, 2, 2, key=_key(13), dtype=F32), _normal(1, 3, 4, 3)
        )
    ],
    "ConvTranspose": [
        lambda: _plain(
            eqx.nn.ConvTranspose(1, 2, 2, 3, stride=2, key=_key(14), dtype=F32),
            _normal(2, 4),
        )
    ],
    "ConvTranspose1d": [
        lambda: _plain(
            eqx.nn.ConvTranspose1d(2, 1, 3, padding=1, key=_key(15), dtype=F32),
            _normal(2, 5),
        )
    ],
    "ConvTranspose2d": [
        lambda: _plain(
            eqx.nn.ConvTranspose2d(1, 2, 2, stride=2, key=_key(16), dtype=F32),
            _normal(1, 3, 3),
        )
    ],
    "ConvTranspose3d": [
        lambda: _plain(
            eqx.nn.ConvTranspose3d(1, 1, 2, key=_key(17), dtype=F32),
            _normal(1, 2, 3, 2),
        )
    ],
    "Dropout": [
        lambda: _plain(
            eqx.nn.Sequential(
                [
                    eqx.nn.Linear(3, 4, key=_key(18), dtype=F32),
                    eqx.nn.Dropout(0.5, inference=True),
                ]
            ),
            _normal(3),
        ),
        # In training mode with a key: the mask is fixed by the key.
        lambda: _Case(
            eqx.nn.Sequential(
                [
                    eqx.nn.Linear(3, 6, key=_key(19), dtype=F32),
                    eqx.nn.Dropout(0.5),
                ]
            ),
            _normal(3),
            (),
            lambda m, x: m(x, key=jr.PRNGKey(3)),
        ),
    ],
    "Embedding": [_embedding],
    "GRUCell": [_gru],
    "GroupNorm": [
        lambda: _plain(eqx.nn.GroupNorm(2, 4, dtype=F32), _normal(4, 3)),
    ],
    "Identity": [
        lambda: _plain(
            eqx.nn.Sequential(
                [eqx.nn.Linear(3, 2, key=_key(20), dtype=F32), eqx.nn.Identity()]
            ),
            _normal(3),
        )
    ],
    "LSTMCell": [_lstm],
    "Lambda": [
        lambda: _plain(
            eqx.nn.Sequential(
                [
                    eqx.nn.Linear(3, 4, key=_key(21), dtype=F32),
                    eqx.nn.Lambda(jax.nn.gelu),
                ]
            ),
            _normal(3),
        )
    ],
    "LayerNorm": [
        lambda: _plain(eqx.nn.LayerNorm(5, dtype=F32), _normal(5)),
        lambda: _plain(
            eqx.nn.LayerNorm((2, 3), use_bias=False, dtype=F32), _normal(2, 3)
        ),
    ],
    "Linear": [
        lambda: _plain(eqx.nn.Linear(3, 2, key=_key(22), dtype=F32), _normal(3)),
        lambda: _plain(
            eqx.nn.Linear("scalar", 3, key=_key(23), dtype=F32), _normal(seed=4)
        ),
    ],
    "MLP": [
        lambda: _plain(
            eqx.nn.MLP(
                3,
                2,
                4,
                2,
                activation=jax.nn.softplus,
                final_activation=jnp.tanh,
                key=_key(24),
                dtype=F32,
            ),
            _normal(3),
        )
    ],
    "MaxPool1d": [lambda: _plain(eqx.nn.MaxPool1d(3, 2), _normal(2, 9))],
    "MaxPool2d": [lambda: _plain(eqx.nn.MaxPool2d(2, 1, padding=1), _normal(1, 4, 4))],
    "MaxPool3d": [lambda: _plain(eqx.nn.MaxPool3d(2, 2), _normal(1, 4, 4, 5))],
    "MultiheadAttention": [_attention],
    "PReLU": [lambda: _plain(eqx.nn.PReLU(jnp.array([0.1, 0.3])), _normal(2))],
    "Pool": [
        lambda: _plain(
            eqx.nn.Pool(-jnp.inf, jax.lax.max, 1, 2, stride=2), _normal(2, 8)
        )
    ],
    "RMSNorm": [lambda: _plain(eqx.nn.RMSNorm(4, dtype=F32), _normal(4))],
    "RotaryPositionalEmbedding": [
        lambda: _plain(eqx.nn.RotaryPositionalEmbedding(4, dtype=F32), _normal(3, 4))
    ],
    "Sequential": [_stateful_sequential],
    "Shared": [lambda: _plain(_SharedLinears(_key(25)), _normal(3))],
    "SpectralNorm": [_spectral_norm, _spectral_norm_inference],
    "WeightNorm": [
        lambda: _plain(
            eqx.nn.WeightNorm(eqx.nn.Linear(3, 4, key=_key(26), dtype=F32)),
            _normal(3),
        )
    ],
}

# Not layers: containers of state that the stateful cases above use.
_NOT_LAYERS = {"State", "StateIndex", "StatefulLayer"}


def test_every_layer_is_covered():
    public = {
        name
        for name, obj in vars(eqx.nn).items()
        if not name.startswith("_")
        and inspect.isclass(obj)
        and issubclass(obj, eqx.Module)
    }
    assert public - _NOT_LAYERS - set(CASES) == set()


_PARAMS = [
    pytest.param(name, index, id=f"{name}-{index}")
    for name, builders in CASES.items()
    for index in range(len(builders))
]


def _has_parameters(case):
    return bool(jax.tree.leaves(eqx.filter(case.layer, eqx.is_inexact_array)))


def _close(actual, expected):
    assert tree_allclose(actual, expected, rtol=_RTOL, atol=_ATOL)


@pytest.mark.parametrize("order", ["fwd", "rev"])
@pytest.mark.parametrize("name, index", _PARAMS)
def test_parameter_jacobian(name, index, order):
    case = CASES[name][index]()
    if not _has_parameters(case):
        pytest.skip("no parameters (tests/test_equinox.py covers that case)")
    has_aux = case.stateful
    # The eager call uses up a state (an `eqx.nn.State`, passed through untouched):
    # the reference takes a copy, as Equinox asks of a state used twice.
    leaves, treedef = jax.tree_util.tree_flatten(case.rest)
    rest = jax.tree_util.tree_unflatten(treedef, leaves)
    got = gx.filter_jacve(case.call, order=order, has_aux=has_aux)(
        case.layer, case.x, *case.rest
    )
    want = eqx.filter_jit(eqx.filter_jacrev(case.call, has_aux=has_aux))(
        case.layer, case.x, *rest
    )
    if has_aux:
        (got, got_state), (want, want_state) = got, want
        _close(got_state, want_state)
    _close(got, want)


@pytest.mark.parametrize("name, index", _PARAMS)
def test_loss_gradient_under_filter_jit(name, index):
    case = CASES[name][index]()
    if not _has_parameters(case):
        pytest.skip("no parameters (tests/test_equinox.py covers that case)")

    def loss(layer, x, *rest):
        out = case.call(layer, x, *rest)
        if case.stateful:
            out, state = out
            return jnp.sum(jnp.tanh(out) ** 2), state
        return jnp.sum(jnp.tanh(out) ** 2)

    has_aux = case.stateful
    got = eqx.filter_jit(gx.filter_value_and_jacve(loss, has_aux=has_aux))(
        case.layer, case.x, *case.rest
    )
    want = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=has_aux))(
        case.layer, case.x, *case.rest
    )
    _close(got, want)


@pytest.mark.parametrize("name, index", _PARAMS)
def test_input_jacobian(name, index):
    case = CASES[name][index]()
    if not jnp.issubdtype(case.x.dtype, jnp.floating):
        pytest.skip("the input is an index")

    def of_input(case):
        def fun(x):
            out = case.call(case.layer, x, *case.rest)
            return out[0] if case.stateful else out

        return fun

    got = gx.jacve(of_input(case), order="auto")(case.x)
    # A fresh case: an eager call of a stateful layer may use its state only once.
    want = jax.jit(jax.jacrev(of_input(CASES[name][index]())))(case.x)
    np.testing.assert_allclose(got, want, rtol=_RTOL, atol=_ATOL)
