"""Jacobians through the solvers of the Equinox ecosystem (diffrax, lineax,
optimistix), against JAX's.

These libraries define their derivatives by custom rules (implicit differentiation,
checkpointed loops, custom linear solves), so they exercise the parts of the engine
that the other tests reach only with programs written for them.
"""

import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

import graphax_eqx as gx

from .helpers import assert_tree_matches


diffrax = pytest.importorskip("diffrax")
lx = pytest.importorskip("lineax")
optx = pytest.importorskip("optimistix")


def _check(f, args, argnums, *, orders=("auto", "fwd"), rtol=1e-4, atol=1e-5):
    """`jacve` of `f`, eagerly and under `jit` for the first order, under `jit`
    for the others, against `jax.jacrev` (whose layout and dtypes `jacve` follows)
    and, where it can differentiate `f`, `jax.jacfwd`."""
    reference = jax.jacrev(f, argnums=argnums)(*args)
    if "fwd" in orders:
        forward = jax.jacfwd(f, argnums=argnums)(*args)
        assert_tree_matches(forward, reference, check_dtype=False, rtol=rtol, atol=atol)
    for k, order in enumerate(orders):
        jac = gx.jacve(f, order=order, argnums=argnums)
        calls = (jac, jax.jit(jac)) if k == 0 else (jax.jit(jac),)
        for call in calls:
            assert_tree_matches(
                call(*args), reference, rtol=rtol, atol=atol, label=f"order={order}"
            )


def _y0():
    return jnp.array([1.0, 0.5, -0.3], jnp.float32)


def _adaptive_tsit5(y0, p):
    def field(t, y, args):
        return -args[0] * y + jnp.sin(args[1] * y[::-1])

    solution = diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        diffrax.Tsit5(),
        t0=0.0,
        t1=1.0,
        dt0=0.1,
        y0=y0,
        args=p,
        stepsize_controller=diffrax.PIDController(rtol=1e-5, atol=1e-5),
    )
    return solution.ys[-1]


def test_diffrax_adaptive_solve_with_checkpointed_adjoint():
    # The default adjoint differentiates in reverse only (`jax.jacfwd` cannot).
    args = (_y0(), (jnp.float32(0.7), jnp.float32(1.3)))
    _check(_adaptive_tsit5, args, (0, 1), orders=("auto", "rev"))


def _shapes(jaxpr, found: set) -> set:
    for eqn in jaxpr.eqns:
        found.update(tuple(v.aval.shape) for v in eqn.outvars)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    _shapes(sub, found)
    return found


@pytest.mark.parametrize("order", ["rev", "auto"])
def test_diffrax_checkpointed_adjoint_pulls_back_the_result_only(order):
    # The checkpointed loop returns its state (14 floating entries: the solution,
    # times, step sizes, the saved values) through a rule that gives most of them no
    # tangent. Only the 3 entries that reach the result are pulled back, as
    # `jax.jacrev` does (one pullback per entry of the local Jacobian's rows).
    def solve(y0):
        solution = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, args: -y + jnp.sin(y[::-1])),
            diffrax.Tsit5(),
            t0=0.0,
            t1=1.0,
            dt0=0.05,
            y0=y0,
            saveat=diffrax.SaveAt(t1=True),
            stepsize_controller=diffrax.ConstantStepSize(),
            max_steps=40,
        )
        return solution.ys[0]

    y0 = _y0()
    shapes = _shapes(jax.make_jaxpr(gx.jacve(solve, order=order))(y0).jaxpr, set())
    assert not any(s[:1] == (14,) for s in shapes), sorted(shapes)
    _check(solve, (y0,), 0, orders=(order,))


def test_diffrax_fixed_steps_saved_at_several_times():
    def solve(y0, p):
        solution = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, args: -args * y**3),
            diffrax.Heun(),
            t0=0.0,
            t1=1.0,
            dt0=0.05,
            y0=y0,
            args=p,
            saveat=diffrax.SaveAt(ts=jnp.linspace(0.0, 1.0, 4)),
            adjoint=diffrax.DirectAdjoint(),
        )
        return solution.ys

    _check(solve, (_y0(), jnp.float32(0.5)), (0, 1))


def _matrix():
    return jr.normal(jr.PRNGKey(0), (4, 4), jnp.float32) + 4 * jnp.eye(
        4, dtype=jnp.float32
    )


@pytest.mark.parametrize("solver", ["lu", "cholesky", "cg", "lstsq"])
def test_lineax_linear_solves(solver):
    def solve(a, b):
        if solver == "lu":
            operator, method = lx.MatrixLinearOperator(a), lx.LU()
        elif solver == "lstsq":  # overdetermined: least squares
            operator = lx.MatrixLinearOperator(a[:, :3])
            method = lx.AutoLinearSolver(well_posed=False)
        else:
            spd = lx.MatrixLinearOperator(a @ a.T, lx.positive_semidefinite_tag)
            operator = spd
            method = (
                lx.Cholesky()
                if solver == "cholesky"
                else lx.CG(rtol=1e-7, atol=1e-7, max_steps=200)
            )
        return lx.linear_solve(operator, b, solver=method).value

    args = (_matrix(), jr.normal(jr.PRNGKey(1), (4,), jnp.float32))
    tolerance = {"rtol": 1e-2, "atol": 1e-3} if solver == "cg" else {"rtol": 1e-3}
    _check(solve, args, (0, 1), **tolerance)


def test_optimistix_root_find_by_implicit_differentiation():
    def root(p):
        def fn(y, args):
            return jnp.tanh(y) + args * y - 1.0

        solver = optx.Newton(rtol=1e-6, atol=1e-6)
        return optx.root_find(fn, solver, jnp.zeros(3), args=p).value

    _check(root, (jnp.array([1.0, 2.0, 3.0], jnp.float32),), 0, rtol=1e-3)


def test_optimistix_least_squares_and_minimisation():
    def fit(p):
        def residual(y, args):
            return y[0] * jnp.exp(y[1] * jnp.arange(4.0)) - args

        solver = optx.LevenbergMarquardt(rtol=1e-7, atol=1e-7)
        y0 = jnp.array([1.0, 0.1])
        return optx.least_squares(residual, solver, y0, args=p, max_steps=200).value

    def minimum(p):
        def loss(y, args):
            return jnp.sum((y - args) ** 2) + jnp.sum(y**4)

        solver = optx.BFGS(rtol=1e-6, atol=1e-6)
        return optx.minimise(loss, solver, jnp.zeros(2), args=p, max_steps=200).value

    for f, p in [(fit, [1.0, 1.2, 1.5, 1.9]), (minimum, [0.5, -0.8])]:
        p = jnp.array(p, jnp.float32)
        _check(f, (p,), 0, orders=("auto",), rtol=1e-2, atol=1e-3)


def test_jax_experimental_odeint():
    # Its `custom_vjp` packs residuals beside the cotangent in one buffer
    # (`ravel_pytree`) and picks its first step from the cotangent's norm before an
    # adaptive loop: linear, as far as the loop's tolerance. Its rule also indexes
    # the (here constant) time points with traced values.
    from jax.experimental.ode import odeint

    def decay(y0, rate):
        ts = jnp.array([0.0, 0.5, 1.0], jnp.float32)
        ys = odeint(lambda y, t, r: -r * y + 0.1 * jnp.sin(t), y0, ts, rate)
        return ys[-1]

    args = (_y0(), jnp.array([0.4, 0.9, 1.3], jnp.float32))
    _check(decay, args, (0, 1), orders=("rev", "markowitz"), rtol=1e-3, atol=1e-4)
