"""Jacobians of `eqx.nn` layers, small models and simulations, against JAX.

Each program's Jacobian is timed under `jax.jit` in the order `auto` picks and in
forward and reverse order, against `jax.jacfwd` and `jax.jacrev` (median seconds of
interleaved calls, the start rotated every round; one call that compiles each program
first; each sample a run of calls lasting about a millisecond). The last columns
give the faster of JAX's two over `auto` (above 1, `auto` is
faster) and the order `auto` picked. Float32 throughout.

    python -m benchmarks.models [--quick] [--only NAME,NAME]

`--quick` runs three repetitions (a smoke test); `--only` picks programs whose name
contains one of the given words.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import graphax_eqx as gx


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    fun: Callable[[jax.Array], Any]
    x: jax.Array


def _transformer_block(key, tokens: int, features: int, heads: int, hidden: int):
    k1, k2 = jax.random.split(key)
    attention = eqx.nn.MultiheadAttention(heads, features, key=k1)
    norm = eqx.nn.LayerNorm(features)
    mlp = eqx.nn.MLP(features, features, hidden, 1, activation=jax.nn.gelu, key=k2)

    def block(x):
        h = jax.vmap(norm)(x)
        x = x + attention(h, h, h)
        return x + jax.vmap(mlp)(jax.vmap(norm)(x))

    return block, attention


def _lorenz_solve(adjoint):
    import diffrax

    def lorenz(t, y, args):
        s, r, b = 10.0, 28.0, 8.0 / 3.0
        return jnp.stack(
            [s * (y[1] - y[0]), y[0] * (r - y[2]) - y[1], y[0] * y[1] - b * y[2]]
        )

    def solve(y0):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lorenz),
            diffrax.Tsit5(),
            0.0,
            1.0,
            0.01,
            y0,
            saveat=diffrax.SaveAt(t1=True),
            stepsize_controller=diffrax.ConstantStepSize(),
            max_steps=200,
            adjoint=adjoint,
        )
        return sol.ys[0]

    return solve


def programs() -> list[Program]:
    keys = iter(jax.random.split(jax.random.key(0), 32))

    def normal(*shape):
        return jax.random.normal(next(keys), shape)

    out = [
        Program("Linear 64 → 64", eqx.nn.Linear(64, 64, key=next(keys)), normal(64)),
        Program(
            "MLP 32 → 128 × 3 → 16 (relu)",
            eqx.nn.MLP(32, 16, 128, 3, key=next(keys)),
            normal(32),
        ),
        Program(
            "MLP 64 → 512 × 3 → 64 (gelu)",
            eqx.nn.MLP(64, 64, 512, 3, activation=jax.nn.gelu, key=next(keys)),
            normal(64),
        ),
        Program("LayerNorm 128", eqx.nn.LayerNorm(128), normal(128)),
    ]
    gru = eqx.nn.GRUCell(16, 32, key=next(keys))
    h0 = normal(32)
    out.append(Program("GRUCell 16 → 32 (input)", lambda x: gru(x, h0), normal(16)))
    conv = eqx.nn.Conv2d(3, 8, 3, padding=1, key=next(keys))
    out.append(Program("Conv2d 3 → 8, 16 × 16", conv, normal(3, 16, 16)))
    cnn = eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(3, 8, 3, key=next(keys)),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.MaxPool2d(2, 2),
            eqx.nn.Lambda(jnp.ravel),
            eqx.nn.Linear(8 * 7 * 7, 10, key=next(keys)),
        ]
    )
    out.append(Program("CNN 3 × 16 × 16 → 10", cnn, normal(3, 16, 16)))
    block, attention = _transformer_block(next(keys), 16, 64, 8, 256)
    tokens = normal(16, 64)
    out.append(
        Program("attention, 8 heads, 16 × 64", lambda x: attention(x, x, x), tokens)
    )
    out.append(Program("transformer block, 16 × 64", block, tokens))

    def step(u):
        return u + 0.1 * (jnp.roll(u, 1) - 2 * u + jnp.roll(u, -1)) - 0.01 * u**3

    out.append(Program("heat step with roll, 1,000", step, normal(1000)))
    try:
        import diffrax
    except ImportError:  # pragma: no cover
        return out
    y0 = jnp.array([1.0, 1.0, 1.0])
    out.append(
        Program(
            "diffrax Lorenz, checkpointed adjoint",
            _lorenz_solve(diffrax.RecursiveCheckpointAdjoint()),
            y0,
        )
    )
    out.append(
        Program("diffrax Lorenz, ForwardMode", _lorenz_solve(diffrax.ForwardMode()), y0)
    )
    return out


def _picked(fun, x) -> str:
    costs = {
        name: gx.elimination_cost(fun, order=name)(x)
        for name in (
            "auto",
            "fwd",
            "rev",
            "markowitz",
            "relative_markowitz",
            "min_fill",
        )
    }
    auto = tuple(costs.pop("auto").order)
    return next((n for n, c in costs.items() if tuple(c.order) == auto), "auto")


def _jax_mode(transform, fun, x):
    """`jax.jit(transform(fun))`, or `None` where JAX cannot differentiate `fun` in
    that mode (a `custom_vjp` function has no forward mode, a `while_loop` no
    reverse mode)."""
    program = jax.jit(transform(fun))
    try:
        jax.block_until_ready(program(x))
    except (TypeError, ValueError):
        return None
    return program


def _time_programs(programs: dict[str, Any], x, repetitions: int) -> dict[str, float]:
    """Median seconds per call: rounds of interleaved samples (the start rotated
    every round), each sample a run of calls lasting about a millisecond, so that
    microsecond programs are not measured by single, noisy dispatches."""
    labels = list(programs)
    calls = {}
    for label, program in programs.items():
        jax.block_until_ready(program(x))
        # The fastest of a few calls: one slow first call would make every sample of
        # this program a shorter run, whose dispatch overlaps less.
        once = []
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(program(x))
            once.append(time.perf_counter() - start)
        calls[label] = max(1, min(200, int(1e-3 / min(once))))
    samples: dict[str, list[float]] = {label: [] for label in labels}
    for rep in range(repetitions):
        shift = rep % len(labels)
        for label in labels[shift:] + labels[:shift]:
            program, n = programs[label], calls[label]
            start = time.perf_counter()
            for _ in range(n):
                out = program(x)
            jax.block_until_ready(out)
            samples[label].append((time.perf_counter() - start) / n)
    return {label: statistics.median(v) for label, v in samples.items()}


HEADER = (
    "| program | `auto` | fwd | rev | `jax.jacfwd` | `jax.jacrev` | JAX best / `auto` "
    "| `auto` picks |\n|---|---|---|---|---|---|---|---|"
)


def run(selected: Sequence[Program], repetitions: int) -> list[str]:
    """One table row per program (printed as it is measured)."""
    rows = []
    for p in selected:
        timed: dict[str, Any] = {
            order: jax.jit(gx.jacve(p.fun, order=order))
            for order in ("auto", "fwd", "rev")
        }
        for label, transform in (
            ("jax.jacfwd", jax.jacfwd),
            ("jax.jacrev", jax.jacrev),
        ):
            program = _jax_mode(transform, p.fun, p.x)
            if program is not None:
                timed[label] = program
        times = _time_programs(timed, p.x, repetitions)
        jax_best = min(times.get(m, float("inf")) for m in ("jax.jacfwd", "jax.jacrev"))

        def cell(label):
            return f"{times[label] * 1e6:,.1f} µs" if label in times else "–"

        rows.append(
            f"| {p.name} | {cell('auto')} | {cell('fwd')} | {cell('rev')} "
            f"| {cell('jax.jacfwd')} | {cell('jax.jacrev')} "
            f"| {jax_best / times['auto']:.2f}× | {_picked(p.fun, p.x)} |"
        )
        print(rows[-1], flush=True)
    return rows


def select(candidates: Sequence[Any], only: str) -> list[Any]:
    """The programs whose name contains one of the comma-separated words of `only`
    (all of them where it names none)."""
    words = [w.strip() for w in only.split(",") if w.strip()]
    return [p for p in candidates if not words or any(w in p.name for w in words)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="")
    args = parser.parse_args(argv)
    selected = select(programs(), args.only)
    start = time.perf_counter()
    print(HEADER)
    run(selected, 3 if args.quick else 21)
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
