"""Benchmark tasks: pure JAX functions whose Jacobians are timed and counted.

Every task is a function of flat array arguments (scalars, vectors or small matrices)
that returns an array or a tuple of arrays. Constants (network weights, random
program structure) are fixed when this module is imported, so a task is the same
program in every run. [`TASKS`][] maps each task name to a [`Task`][].

Inputs come from `Task.make_args(key, dtype)`, which returns one unbatched example
drawn from a physically sensible range (positive densities, pressures and mole
numbers, realistic option parameters, ...). `make_batch` stacks many such examples
along a new leading axis for `jax.vmap`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.stats import norm


Args = tuple[jax.Array, ...]


@dataclasses.dataclass(frozen=True)
class Task:
    """One benchmark function and how to feed it.

    **Arguments:**

    - `name`: registry key, also used in report tables.
    - `fn`: the function whose Jacobian is benchmarked.
    - `make_args`: `make_args(key, dtype)` returns one unbatched example, a tuple of
      arrays matching the positional arguments of `fn`.
    - `scalar_heavy`: whether the graph consists mostly of scalar operations (the
      regime where elimination orders other than forward and reverse shine), as
      opposed to a few vector and matrix operations.
    - `argnums`: the positional arguments the Jacobian is taken with respect to.
    - `baseline_fn`: the function the JAX baselines (`jax.jacfwd`, `jax.jacrev`)
      differentiate, when it differs from `fn`; mathematically the same function.
    - `summary`: one line for report tables.
    """

    name: str
    fn: Callable[..., Any]
    make_args: Callable[[jax.Array, Any], Args]
    scalar_heavy: bool
    argnums: int | tuple[int, ...]
    baseline_fn: Callable[..., Any] | None = None
    summary: str = ""

    @property
    def reference_fn(self) -> Callable[..., Any]:
        """The function JAX's own transforms differentiate."""
        return self.fn if self.baseline_fn is None else self.baseline_fn


def make_batch(task: Task, key: jax.Array, dtype: Any, batch: int) -> Args:
    """Stack `batch` independent examples of `task` along a new leading axis."""
    keys = jax.random.split(key, batch)
    return jax.vmap(lambda k: task.make_args(k, dtype))(keys)


def _uniform(key, dtype, low, high, shape=()):
    return jax.random.uniform(key, shape, dtype, minval=low, maxval=high)


def _const(array: np.ndarray, like: jax.Array) -> jax.Array:
    # Fixed weights are stored in float64 and cast to the input precision, so
    # float32 benchmarks stay float32 and float64 tests stay float64.
    return jnp.asarray(array, dtype=jnp.result_type(like))


# ---------------------------------------------------------------------------
# Roe approximate Riemann solver for the Euler equations
# ---------------------------------------------------------------------------

GAMMA = 1.4
# Harten's entropy fix replaces |λ| by (λ² + δ²) / (2δ) when |λ| < δ; δ is taken
# relative to the Roe-averaged sound speed.
HARTEN_FRACTION = 0.1


def _harten_abs(lam, delta):
    abs_lam = jnp.abs(lam)
    smoothed = (lam * lam + delta * delta) / (2 * delta)
    return jnp.where(abs_lam < delta, smoothed, abs_lam)


def roe_flux_1d(rho_l, u_l, p_l, rho_r, u_r, p_r):
    """Roe flux of the 1D Euler equations (ideal gas, γ = 1.4). 6 → 3 scalars.

    With primitive states (ρ, u, p) on either side of an interface, total energy
    E = p/(γ-1) + ρu²/2, enthalpy H = (E + p)/ρ and physical flux
    F(U) = (ρu, ρu² + p, u(E + p)):

    - Roe averages with weights √ρ: ũ = (√ρ_L u_L + √ρ_R u_R)/(√ρ_L + √ρ_R), H̃ the
      same way, ρ̃ = √(ρ_L ρ_R), ã² = (γ-1)(H̃ - ũ²/2);
    - eigenvalues λ = (ũ - ã, ũ, ũ + ã) with right eigenvectors
      r₁ = (1, ũ - ã, H̃ - ũã), r₂ = (1, ũ, ũ²/2), r₃ = (1, ũ + ã, H̃ + ũã);
    - wave strengths α₁,₃ = (Δp ∓ ρ̃ãΔu)/(2ã²), α₂ = Δρ - Δp/ã²;
    - F = (F(U_L) + F(U_R))/2 - ½ Σ_k |λ_k|_δ α_k r_k, with Harten's entropy fix
      |λ|_δ = (λ² + δ²)/(2δ) for |λ| < δ = 0.1 ã.

    Returns the three flux components (mass, momentum, energy).
    """
    gm1 = GAMMA - 1.0
    e_l = p_l / gm1 + 0.5 * rho_l * u_l * u_l
    e_r = p_r / gm1 + 0.5 * rho_r * u_r * u_r
    h_l = (e_l + p_l) / rho_l
    h_r = (e_r + p_r) / rho_r

    sqrt_l = jnp.sqrt(rho_l)
    sqrt_r = jnp.sqrt(rho_r)
    inv_sum = 1.0 / (sqrt_l + sqrt_r)
    u_t = (sqrt_l * u_l + sqrt_r * u_r) * inv_sum
    h_t = (sqrt_l * h_l + sqrt_r * h_r) * inv_sum
    rho_t = sqrt_l * sqrt_r
    a2_t = gm1 * (h_t - 0.5 * u_t * u_t)
    a_t = jnp.sqrt(a2_t)

    d_rho = rho_r - rho_l
    d_u = u_r - u_l
    d_p = p_r - p_l
    alpha1 = (d_p - rho_t * a_t * d_u) / (2.0 * a2_t)
    alpha2 = d_rho - d_p / a2_t
    alpha3 = (d_p + rho_t * a_t * d_u) / (2.0 * a2_t)

    delta = HARTEN_FRACTION * a_t
    k1 = _harten_abs(u_t - a_t, delta) * alpha1
    k2 = _harten_abs(u_t, delta) * alpha2
    k3 = _harten_abs(u_t + a_t, delta) * alpha3

    diss0 = k1 + k2 + k3
    diss1 = k1 * (u_t - a_t) + k2 * u_t + k3 * (u_t + a_t)
    diss2 = k1 * (h_t - u_t * a_t) + k2 * (0.5 * u_t * u_t) + k3 * (h_t + u_t * a_t)

    f0 = 0.5 * (rho_l * u_l + rho_r * u_r) - 0.5 * diss0
    f1 = 0.5 * (rho_l * u_l * u_l + p_l + rho_r * u_r * u_r + p_r) - 0.5 * diss1
    f2 = 0.5 * (u_l * (e_l + p_l) + u_r * (e_r + p_r)) - 0.5 * diss2
    return f0, f1, f2


