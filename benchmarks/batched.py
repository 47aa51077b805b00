"""Jacobians of functions written on a batch of small state vectors, against JAX
and asdex.

Each function takes a `(B, n)` array, reads its columns (`x[:, i]`), applies
formulas and stacks its outputs as columns, so its Jacobian is block diagonal: one
small block per row. `jacve` with `sparse_representation=True` finds the blocks from
the graph and stores each one's structural nonzeros. It is timed under `jax.jit` in
the order `auto` picks and in forward and reverse order, against the two ways JAX
computes the same blocks (`jax.vmap` of `jax.jacfwd` / `jax.jacrev` of the function
of one row) and against asdex (`asdex.jacobian_from_coloring` of the flattened
function, its sparsity detection and colouring done once beforehand and not timed).
Times are medians of interleaved calls (as in `benchmarks.models`), float32, B =
4,096 unless `--batch` says otherwise. The last columns give the faster of JAX's
two, and asdex, over `auto` (above 1, `auto` is faster) and the mode `auto` picked.

    python -m benchmarks.batched [--quick] [--batch B] [--only NAME,NAME]

`--quick` runs three repetitions (a smoke test); `--only` picks programs whose name
contains one of the given words.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import graphax_eqx as gx

from . import tasks
from .models import _time_programs, select


try:
    import asdex
except Exception:  # an optional dependency: the other methods still run
    asdex = None


@dataclasses.dataclass(frozen=True)
class Batched:
    """A function of a `(B, n)` batch and the range its inputs are drawn from."""

    name: str
    fun: Callable[[jax.Array], jax.Array]
    n: int
    low: float
    high: float


def _columns(scalar_fun: Callable, n: int) -> Callable[[jax.Array], jax.Array]:
    """A scalar task (n scalars in, a tuple of scalars out) written on a batch: its
    inputs are the columns of `x`, its outputs stacked as columns."""

    def fun(x):
        out = scalar_fun(*(x[:, i] for i in range(n)))
        out = out if isinstance(out, (tuple, list)) else (out,)
        return jnp.stack(list(out), axis=1)

    return fun


def _lorenz_rhs(x):
    u, v, w = x[:, 0], x[:, 1], x[:, 2]
    return jnp.stack([10.0 * (v - u), u * (28.0 - w) - v, u * v - 8.0 / 3.0 * w], 1)


def lorenz_euler(x):
    """Four explicit Euler steps (h = 0.01) of the Lorenz system."""
    for _ in range(4):
        x = x + 0.01 * _lorenz_rhs(x)
    return x


def _rk4(rhs, x, h: float, steps: int):
    for _ in range(steps):
        k1 = rhs(x)
        k2 = rhs(x + h / 2 * k1)
        k3 = rhs(x + h / 2 * k2)
        k4 = rhs(x + h * k3)
        x = x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return x


def lorenz_rk4(x):
    """Three classical Runge–Kutta steps (h = 0.01) of the Lorenz system."""
    return _rk4(_lorenz_rhs, x, 0.01, 3)


def pendulum_rhs(x):
    """The double pendulum (unit masses and lengths, g = 9.8): angles θ1, θ2 and
    angular velocities ω1, ω2 to (ω1, ω2, ω1', ω2')."""
    th1, th2, w1, w2 = x[:, 0], x[:, 1], x[:, 2], x[:, 3]
    d = th1 - th2
    den = 2.0 - jnp.cos(2.0 * d)
    a1 = (
        -3.0 * 9.8 * jnp.sin(th1)
        - 9.8 * jnp.sin(th1 - 2.0 * th2)
        - 2.0 * jnp.sin(d) * (w2**2 + w1**2 * jnp.cos(d))
    ) / den
    a2 = (
        2.0
        * jnp.sin(d)
        * (2.0 * w1**2 + 2.0 * 9.8 * jnp.cos(th1) + w2**2 * jnp.cos(d))
        / den
    )
    return jnp.stack([w1, w2, a1, a2], axis=1)


def pendulum_rk4(x):
    """Two classical Runge–Kutta steps (h = 0.01) of the double pendulum."""
    return _rk4(pendulum_rhs, x, 0.01, 2)


def sir_euler(x):
    """Five explicit Euler steps (h = 0.1) of the SIR epidemic model with β = 0.3
    and γ = 0.1: S' = -βSI/N, I' = βSI/N - γI, R' = γI, N = S + I + R."""
    for _ in range(5):
        s, i, r = x[:, 0], x[:, 1], x[:, 2]
        infections = 0.3 * s * i / (s + i + r)
        x = x + 0.1 * jnp.stack([-infections, infections - 0.1 * i, 0.1 * i], 1)
    return x


def lorenz96_euler(x):
    """Three explicit Euler steps (h = 0.01) of Lorenz-96 with forcing F = 8:
    x_i' = (x_{i+1} - x_{i-2}) x_{i-1} - x_i + F, indices modulo n (n = 8 here)."""
    n = x.shape[1]
    for _ in range(3):
        c = [x[:, i] for i in range(n)]
        rhs = [(c[(i + 1) % n] - c[i - 2]) * c[i - 1] - c[i] + 8.0 for i in range(n)]
        x = x + 0.01 * jnp.stack(rhs, axis=1)
    return x


