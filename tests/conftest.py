import jax


# Float64 programs need x64; float32 programs build their float32 arrays explicitly.
jax.config.update("jax_enable_x64", True)
