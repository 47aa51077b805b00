"""Elimination orders on the benchmark suite: counts, search, and measured run time.

For every task of `benchmarks.tasks`, this script

- counts the multiplications of every named order (fwd, rev, markowitz,
  relative_markowitz, min_fill, auto) with `graphax_eqx.elimination_cost`;
- runs `graphax_eqx.search_order` with a time budget (default 60 s);
- times `jax.jit(jax.vmap(jacve(f, order)))` at batch 512 for every order, the searched
  one included, against `jax.vmap(jax.jacfwd(f))` and `jax.vmap(jax.jacrev(f))`, with
  interleaved repetitions;
- writes the raw results to `benchmarks/orders_results.json` and the table between
  the markers of `docs/orders.md`.

    python -m benchmarks.orders                 # full run, ~15 min on 2 cores
    python -m benchmarks.orders --budget 5 --tasks RoeFlux_1d,MLP --no-write

`--fit` fits the weights of the run-time model to `orders_results.json` instead (see
`docs/orders.md`); `--render` rewrites the docs table from that file without running.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import graphax_eqx as gx

from . import tasks as task_registry
from .run import run_lines


BATCH = 512
DTYPE = jnp.float32
NAMED = ("fwd", "rev", "markowitz", "relative_markowitz", "min_fill", "auto")
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "orders_results.json"
PAGE = REPO_ROOT / "docs" / "orders.md"
START, END = "<!-- orders-table:start -->", "<!-- orders-table:end -->"

# AlphaGrad (NeurIPS 2024): reduction in multiplications of its best order against
# the best of forward, reverse and minimal Markowitz, on its own versions of the tasks.
ALPHAGRAD = {
    "RoeFlux_1d": 0.12,
    "RoeFlux_3d": 0.14,
    "RobotArm_6DOF": 0.20,
    "HumanHeartDipole": 0.14,
    "PropaneCombustion": 0.02,
    "BlackScholes_Jacobian": 0.11,
    "RandomWide": 0.28,
    "RandomDeep": 0.075,
    "MLP": 0.008,
    "TransformerEncoder": 0.007,
}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _block(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: x.block_until_ready() if hasattr(x, "block_until_ready") else x, tree
    )


def _time_programs(programs: dict[str, Any], args, max_reps: int, budget_s: float):
    """Median seconds per call, repetitions interleaved with a rotating start."""
    labels = list(programs)
    for f in programs.values():
        for _ in range(2):
            _block(f(*args))
    samples: dict[str, list[float]] = {k: [] for k in labels}
    start = time.perf_counter()
    for rep in range(max_reps):
        if rep >= 15 and time.perf_counter() - start > budget_s:
            break
        shift = rep % len(labels)
        for label in labels[shift:] + labels[:shift]:
            t0 = time.perf_counter()
            _block(programs[label](*args))
            samples[label].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}, len(
        samples[labels[0]]
    )


def run_task(task: task_registry.Task, budget_s: float, seed: int) -> dict[str, Any]:
    example = task.make_args(jax.random.key(0), DTYPE)
    costs = {}
    for name in NAMED:
        c = gx.elimination_cost(task.fn, order=name, argnums=task.argnums)(*example)
        costs[name] = c
    _log(f"[{task.name}] search, {budget_s:.0f} s")
    found = gx.search_order(
        task.fn, argnums=task.argnums, budget_s=budget_s, seed=seed, progress=False
    )(*example)
    costs["searched"] = found.cost
    orders = {name: tuple(c.order) for name, c in costs.items()}

    _log(f"[{task.name}] timing at batch {BATCH}")
    batch = task_registry.make_batch(task, jax.random.key(BATCH), DTYPE, BATCH)
    programs = {}
    for name, order in orders.items():
        jac = gx.jacve(task.fn, order=order, argnums=task.argnums)
        programs[name] = jax.jit(jax.vmap(jac))
    programs["jax.jacfwd"] = jax.jit(
        jax.vmap(jax.jacfwd(task.reference_fn, argnums=task.argnums))
    )
    programs["jax.jacrev"] = jax.jit(
        jax.vmap(jax.jacrev(task.reference_fn, argnums=task.argnums))
    )
    times, reps = _time_programs(programs, batch, max_reps=60, budget_s=8.0)
    jax_best = min(times["jax.jacfwd"], times["jax.jacrev"])
    return {
        "task": task.name,
        "summary": task.summary,
        "costs": {
            name: {
                "muls": c.num_muls,
                "adds": c.num_adds,
                "traffic": c.traffic,
                "products": c.products,
                "fill": c.fill,
                "gathered": c.gathered,
                "predicted": c.predicted_time,
            }
            for name, c in costs.items()
        },
        "auto_picked": next(
            (n for n in NAMED[:-1] if orders[n] == orders["auto"]), "auto"
        ),
        "search": {
            "seconds": found.elapsed_s,
            "evaluations": found.evaluations,
            "reduction": found.reduction,
        },
        "times": times,
        "repeats": reps,
        "speedup": {name: jax_best / times[name] for name in orders},
    }


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


# Short names for the orders in the tables.
_SHORT = {
    "fwd": "fwd",
    "rev": "rev",
    "markowitz": "markowitz",
    "relative_markowitz": "rel. Markowitz",
    "min_fill": "min fill",
    "auto": "auto",
}


def _details(title: str, lines: list[str]) -> list[str]:
    """A collapsed admonition box whose Markdown content is rendered."""
    return [
        '<details class="note" markdown="1">',
        f"<summary>{title}</summary>",
        "",
        *lines,
        "",
        "</details>",
        "",
    ]


def render(results: Sequence[dict[str, Any]], header: list[str]) -> str:
    lines = [START, "", *header, ""]
    lines += [
        "The searched order's multiplications and the fraction it saves against "
        "the best of fwd / rev / markowitz (*best named*), next to AlphaGrad's "
        "published reduction on its own version of the task, and the search time.",
        "",
        "| task | best named | searched | saved | AlphaGrad | search |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r["costs"]
        best3 = min(c[k]["muls"] for k in ("fwd", "rev", "markowitz"))
        red = 1 - c["searched"]["muls"] / best3 if best3 else 0.0
        lines.append(
            f"| {r['task']} | {best3:,} | **{c['searched']['muls']:,}** "
            f"| {_pct(red)} | {_pct(ALPHAGRAD[r['task']])} "
            f"| {r['search']['seconds']:.0f} s |"
        )
    lines.append("")
    per_order = ("fwd", "rev", "markowitz", "relative_markowitz", "min_fill")
    rows = [
        "| task | " + " | ".join(_SHORT[k] for k in per_order) + " |",
        "|---|" + "---|" * len(per_order),
    ]
    for r in results:
        c = r["costs"]
        cells = " | ".join(f"{c[k]['muls']:,}" for k in per_order)
        rows.append(f"| {r['task']} | {cells} |")
    lines += _details("Multiplications of every named order", rows)
    lines += [
        f"Speed-up at batch {BATCH} (`jax.jit(jax.vmap(...))`, medians of "
        "interleaved repetitions) against the faster of `jax.jacfwd` and "
        "`jax.jacrev`; above 1 means faster.",
        "",
        "| task | auto | searched | auto picks | JAX best |",
        "|---|---|---|---|---|",
    ]
    ups = []
    for r in results:
        t = r["times"]
        best = min(t["jax.jacfwd"], t["jax.jacrev"])
        ups.append(r["speedup"]["auto"])
        lines.append(
            f"| {r['task']} | {r['speedup']['auto']:.2f}× "
            f"| {r['speedup']['searched']:.2f}× | {_SHORT[r['auto_picked']]} "
            f"| {_us(best)} |"
        )
    geo = math.exp(statistics.fmean(math.log(u) for u in ups))
    lines += ["", f"Geometric mean speed-up of `auto`: {geo:.2f}×.", ""]
    names = (*NAMED[:-1], "searched", "jax.jacfwd", "jax.jacrev")
    rows = [
        "| task | " + " | ".join(_SHORT.get(k, k) for k in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for r in results:
        t = r["times"]
        rows.append(f"| {r['task']} | " + " | ".join(_us(t[k]) for k in names) + " |")
    lines += _details("Run time of every order", rows)
    lines.append(END)
    return "\n".join(lines)


def write_page(table: str) -> None:
    text = PAGE.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    PAGE.write_text(head + table + tail)


def fit(path: Path = RESULTS) -> dict[str, float]:
    """Fit the run-time model's weights to measured run times; prints them.

    Within a task only differences between orders matter, so each task's times and
    features are centred on their task mean, scaled by the task's mean time, and the
    non-negative weights minimise the squared error of the centred times.
    """
    data = json.loads(path.read_text())
    features = ("muls", "adds", "traffic", "products")
    rows, targets = [], []
    for r in data["results"]:
        names = [n for n in r["costs"] if n in r["times"]]
        x = np.array([[r["costs"][n][f] for f in features] for n in names], float)
        y = np.array([r["times"][n] for n in names], float)
        scale = y.mean()
        x_scale = np.maximum(x[:, 0].mean(), 1.0)
        rows.append((x - x.mean(0)) / x_scale)
        targets.append((y - y.mean()) / scale)
    a, b = np.concatenate(rows), np.concatenate(targets)
    weights = _nnls(a, b)
    weights = weights / weights[0] if weights[0] > 0 else weights
    out = dict(zip(features, (float(w) for w in weights)))
    print(json.dumps(out, indent=1))
    return out


def _nnls(a: np.ndarray, b: np.ndarray, iters: int = 5000) -> np.ndarray:
    """Non-negative least squares by projected gradient (small problems only)."""
    x = np.zeros(a.shape[1])
    step = 1.0 / max(np.linalg.norm(a, 2) ** 2, 1e-12)
    for _ in range(iters):
        x = np.maximum(0.0, x - step * (a.T @ (a @ x - b)))
    return x


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.orders")
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", default=",".join(task_registry.TASKS))
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--fit", action="store_true")
    parser.add_argument(
        "--render",
        action="store_true",
        help="rewrite the docs table from the saved results, without running",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.fit:
        fit()
        return 0
    if args.render:
        saved = json.loads(RESULTS.read_text())
        write_page(render(saved["results"], saved["header"]))
        return 0
    start = time.perf_counter()
    results = []
    for name in args.tasks.split(","):
        results.append(run_task(task_registry.TASKS[name], args.budget, args.seed))
    command = "python -m benchmarks.orders"
    if argv:
        command += " " + " ".join(argv)
    header = run_lines(command, time.perf_counter() - start, [])
    table = render(results, header)
    print(table)
    if not args.no_write:
        RESULTS.write_text(
            json.dumps({"header": header, "results": results}, indent=1) + "\n"
        )
        write_page(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
