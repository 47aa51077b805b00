import os
import shutil
import subprocess
import sys
import tempfile


# Most of the suite's time goes to XLA compiling small programs, one per eager
# operation included. Every Jacobian is compared with JAX's own transforms, compiled
# the same way in the same process, so the suite compiles for speed of compilation:
# - without LLVM's optimisations (about a fifth faster);
# - on the CPU, with XLA's older elemental emitters instead of its MLIR fusion
#   emitters (compilation takes about half the time; the suite 30% less).
# A flag already named in XLA_FLAGS is left as it is, so that
#   XLA_FLAGS="--xla_backend_optimization_level=3 --xla_cpu_use_fusion_emitters=true"
# runs the suite as XLA compiles by default. XLA aborts on a flag it does not know,
# so the emitter flag is first tried in a subprocess (once: the pytest-xdist workers
# inherit the environment of the main process).
def _xla_knows(flags: str) -> bool:
    script = "import jax; jax.numpy.zeros(1).block_until_ready()"
    try:
        probe = subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"},
            capture_output=True,
            timeout=120,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


_PROBED_VAR = "GRAPHAX_EQX_TEST_XLA_PROBED"
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    _flags = f"{_flags} --xla_backend_optimization_level=0".strip()
if "xla_cpu_use_fusion_emitters" not in _flags and _PROBED_VAR not in os.environ:
    os.environ[_PROBED_VAR] = "1"
    _emitters = f"{_flags} --xla_cpu_use_fusion_emitters=false"
    if _xla_knows(_emitters):
        _flags = _emitters
os.environ["XLA_FLAGS"] = _flags

import jax  # noqa: E402
import pytest  # noqa: E402


# Float64 programs need x64; float32 programs build their float32 arrays explicitly.
jax.config.update("jax_enable_x64", True)

# GPUs multiply float32 matrices in reduced precision (TF32) by default, where `jacve`
# and JAX's transforms contract in different orders and so round differently. The
# suite compares Jacobians to float32 precision, so it asks for full precision.
if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")


# XLA programs compiled more than once in a run (an order that eliminates like
# another, the same operations in two worker processes) are compiled once: a
# persistent compilation cache private to the run, made by the main process and
# shared with the pytest-xdist workers through the environment, removed at the end.
# It is left alone where one is configured already.
_CACHE_VAR = "GRAPHAX_EQX_TEST_XLA_CACHE"
_CACHE_KEY = pytest.StashKey[str]()


def pytest_configure(config):
    if jax.config.jax_compilation_cache_dir is not None:
        return
    if hasattr(config, "workerinput"):  # an xdist worker: the main process made it
        cache = os.environ.get(_CACHE_VAR)
    else:
        cache = tempfile.mkdtemp(prefix="graphax-eqx-xla-")
        os.environ[_CACHE_VAR] = cache
        config.stash[_CACHE_KEY] = cache
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def pytest_unconfigure(config):
    cache = config.stash.get(_CACHE_KEY, None)
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)
