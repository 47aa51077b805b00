"""Sparse benchmark tasks: discretised PDE residuals, batched fluxes, a spring network
and a convolution, whose Jacobians are large and sparse.

Every task is a function of ONE array returning ONE array. Its Jacobian has shape
`output.shape + input.shape` and only a few nonzeros per row, placed by the
index-moving primitives the function is written with (slices, `jnp.pad`, `jnp.roll`,
`jnp.diff`, `jnp.concatenate`, gathers, `segment_sum`, convolutions). Each task comes
in two sizes: the benchmark size given in its docstring and a `small` variant for
tests and smoke runs.

`SPARSE_TASKS` maps each task name to a [`SparseTask`][];
`task.function(small)` returns the function (built once per size, so repeated calls
return the same object) and `task.make_input(dtype, small)` a deterministic input.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .tasks import roe_flux_1d


@dataclasses.dataclass(frozen=True)
class SparseTask:
    """One sparse benchmark problem at two sizes.

    **Arguments:**

    - `name`: registry key, also used in report tables.
    - `summary`: one line for report tables.
    - `build`: `build(**size)` returns the function of one array.
    - `build_input`: `build_input(dtype, **size)` returns its input.
    - `full`: the size parameters of the benchmark.
    - `small`: the size parameters of the small variant.
    """

    name: str
    summary: str
    build: Callable[..., Callable[[jax.Array], jax.Array]]
    build_input: Callable[..., jax.Array]
    full: Mapping[str, int]
    small: Mapping[str, int]

    def size(self, small: bool = False) -> Mapping[str, int]:
        return self.small if small else self.full

    def function(self, small: bool = False) -> Callable[[jax.Array], jax.Array]:
        """The task's function at the chosen size (the same object on every call)."""
        return _built(self.build, tuple(sorted(self.size(small).items())))

    def make_input(self, dtype: Any = jnp.float32, small: bool = False) -> jax.Array:
        """A deterministic input at the chosen size, in `dtype`."""
        return self.build_input(dtype, **self.size(small))


@functools.cache
def _built(build, size: tuple[tuple[str, int], ...]):
    return build(**dict(size))


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _as(array: np.ndarray, dtype: Any) -> jax.Array:
    return jnp.asarray(array, dtype=dtype)


# ---------------------------------------------------------------------------
# 1D stencil with a cubic nonlinearity
# ---------------------------------------------------------------------------


def build_stencil_1d(n: int):
    """Second difference plus a nonlinear source, n = 8000 → n - 2 = 7998.

    f(u)_i = u_{i+1} - 2u_i + u_{i-1} + sin(u_i)³ for the interior points
    i = 1, …, n - 2, written with the slices `u[2:]`, `u[1:-1]`, `u[:-2]`. The
    Jacobian is tridiagonal (shifted by one column): 3(n - 2) nonzeros.
    """
    del n

    def stencil_1d(u):
        return u[2:] - 2.0 * u[1:-1] + u[:-2] + jnp.sin(u[1:-1]) ** 3

    return stencil_1d


def _stencil_input(dtype, n):
    x = np.linspace(0.0, 1.0, n)
    u = np.sin(2 * math.pi * x) + 0.1 * _rng(101).standard_normal(n)
    return _as(u, dtype)


# ---------------------------------------------------------------------------
# Gray–Scott reaction–diffusion
# ---------------------------------------------------------------------------

GRAY_SCOTT = dict(du=0.16, dv=0.08, feed=0.035, kill=0.065)


def build_gray_scott(grid: int):
    """Right-hand side of the Gray–Scott model on a periodic grid×grid square,
    state (2, 64, 64) → (2, 64, 64).

    With the state s = (u, v) and the 5-point Laplacian on a unit-spaced periodic grid,
    Δu = u(i+1, j) + u(i-1, j) + u(i, j+1) + u(i, j-1) - 4u(i, j), built from four
    `jnp.roll`s,

    - ∂u/∂t = D_u Δu - u v² + F (1 - u),
    - ∂v/∂t = D_v Δv + u v² - (F + k) v,

    with D_u = 0.16, D_v = 0.08, F = 0.035, k = 0.065. Each output depends on the five
    stencil points of its own species and on the other species at the same point:
    12 · grid² nonzeros.
    """
    del grid
    du, dv, feed, kill = (GRAY_SCOTT[k] for k in ("du", "dv", "feed", "kill"))

    def laplacian(a):
        return (
            jnp.roll(a, 1, axis=0)
            + jnp.roll(a, -1, axis=0)
            + jnp.roll(a, 1, axis=1)
            + jnp.roll(a, -1, axis=1)
            - 4.0 * a
        )

    def gray_scott(state):
        u, v = state[0], state[1]
        uvv = u * v * v
        du_dt = du * laplacian(u) - uvv + feed * (1.0 - u)
        dv_dt = dv * laplacian(v) + uvv - (feed + kill) * v
        return jnp.stack([du_dt, dv_dt])

    return gray_scott


