"""Real functions with complex intermediates: `graphax_eqx._complex`.

Every complex vertex becomes a pair of real vertices. Each program runs under every
order (eagerly, and all orders at once under `jax.jit`), in float32 (complex64
intermediates) and float64 (complex128), against `jax.jacfwd` and `jax.jacrev`.
"""

import dataclasses
import functools
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
import pytest
from jax import lax

import graphax_eqx as gx
from graphax_eqx._complex import RealView, realify
from graphax_eqx._graph import Lit, inline

from .helpers import (
    ORDERS,
    assert_matches_references,
    is_sparse_block,
    reference_jacobians,
    resolve_order,
)


def _c(x) -> Any:
    """The complex dtype matching the precision of `x`."""
    return jnp.result_type(x.dtype, jnp.complex64)


_FILTER = np.array([1.0, 0.5 - 0.25j, -0.3j, 0.2 + 0.1j])
_KERNEL = np.array([0.5, -1.0, 0.25])
_MATRIX = np.array([[1.0 + 0.5j, -0.5j, 0.3], [0.2 - 0.1j, 1.0, 0.4j]])


def _eigvals_sorted(a):
    ev = jnp.linalg.eigvals(a)
    ev = ev[jnp.argsort(jnp.real(ev))]
    return jnp.concatenate([jnp.real(ev), jnp.abs(ev)])


def _eig_values_only(a):
    w, _ = lax.linalg.eig(
        a,
        compute_left_eigenvectors=False,
        compute_right_eigenvectors=True,
        enable_eigvec_derivs=True,
    )
    return jnp.sort(jnp.abs(w))


def _scan_complex_carry(x):
    def step(c, xi):
        c = c * jnp.exp(1j * xi) + xi
        return c, jnp.real(c) * jnp.imag(c)

    c, ys = lax.scan(step, jnp.asarray(0.5 + 0.5j, _c(x)), x)
    return jnp.concatenate([ys, jnp.abs(c)[None]])


def _scan_complex_inside(x):
    def step(c, xi):
        z = jnp.exp(1j * (c + xi))
        return c + jnp.real(z * jnp.conj(z + 1.0)), jnp.angle(z + 2.0)

    c, ys = lax.scan(step, x[0], x[1:])
    return jnp.concatenate([ys, c[None]])


def _cond_while(x):
    z = lax.cond(x[0] > 0, lambda z: z * z, lambda z: jnp.conj(z), x * (1 + 1j))

    def body(carry):
        i, z = carry
        return i + 1, z * jnp.exp(1j * x) + 0.1

    _, z = lax.while_loop(lambda carry: carry[0] < 3, body, (0, z))
    return jnp.abs(z)


def _arith(x, y):
    z = x + 1j * y
    return jnp.real(z * jnp.conj(z) * jnp.exp(1j * x))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fun: Callable
    shapes: tuple  # shapes of the real arguments; a `complex` entry is a complex one
    argnums: int | tuple[int, ...] = 0
    has_aux: bool = False
    refs: tuple[str, ...] = ("fwd", "rev")
    lo: float = 0.2
    hi: float = 1.0

    def args(self, dtype) -> tuple:
        rng = np.random.default_rng(zlib.crc32(self.name.encode()))
        out = []
        for shape in self.shapes:
            if isinstance(shape, tuple) and shape and shape[0] == "complex":
                re = rng.uniform(self.lo, self.hi, shape[1:])
                im = rng.uniform(self.lo, self.hi, shape[1:])
                out.append(jnp.asarray(re + 1j * im, jnp.result_type(dtype, 1j)))
            elif shape == "matrix":
                a = np.array([[1.0, 2.0, 0.3], [-1.5, 0.5, 0.2], [0.1, 0.4, 2.0]])
                out.append(jnp.asarray(a + 0.05 * rng.uniform(-1, 1, (3, 3)), dtype))
            else:
                out.append(jnp.asarray(rng.uniform(self.lo, self.hi, shape), dtype))
        return tuple(out)


