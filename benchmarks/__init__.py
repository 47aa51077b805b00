"""Benchmarks of `graphax_eqx` against JAX's own Jacobians.

Run `python -m benchmarks` (add `--quick` for a smoke run); see `benchmarks.run`.
The task definitions live in `benchmarks.tasks`.
"""
