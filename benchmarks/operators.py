"""Jacobians through convolution layers, sparse operators and segment maxima.

Three programs outside the sparse suite, each timed under `jax.jit` as the median
of interleaved repetitions after one call that compiles it (whose time is reported
as the first call):

- `CNN`: `Conv2d(3, 8, 3)` → gelu → `Conv2d(8, 2, 3, stride 2)` on 3 × 32 × 32
  (float32), its input Jacobian as a `CooTensor`; and with a `Linear(512, 10)`
  head, dense.
- `BCOO Laplacian`: `K @ u + u**3 - b`, `K` the 5-point Laplacian on 64 × 64 as a
  `jax.experimental.sparse.BCOO` matrix.
- `segment_max`: `jax.ops.segment_max(sin(u), ids, 4096)` over 16,384 entries with
  constant ids, times `u[:4096]`.

Each is compared with `jax.jacfwd`, `jax.jacrev` and asdex (its preparation time
reported apart; "no rule" where asdex cannot trace the program).

    python -m benchmarks.operators [repetitions]
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as ssp
from jax.experimental import sparse

import graphax_eqx as gx


def _cnn():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    first = eqx.nn.Conv2d(3, 8, 3, padding=1, key=k1)
    second = eqx.nn.Conv2d(8, 2, 3, padding=1, stride=2, key=k2)
    head = eqx.nn.Linear(2 * 16 * 16, 10, key=k3)

    def features(img):
        return second(jax.nn.gelu(first(img)))

    def logits(img):
        return head(jnp.ravel(features(img)))

    img = jax.random.uniform(jax.random.PRNGKey(1), (3, 32, 32))
    return features, logits, img


def _laplacian():
    m = 64
    line = ssp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    grid = ssp.kron(line, ssp.eye(m)) + ssp.kron(ssp.eye(m), line)
    k = sparse.BCOO.from_scipy_sparse(grid.tocoo().astype(np.float32))
    b = jnp.ones(m * m, jnp.float32)

    def residual(u):
        return k @ u + u**3 - b

    u = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, m * m), jnp.float32)
    return residual, u


def _segments():
    n, segments = 16384, 4096
    ids = jnp.asarray(np.random.default_rng(1).integers(0, segments, n))

    def pooled(u):
        return jax.ops.segment_max(jnp.sin(u), ids, segments) * u[:segments]

    u = jnp.asarray(np.random.default_rng(2).uniform(0.5, 1.5, n), jnp.float32)
    return pooled, u


def _asdex(fn, x):
    """`(jitted asdex Jacobian, preparation seconds)`, or `None` without a rule."""
    try:
        import asdex
    except ImportError:
        return None
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sparsity = asdex.jacobian_sparsity(fn, x)
            coloring = asdex.jacobian_coloring_from_sparsity(sparsity)
    except NotImplementedError:
        return None
    prep = time.perf_counter() - start
    return jax.jit(asdex.jacobian_from_coloring(fn, coloring)), prep


def _programs():
    features, logits, img = _cnn()
    residual, u = _laplacian()
    pooled, v = _segments()
    for name, fn, x in (
        ("CNN input Jacobian", features, img),
        ("BCOO Laplacian", residual, u),
        ("segment_max", pooled, v),
    ):
        yield (
            name,
            x,
            {
                "jacve sparse": jax.jit(gx.jacve(fn, sparse_representation=True)),
                "jacve dense": jax.jit(gx.jacve(fn)),
                "jax.jacfwd": jax.jit(jax.jacfwd(fn)),
                "jax.jacrev": jax.jit(jax.jacrev(fn)),
            },
            _asdex(fn, x),
        )
    yield (
        "CNN + 10-output head",
        img,
        {
            "jacve dense": jax.jit(gx.jacve(logits)),
            "jax.jacfwd": jax.jit(jax.jacfwd(logits)),
            "jax.jacrev": jax.jit(jax.jacrev(logits)),
        },
        _asdex(logits, img),
    )


def main(repetitions: int = 15) -> None:
    print("| program | method | run | first call | nse |")
    print("|---|---|---|---|---|")
    for name, x, programs, asdex_program in _programs():
        first, nse = {}, {}
        if asdex_program is not None:
            programs["asdex"] = asdex_program[0]
        for label, program in programs.items():
            start = time.perf_counter()
            out = jax.block_until_ready(program(x))
            first[label] = f"{time.perf_counter() - start:.2f} s"
            nse[label] = out.nse if hasattr(out, "nse") else ""
        if asdex_program is not None:
            first["asdex"] = f"{asdex_program[1]:.2f} s + {first['asdex']}"
        times = {label: [] for label in programs}
        for _ in range(repetitions):
            for label, program in programs.items():
                start = time.perf_counter()
                jax.block_until_ready(program(x))
                times[label].append(time.perf_counter() - start)
        for label in programs:
            run = statistics.median(times[label]) * 1e3
            print(
                f"| {name} | {label} | {run:.3f} ms | {first[label]} | {nse[label]} |"
            )
        if asdex_program is None:
            print(f"| {name} | asdex | no rule | | |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