def roe_flux_3d(rho_l, u_l, v_l, w_l, p_l, rho_r, u_r, v_r, w_r, p_r):
    """Roe flux of the 3D Euler equations normal to an x-face (γ = 1.4). 10 → 5.

    States are primitive (ρ, u, v, w, p) left and right; E = p/(γ-1) + ρ|q|²/2,
    H = (E + p)/ρ and the x-flux is F = (ρu, ρu² + p, ρuv, ρuw, u(E + p)).
    Roe averages ũ, ṽ, w̃, H̃ use weights √ρ, ρ̃ = √(ρ_L ρ_R),
    ã² = (γ-1)(H̃ - q̃²/2) with q̃² = ũ² + ṽ² + w̃². Eigenvalues ũ - ã, ũ (three
    times), ũ + ã; wave strengths

    - α₁,₅ = (Δp ∓ ρ̃ãΔu)/(2ã²) on r₁,₅ = (1, ũ ∓ ã, ṽ, w̃, H̃ ∓ ũã),
    - α₂ = Δρ - Δp/ã² on r₂ = (1, ũ, ṽ, w̃, q̃²/2),
    - α₃ = ρ̃Δv on r₃ = (0, 0, 1, 0, ṽ) and α₄ = ρ̃Δw on r₄ = (0, 0, 0, 1, w̃).

    F = (F_L + F_R)/2 - ½ Σ_k |λ_k|_δ α_k r_k with Harten's entropy fix as in
    [`roe_flux_1d`][]. Returns the five flux components.
    """
    gm1 = GAMMA - 1.0
    q2_l = u_l * u_l + v_l * v_l + w_l * w_l
    q2_r = u_r * u_r + v_r * v_r + w_r * w_r
    e_l = p_l / gm1 + 0.5 * rho_l * q2_l
    e_r = p_r / gm1 + 0.5 * rho_r * q2_r
    h_l = (e_l + p_l) / rho_l
    h_r = (e_r + p_r) / rho_r

    sqrt_l = jnp.sqrt(rho_l)
    sqrt_r = jnp.sqrt(rho_r)
    inv_sum = 1.0 / (sqrt_l + sqrt_r)
    u_t = (sqrt_l * u_l + sqrt_r * u_r) * inv_sum
    v_t = (sqrt_l * v_l + sqrt_r * v_r) * inv_sum
    w_t = (sqrt_l * w_l + sqrt_r * w_r) * inv_sum
    h_t = (sqrt_l * h_l + sqrt_r * h_r) * inv_sum
    rho_t = sqrt_l * sqrt_r
    q2_t = u_t * u_t + v_t * v_t + w_t * w_t
    a2_t = gm1 * (h_t - 0.5 * q2_t)
    a_t = jnp.sqrt(a2_t)

    d_rho = rho_r - rho_l
    d_u = u_r - u_l
    d_v = v_r - v_l
    d_w = w_r - w_l
    d_p = p_r - p_l
    alpha1 = (d_p - rho_t * a_t * d_u) / (2.0 * a2_t)
    alpha2 = d_rho - d_p / a2_t
    alpha3 = rho_t * d_v
    alpha4 = rho_t * d_w
    alpha5 = (d_p + rho_t * a_t * d_u) / (2.0 * a2_t)

    delta = HARTEN_FRACTION * a_t
    abs_mid = _harten_abs(u_t, delta)
    k1 = _harten_abs(u_t - a_t, delta) * alpha1
    k2 = abs_mid * alpha2
    k3 = abs_mid * alpha3
    k4 = abs_mid * alpha4
    k5 = _harten_abs(u_t + a_t, delta) * alpha5

    k15 = k1 + k5
    diss0 = k15 + k2
    diss1 = k1 * (u_t - a_t) + k2 * u_t + k5 * (u_t + a_t)
    diss2 = (k15 + k2) * v_t + k3
    diss3 = (k15 + k2) * w_t + k4
    diss4 = (
        k1 * (h_t - u_t * a_t)
        + k2 * (0.5 * q2_t)
        + k3 * v_t
        + k4 * w_t
        + k5 * (h_t + u_t * a_t)
    )

    mass_l = rho_l * u_l
    mass_r = rho_r * u_r
    f0 = 0.5 * (mass_l + mass_r) - 0.5 * diss0
    f1 = 0.5 * (mass_l * u_l + p_l + mass_r * u_r + p_r) - 0.5 * diss1
    f2 = 0.5 * (mass_l * v_l + mass_r * v_r) - 0.5 * diss2
    f3 = 0.5 * (mass_l * w_l + mass_r * w_r) - 0.5 * diss3
    f4 = 0.5 * (u_l * (e_l + p_l) + u_r * (e_r + p_r)) - 0.5 * diss4
    return f0, f1, f2, f3, f4