def _gray_scott_input(dtype, grid):
    # The classic start: u = 1, v = 0, with a perturbed square in the middle.
    u = np.ones((grid, grid))
    v = np.zeros((grid, grid))
    lo, hi = grid // 2 - max(1, grid // 8), grid // 2 + max(1, grid // 8)
    u[lo:hi, lo:hi] = 0.5
    v[lo:hi, lo:hi] = 0.25
    noise = 0.05 * _rng(102).standard_normal((2, grid, grid))
    return _as(np.stack([u, v]) + noise, dtype)


# ---------------------------------------------------------------------------
# Bratu problem
# ---------------------------------------------------------------------------

BRATU_LAMBDA = 6.0


def build_bratu(grid: int):
    """Residual of the Bratu problem -Δu = λ eᵘ on the unit square with u = 0 on the
    boundary, (128, 128) interior unknowns → (128, 128).

    With h = 1/(grid + 1), the padded field P = `jnp.pad(U, 1)` supplies the zero
    Dirichlet boundary, and

    F(U) = (4U - P[:-2, 1:-1] - P[2:, 1:-1] - P[1:-1, :-2] - P[1:-1, 2:]) / h² - λ eᵁ,

    with λ = 6 (below the turning point λ* ≈ 6.81). The Jacobian is the 5-point
    Laplacian plus a diagonal: 5 · grid² - 4 · grid nonzeros.
    """
    inv_h2 = float((grid + 1) ** 2)

    def bratu(u):
        p = jnp.pad(u, 1)
        lap = 4.0 * u - p[:-2, 1:-1] - p[2:, 1:-1] - p[1:-1, :-2] - p[1:-1, 2:]
        return inv_h2 * lap - BRATU_LAMBDA * jnp.exp(u)

    return bratu


def _bratu_input(dtype, grid):
    # A smooth bump of the size of the solution, plus a little noise.
    x = np.arange(1, grid + 1) / (grid + 1)
    bump = 16.0 * np.outer(x * (1 - x), x * (1 - x))
    return _as(bump + 0.01 * _rng(103).standard_normal((grid, grid)), dtype)


# ---------------------------------------------------------------------------
# Viscous Burgers, upwind
# ---------------------------------------------------------------------------

BURGERS_NU = 0.01


def build_burgers_1d(n: int):
    """Semi-discrete viscous Burgers equation u_t + (u²/2)_x = ν u_xx with the upwind
    (Engquist–Osher) flux, n = 8000 → n - 2 = 7998 interior points.

    On a unit interval with spacing h = 1/(n - 1), the interface flux is
    F_{i+½} = max(u_i, 0)²/2 + min(u_{i+1}, 0)²/2, which takes each half of the flux
    from the upwind side, and for i = 1, …, n - 2

    du_i/dt = -(F_{i+½} - F_{i-½})/h + ν (u_{i+1} - 2u_i + u_{i-1})/h²,

    with ν = 0.01, written as `-jnp.diff(F) / h + ν jnp.diff(u, n=2) / h²`.
    Tridiagonal Jacobian: 3(n - 2) structural nonzeros.
    """
    h = 1.0 / (n - 1)

    def burgers_1d(u):
        forward = 0.5 * jnp.maximum(u, 0.0) ** 2
        backward = 0.5 * jnp.minimum(u, 0.0) ** 2
        flux = forward[:-1] + backward[1:]
        return -jnp.diff(flux) / h + (BURGERS_NU / h**2) * jnp.diff(u, n=2)

    return burgers_1d


def _burgers_input(dtype, n):
    # A sine wave of both signs, so both halves of the flux are active; kept away
    # from exactly zero, where max/min have a kink.
    x = np.linspace(0.0, 1.0, n)
    u = np.sin(2 * math.pi * x) + 0.25 + 0.01 * _rng(104).standard_normal(n)
    u = np.where(np.abs(u) < 1e-3, 1e-3, u)
    return _as(u, dtype)


# ---------------------------------------------------------------------------
# Batched Roe flux
# ---------------------------------------------------------------------------


