"""Eager (un-jitted) repeated calls: jacve against JAX's own eager transforms.

Every eager call of `jacve` traces the function again, as `jax.jacrev` does, so values
it closes over are read afresh. The analysed graph and the resolved order are cached,
and repeated calls run the evaluation and elimination as one compiled function whose
inputs are the leaves and closed-over values. This script shows what that costs: the
median of 20 interleaved repetitions of each pair, after one warm-up call of each.

    python -m benchmarks.eager
"""

from __future__ import annotations

import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

import graphax_eqx as gx


def _cases():
    model = eqx.nn.MLP(8, 4, 32, 2, key=jr.PRNGKey(0))
    batch = jr.normal(jr.PRNGKey(1), (16, 8))

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    def stencil(u):
        return u[2:] - 2 * u[1:-1] + u[:-2] + jnp.sin(u[1:-1]) ** 3

    def mixed(x):
        return jnp.sin(x) * jnp.sum(x**2) + jnp.cumsum(x)

    u = jnp.linspace(0.0, 1.0, 64)
    yield (
        "MLP loss, filter_jacve vs eqx.filter_grad",
        lambda: gx.filter_jacve(loss)(model, batch),
        lambda: eqx.filter_grad(loss)(model, batch),
    )
    yield (
        "MLP loss, filter_value_and_jacve vs eqx.filter_value_and_grad",
        lambda: gx.filter_value_and_jacve(loss)(model, batch),
        lambda: eqx.filter_value_and_grad(loss)(model, batch),
    )
    yield (
        "stencil n=64, jacve vs jax.jacrev",
        lambda: gx.jacve(stencil)(u),
        lambda: jax.jacrev(stencil)(u),
    )
    yield (
        "sin/sum/cumsum n=64, jacve vs jax.jacrev",
        lambda: gx.jacve(mixed)(u),
        lambda: jax.jacrev(mixed)(u),
    )
    try:
        import diffrax
    except ImportError:  # pragma: no cover
        return
    from .models import _lorenz_solve

    solve = _lorenz_solve(diffrax.RecursiveCheckpointAdjoint())
    y0 = jnp.array([1.0, 1.0, 1.0])
    yield (
        "diffrax Lorenz (checkpointed adjoint), jacve vs jax.jacrev",
        lambda: gx.jacve(solve)(y0),
        lambda: jax.jacrev(solve)(y0),
    )


def _time(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def main(repeats: int = 20) -> None:
    print(f"{'case':<64} {'jacve ms':>9} {'JAX ms':>9} {'ratio':>6}")
    for name, ours, theirs in _cases():
        _time(ours), _time(theirs)
        a, b = [], []
        for _ in range(repeats):
            a.append(_time(ours))
            b.append(_time(theirs))
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{name:<64} {ma * 1e3:>9.2f} {mb * 1e3:>9.2f} {ma / mb:>6.2f}")


if __name__ == "__main__":
    main()