def _euler_state(key, dtype, n_velocity):
    k_rho, k_vel, k_p = jax.random.split(key, 3)
    rho = _uniform(k_rho, dtype, 0.5, 2.0)
    vel = _uniform(k_vel, dtype, -0.5, 0.5, (n_velocity,))
    p = _uniform(k_p, dtype, 0.5, 2.0)
    return (rho, *(vel[i] for i in range(n_velocity)), p)


def _roe_1d_args(key, dtype):
    k_l, k_r = jax.random.split(key)
    return (*_euler_state(k_l, dtype, 1), *_euler_state(k_r, dtype, 1))


def _roe_3d_args(key, dtype):
    k_l, k_r = jax.random.split(key)
    return (*_euler_state(k_l, dtype, 3), *_euler_state(k_r, dtype, 3))


# ---------------------------------------------------------------------------
# 6-DOF robot arm forward kinematics
# ---------------------------------------------------------------------------

# Denavit–Hartenberg parameters (d, a, α) of a UR5-type arm, in metres and radians.
ROBOT_DH = (
    (0.089159, 0.0, math.pi / 2),
    (0.0, -0.425, 0.0),
    (0.0, -0.39225, 0.0),
    (0.10915, 0.0, math.pi / 2),
    (0.09465, 0.0, -math.pi / 2),
    (0.0823, 0.0, 0.0),
)


# The kinematic chain is evaluated entry by entry on scalars. Entries that are exact
# Python constants (the zeros and ones of the DH matrices) are folded while the
# program is built, so the traced graph holds only the arithmetic a hand-written
# kinematics routine would do.
def _is(x, value):
    return isinstance(x, float) and x == value


def _mul(x, y):
    if isinstance(x, float) and isinstance(y, float):
        return x * y
    if _is(x, 0.0) or _is(y, 0.0):
        return 0.0
    if _is(x, 1.0):
        return y
    if _is(y, 1.0):
        return x
    if _is(x, -1.0):
        return -y
    if _is(y, -1.0):
        return -x
    return x * y


def _add(x, y):
    if isinstance(x, float) and isinstance(y, float):
        return x + y
    if _is(x, 0.0):
        return y
    if _is(y, 0.0):
        return x
    return x + y


def _dot(xs, ys):
    total = 0.0
    for x, y in zip(xs, ys, strict=True):
        total = _add(total, _mul(x, y))
    return total


def _dh_transform(theta, d, a, alpha):
    # Exact cos/sin for the right angles used by the DH table.
    ca = float(round(math.cos(alpha), 12)) + 0.0
    sa = float(round(math.sin(alpha), 12)) + 0.0
    ct = jnp.cos(theta)
    st = jnp.sin(theta)
    rot = [
        [ct, _mul(-ca, st), _mul(sa, st)],
        [st, _mul(ca, ct), _mul(-sa, ct)],
        [0.0, sa, ca],
    ]
    trans = [_mul(a, ct), _mul(a, st), float(d)]
    return rot, trans


def _compose(first, second):
    rot1, trans1 = first
    rot2, trans2 = second
    columns2 = [[rot2[i][j] for i in range(3)] for j in range(3)]
    rot = [[_dot(rot1[i], columns2[j]) for j in range(3)] for i in range(3)]
    trans = [_add(_dot(rot1[i], trans2), trans1[i]) for i in range(3)]
    return rot, trans


def robot_arm_6dof(q1, q2, q3, q4, q5, q6):
    """End-effector pose of a 6-axis arm by Denavit–Hartenberg forward kinematics.
    6 joint angles → 6 pose components.

    Each joint contributes T_i = Rot_z(θ_i) Trans_z(d_i) Trans_x(a_i) Rot_x(α_i), i.e.
    rotation [[cθ, -sθcα, sθsα], [sθ, cθcα, -cθsα], [0, sα, cα]] and translation
    (a cθ, a sθ, d), with the UR5-type table `ROBOT_DH`. The pose T = T₁⋯T₆ is
    reported as position (x, y, z) and Z-Y-X Euler angles from its rotation R:
    roll = atan2(R₃₂, R₃₃), pitch = atan2(-R₃₁, √(R₃₂² + R₃₃²)),
    yaw = atan2(R₂₁, R₁₁).
    """
    pose = None
    for theta, (d, a, alpha) in zip((q1, q2, q3, q4, q5, q6), ROBOT_DH, strict=True):
        link = _dh_transform(theta, d, a, alpha)
        pose = link if pose is None else _compose(pose, link)
    assert pose is not None
    rot, trans = pose
    roll = jnp.arctan2(rot[2][1], rot[2][2])
    pitch = jnp.arctan2(-rot[2][0], jnp.sqrt(rot[2][1] ** 2 + rot[2][2] ** 2))
    yaw = jnp.arctan2(rot[1][0], rot[0][0])
    return trans[0], trans[1], trans[2], roll, pitch, yaw


def _robot_args(key, dtype):
    q = _uniform(key, dtype, -math.pi, math.pi, (6,))
    return tuple(q[i] for i in range(6))


# ---------------------------------------------------------------------------
# MINPACK-2 problems
# ---------------------------------------------------------------------------