def build_roe_flux_batched(batch: int):
    """The 1D Euler Roe flux of [`benchmarks.tasks.roe_flux_1d`][] on a batch of
    interfaces, x (4096, 6) → (4096, 3), vectorised by hand (no vmap).

    Row b of x holds the primitive states (ρ_L, u_L, p_L, ρ_R, u_R, p_R) of one
    interface; the six columns `x[:, i]` are passed to the scalar formulas, which
    then act elementwise on whole columns, and the three flux components (mass,
    momentum, energy) are put back together with `jnp.stack(..., axis=1)`. The
    Jacobian is block diagonal: one dense 3 × 6 block per row, 18 · batch nonzeros.
    """
    del batch

    def roe_flux_batched(x):
        columns = [x[:, i] for i in range(6)]
        return jnp.stack(roe_flux_1d(*columns), axis=1)

    return roe_flux_batched


def _roe_input(dtype, batch):
    rng = _rng(105)
    rho = rng.uniform(0.5, 2.0, (batch, 2))
    u = rng.uniform(-0.5, 0.5, (batch, 2))
    p = rng.uniform(0.5, 2.0, (batch, 2))
    x = np.stack([rho[:, 0], u[:, 0], p[:, 0], rho[:, 1], u[:, 1], p[:, 1]], axis=1)
    return _as(x, dtype)


# ---------------------------------------------------------------------------
# Spring network
# ---------------------------------------------------------------------------

SPRING_STIFFNESS = (1.0, 1.0, 0.5, 0.5)  # horizontal, vertical, both diagonals


