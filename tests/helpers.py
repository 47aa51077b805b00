"""Shared comparison utilities for the test suite."""

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

import graphax_eqx


ORDERS = ("fwd", "rev", "markowitz", "auto", "random")


def run_on_host_devices(
    script: str, *args: str, devices: int = 8, timeout: float = 600
) -> str:
    """Run `script` (`python -c`) in a fresh process with `devices` CPU devices and
    return its standard output; fails the test if the process fails.

    The host device count must be set before JAX starts, hence the process. It gets
    the suite's XLA_FLAGS (tests/conftest.py) plus the device count, and imports
    `graphax_eqx` and `tests` from this checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


# (rtol, atol) per dtype. `atol` is multiplied by the largest magnitude in the
# reference leaf, so that cancellation in large Jacobian entries is not reported as
# a mismatch of small ones.
_TOLERANCES = {
    np.dtype(jnp.bfloat16): (2e-2, 2e-2),
    np.dtype(np.float16): (5e-3, 5e-3),
    np.dtype(np.float32): (2e-5, 1e-5),
    np.dtype(np.float64): (1e-10, 1e-10),
}


def _to_host(x: Any) -> Any:
    return np.asarray(x) if isinstance(x, jax.Array) else x


def tree_allclose(a: Any, b: Any, rtol: float = 0.0, atol: float = 0.0) -> bool:
    """Whether two pytrees have equal structure, shapes and dtypes, and values within
    `rtol`/`atol`.

    Always gives a Python bool.
    """
    # Compared on the host in NumPy: comparing with JAX would compile a program per
    # shape and dtype, a large share of the suite's time.
    a, b = jtu.tree_map(_to_host, (a, b))
    return bool(eqx.tree_equal(a, b, rtol=rtol, atol=atol))


def tolerances(dtype: Any) -> tuple[float, float]:
    """The default `(rtol, atol)` for a floating dtype."""
    return _TOLERANCES.get(np.dtype(dtype), (1e-10, 1e-10))


def _describe(path: Any) -> str:
    return jtu.keystr(path) or "<root>"


def assert_tree_matches(
    actual: Any,
    expected: Any,
    *,
    check_dtype: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    label: str = "",
) -> None:
    """Assert equal tree structure, leaf shapes, dtypes and (tolerant) values.

    Tolerances default to those of the lower-precision dtype of each pair of leaves,
    with `atol` scaled by the largest magnitude of the expected leaf.
    """
    actual_leaves, actual_def = jtu.tree_flatten(actual)
    expected_paths, expected_def = jtu.tree_flatten_with_path(expected)
    assert actual_def == expected_def, (
        f"{label}tree structure differs:\n  got      {actual_def}\n"
        f"  expected {expected_def}"
    )
    for (path, e), a in zip(expected_paths, actual_leaves, strict=True):
        where = f"{label}leaf {_describe(path)}"
        if not isinstance(e, jax.Array) and not isinstance(a, jax.Array):
            # A leaf JAX returns as it was (an aux object outside `jit`).
            assert type(a) is type(e) and bool(np.all(a == e)), f"{where}: {a} != {e}"
            continue
        assert isinstance(a, jax.Array), f"{where}: got {type(a).__name__}, not Array"
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, f"{where}: shape {a.shape} != {e.shape}"
        if check_dtype:
            assert a.dtype == e.dtype, f"{where}: dtype {a.dtype} != {e.dtype}"
        if not jnp.issubdtype(e.dtype, jnp.inexact):
            assert bool(np.all(a == e)), f"{where}: values differ\n{a}\n!=\n{e}"
            continue
        low = max((a.dtype, e.dtype), key=lambda d: float(jnp.finfo(d).eps))
        default_rtol, default_atol = tolerances(low)
        leaf_rtol = default_rtol if rtol is None else rtol
        leaf_atol = default_atol if atol is None else atol
        e64 = np.asarray(e, dtype=np.float64)
        scale = max(1.0, float(np.max(np.abs(e64), initial=0.0)))
        a_cast = a.astype(e.dtype)
        if not tree_allclose(a_cast, e, rtol=leaf_rtol, atol=leaf_atol * scale):
            diff = np.abs(np.asarray(a_cast, dtype=np.float64) - e64)
            raise AssertionError(
                f"{where}: values differ (max abs diff {np.nanmax(diff, initial=0.0)},"
                f" rtol={leaf_rtol}, atol={leaf_atol * scale})\n"
                f"got:\n{a}\nexpected:\n{e}"
            )


def on_host(tree: Any) -> Any:
    """`tree`'s arrays on the CPU, where references are computed on every backend.

    On GPUs, JAX's own derivatives of some primitives are approximate (the windowed
    maximum's reduces float64 to 32-bit precision), so references computed there
    would be wrong in the last digits the tests check."""
    if jax.default_backend() == "cpu":
        return tree
    return jax.device_put(tree, jax.devices("cpu")[0])


def reference_jacobians(
    fun: Callable,
    args: Sequence[Any],
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    refs: Sequence[str] = ("fwd", "rev"),
    jit: bool = True,
) -> dict[str, Any]:
    """`jax.jacfwd` and/or `jax.jacrev` of `fun` at `args`, keyed by "fwd"/"rev".

    With `jit=True` the references are computed under `jax.jit` (one compilation
    instead of many eager dispatches, which keeps the suite fast). Arguments that are
    not differentiated and hold non-array leaves (Python ints, say) are closed over,
    so `fun` sees them exactly as it does eagerly. Use `jit=False` for arbitrary
    programs: XLA's CPU backend (jaxlib 0.10.2) miscompiles some of them, e.g.
    `jax.jit(jax.jacrev(lambda x: jnp.cumsum(x)[1::2]))` on float32.
    """
    transforms = {"fwd": jax.jacfwd, "rev": jax.jacrev}
    args = on_host(args)
    if not jit:
        return {
            ref: transforms[ref](fun, argnums=argnums, has_aux=has_aux)(*args)
            for ref in refs
        }
    diff = {argnums} if isinstance(argnums, int) else set(argnums)
    dynamic = [
        i
        for i, arg in enumerate(args)
        if i in diff or all(isinstance(l, jax.Array) for l in jtu.tree_leaves(arg))
    ]
    position = {i: k for k, i in enumerate(dynamic)}
    # Differentiated positions move when static arguments are closed over.
    if isinstance(argnums, int):
        inner_argnums: int | tuple[int, ...] = position[argnums]
    else:
        inner_argnums = tuple(position[i] for i in argnums)

    def call(*dynamic_args):
        def inner(*inner_args):
            full = list(args)
            for i, value in zip(dynamic, inner_args, strict=True):
                full[i] = value
            return fun(*full)

        return {
            ref: transforms[ref](inner, argnums=inner_argnums, has_aux=has_aux)(
                *dynamic_args
            )
            for ref in refs
        }

    return jax.jit(call)(*(args[i] for i in dynamic))


def assert_matches_references(
    result: Any,
    references: dict[str, Any],
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Compare a `jacve` result with each reference Jacobian.

    Dtypes are compared with the `jax.jacrev` reference (the documented contract);
    with mixed precision `jax.jacfwd` returns the output's dtype instead, so against it
    only structure, shapes and values are checked. When only `jax.jacfwd` could run
    its dtypes are used.
    """
    assert references, "no reference Jacobian to compare with"
    for ref, expected in references.items():
        check_dtype = ref == "rev" or "rev" not in references
        assert_tree_matches(
            result,
            expected,
            check_dtype=check_dtype,
            rtol=rtol,
            atol=atol,
            label=f"[vs jac{ref}] ",
        )