# Measured sums of the first human heart dipole instance (DHHD1) and its standard
# starting point, from the MINPACK-2 collection.
HHD_SUMS = dict(
    mx=0.485, my=-0.0019, A=-0.0581, B=0.015, C=0.105, D=0.0406, E=0.167, F=-0.399
)
HHD_START = (0.299, 0.186, -0.0273, 0.0254, -0.474, 0.474, -0.0892, 0.0892)


def human_heart_dipole(a, b, c, d, t, u, v, w):
    """Residual of the MINPACK-2 human heart dipole problem (instance DHHD1). 8 → 8.

    f₁ = a + b - σ_mx
    f₂ = c + d - σ_my
    f₃ = ta + ub - vc - wd - σ_A
    f₄ = va + wb + tc + ud - σ_B
    f₅ = a(t² - v²) - 2ctv + b(u² - w²) - 2duw - σ_C
    f₆ = c(t² - v²) + 2atv + d(u² - w²) + 2buw - σ_D
    f₇ = at(t² - 3v²) + cv(v² - 3t²) + bu(u² - 3w²) + dw(w² - 3u²) - σ_E
    f₈ = ct(t² - 3v²) - av(v² - 3t²) + du(u² - 3w²) - bw(w² - 3u²) - σ_F

    with the sums σ of `HHD_SUMS`.
    """
    s = HHD_SUMS
    tt, vv, uu, ww = t * t, v * v, u * u, w * w
    tv, uw = t * v, u * w
    t2_v2 = tt - vv
    u2_w2 = uu - ww
    t2_3v2 = tt - 3.0 * vv
    v2_3t2 = vv - 3.0 * tt
    u2_3w2 = uu - 3.0 * ww
    w2_3u2 = ww - 3.0 * uu
    f1 = a + b - s["mx"]
    f2 = c + d - s["my"]
    f3 = t * a + u * b - v * c - w * d - s["A"]
    f4 = v * a + w * b + t * c + u * d - s["B"]
    f5 = a * t2_v2 - 2.0 * c * tv + b * u2_w2 - 2.0 * d * uw - s["C"]
    f6 = c * t2_v2 + 2.0 * a * tv + d * u2_w2 + 2.0 * b * uw - s["D"]
    f7 = a * t * t2_3v2 + c * v * v2_3t2 + b * u * u2_3w2 + d * w * w2_3u2 - s["E"]
    f8 = c * t * t2_3v2 - a * v * v2_3t2 + d * u * u2_3w2 - b * w * w2_3u2 - s["F"]
    return f1, f2, f3, f4, f5, f6, f7, f8


def _hhd_args(key, dtype):
    k_scale, k_shift = jax.random.split(key)
    start = jnp.asarray(HHD_START, dtype)
    scale = _uniform(k_scale, dtype, 0.8, 1.2, (8,))
    shift = 0.01 * jax.random.normal(k_shift, (8,), dtype)
    x = start * scale + shift
    return tuple(x[i] for i in range(8))


# Propane combustion in air, full formulation: fuel-to-air ratio R, pressure p in
# atmospheres and equilibrium constants K5..K10 at 2200 K.
PROPANE_R = 10.0
PROPANE_P = 40.0
PROPANE_K = {
    5: 1.930e-1,
    6: 2.597e-3,
    7: 3.448e-3,
    8: 1.799e-5,
    9: 2.155e-4,
    10: 3.846e-5,
}
# Typical mole numbers x1..x10 (nitrogen near its balance 2·x3 ≈ 4R); x11 is the
# total number of moles.
PROPANE_START = (1.5, 2.0, 20.0, 0.5, 0.05, 0.005, 0.04, 0.003, 0.02, 5.0)


def propane_combustion(x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11):
    """Residual of the MINPACK-2 propane combustion problem, full formulation.
    11 mole numbers → 11 residuals.

    Element balances and equilibrium relations for the products of burning propane
    in air (R = 10, p = 40, constants `PROPANE_K`), with x11 the total moles:

    f₁ = x₁ + x₄ - 3
    f₂ = 2x₁ + x₂ + x₄ + x₇ + x₈ + x₉ + 2x₁₀ - R
    f₃ = 2x₂ + 2x₅ + x₆ + x₇ - 8
    f₄ = 2x₃ + x₉ - 4R
    f₅ = K₅x₂x₄ - x₁x₅
    f₆ = K₆√(x₂x₄) - √x₁ x₆ √(p/x₁₁)
    f₇ = K₇√(x₁x₂) - √x₄ x₇ √(p/x₁₁)
    f₈ = K₈x₁ - x₄x₈ (p/x₁₁)
    f₉ = K₉x₁√x₃ - x₄x₉ √(p/x₁₁)
    f₁₀ = K₁₀x₁² - x₄²x₁₀ (p/x₁₁)
    f₁₁ = x₁₁ - Σ_{j≤10} x_j
    """
    r, k = PROPANE_R, PROPANE_K
    p_ratio = PROPANE_P / x11
    sqrt_ratio = jnp.sqrt(p_ratio)
    f1 = x1 + x4 - 3.0
    f2 = 2.0 * x1 + x2 + x4 + x7 + x8 + x9 + 2.0 * x10 - r
    f3 = 2.0 * x2 + 2.0 * x5 + x6 + x7 - 8.0
    f4 = 2.0 * x3 + x9 - 4.0 * r
    f5 = k[5] * x2 * x4 - x1 * x5
    f6 = k[6] * jnp.sqrt(x2 * x4) - jnp.sqrt(x1) * x6 * sqrt_ratio
    f7 = k[7] * jnp.sqrt(x1 * x2) - jnp.sqrt(x4) * x7 * sqrt_ratio
    f8 = k[8] * x1 - x4 * x8 * p_ratio
    f9 = k[9] * x1 * jnp.sqrt(x3) - x4 * x9 * sqrt_ratio
    f10 = k[10] * x1 * x1 - x4 * x4 * x10 * p_ratio
    f11 = x11 - (x1 + x2 + x3 + x4 + x5 + x6 + x7 + x8 + x9 + x10)
    return f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11


