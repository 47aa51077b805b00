import os
import pathlib
import re
import subprocess
import sys


ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _run(name, *args, cwd):
    env = dict(os.environ)
    # The examples import the package from this checkout even when it is not
    # installed, and never need a display.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p
    )
    env["MPLBACKEND"] = "Agg"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"{name} exited with {proc.returncode}\n"
        f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc.stdout


def test_quickstart(tmp_path):
    out = _run(
        "quickstart.py",
        *("--steps", "30", "--print-every", "10", "--samples", "32"),
        *("--width", "8", "--depth", "1"),
        cwd=tmp_path,
    )
    assert "loss" in out
    for order in ("fwd", "rev", "markowitz", "auto"):
        assert order in out


def test_train_optax(tmp_path):
    out = _run(
        "train_optax.py",
        *("--epochs", "2", "--train-samples", "128", "--test-samples", "64"),
        *("--batch-size", "32", "--width", "16", "--depth", "1"),
        cwd=tmp_path,
    )
    assert "test accuracy" in out


def test_per_layer_jacobians(tmp_path):
    figure = tmp_path / "figures" / "jacobians.png"
    figure.parent.mkdir()
    out = _run(
        "per_layer_jacobians.py",
        *("--in-size", "4", "--out-size", "2", "--width", "6", "--depth", "2"),
        *("--out", str(figure)),
        cwd=tmp_path,
    )
    assert "SparseTensor" in out
    assert figure.is_file() and figure.stat().st_size > 0


def test_newton_bratu(tmp_path):
    out = _run("newton_bratu.py", "--grid", "10", "--check", cwd=tmp_path)
    assert "structural nonzeros: 460 (5·n - 4·grid = 460)" in out
    (difference,) = re.findall(r"largest difference from jax.jacfwd: (\S+)", out)
    assert float(difference) < 1e-9
    assert "converged: True" in out