CASES = [
    Case("abs_fft", lambda x: jnp.abs(jnp.fft.fft(x)), ((6,),)),
    Case(
        "rfft_complex_filter",
        lambda x: jnp.fft.irfft(jnp.fft.rfft(x) * jnp.asarray(_FILTER, _c(x)), n=6),
        ((6,),),
    ),
    Case(
        "rfft_real_filter_argnums",
        lambda x, h: jnp.fft.irfft(jnp.fft.rfft(x) * h, n=8),
        ((8,), (5,)),
        argnums=(0, 1),
    ),
    Case(
        "fftconvolve_argnums",
        lambda x, k: jsp.signal.fftconvolve(x, k),
        ((5,), (3,)),
        argnums=(0, 1),
    ),
    Case("fft2_power", lambda x: jnp.abs(jnp.fft.fft2(x)) ** 2, ((3, 4),)),
    Case("arith", _arith, ((4,), (4,)), argnums=(0, 1)),
    Case(
        "angle_exp_log",
        lambda x: jnp.stack(
            [
                jnp.angle(x + 1j * x[::-1] - 0.6),
                jnp.real(jnp.log(jnp.exp(1j * x) + 2.0)),
                jnp.imag(jnp.log(x - 1j * x**2)),
            ]
        ),
        ((4,),),
    ),
    Case(
        "sqrt_pow_sign_where",
        lambda x: jnp.stack(
            [
                jnp.real(jnp.sqrt(x + 1j)) + jnp.imag((x - 0.5j) ** 3),
                jnp.abs((x + 1j) ** (0.5 + 0.25j)),
                # `sign` has a zero derivative, for complex values too.
                jnp.real(jnp.sign(x + 1j * x[::-1])) * x,
                jnp.imag(jnp.where(x > 0.6, x + 2j * x, jnp.conj(x + 2j * x**2))),
            ]
        ),
        ((4,),),
    ),
    Case("eigvals_sorted", _eigvals_sorted, ("matrix",)),
    Case("eig_values_only", _eig_values_only, ("matrix",)),
    Case("scan_complex_carry", _scan_complex_carry, ((4,),)),
    Case("scan_complex_inside", _scan_complex_inside, ((4,),)),
    # `while_loop` is forward-only in JAX.
    Case("cond_while_complex", _cond_while, ((4,),), refs=("fwd",)),
    Case(
        "jit_inside",
        lambda x: jax.jit(lambda y: jnp.abs(jnp.fft.fft(y * 1j + 1.0)))(x) * x,
        ((4,),),
    ),
    Case(
        "complex_const_matmul_sum",
        lambda x: jnp.concatenate(
            [
                jnp.abs(jnp.asarray(_MATRIX, _c(x)) @ (x + 0.5j)),
                jnp.abs(jnp.sum(jnp.exp(1j * x)))[None],
                jnp.real(jnp.cumsum(x * (1 + 1j))),
            ]
        ),
        ((3,),),
    ),
    Case(
        "complex_aux",
        lambda x: (jnp.abs(jnp.fft.fft(x)), (jnp.fft.fft(x), x + 1j)),
        ((4,),),
        has_aux=True,
    ),
    Case(
        "complex_off_path",
        lambda x, c: x * jnp.abs(jnp.sum(jnp.fft.fft(c))) + jnp.real(c * x),
        ((4,), ("complex", 4)),
    ),
]

# Eager runs dispatch (and compile) every operation on its own, so a representative
# subset runs eagerly; every case runs under `jax.jit`.
EAGER = (
    "abs_fft",
    "arith",
    "angle_exp_log",
    "scan_complex_carry",
    "complex_aux",
    "complex_off_path",
)

_BY_NAME = {case.name: case for case in CASES}
DTYPES = (np.float32, np.float64)