def _propane_args(key, dtype):
    k_moles, k_total = jax.random.split(key)
    start = jnp.asarray(PROPANE_START, dtype)
    moles = start * jnp.exp(0.3 * jax.random.normal(k_moles, (10,), dtype))
    total = jnp.sum(moles) * _uniform(k_total, dtype, 0.9, 1.1)
    return (*(moles[i] for i in range(10)), total)


# ---------------------------------------------------------------------------
# Black–Scholes second-order Greeks
# ---------------------------------------------------------------------------

BLACK_SCHOLES_ARGNUMS = (0, 1, 2, 3, 4)


def black_scholes(spot, strike, vol, rate, maturity):
    """European call and put prices under Black–Scholes. 5 → 2 scalars.

    d₁ = (ln(S/K) + (r + σ²/2)T)/(σ√T), d₂ = d₁ - σ√T,
    C = S N(d₁) - K e^{-rT} N(d₂), P = K e^{-rT} N(-d₂) - S N(-d₁),
    with N the standard normal CDF (`jax.scipy.stats.norm.cdf`, erf-based).
    """
    vol_sqrt_t = vol * jnp.sqrt(maturity)
    d1 = (jnp.log(spot / strike) + (rate + 0.5 * vol * vol) * maturity) / vol_sqrt_t
    d2 = d1 - vol_sqrt_t
    discounted_strike = strike * jnp.exp(-rate * maturity)
    call = spot * norm.cdf(d1) - discounted_strike * norm.cdf(d2)
    put = discounted_strike * norm.cdf(-d2) - spot * norm.cdf(-d1)
    return call, put


def black_scholes_greeks(spot, strike, vol, rate, maturity):
    """First-order Greeks of [`black_scholes`][], computed by `graphax_eqx.jacve`.
    5 → 2 × 5 scalars.

    Differentiating this function gives the second-order Greeks (gamma, vanna,
    volga, ...), a 2 × 5 × 5 Jacobian of a Jacobian. The inner Jacobian always uses
    `graphax_eqx.jacve` with its default order; the method under test differentiates
    the resulting program. JAX baselines differentiate
    [`black_scholes_greeks_reference`][] instead, the same quantity computed by
    `jax.jacrev`, so each side is a pure nesting of its own transforms (the way a
    user of either library would write second derivatives).
    """
    import graphax_eqx

    greeks = graphax_eqx.jacve(black_scholes, argnums=BLACK_SCHOLES_ARGNUMS)
    return greeks(spot, strike, vol, rate, maturity)


black_scholes_greeks_reference = jax.jacrev(
    black_scholes, argnums=BLACK_SCHOLES_ARGNUMS
)


def _black_scholes_args(key, dtype):
    keys = jax.random.split(key, 5)
    spot = _uniform(keys[0], dtype, 50.0, 150.0)
    strike = _uniform(keys[1], dtype, 80.0, 120.0)
    vol = _uniform(keys[2], dtype, 0.1, 0.5)
    rate = _uniform(keys[3], dtype, 0.0, 0.05)
    maturity = _uniform(keys[4], dtype, 0.25, 2.0)
    return spot, strike, vol, rate, maturity


# ---------------------------------------------------------------------------
# Random-structure programs
# ---------------------------------------------------------------------------

# Bounded or slowly growing elementwise maps keep values of moderate size along
# long random chains, in float32 as in float64.
_UNARY: dict[str, Callable[[jax.Array], jax.Array]] = {
    "sin": jnp.sin,
    "cos": jnp.cos,
    "tanh": jnp.tanh,
    "rational": lambda x: x / (1.0 + x * x),
    "gauss": lambda x: jnp.exp(-x * x),
    "log1p_sq": lambda x: jnp.log1p(x * x),
    "softabs": lambda x: jnp.sqrt(1.0 + x * x),
    "swish": lambda x: x * jax.nn.sigmoid(x),
}
_UNARY_NAMES = tuple(_UNARY)


@dataclasses.dataclass(frozen=True)
class _Op:
    kind: str
    arg: Any = None


class _ConstantPool:
    """Fixed random constants, referred to by index from a program description."""

    def __init__(self, seed: int):
        self._rng = np.random.default_rng(seed)
        self.arrays: list[np.ndarray] = []

    def add(self, shape: Sequence[int], scale: float = 1.0, offset: float = 0.0) -> int:
        self.arrays.append(offset + scale * self._rng.standard_normal(tuple(shape)))
        return len(self.arrays) - 1

    def get(self, index: int, like: jax.Array) -> jax.Array:
        return _const(self.arrays[index], like)


WIDE_SEED = 20240501
WIDE_BRANCHES = 16