def spring_edges(grid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The springs of a grid × grid mesh of nodes (node (r, c) has index r·grid + c):
    horizontal, vertical and both diagonal neighbours. Returns the end points i and j,
    the stiffness and the rest length of every spring (unit mesh spacing)."""
    index = np.arange(grid * grid).reshape(grid, grid)
    groups = (
        (index[:, :-1], index[:, 1:], 1.0),
        (index[:-1, :], index[1:, :], 1.0),
        (index[:-1, :-1], index[1:, 1:], math.sqrt(2.0)),
        (index[:-1, 1:], index[1:, :-1], math.sqrt(2.0)),
    )
    i = np.concatenate([a.ravel() for a, _, _ in groups]).astype(np.int32)
    j = np.concatenate([b.ravel() for _, b, _ in groups]).astype(np.int32)
    stiffness = np.concatenate(
        [
            np.full(a.size, k)
            for (a, _, _), k in zip(groups, SPRING_STIFFNESS, strict=True)
        ]
    )
    rest = np.concatenate([np.full(a.size, length) for a, _, length in groups])
    return i, j, stiffness, rest


def build_spring_network(grid: int):
    """Net spring force on every node of a 100 × 100 mesh (10,000 nodes): positions
    (N, 2) → forces (N, 2), with N = grid².

    Springs join horizontal, vertical (stiffness 1, rest length 1) and diagonal
    (stiffness ½, rest length √2) neighbours: about 4N springs, see
    [`spring_edges`][]. For a spring e from node i to node j with d = x_j - x_i,

    f_e = k_e (|d| - L_e) d / |d|,

    the force it exerts on i; node i receives +f_e and node j receives -f_e. The
    ends are gathered with the constant index arrays, `x[i]` and `x[j]`, and the
    forces summed into the nodes with `jax.ops.segment_sum`. The Jacobian couples
    each node with itself and its (up to 8) neighbours, 2 × 2 entries per pair.
    """
    i, j, stiffness, rest = spring_edges(grid)
    nodes = grid * grid

    def spring_network(x):
        d = x[j] - x[i]
        length = jnp.sqrt(jnp.sum(d * d, axis=1, keepdims=True))
        k = jnp.asarray(stiffness[:, None], x.dtype)
        rest_length = jnp.asarray(rest[:, None], x.dtype)
        force = k * (length - rest_length) * d / length
        return jax.ops.segment_sum(force, i, nodes) - jax.ops.segment_sum(
            force, j, nodes
        )

    return spring_network


def _spring_input(dtype, grid):
    # The mesh stretched by 5% and jiggled, so every spring is under some load.
    r, c = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")
    x = 1.05 * np.stack([c.ravel(), r.ravel()], axis=1).astype(np.float64)
    return _as(x + 0.1 * _rng(106).standard_normal(x.shape), dtype)


# ---------------------------------------------------------------------------
# Explicit steps of a nonlinear heat equation
# ---------------------------------------------------------------------------

HEAT_STEPS = 10
HEAT_RATIO = 0.2  # Δt / h²


def build_heat_steps(n: int):
    """Ten explicit Euler steps of the heat equation u_t = (κ(u) u_x)_x with a
    temperature-dependent conductivity κ(u) = 1 + u²/2, n = 4096 → 4096.

    With r = Δt/h² = 0.2 and the face values ū = (u_i + u_{i+1})/2, the face
    fluxes q_{i+½} = κ(ū)(u_{i+1} - u_i) give the update

    u_i ← u_i + r (q_{i+½} - q_{i-½}) for i = 1, …, n - 2,

    with the two boundary values held fixed (Dirichlet), reassembled each step with
    `jnp.concatenate`. Each step couples nearest neighbours, so the Jacobian of ten
    steps is banded with half-bandwidth 10: about 21 n nonzeros (fill-in).
    Stable for r · max κ ≤ ½, i.e. |u| ≤ √3.
    """
    del n

    def heat_steps(u):
        for _ in range(HEAT_STEPS):
            mean = 0.5 * (u[1:] + u[:-1])
            flux = (1.0 + 0.5 * mean * mean) * (u[1:] - u[:-1])
            interior = u[1:-1] + HEAT_RATIO * (flux[1:] - flux[:-1])
            u = jnp.concatenate([u[:1], interior, u[-1:]])
        return u

    return heat_steps


def _heat_input(dtype, n):
    x = np.linspace(0.0, 1.0, n)
    u = 0.5 + 0.3 * np.sin(3 * math.pi * x) + 0.05 * _rng(107).standard_normal(n)
    return _as(u, dtype)


# ---------------------------------------------------------------------------
# 1D convolution
# ---------------------------------------------------------------------------

CONV_KERNEL = np.array([0.1, -0.4, 1.0, -0.4, 0.1])


def build_conv1d(n: int):
    """A 1D convolution layer's input Jacobian, n = 4096 → 4096.

    y = tanh(w ⋆ x) with a fixed width-5 kernel w = (0.1, -0.4, 1, -0.4, 0.1),
    applied by `jax.lax.conv_general_dilated` with one batch, one channel and "SAME"
    (zero) padding. The Jacobian is pentadiagonal: 5n - 6 nonzeros.
    """
    del n

    def conv1d(x):
        kernel = jnp.asarray(CONV_KERNEL.reshape(1, 1, -1), x.dtype)
        y = jax.lax.conv_general_dilated(
            x.reshape(1, 1, -1), kernel, window_strides=(1,), padding="SAME"
        )
        return jnp.tanh(y.reshape(-1))

    return conv1d


def _conv_input(dtype, n):
    return _as(_rng(108).standard_normal(n), dtype)


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------


SPARSE_TASKS: dict[str, SparseTask] = {
    task.name: task
    for task in (
        SparseTask(
            "Stencil1D",
            "u'' + sin(u)³, slices",
            build_stencil_1d,
            _stencil_input,
            full=dict(n=8000),
            small=dict(n=12),
        ),
        SparseTask(
            "GrayScott2D",
            "Gray–Scott RHS, roll Laplacian",
            build_gray_scott,
            _gray_scott_input,
            full=dict(grid=64),
            small=dict(grid=5),
        ),
        SparseTask(
            "Bratu2D",
            "Bratu residual, pad + slices",
            build_bratu,
            _bratu_input,
            full=dict(grid=128),
            small=dict(grid=5),
        ),
        SparseTask(
            "Burgers1D",
            "viscous Burgers, upwind, diff",
            build_burgers_1d,
            _burgers_input,
            full=dict(n=8000),
            small=dict(n=12),
        ),
        SparseTask(
            "RoeFluxBatched",
            "Roe flux on (B, 6) columns",
            build_roe_flux_batched,
            _roe_input,
            full=dict(batch=4096),
            small=dict(batch=4),
        ),
        SparseTask(
            "SpringNetwork",
            "spring forces, gather + segment_sum",
            build_spring_network,
            _spring_input,
            full=dict(grid=100),
            small=dict(grid=4),
        ),
        SparseTask(
            "HeatSteps",
            "10 explicit nonlinear heat steps",
            build_heat_steps,
            _heat_input,
            full=dict(n=4096),
            small=dict(n=16),
        ),
        SparseTask(
            "Conv1D",
            "tanh(conv, width 5)",
            build_conv1d,
            _conv_input,
            full=dict(n=4096),
            small=dict(n=12),
        ),
    )
}
