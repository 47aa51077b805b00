import jax


# Float64 programs need x64; float32 programs build their float32 arrays explicitly.
jax.config.update("jax_enable_x64", True)

# GPUs multiply float32 matrices in reduced precision (TF32) by default, where `jacve`
# and JAX's transforms contract in different orders and so round differently. The
# suite compares Jacobians to float32 precision, so it asks for full precision.
if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")