def _build_wide_program(seed: int):
    chooser = random.Random(seed)
    pool = _ConstantPool(seed)
    branches = []
    for _ in range(WIDE_BRANCHES):
        kind = chooser.choice(("scalar", "vector", "matrix"))
        if kind == "scalar":
            source = chooser.choice(("s", "sum_v", "trace_m"))
            source_arg = pool.add((16,), 0.25) if source == "sum_v" else None
        elif kind == "vector":
            source = chooser.choice(("v", "flat_m", "broadcast_s"))
            source_arg = pool.add((16,)) if source == "broadcast_s" else None
        else:
            source = chooser.choice(("m", "square_v", "outer_v"))
            source_arg = None
        ops = []
        for _ in range(chooser.randint(3, 6)):
            choice = chooser.random()
            if choice < 0.45:
                ops.append(_Op("unary", chooser.choice(_UNARY_NAMES)))
            elif choice < 0.6:
                shape = {"scalar": (), "vector": (16,), "matrix": (4, 4)}[kind]
                scale, shift = pool.add(shape, 0.5, 1.0), pool.add(shape, 0.3)
                ops.append(_Op("affine", (scale, shift)))
            elif choice < 0.8:
                if kind == "scalar":
                    ops.append(_Op(chooser.choice(("times_s", "plus_s"))))
                elif kind == "vector":
                    ops.append(_Op("matvec", pool.add((16, 16), 0.25)))
                else:
                    op = chooser.choice(("left_matmul", "right_matmul", "self_matmul"))
                    ops.append(_Op(op, pool.add((4, 4), 0.5)))
            else:
                if kind == "scalar":
                    ops.append(_Op("times_s"))
                elif kind == "vector":
                    ops.append(_Op(chooser.choice(("times_v", "plus_s", "normalise"))))
                else:
                    ops.append(_Op(chooser.choice(("transpose", "plus_s", "times_m"))))
        target = chooser.choice(("vector", "matrix"))
        branches.append((kind, source, source_arg, tuple(ops), target, pool.add((16,))))
    return tuple(branches), pool


WIDE_PROGRAM, _WIDE_POOL = _build_wide_program(WIDE_SEED)


def _wide_branch(branch, s, v, m):
    kind, source, source_arg, ops, _, _ = branch
    pool = _WIDE_POOL
    if source == "s":
        x = s
    elif source == "sum_v":
        x = jnp.sum(v * pool.get(source_arg, v))
    elif source == "trace_m":
        x = jnp.trace(m) * 0.25
    elif source == "v":
        x = v
    elif source == "flat_m":
        x = jnp.reshape(m, (16,))
    elif source == "broadcast_s":
        x = s * pool.get(source_arg, s)
    elif source == "m":
        x = m
    elif source == "square_v":
        x = jnp.reshape(v, (4, 4))
    else:
        x = 0.5 * jnp.outer(v[:4], v[4:8])
    for op in ops:
        if op.kind == "unary":
            x = _UNARY[op.arg](x)
        elif op.kind == "affine":
            scale, shift = op.arg
            x = pool.get(scale, x) * x + pool.get(shift, x)
        elif op.kind == "times_s":
            x = x * s
        elif op.kind == "plus_s":
            x = x + s
        elif op.kind == "matvec":
            x = pool.get(op.arg, x) @ x
        elif op.kind == "left_matmul":
            x = pool.get(op.arg, x) @ x
        elif op.kind == "right_matmul":
            x = x @ pool.get(op.arg, x)
        elif op.kind == "self_matmul":
            x = 0.5 * (x @ x) + pool.get(op.arg, x)
        elif op.kind == "times_v":
            x = x * v
        elif op.kind == "normalise":
            x = x / jnp.sqrt(jnp.mean(x * x) + 1.0)
        elif op.kind == "transpose":
            x = x.T
        elif op.kind == "times_m":
            x = x * m
        else:
            raise AssertionError(op.kind)
    return kind, x


def random_wide(s, v, m):
    """A wide random program: 16 independent branches combined at the end.
    Inputs: scalar s, vector v (16,), matrix m (4, 4) (33 numbers); outputs: a
    vector (16,) and a matrix (4, 4) (32 numbers).

    Each branch starts from one input (or a reduction, reshape, outer product or
    broadcast of one), applies 3–6 operations of its own kind — elementwise maps,
    affine maps, products with the inputs, matrix-vector and matrix-matrix products
    with fixed matrices, normalisation, transposition — and is added to one of the
    two outputs: scalars and matrices through fixed weight vectors and reshapes.
    The structure and constants come from `WIDE_SEED` and are fixed at import.
    """
    out_vec = jnp.zeros_like(v)
    out_mat = jnp.zeros_like(m)
    for branch in WIDE_PROGRAM:
        weight = _WIDE_POOL.get(branch[5], v)
        kind, x = _wide_branch(branch, s, v, m)
        if kind == "scalar":
            vec = x * weight
        elif kind == "vector":
            vec = x * weight
        else:
            vec = jnp.reshape(x, (16,)) * weight
        if branch[4] == "vector":
            out_vec = out_vec + vec
        else:
            out_mat = out_mat + jnp.reshape(vec, (4, 4))
    return out_vec, out_mat


def _wide_args(key, dtype):
    k_s, k_v, k_m = jax.random.split(key, 3)
    s = _uniform(k_s, dtype, -1.0, 1.0)
    v = jax.random.normal(k_v, (16,), dtype)
    m = jax.random.normal(k_m, (4, 4), dtype)
    return s, v, m


DEEP_SEED = 20240502
DEEP_LENGTH = 100
DEEP_OUT = 8


def _orthogonal(pool: _ConstantPool, n: int) -> int:
    index = pool.add((n, n))
    q, r = np.linalg.qr(pool.arrays[index])
    pool.arrays[index] = q * np.sign(np.diag(r))
    return index