def programs() -> list[Batched]:
    return [
        Batched("RoeFlux_1d", _columns(tasks.roe_flux_1d, 6), 6, 0.5, 1.5),
        Batched("RoeFlux_3d", _columns(tasks.roe_flux_3d, 10), 10, 0.5, 1.5),
        Batched("RobotArm_6DOF", _columns(tasks.robot_arm_6dof, 6), 6, -1.0, 1.0),
        Batched("HumanHeartDipole", _columns(tasks.human_heart_dipole, 8), 8, 0.5, 1.5),
        Batched(
            "PropaneCombustion", _columns(tasks.propane_combustion, 11), 11, 0.5, 1.5
        ),
        Batched("BlackScholes", _columns(tasks.black_scholes, 5), 5, 0.5, 1.5),
        Batched("Lorenz, 4 Euler steps", lorenz_euler, 3, -1.0, 1.0),
        Batched("Lorenz, 3 RK4 steps", lorenz_rk4, 3, -1.0, 1.0),
        Batched("double pendulum", pendulum_rhs, 4, -1.0, 1.0),
        Batched("double pendulum, 2 RK4 steps", pendulum_rk4, 4, -1.0, 1.0),
        Batched("SIR, 5 Euler steps", sir_euler, 3, 0.5, 1.0),
        Batched("Lorenz-96, 3 Euler steps", lorenz96_euler, 8, 0.5, 2.0),
    ]


def _per_row(fun):
    return lambda row: fun(row[None])[0]


def _asdex_program(fun, x):
    """`jax.jit` of asdex's Jacobian of the flattened function, or `None`."""
    if asdex is None:
        return None
    shape = x.shape

    def flat(z):
        return fun(z.reshape(shape)).reshape(-1)

    z = x.reshape(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        coloring = asdex.jacobian_coloring_from_sparsity(
            asdex.jacobian_sparsity(flat, z)
        )
    program = jax.jit(asdex.jacobian_from_coloring(flat, coloring))
    return lambda x: program(x.reshape(-1))


def _picked(fun, x) -> str:
    auto = tuple(gx.elimination_cost(fun)(x).order)
    for name in ("fwd", "rev"):
        if tuple(gx.elimination_cost(fun, order=name)(x).order) == auto:
            return name
    return "auto"


def _check(got, want, name: str) -> None:
    """`got` (a structured result) against JAX's per-row blocks `want`."""
    dense = np.asarray(got.dense())
    rows = dense.shape[0]
    blocks = dense.reshape(rows, -1, rows, dense.shape[-1])
    blocks = np.einsum("bibj->bij", blocks)
    np.testing.assert_allclose(
        blocks, np.asarray(want), rtol=1e-3, atol=1e-4, err_msg=name
    )


HEADER = (
    "| program | B × n | `auto` | fwd | rev | vmap `jacfwd` | vmap `jacrev` | asdex "
    "| JAX best / `auto` | asdex / `auto` | `auto` picks |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def run(selected: Sequence[Batched], batch: int, repetitions: int) -> list[str]:
    """One table row per program (printed as it is measured)."""
    rows = []
    rng = np.random.default_rng(0)
    for p in selected:
        x = jnp.asarray(rng.uniform(p.low, p.high, (batch, p.n)), jnp.float32)
        timed: dict[str, Any] = {
            order: jax.jit(
                lambda x, order=order: (
                    gx.jacve(p.fun, order=order, sparse_representation=True)(x).val
                )
            )
            for order in ("auto", "fwd", "rev")
        }
        timed["vmap jacfwd"] = jax.jit(jax.vmap(jax.jacfwd(_per_row(p.fun))))
        timed["vmap jacrev"] = jax.jit(jax.vmap(jax.jacrev(_per_row(p.fun))))
        program = _asdex_program(p.fun, x)
        if program is not None:
            timed["asdex"] = program
        small = x[:8]
        _check(
            gx.jacve(p.fun, sparse_representation=True)(small),
            jax.vmap(jax.jacfwd(_per_row(p.fun)))(small),
            p.name,
        )
        times = _time_programs(timed, x, repetitions)
        best = min(times["vmap jacfwd"], times["vmap jacrev"])

        def cell(label):
            return f"{times[label] * 1e6:,.0f} µs" if label in times else "–"

        over_asdex = (
            f"{times['asdex'] / times['auto']:.2f}×" if "asdex" in times else "–"
        )
        rows.append(
            f"| {p.name} | {batch} × {p.n} | {cell('auto')} | {cell('fwd')} "
            f"| {cell('rev')} | {cell('vmap jacfwd')} | {cell('vmap jacrev')} "
            f"| {cell('asdex')} | {best / times['auto']:.2f}× | {over_asdex} "
            f"| {_picked(p.fun, x)} |"
        )
        print(rows[-1], flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--only", default="")
    args = parser.parse_args(argv)
    selected = select(programs(), args.only)
    start = time.perf_counter()
    print(HEADER)
    run(selected, args.batch, 3 if args.quick else 21)
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