@functools.cache
def _references(name: str, dtype_name: str) -> dict[str, Any]:
    case = _BY_NAME[name]
    return reference_jacobians(
        case.fun,
        case.args(dtype_name),
        argnums=case.argnums,
        has_aux=case.has_aux,
        refs=case.refs,
    )


def _parts(tree):
    """Complex leaves as (real, imaginary) pairs, which the helpers compare."""
    return jax.tree.map(lambda a: (jnp.real(a), jnp.imag(a)), tree)


def _check(case: Case, dtype, result) -> None:
    references = _references(case.name, np.dtype(dtype).name)
    if case.has_aux:
        result, aux = result
        expected_aux = case.fun(*case.args(dtype))[1]
        assert_matches_references(_parts(aux), {"rev": _parts(expected_aux)})
        references = {k: v[0] for k, v in references.items()}
    assert_matches_references(result, references)


def _order(case: Case, order: str, args):
    return resolve_order(
        order, case.fun, args, argnums=case.argnums, has_aux=case.has_aux
    )


def _main(case: Case) -> Callable:
    return (lambda *a: case.fun(*a)[0]) if case.has_aux else case.fun


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", EAGER)
def test_parity_eager(name, order, dtype):
    case = _BY_NAME[name]
    args = case.args(dtype)
    spec = _order(case, order, args)
    result, counts = gx.jacve(
        case.fun,
        order=spec,
        argnums=case.argnums,
        has_aux=case.has_aux,
        count_ops=True,
    )(*args)
    _check(case, dtype, result)
    graph = gx.make_graph(_main(case), argnums=case.argnums)(*args)
    assert counts["num_muls"] == graph.counts(spec)["num_muls"]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_parity_jit(case, dtype):
    """Every order, and a sparse result with its counts, in one compilation."""
    args = case.args(dtype)
    orders = [_order(case, order, args) for order in ORDERS]
    kwargs = dict(argnums=case.argnums, has_aux=case.has_aux)
    counted = []

    @jax.jit
    def run(*args):
        dense = [gx.jacve(case.fun, order=o, **kwargs)(*args) for o in orders]
        sparse, counts = gx.jacve(
            case.fun,
            order="markowitz",
            sparse_representation=True,
            count_ops=True,
            **kwargs,
        )(*args)
        counted.append(counts)
        return dense, sparse

    dense, sparse = run(*args)
    for result in dense:
        _check(case, dtype, result)
    is_sparse = is_sparse_block
    leaves = jax.tree.leaves(sparse[0] if case.has_aux else sparse, is_leaf=is_sparse)
    assert all(map(is_sparse, leaves))
    densified = jax.tree.map(
        lambda s: s.dense() if is_sparse(s) else s, sparse, is_leaf=is_sparse
    )
    _check(case, dtype, densified)
    graph = gx.make_graph(_main(case), argnums=case.argnums)(*args)
    assert counted[0]["num_muls"] == graph.counts("markowitz")["num_muls"]


def test_value_and_jacve_complex_aux():
    case = _BY_NAME["complex_aux"]
    (x,) = case.args(np.float32)
    (value, aux), jac = gx.value_and_jacve(case.fun, has_aux=True)(x)
    expected_value, expected_aux = case.fun(x)
    assert aux[0].dtype == jnp.complex64
    assert_matches_references(
        _parts((value, aux)), {"rev": _parts((expected_value, expected_aux))}
    )
    assert_matches_references(jac, {"fwd": jax.jacfwd(lambda x: case.fun(x)[0])(x)})


#
# The rewrite itself.
#


def _program(fun, *args):
    return inline(jax.make_jaxpr(fun)(*args))


