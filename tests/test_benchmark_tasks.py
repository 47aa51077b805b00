"""The benchmark tasks: `jacve` agrees with `jax.jacrev` on each of them, and the
benchmark script runs end to end in quick mode."""

import functools
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import graphax_eqx
from benchmarks.tasks import TASKS

from .helpers import tree_allclose


REPO_ROOT = Path(__file__).resolve().parent.parent
# Op-by-op evaluation beats XLA compile time on the long graphs of small operations;
# the networks and the wide program have fewer, larger operations, where compiling is
# the quicker way.
COMPILED = frozenset({"MLP", "RandomWide", "TransformerEncoder"})


def _maybe_jit(name, fn):
    return jax.jit(fn) if name in COMPILED else fn


@functools.cache
def _example(name):
    task = TASKS[name]
    args = task.make_args(jax.random.key(1), jnp.float64)
    jac = jax.jacrev(task.reference_fn, argnums=task.argnums)
    return args, _maybe_jit(name, jac)(*args)


@pytest.mark.parametrize("order", ("fwd", "rev", "markowitz"))
@pytest.mark.parametrize("name", list(TASKS))
def test_jacve_matches_jacrev(name, order):
    task = TASKS[name]
    args, reference = _example(name)
    jac = graphax_eqx.jacve(task.fn, order=order, argnums=task.argnums)
    jac = _maybe_jit(name, jac)(*args)
    assert tree_allclose(jac, reference, rtol=1e-9, atol=1e-9)


def test_quick_run_writes_report(tmp_path):
    command = [
        sys.executable,
        "-m",
        "benchmarks",
        "--quick",
        "--tasks",
        "MLP",
        "--no-training",
        "--no-scaling",
        "--out-dir",
        str(tmp_path),
    ]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "## Summary" in done.stdout
    report = (tmp_path / "benchmarks.md").read_text(encoding="utf-8")
    assert "| MLP |" in report
    assert "## Failures" not in report, report
    assert (tmp_path / "benchmarks_speedup.png").stat().st_size > 0