def _build_deep_program(seed: int):
    chooser = random.Random(seed)
    pool = _ConstantPool(seed)
    ops = []
    kinds = (
        ("unary", 0.28),
        ("affine", 0.10),
        ("matvec", 0.10),
        ("matrix_right", 0.06),
        ("matrix_gram", 0.05),
        ("matrix_transpose", 0.04),
        ("centre", 0.05),
        ("normalise", 0.08),
        ("gate", 0.06),
        ("softmax", 0.04),
        ("skip_add", 0.07),
        ("skip_mul", 0.07),
    )
    names = [name for name, _ in kinds]
    weights = [weight for _, weight in kinds]
    for step in range(DEEP_LENGTH):
        kind = chooser.choices(names, weights)[0]
        if kind in ("skip_add", "skip_mul") and step < 4:
            kind = "unary"
        if kind == "unary":
            ops.append(_Op(kind, chooser.choice(_UNARY_NAMES)))
        elif kind == "affine":
            ops.append(_Op(kind, (pool.add((16,), 0.2, 1.0), pool.add((16,), 0.3))))
        elif kind == "matvec":
            ops.append(_Op(kind, _orthogonal(pool, 16)))
        elif kind == "matrix_right":
            ops.append(_Op(kind, _orthogonal(pool, 4)))
        elif kind == "gate":
            ops.append(_Op(kind, pool.add((16,), 0.25)))
        elif kind in ("skip_add", "skip_mul"):
            # Refer back to a state at most 20 steps ago.
            ops.append(_Op(kind, chooser.randint(max(0, step - 20), step - 2)))
        else:
            ops.append(_Op(kind))
    projection = pool.add((DEEP_OUT, 16), 0.25)
    return tuple(ops), projection, pool


DEEP_PROGRAM, _DEEP_PROJECTION, _DEEP_POOL = _build_deep_program(DEEP_SEED)


def random_deep(x):
    """A deep random program: a chain of 100 operations on a 16-vector. 16 → 8.

    Each step maps the state h to the next one by one of: a residual elementwise map
    h + u(h)/2, an affine map h·a + b, a product Q h with a fixed orthogonal
    16 × 16 matrix, a view of h as a 4 × 4 matrix H followed by H Q (Q orthogonal),
    H + H Hᵀ/16 or Hᵀ, centring h - mean(h), normalisation h/√(mean(h²) + 0.1),
    gating h·(1 + tanh(⟨c, h⟩)/2), a residual softmax h + 4 softmax(h), or a skip
    connection h + h_k or h·(1 + tanh(h_k)/2) to a state at most 20 steps back. The
    last state is normalised and a fixed 8 × 16 projection gives the output.
    Residual forms and orthogonal matrices keep both the values and the Jacobian of
    moderate size over the whole chain. Structure and constants come from
    `DEEP_SEED`.
    """
    pool = _DEEP_POOL
    history = [x]
    h = x
    for op in DEEP_PROGRAM:
        if op.kind == "unary":
            h = h + 0.5 * _UNARY[op.arg](h)
        elif op.kind == "affine":
            scale, shift = op.arg
            h = pool.get(scale, h) * h + pool.get(shift, h)
        elif op.kind == "matvec":
            h = pool.get(op.arg, h) @ h
        elif op.kind == "matrix_right":
            h = jnp.reshape(jnp.reshape(h, (4, 4)) @ pool.get(op.arg, h), (16,))
        elif op.kind == "matrix_gram":
            mat = jnp.reshape(h, (4, 4))
            h = h + jnp.reshape(mat @ mat.T, (16,)) * 0.0625
        elif op.kind == "matrix_transpose":
            h = jnp.reshape(jnp.reshape(h, (4, 4)).T, (16,))
        elif op.kind == "centre":
            h = h - jnp.mean(h)
        elif op.kind == "normalise":
            h = h / jnp.sqrt(jnp.mean(h * h) + 0.1)
        elif op.kind == "gate":
            h = h * (1.0 + 0.5 * jnp.tanh(jnp.dot(pool.get(op.arg, h), h)))
        elif op.kind == "softmax":
            shifted = h - jax.lax.stop_gradient(jnp.max(h))
            exp = jnp.exp(shifted)
            h = h + 4.0 * exp / jnp.sum(exp)
        elif op.kind == "skip_add":
            h = h + history[op.arg]
        elif op.kind == "skip_mul":
            h = h * (1.0 + 0.5 * jnp.tanh(history[op.arg]))
        else:
            raise AssertionError(op.kind)
        history.append(h)
    h = h / jnp.sqrt(jnp.mean(h * h) + 0.1)
    return pool.get(_DEEP_PROJECTION, h) @ h


def _deep_args(key, dtype):
    return (jax.random.normal(key, (16,), dtype),)


# ---------------------------------------------------------------------------
# Neural networks
# ---------------------------------------------------------------------------


def _glorot(rng, fan_in, fan_out):
    return rng.standard_normal((fan_out, fan_in)) * math.sqrt(2.0 / (fan_in + fan_out))


MLP_SIZES = (16, 32, 32, 4)
_MLP_RNG = np.random.default_rng(20240503)
MLP_PARAMS = tuple(
    (_glorot(_MLP_RNG, n_in, n_out), 0.1 * _MLP_RNG.standard_normal(n_out))
    for n_in, n_out in zip(MLP_SIZES[:-1], MLP_SIZES[1:])
)


