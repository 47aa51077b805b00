import os
import shutil
import tempfile


# Most of the suite's time goes to XLA compiling small programs, one per eager
# operation included. The suite compiles them without LLVM's optimisations (about a
# fifth faster), unless XLA_FLAGS already sets a level: every Jacobian is compared
# with JAX's own transforms, compiled the same way in the same process.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_backend_optimization_level=0".strip()

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
