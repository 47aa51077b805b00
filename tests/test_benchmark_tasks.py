"""The benchmark tasks: `jacve` agrees with `jax.jacrev` on each of them, the
benchmark script runs end to end in quick mode, and the sparse suite's tasks are
well-formed."""

import functools
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import graphax_eqx
from benchmarks.sparse_tasks import SPARSE_TASKS
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


def _run_benchmarks(*arguments: str) -> subprocess.CompletedProcess:
    """`python -m benchmarks ARGUMENTS` from the repository root; it must succeed."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", *arguments],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_quick_run_writes_report(tmp_path):
    done = _run_benchmarks(
        "--quick",
        "--tasks",
        "MLP",
        "--no-training",
        "--no-scaling",
        "--out-dir",
        str(tmp_path),
    )
    assert "## Summary" in done.stdout
    report = (tmp_path / "benchmarks.md").read_text(encoding="utf-8")
    assert "| MLP |" in report
    assert "## Failures" not in report, report
    assert (tmp_path / "benchmarks_speedup.png").stat().st_size > 0


def test_sparse_suite_times_the_named_orders(tmp_path):
    out = tmp_path / "sparse.md"
    _run_benchmarks(
        "--suite",
        "sparse",
        "--small",
        "--repeats",
        "2",
        "--tasks",
        "Stencil1D,HeatSteps",
        # Every order is timed, however loaded the machine running the suite.
        "--skip-after",
        "300",
        "--out",
        str(out),
    )
    report = out.read_text(encoding="utf-8")
    assert "**WRONG**" not in report and "## WRONG RESULTS" not in report
    orders = report.split("## Orders")[1].split("##")[0]
    for name in ("Stencil1D", "HeatSteps"):
        (row,) = [
            line for line in orders.splitlines() if line.startswith(f"| {name} |")
        ]
        cells = [c.strip() for c in row.strip("|").split("|")]
        # auto's pick, four timings and the ratio, all measured.
        assert cells[1] in ("fwd", "rev", "markowitz", "relative_markowitz", "min_fill")
        assert all(c.endswith("s") for c in cells[2:6]), row
        assert cells[6].endswith("×"), row
    # The named orders are checked against the reference too.
    assert "jacve markowitz" in report.split("## Correctness")[1]


@pytest.mark.parametrize("name", list(SPARSE_TASKS))
def test_sparse_task_is_well_formed(name):
    # At the small size: one array in, one finite array out of the input's dtype,
    # and forward and reverse mode agree on the Jacobian.
    task = SPARSE_TASKS[name]
    fn = task.function(small=True)
    assert task.function(small=True) is fn
    x = task.make_input(jnp.float64, small=True)
    assert x.dtype == jnp.float64
    assert jnp.array_equal(x, task.make_input(jnp.float64, small=True))
    assert task.make_input(small=True).dtype == jnp.float32
    # One compiled program is quicker than op-by-op evaluation of three.
    y, forward, reverse = jax.jit(
        lambda x: (fn(x), jax.jacfwd(fn)(x), jax.jacrev(fn)(x))
    )(x)
    assert isinstance(y, jax.Array) and y.dtype == x.dtype
    assert bool(jnp.all(jnp.isfinite(y)))
    assert forward.shape == y.shape + x.shape
    assert bool(jnp.all(jnp.isfinite(forward)))
    assert np.count_nonzero(forward) > 0
    assert jnp.allclose(forward, reverse, rtol=1e-12, atol=1e-12)


_STAND_INS = {
    # Small functions under the names and arities the script expects, standing in
    # for the original repository's examples (which are not part of this one).
    "roe.py": "import jax.numpy as jnp\n\n\ndef RoeFlux_1d(a, b, c, d, e, f):\n"
    "    s = jnp.sin(a * b) + c * d\n    return s * e, s / (f + 2.0), jnp.exp(a - f)\n",
    "differential_kinematics.py": "import jax.numpy as jnp\n\n\n"
    "def RobotArm_6DOF(a, b, c, d, e, f):\n    x = jnp.cos(a) * jnp.sin(b + c)\n"
    "    return x * d, x + e * f, jnp.arctan2(d, e + 3.0)\n",
    "minpack.py": "import jax.numpy as jnp\n\n\n"
    "def HumanHeartDipole(*x):\n    y = [jnp.sin(v) for v in x]\n"
    "    return tuple(y[i] * y[(i + 1) % 8] for i in range(8))\n"
    "\n\ndef PropaneCombustion(*x):\n    s = jnp.sqrt(x[0] * x[1])\n"
    "    return tuple(s * x[i] - x[(i + 3) % 11] for i in range(11))\n",
}


def test_original_tasks_script(tmp_path):
    for name, text in _STAND_INS.items():
        (tmp_path / name).write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.original_tasks", str(tmp_path)]
        + ["--budget", "0.2"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for task in (
        "RoeFlux_1d",
        "RobotArm_6DOF",
        "HumanHeartDipole",
        "PropaneCombustion",
    ):
        assert f"| {task} |" in result.stdout
    assert "| yes |" in result.stdout and "| NO |" not in result.stdout


def test_original_tasks_script_needs_the_examples_folder(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.original_tasks", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode != 0
    assert "original graphax repository" in result.stderr


def test_sparse_suite_sizes_and_probe_reference():
    from benchmarks import sparse

    tasks = sparse._resized(SPARSE_TASKS, ["Bratu2D:grid=7", "Stencil1D:n=30"])
    assert tasks["Bratu2D"].full == {"grid": 7}
    assert tasks["Stencil1D"].full == {"n": 30}
    assert tasks["GrayScott2D"] is SPARSE_TASKS["GrayScott2D"]
    for bad in ("Nope:n=3", "Bratu2D:n=3", "Bratu2D:grid=x", "Bratu2D"):
        with pytest.raises(SystemExit, match="TASK:NAME=VALUE"):
            sparse._resized(SPARSE_TASKS, [bad])
    # The reference used where no Jacobian method ran: J · V from forward products.
    task = tasks["Bratu2D"]
    fn, x = task.function(), task.make_input(jnp.float32)
    probe = np.random.default_rng(0).standard_normal((x.size, 3))
    jac = np.asarray(jax.jacfwd(fn)(x), np.float64).reshape(-1, x.size)
    np.testing.assert_allclose(
        sparse._probe_products(fn, x, probe), jac @ probe, rtol=1e-5, atol=1e-4
    )


def test_models_script(capsys):
    from benchmarks import models

    models.main(["--quick", "--only", "Linear,ForwardMode"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(rows) == 3, out  # the header and two programs
    linear, lorenz = rows[1].split(" | "), rows[2].split(" | ")
    assert linear[0] == "| Linear 64 → 64" and linear[-1] == "rev |"
    # `jax.jacrev` cannot differentiate that solve (a `while_loop`).
    assert lorenz[5] == "–"


def test_batched_script(capsys):
    from benchmarks import batched

    batched.main(["--quick", "--batch", "8", "--only", "SIR,RobotArm"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(rows) == 3, out  # the header and two programs
    robot, sir = rows[1].split(" | "), rows[2].split(" | ")
    assert robot[0] == "| RobotArm_6DOF" and robot[-1] == "fwd |"
    assert sir[0] == "| SIR, 5 Euler steps" and sir[-1] == "fwd |"