@pytest.mark.parametrize(
    "fun",
    [
        lambda x: jnp.sin(x) * x.sum(),
        lambda x: lax.scan(lambda c, y: (c * y, jnp.tanh(c)), x[0], x)[1],
        lambda x: jnp.linalg.solve(jnp.eye(3) + jnp.outer(x, x), x),
    ],
)
def test_realify_leaves_real_programs_alone(fun):
    program = _program(fun, jnp.linspace(0.1, 0.9, 3))
    assert realify(program) is program
    assert not any(isinstance(e.prim, RealView) for e in program.eqns)


def test_realify_splits_every_complex_value():
    c = jnp.array([1.0 + 2.0j, -0.5j, 3.0])

    def fun(x, z):
        w = jnp.fft.fft(x * c + z) * 1j
        return jnp.abs(w), w

    x = jnp.linspace(0.1, 0.9, 3)
    program = _program(fun, x, c)
    interface = set(program.invars) | set(program.constvars)
    interface |= {a for a in program.outvars if isinstance(a, int)}
    for eqn in program.eqns:
        if isinstance(eqn.prim, RealView):
            for a in eqn.invars:
                dtype = program.avals[a][1] if isinstance(a, int) else a.value.dtype
                assert not jnp.issubdtype(dtype, jnp.complexfloating)
            for v in eqn.outvars:
                assert not jnp.issubdtype(program.avals[v][1], jnp.complexfloating)
        for a in eqn.invars:
            if isinstance(a, Lit):
                assert not jnp.issubdtype(jnp.result_type(a.value), jnp.complexfloating)
    complex_vars = {
        v
        for v, (_, d) in program.avals.items()
        if jnp.issubdtype(d, jnp.complexfloating)
    }
    assert complex_vars <= interface
    # The interface is unchanged: same inputs and outputs, evaluated the same way.
    out = jax.jit(lambda x, z: gx.value_and_jacve(fun, has_aux=True)(x, z)[0])(x, c)
    assert_matches_references(_parts(out), {"rev": _parts(fun(x, c))})


def test_graph_shows_real_views():
    x = jnp.linspace(0.1, 0.9, 4)
    graph = gx.make_graph(lambda x: jnp.abs(jnp.fft.fft(x * 1j)))(x)
    names = {v.primitive for v in graph.vertices if v.kind == "intermediate"}
    assert {"mul[re,im]", "fft[re,im]", "abs[re,im]"} <= names
    assert all(jnp.issubdtype(v.dtype, jnp.floating) for v in graph.vertices)
    assert "fft[re,im]" in str(graph)


def test_promotion_adds_no_vertex():
    # `x.astype(complex)` has real part `x` and a constant zero imaginary part.
    x = jnp.linspace(0.1, 0.9, 4)
    graph = gx.make_graph(lambda x: jnp.abs(jnp.fft.fft(x)))(x)
    names = [v.primitive for v in graph.vertices if v.kind == "intermediate"]
    assert names == ["fft[re,im]", "fft[re,im]", "abs[re,im]"]


def test_elementwise_partials_are_diagonal():
    x = jnp.linspace(0.1, 0.9, 4)
    graph = gx.make_graph(lambda x: jnp.real(jnp.exp(1j * x) * (x + 2j)))(x)
    dense = [e for e in graph.edges if "val[a b]" in e.structure]
    assert not dense, dense


def test_complex_inputs_and_outputs_still_refused():
    z = jnp.array([1.0 + 1.0j, 2.0])
    with pytest.raises(TypeError, match="complex"):
        gx.jacve(lambda z: jnp.abs(z))(z)
    with pytest.raises(TypeError, match="complex64|complex128"):
        gx.jacve(lambda x: jnp.fft.fft(x))(jnp.ones(3))


def test_eigenvector_derivatives_error_like_jax():
    (a,) = _BY_NAME["eigvals_sorted"].args(np.float64)
    fun = lambda a: jnp.abs(jnp.linalg.eig(a)[0])
    with pytest.raises(NotImplementedError):
        jax.jacfwd(fun)(a)
    with pytest.raises(TypeError, match="eig"):
        gx.jacve(fun)(a)
