"""Order search on the original authors' versions of four benchmark tasks.

AlphaGrad's published orders were found for the task functions of the original graphax
repository. Counted by this engine, those orders need 249 (RoeFlux_1d), 176
(RobotArm_6DOF), 70 (HumanHeartDipole) and 36 (PropaneCombustion) multiplications.
This script runs `graphax_eqx.search_order` on the same functions and compares.

The functions are not part of this repository. Point the script at the `examples`
folder of a checkout of the original repository (`src/graphax/examples`); it loads
`roe.py`, `differential_kinematics.py` and `minpack.py` from there by file path (they
only import JAX):

    python -m benchmarks.original_tasks PATH/TO/graphax/src/graphax/examples
    python -m benchmarks.original_tasks PATH --budget 10 --seed 1

For each task it prints the multiplications of every named order, of the searched
order and of AlphaGrad's order, the search time, and whether the searched order's
Jacobian equals `jax.jacrev`'s at a point where the function is finite.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

import graphax_eqx as gx

from .run import run_lines


# task -> (file in the examples folder, function name, number of scalar inputs,
# multiplications of AlphaGrad's published order as counted by this engine).
TASKS: dict[str, tuple[str, str, int, int]] = {
    "RoeFlux_1d": ("roe.py", "RoeFlux_1d", 6, 249),
    "RobotArm_6DOF": ("differential_kinematics.py", "RobotArm_6DOF", 6, 176),
    "HumanHeartDipole": ("minpack.py", "HumanHeartDipole", 8, 70),
    "PropaneCombustion": ("minpack.py", "PropaneCombustion", 11, 36),
}
NAMED = ("fwd", "rev", "markowitz", "relative_markowitz", "min_fill", "auto")


def _load(folder: Path, filename: str) -> ModuleType:
    path = folder / filename
    if not path.is_file():
        raise SystemExit(
            f"{path} does not exist: pass the `src/graphax/examples` folder of a "
            "checkout of the original graphax repository."
        )
    spec = importlib.util.spec_from_file_location(f"_original_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _finite_point(fun: Callable, n: int) -> tuple[jax.Array, ...]:
    """Scalar arguments in [0.5, 1.5] at which `fun` and its Jacobian are finite (the
    tasks take square roots of differences, so not every point qualifies)."""
    for seed in range(1000):
        xs = np.random.default_rng(seed).uniform(0.5, 1.5, n)
        args = tuple(jnp.asarray(x, jnp.float64) for x in xs)
        jac = jax.jacrev(fun, argnums=tuple(range(n)))(*args)
        leaves = jax.tree_util.tree_leaves((fun(*args), jac))
        if all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in leaves):
            return args
    raise RuntimeError("found no point where the function is finite")


def _same(a, b) -> bool:
    return all(
        np.allclose(x, y, rtol=1e-9, atol=1e-12)
        for x, y in zip(
            jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.original_tasks", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "examples", type=Path, help="src/graphax/examples of a checkout"
    )
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)

    start = time.perf_counter()
    rows = []
    for name, (filename, attr, n, alphagrad) in TASKS.items():
        fun = getattr(_load(args.examples, filename), attr)
        point = _finite_point(fun, n)
        argnums = tuple(range(n))
        named = {
            order: gx.elimination_cost(fun, order=order, argnums=argnums)(*point)
            for order in NAMED
        }
        t0 = time.perf_counter()
        found = gx.search_order(
            fun, argnums=argnums, budget_s=args.budget, seed=args.seed, progress=False
        )(*point)
        elapsed = time.perf_counter() - t0
        jac = gx.jacve(fun, order=found.order, argnums=argnums)(*point)
        same = _same(jac, jax.jacrev(fun, argnums=argnums)(*point))
        best = min(named[o].num_muls for o in ("fwd", "rev", "markowitz"))
        rows.append((name, named, found.cost.num_muls, alphagrad, best, elapsed, same))
        print(f"{name}: searched {found.cost.num_muls}, AlphaGrad {alphagrad}")

    wall = time.perf_counter() - start
    print()
    for line in run_lines(
        "python -m benchmarks.original_tasks " + " ".join(sys.argv[1:]), wall, []
    ):
        print(line)
    print()
    header = [*NAMED, "searched", "AlphaGrad's order", "saved", "search", "= jacrev"]
    print("| task | " + " | ".join(header) + " |")
    print("|---" * (len(header) + 1) + "|")
    for name, named, searched, alphagrad, best, elapsed, same in rows:
        cells = [f"{named[o].num_muls:,}" for o in NAMED]
        cells += [
            f"**{searched:,}**",
            f"{alphagrad:,}",
            f"{1 - searched / best:.1%} ({1 - alphagrad / best:.1%})" if best else "—",
            f"{elapsed:.0f} s",
            "yes" if same else "NO",
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    ok = all(row[6] for row in rows) and all(row[2] <= row[3] for row in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