def mlp(x):
    """A per-example multilayer perceptron 16 → 32 → 32 → 4 with tanh hidden
    activations and a linear last layer: h_{k+1} = tanh(W_k h_k + b_k). Fixed
    weights; the Jacobian is taken with respect to the input x (16,), giving (4, 16).
    """
    h = x
    for index, (weight, bias) in enumerate(MLP_PARAMS):
        h = _const(weight, x) @ h + _const(bias, x)
        if index < len(MLP_PARAMS) - 1:
            h = jnp.tanh(h)
    return h


def _mlp_args(key, dtype):
    return (jax.random.normal(key, (MLP_SIZES[0],), dtype),)


TOKENS = 4
FEATURES = 8
HEADS = 2
HIDDEN = 16
LAYERNORM_EPS = 1e-5
_TRANSFORMER_RNG = np.random.default_rng(20240504)


def _transformer_params(rng):
    def dense(n_in, n_out):
        return rng.standard_normal((n_in, n_out)) * math.sqrt(1.0 / n_in)

    return dict(
        ln1_scale=1.0 + 0.1 * rng.standard_normal(FEATURES),
        ln1_shift=0.1 * rng.standard_normal(FEATURES),
        w_q=dense(FEATURES, FEATURES),
        w_k=dense(FEATURES, FEATURES),
        w_v=dense(FEATURES, FEATURES),
        w_o=dense(FEATURES, FEATURES),
        ln2_scale=1.0 + 0.1 * rng.standard_normal(FEATURES),
        ln2_shift=0.1 * rng.standard_normal(FEATURES),
        w_1=dense(FEATURES, HIDDEN),
        b_1=0.1 * rng.standard_normal(HIDDEN),
        w_2=dense(HIDDEN, FEATURES),
        b_2=0.1 * rng.standard_normal(FEATURES),
    )


TRANSFORMER_PARAMS = _transformer_params(_TRANSFORMER_RNG)


def _layernorm(x, scale, shift):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centred = x - mean
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    return centred / jnp.sqrt(var + LAYERNORM_EPS) * scale + shift


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def transformer_encoder(x):
    """One pre-norm Transformer encoder block on 4 tokens × 8 features → same.

    y = h + MLP(LN(h)) with h = x + MHA(LN(x)), where LN(z) = (z - μ)/√(σ² + ε)·γ + β
    over features; MHA has 2 heads of width 4: Q, K, V = LN(x) W_{q,k,v}, per head
    softmax(Q Kᵀ/√4) V (softmax with max-shift), heads concatenated and mixed by
    W_o; the MLP is 8 → 16 → 8 with the tanh approximation of GELU. Fixed weights;
    the Jacobian with respect to x has shape (4, 8, 4, 8).
    """
    p = {name: _const(value, x) for name, value in TRANSFORMER_PARAMS.items()}
    head_dim = FEATURES // HEADS
    z = _layernorm(x, p["ln1_scale"], p["ln1_shift"])
    q = jnp.reshape(z @ p["w_q"], (TOKENS, HEADS, head_dim))
    k = jnp.reshape(z @ p["w_k"], (TOKENS, HEADS, head_dim))
    v = jnp.reshape(z @ p["w_v"], (TOKENS, HEADS, head_dim))
    scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
    scores = scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    weights = jnp.exp(scores)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    attended = jnp.einsum("hqk,khd->qhd", weights, v)
    h = x + jnp.reshape(attended, (TOKENS, FEATURES)) @ p["w_o"]
    z = _layernorm(h, p["ln2_scale"], p["ln2_shift"])
    hidden = _gelu_tanh(z @ p["w_1"] + p["b_1"])
    return h + hidden @ p["w_2"] + p["b_2"]


def _transformer_args(key, dtype):
    return (jax.random.normal(key, (TOKENS, FEATURES), dtype),)


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------


def _all(n: int) -> tuple[int, ...]:
    return tuple(range(n))


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task(
            "RoeFlux_1d",
            roe_flux_1d,
            _roe_1d_args,
            True,
            _all(6),
            summary="Roe flux, 1D Euler (6 → 3)",
        ),
        Task(
            "RoeFlux_3d",
            roe_flux_3d,
            _roe_3d_args,
            True,
            _all(10),
            summary="Roe flux, 3D Euler (10 → 5)",
        ),
        Task(
            "RobotArm_6DOF",
            robot_arm_6dof,
            _robot_args,
            True,
            _all(6),
            summary="DH forward kinematics (6 → 6)",
        ),
        Task(
            "HumanHeartDipole",
            human_heart_dipole,
            _hhd_args,
            True,
            _all(8),
            summary="MINPACK-2 heart dipole (8 → 8)",
        ),
        Task(
            "PropaneCombustion",
            propane_combustion,
            _propane_args,
            True,
            _all(11),
            summary="MINPACK-2 propane, full (11 → 11)",
        ),
        Task(
            "BlackScholes_Jacobian",
            black_scholes_greeks,
            _black_scholes_args,
            True,
            BLACK_SCHOLES_ARGNUMS,
            baseline_fn=black_scholes_greeks_reference,
            summary="Black–Scholes 2nd-order Greeks (5 → 2×5×5)",
        ),
        Task(
            "RandomWide",
            random_wide,
            _wide_args,
            False,
            _all(3),
            summary="16 random branches (33 → 32)",
        ),
        Task(
            "RandomDeep",
            random_deep,
            _deep_args,
            False,
            0,
            summary="100-op random chain (16 → 8)",
        ),
        Task("MLP", mlp, _mlp_args, False, 0, summary="MLP 16-32-32-4, tanh (16 → 4)"),
        Task(
            "TransformerEncoder",
            transformer_encoder,
            _transformer_args,
            False,
            0,
            summary="encoder block, 4×8 tokens (32 → 32)",
        ),
    )
}
