import os


# Most of the suite's time goes to XLA compiling small programs, one per eager
# operation included. The suite compiles them without LLVM's optimisations (about a
# fifth faster), unless XLA_FLAGS already sets a level: every Jacobian is compared
# with JAX's own transforms, compiled the same way in the same process.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402


# Float64 programs need x64; float32 programs build their float32 arrays explicitly.
jax.config.update("jax_enable_x64", True)

# GPUs multiply float32 matrices in reduced precision (TF32) by default, where `jacve`
# and JAX's transforms contract in different orders and so round differently. The
# suite compares Jacobians to float32 precision, so it asks for full precision.
if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")