def graph_of(
    fun: Callable,
    args: Sequence[Any],
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Any:
    """The `make_graph` graph of `fun` (of its first output when `has_aux`).

    With `has_aux` the auxiliary data is not differentiated, so work that only feeds
    it is no part of the Jacobian's graph.
    """
    if has_aux:
        main = lambda *a: fun(*a)[0]
    else:
        main = fun
    return graphax_eqx.make_graph(main, argnums=argnums)(*args)


def random_order(
    fun: Callable,
    args: Sequence[Any],
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    seed: int = 0,
) -> list[int]:
    """A random valid explicit elimination order for `fun` at `args`."""
    graph = graph_of(fun, args, argnums=argnums, has_aux=has_aux)
    rng = np.random.default_rng(seed)
    return [int(v) for v in rng.permutation(np.asarray(graph.intermediates, int))]


def _shapes_graph_alike(args: Sequence[Any], argnums: int | Sequence[int]) -> bool:
    """Whether `make_graph` builds the graph `jacve` eliminates: arguments that are
    not differentiated may shape it (indices), known to `jacve` but abstract to
    `make_graph`."""
    differentiated = {argnums} if isinstance(argnums, int) else set(argnums)
    return differentiated == set(range(len(args)))


def repeated_order(
    fun: Callable,
    args: Sequence[Any],
    order: str,
    others: Sequence[str],
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> str | None:
    """The first of the named `others` that `order` eliminates in the same vertex
    sequence as, if any (`auto` always repeats one of the named orders): running
    that elimination again tests nothing new. `jacve` resolves orders with the same
    function as `Graph.counts`; `None` where its graph may differ."""
    if not _shapes_graph_alike(args, argnums):
        return None
    graph = graph_of(fun, args, argnums=argnums, has_aux=has_aux)
    ids = graph.counts(order)["order"]
    for other in others:
        if graph.counts(other)["order"] == ids:
            return other
    return None


def distinct_orders(
    fun: Callable, args: Sequence[Any], orders: Sequence[str]
) -> list[str]:
    """`orders` less each that eliminates in the same vertex sequence as one before
    it (see `repeated_order`), for a function of its arguments."""
    graph = graph_of(fun, args, argnums=tuple(range(len(args))))
    seen, kept = set(), []
    for order in orders:
        ids = tuple(graph.counts(order)["order"])
        if ids not in seen:
            seen.add(ids)
            kept.append(order)
    return kept


def resolve_order(
    order: str,
    fun: Callable,
    args: Sequence[Any],
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    seed: int = 0,
) -> str | list[int]:
    """Map the pseudo-order "random" to an explicit random order; pass others on."""
    if order == "random":
        return random_order(fun, args, argnums=argnums, has_aux=has_aux, seed=seed)
    return order


def check_jacve(
    fun: Callable,
    args: Sequence[Any],
    order: str | Sequence[int] = "auto",
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    refs: Sequence[str] = ("fwd", "rev"),
    references: dict[str, Any] | None = None,
    seed: int = 0,
    rtol: float | None = None,
    atol: float | None = None,
) -> Any:
    """Assert that `jacve(fun, order, ...)` agrees with `jax.jacfwd` and `jax.jacrev`.

    `refs` picks the references that can run: ("fwd",) for `lax.while_loop`,
    ("rev",) for `custom_vjp`. `order` may be "random" for a random explicit order.
    Returns the `jacve` result.
    """
    if isinstance(order, str):
        order = resolve_order(
            order, fun, args, argnums=argnums, has_aux=has_aux, seed=seed
        )
    if references is None:
        references = reference_jacobians(
            fun, args, argnums=argnums, has_aux=has_aux, refs=refs
        )
    result = graphax_eqx.jacve(fun, order=order, argnums=argnums, has_aux=has_aux)(
        *args
    )
    assert_matches_references(result, references, rtol=rtol, atol=atol)
    return result


def check_eager_jit_sparse(fun: Callable, x: Any, order: str, tol: float) -> None:
    """Assert that `jacve(fun, order)` at `x` equals `jax.jacfwd` eagerly, under
    `jax.jit`, and as structured blocks under `jax.jit`."""
    refs = reference_jacobians(fun, (x,), refs=("fwd",))
    check_jacve(fun, (x,), order, references=refs)
    jitted = jax.jit(graphax_eqx.jacve(fun, order=order))(x)
    assert tree_allclose(jitted, refs["fwd"], rtol=tol, atol=tol)
    sparse = jax.jit(graphax_eqx.jacve(fun, order=order, sparse_representation=True))
    dense = jax.tree_util.tree_map(
        lambda b: b.dense(), sparse(x), is_leaf=is_sparse_block
    )
    assert tree_allclose(dense, refs["fwd"], rtol=tol, atol=tol)


# A custom_vjp whose backward pass is elementwise and differs from the body's
# derivative (twice it), so a result taken from the body would be wrong.
@jax.custom_vjp
def doubled_sin(x):
    return jnp.sin(x)


def _doubled_sin_fwd(x):
    return jnp.sin(x), jnp.cos(x)


def _doubled_sin_bwd(cos_x, g):
    return (2.0 * cos_x * g,)


doubled_sin.defvjp(_doubled_sin_fwd, _doubled_sin_bwd)


def is_sparse_block(x) -> bool:
    """Whether `x` is a structured Jacobian block (`sparse_representation=True`)."""
    return isinstance(x, (graphax_eqx.SparseTensor, graphax_eqx.CooTensor))
