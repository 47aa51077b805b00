"""The sparse benchmark suite, `python -m benchmarks --suite sparse`.

For every task in [`benchmarks.sparse_tasks.SPARSE_TASKS`][] (one array in, one
array out, a large and sparse Jacobian), one run measures five Jacobian programs:

- `jacve sparse`: `jax.jit(graphax_eqx.jacve(f, sparse_representation=True))`;
- `jacve dense`: `jax.jit(graphax_eqx.jacve(f))`;
- `asdex`: `jax.jit(asdex.jacobian_from_coloring(f, coloring))`, a BCOO matrix from
  one JVP or VJP per colour, where `coloring` comes from `asdex.jacobian_sparsity`
  (detection) and `asdex.jacobian_coloring_from_sparsity` (colouring), timed
  separately as asdex's preparation;
- `jax.jacfwd` and `jax.jacrev`, jitted.

For each it reports the runtime (median of interleaved repetitions after one warm-up
call: every repetition runs the methods compared with each other, in an order rotated
each time; sparse jacve and asdex are timed together, then dense jacve, `jax.jacfwd`
and `jax.jacrev`), the first call (trace, compile and first run; the lowering part in
parentheses), the memory XLA plans for the compiled program (temporaries plus
outputs), and for the two sparse methods the number of stored (structural) nonzeros.
A method whose compiled program would need more memory than `--memory-limit`, or whose
first call or any later call takes longer than `--skip-after` seconds, is reported as
skipped.

Every result is checked against `jax.jacfwd` (against asdex, then `jax.jacrev`, when
`jax.jacfwd` was skipped). Up to `DENSE_CHECK_ENTRIES` Jacobian entries the dense
matrices are compared; larger Jacobians are compared through their products with a
fixed random probe matrix of `PROBE_COLUMNS` columns, so no dense copy is made of a
sparse result. Where none of those three ran (sizes whose dense Jacobian does not fit
in memory), the reference products come from one `jax.jvp` per probe column.
`--size TASK:NAME=VALUE` runs a task at another size. A result whose relative error
exceeds the tolerance is flagged as WRONG in the tables and on stderr, and the run
exits with status 1. A method that raises (the elimination engine included) is
reported with its short error and the run continues.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse as jsparse

from . import sparse_tasks
from .run import (
    GRAPHAX_IMPORT_ERROR,
    Failure,
    _block,
    _fmt_bytes,
    _fmt_time,
    _group_failures,
    _log,
    _memory_bytes,
    _short_error,
    _table,
    _time_limit,
    _traceback_tail,
    graphax_eqx,
    render_failures,
    run_lines,
)


try:
    import asdex

    ASDEX_IMPORT_ERROR: str | None = None
except Exception as error:  # an optional dependency: the other methods still run
    asdex = None
    ASDEX_IMPORT_ERROR = f"{type(error).__name__}: {error}"


JACVE_SPARSE = "jacve sparse"
JACVE_DENSE = "jacve dense"
ASDEX = "asdex"
JACFWD = "jax.jacfwd"
JACREV = "jax.jacrev"
# The probe products J · V computed directly, one `jax.jvp` per column of V: the
# reference where none of the methods above gave a result (large sizes).
JVP_PROBE = "jax.jvp"
METHODS = (JACVE_SPARSE, JACVE_DENSE, ASDEX, JACFWD, JACREV)
# Sparse jacve in named orders, timed against each other (`auto` reuses the
# `jacve sparse` program): the check that `auto` picks a fast order.
JACVE_AUTO = "jacve auto"
NAMED_ORDERS = ("fwd", "rev", "markowitz")
ORDER_METHODS = (JACVE_AUTO, *(f"jacve {name}" for name in NAMED_ORDERS))
# The orders `auto` may pick, to name its pick.
AUTO_CANDIDATES = ("fwd", "rev", "markowitz", "relative_markowitz", "min_fill")
# The reference of the correctness check, in order of preference.
REFERENCES = (JACFWD, ASDEX, JACREV, JVP_PROBE)
DTYPE = jnp.float32
# Jacobians with at most this many entries are compared densely, larger ones
# through products with a probe matrix.
DENSE_CHECK_ENTRIES = 2**24
PROBE_COLUMNS = 4
PROBE_SEED = 20240601
# Relative errors above this many machine epsilons of the dtype count as wrong.
TOLERANCE_EPS = 1000


@dataclasses.dataclass(frozen=True)
class Settings:
    """How much work one run does."""

    small: bool
    repeats: int
    min_repeats: int
    # Wall-clock budget of one interleaved timing loop (a group of compared methods
    # on one task), in seconds.
    time_budget: float
    # A method whose first call, or any timed call, exceeds this is skipped.
    skip_after: float
    # Tracing and elimination (Python) are interrupted after this many seconds.
    hard_limit: float
    # Programs planning more memory than this many bytes are compiled but not run.
    memory_limit: int
    # Also time sparse jacve in the named orders against `auto`.
    orders: bool = True


@dataclasses.dataclass
class SparseResult:
    task: sparse_tasks.SparseTask
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    median: dict[str, float] = dataclasses.field(default_factory=dict)
    repeats: dict[str, int] = dataclasses.field(default_factory=dict)
    first_call: dict[str, float] = dataclasses.field(default_factory=dict)
    lower_time: dict[str, float] = dataclasses.field(default_factory=dict)
    memory: dict[str, int | None] = dataclasses.field(default_factory=dict)
    error: dict[str, float] = dataclasses.field(default_factory=dict)
    wrong: dict[str, float] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    nnz: dict[str, int] = dataclasses.field(default_factory=dict)
    reference: str | None = None
    check: str = "dense"
    asdex_detect: float | None = None
    asdex_prep: float | None = None
    asdex_colors: int | None = None
    asdex_mode: str | None = None
    auto_pick: str | None = None

    @property
    def n(self) -> int:
        return math.prod(self.in_shape)

    @property
    def m(self) -> int:
        return math.prod(self.out_shape)

    def ratio(self, numerator: Sequence[str], denominator: str) -> float | None:
        """Best median among `numerator` over the median of `denominator`."""
        values = [self.median.get(method) for method in numerator]
        values = [v for v in values if v is not None]
        below = self.median.get(denominator)
        if not values or below is None:
            return None
        return min(values) / below


# ---------------------------------------------------------------------------
# Jacobian programs
# ---------------------------------------------------------------------------


def _available(method: str) -> str | None:
    """Why `method` cannot run in this environment, or `None` when it can."""
    if method in (JACVE_SPARSE, JACVE_DENSE, *ORDER_METHODS) and graphax_eqx is None:
        return "graphax_eqx unavailable"
    if method == ASDEX and asdex is None:
        return "asdex not installed"
    return None


def _program(
    method: str, fn: Callable[[jax.Array], jax.Array], x: jax.Array, result
) -> Callable[[jax.Array], Any]:
    """The jitted Jacobian program of `method`; asdex's preparation runs (and is
    timed) here."""
    if method == JACVE_SPARSE:
        return jax.jit(graphax_eqx.jacve(fn, sparse_representation=True))
    if method == JACVE_DENSE:
        return jax.jit(graphax_eqx.jacve(fn))
    if method in ORDER_METHODS:
        order = method.removeprefix("jacve ")
        return jax.jit(graphax_eqx.jacve(fn, order=order, sparse_representation=True))
    if method == JACFWD:
        return jax.jit(jax.jacfwd(fn))
    if method == JACREV:
        return jax.jit(jax.jacrev(fn))
    assert method == ASDEX
    start = time.perf_counter()
    sparsity = asdex.jacobian_sparsity(fn, x)
    detected = time.perf_counter()
    with warnings.catch_warnings():
        # Tiny problems colour densely; that is reported, not warned about.
        warnings.simplefilter("ignore", asdex.DenseColoringWarning)
        coloring = asdex.jacobian_coloring_from_sparsity(sparsity)
    end = time.perf_counter()
    result.asdex_detect = detected - start
    result.asdex_prep = end - start
    result.asdex_colors = int(coloring.num_colors)
    result.asdex_mode = str(coloring.mode)
    result.nnz[ASDEX] = int(sparsity.nnz)
    return jax.jit(asdex.jacobian_from_coloring(fn, coloring))


# ---------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------


def _as_bcoo(out: Any) -> jsparse.BCOO | None:
    if isinstance(out, jsparse.BCOO):
        return out
    if hasattr(out, "to_bcoo"):
        return out.to_bcoo()
    return None


def _coordinates(
    bcoo: jsparse.BCOO, out_ndim: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat row and column indices and values of the stored entries of `bcoo`,
    a matrix of shape `out_shape + in_shape`; padding entries are dropped."""
    if bcoo.n_batch or bcoo.n_dense:
        bcoo = jsparse.bcoo_update_layout(bcoo, n_batch=0, n_dense=0)
    shape = np.asarray(bcoo.shape)
    indices = np.asarray(bcoo.indices, np.int64).reshape(-1, len(shape))
    data = np.asarray(bcoo.data, np.float64).reshape(-1)
    inside = np.all(indices < shape, axis=1)
    indices, data = indices[inside], data[inside]
    out_shape, in_shape = tuple(shape[:out_ndim]), tuple(shape[out_ndim:])
    rows = np.ravel_multi_index(tuple(indices[:, :out_ndim].T), out_shape or (1,))
    cols = np.ravel_multi_index(tuple(indices[:, out_ndim:].T), in_shape or (1,))
    return rows, cols, data


def _signature(out: Any, result: SparseResult, probe: np.ndarray | None) -> np.ndarray:
    """What the correctness check compares, in float64: the dense m × n Jacobian
    when `probe` is `None`, else its product with `probe` (n × k)."""
    m, n = result.m, result.n
    bcoo = _as_bcoo(out)
    if bcoo is not None:
        if tuple(bcoo.shape) != result.out_shape + result.in_shape:
            raise ValueError(f"Jacobian of shape {bcoo.shape}")
        rows, cols, data = _coordinates(bcoo, len(result.out_shape))
        if probe is None:
            flat = np.bincount(rows * n + cols, weights=data, minlength=m * n)
            return flat.reshape(m, n)
        columns = [
            np.bincount(rows, weights=data * probe[cols, k], minlength=m)
            for k in range(probe.shape[1])
        ]
        return np.stack(columns, axis=1)
    array = np.asarray(out)
    if array.shape != result.out_shape + result.in_shape:
        raise ValueError(f"Jacobian of shape {array.shape}")
    array = array.reshape(m, n)
    if probe is None:
        return array.astype(np.float64)
    return (array @ probe.astype(array.dtype)).astype(np.float64)


def _probe_products(
    fn: Callable[[jax.Array], jax.Array], x: jax.Array, probe: np.ndarray
) -> np.ndarray:
    """`J · probe` (m × k, float64) from one forward-mode product per column."""

    def column(v):
        _, tangent = jax.jvp(fn, (x,), (v.reshape(x.shape),))
        return tangent.reshape(-1)

    columns = jax.jit(jax.vmap(column, in_axes=1, out_axes=1))
    return np.asarray(columns(jnp.asarray(probe, x.dtype)), np.float64)


def _structural_nnz(out: Any) -> int:
    bcoo = _as_bcoo(out)
    return int(bcoo.nse) if bcoo is not None else int(np.size(out))


def _relative_error(value: np.ndarray, reference: np.ndarray) -> float:
    if value.shape != reference.shape:
        return math.inf
    if not value.size:
        return 0.0
    diff = np.abs(value - reference)
    if np.isnan(diff).any():
        # NaN where the reference has NaN too is agreement.
        both = np.isnan(value) & np.isnan(reference)
        if (np.isnan(diff) & ~both).any():
            return math.inf
        diff = np.where(both, 0.0, diff)
    scale = max(1.0, float(np.nanmax(np.abs(reference))))
    return float(np.max(diff)) / scale


# ---------------------------------------------------------------------------
# The per-task benchmark
# ---------------------------------------------------------------------------


def benchmark_task(
    task: sparse_tasks.SparseTask,
    index: int,
    settings: Settings,
    failures: list[Failure],
) -> SparseResult:
    fn = task.function(settings.small)
    x = task.make_input(DTYPE, settings.small)
    out_shape = tuple(jax.eval_shape(fn, x).shape)
    result = SparseResult(task, tuple(x.shape), out_shape)
    _log(f"[{task.name}] {result.n} → {result.m}")
    probe = None
    if result.m * result.n > DENSE_CHECK_ENTRIES:
        result.check = "probe"
        rng = np.random.default_rng(PROBE_SEED)
        probe = rng.standard_normal((result.n, PROBE_COLUMNS))

    compiled_programs: dict[str, Any] = {}
    signatures: dict[str, list[np.ndarray]] = {}
    shift = (2 * index) % len(METHODS)
    methods = METHODS[shift:] + METHODS[:shift]
    if settings.orders:
        methods += ORDER_METHODS[1:]
    for method in methods:
        reason = _available(method)
        if reason is not None:
            result.skipped[method] = reason
            continue
        try:
            with _time_limit(settings.hard_limit):
                program = _program(method, fn, x, result)
                start = time.perf_counter()
                lowered = program.lower(x)  # type: ignore[attr-defined]
                traced = time.perf_counter()
                compiled = lowered.compile()
                compiled_at = time.perf_counter()
            memory = _memory_bytes(compiled)
            result.memory[method] = memory
            if memory is not None and memory > settings.memory_limit:
                result.skipped[method] = f"plans {_fmt_bytes(memory)}"
                _log(f"  {method}: skipped, plans {_fmt_bytes(memory)}")
                continue
            # The first call is lowering + compilation + one run; the memory
            # analysis in between is not counted.
            run_start = time.perf_counter()
            out = _block(compiled(x))
            end = time.perf_counter()
            result.first_call[method] = (compiled_at - start) + (end - run_start)
            result.lower_time[method] = traced - start
            if method == JACVE_SPARSE:
                result.nnz[method] = _structural_nnz(out)
            signatures[method] = [_signature(out, result, probe)]
            if method == JACVE_SPARSE and probe is None and hasattr(out, "dense"):
                signatures[method].append(_signature(out.dense(), result, None))
            del out
            if result.first_call[method] > settings.skip_after:
                result.skipped[method] = (
                    f"first call {_fmt_time(result.first_call[method])}"
                )
            else:
                compiled_programs[method] = compiled
        except Exception as error:
            message = _short_error(error)
            result.failed[method] = message
            failures.append(Failure(task.name, method, message, _traceback_tail()))
            _log(f"  {method}: FAILED {message}")

    if JACVE_SPARSE in compiled_programs and settings.orders:
        # `auto` is the `jacve sparse` program, timed again with the named orders.
        compiled_programs[JACVE_AUTO] = compiled_programs[JACVE_SPARSE]
        try:
            with _time_limit(settings.hard_limit):
                result.auto_pick = _auto_pick(fn, x)
        except Exception as error:
            _log(f"  auto's pick unknown: {_short_error(error)}")
    if probe is not None and not any(m in signatures for m in REFERENCES):
        try:
            signatures[JVP_PROBE] = [_probe_products(fn, x, probe)]
        except Exception as error:
            failures.append(
                Failure(task.name, JVP_PROBE, _short_error(error), _traceback_tail())
            )
    _check(result, signatures, failures)
    _time_methods(result, compiled_programs, x, settings)
    return result


def _auto_pick(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> str:
    """The named order `auto` picks for `fn` (from the simulator, no FLOPs)."""
    picked = list(graphax_eqx.elimination_cost(fn, order="auto")(x).order)
    for name in AUTO_CANDIDATES:
        if list(graphax_eqx.elimination_cost(fn, order=name)(x).order) == picked:
            return name
    return "other"


def _check(
    result: SparseResult,
    signatures: dict[str, list[np.ndarray]],
    failures: list[Failure],
) -> None:
    reference = next((m for m in REFERENCES if m in signatures), None)
    result.reference = reference
    if reference is None:
        return
    ref = signatures[reference][0]
    tolerance = TOLERANCE_EPS * float(jnp.finfo(DTYPE).eps)
    for method, values in signatures.items():
        error = max(_relative_error(value, ref) for value in values)
        result.error[method] = error
        if not error <= tolerance:
            result.wrong[method] = error
            message = (
                f"relative error {error:.3g} against {reference} "
                f"(tolerance {tolerance:.1g})"
            )
            failures.append(Failure(result.task.name, method, "WRONG " + message, ""))
            _log(f"  !!! {method} is WRONG on {result.task.name}: {message} !!!")


# Methods timed against each other. Each group's repetitions are interleaved; the
# groups run one after the other, the multi-gigabyte dense calls last, so that they
# do not leave the sub-millisecond sparse ones to cold caches and freshly mapped
# memory (timed after them, Stencil1D's reverse mode took 64-73 µs against 44-51 µs
# before them or in a fresh process; forward mode 48 µs either way).
GROUPS = ((JACVE_SPARSE, ASDEX), ORDER_METHODS, (JACVE_DENSE, JACFWD, JACREV))

# After a call whose program plans at least `SETTLE_BYTES`, the timing loop pauses
# for `SETTLE_SECONDS` before the next call. Releasing a gigabyte of buffers goes on
# after the call returns, and on a 2-core host the next call pays for it: on
# Burgers1D, `jax.jacfwd` took 129 ms right after `jax.jacrev` (1.2 GiB of
# temporaries) and 61 ms after a pause of 0.1 s or more, or after itself. Without the
# pause, the rotation below would bill that cost to whichever method most often
# follows the largest one.
SETTLE_BYTES = 64 * 2**20
SETTLE_SECONDS = 0.25


def _time_methods(
    result: SparseResult,
    programs: dict[str, Any],
    x: jax.Array,
    settings: Settings,
) -> None:
    reps = []
    for group in GROUPS:
        timed = [method for method in group if method in programs]
        if timed:
            reps.append(_time_group(result, timed, programs, x, settings))
    line = ", ".join(
        f"{m} {_fmt_time(result.median.get(m))}"
        for m in METHODS + ORDER_METHODS[1:]
        if m in result.median
    )
    _log(f"  {'/'.join(str(r) for r in reps)} reps: {line}")


def _time_group(
    result: SparseResult,
    timed: list[str],
    programs: dict[str, Any],
    x: jax.Array,
    settings: Settings,
) -> int:
    """Time the methods of one group with interleaved repetitions; returns the
    number of repetitions."""

    def call(method: str) -> float:
        start = time.perf_counter()
        _block(programs[method](x))
        seconds = time.perf_counter() - start
        if (result.memory.get(method) or 0) >= SETTLE_BYTES:
            time.sleep(SETTLE_SECONDS)
        if seconds > settings.skip_after:
            result.skipped[method] = f"one call {_fmt_time(seconds)}"
            timed.remove(method)
        return seconds

    for method in list(timed):  # one warm-up call each
        call(method)
    samples: dict[str, list[float]] = {method: [] for method in timed}
    loop_start = time.perf_counter()
    repeats = 0
    for rep in range(settings.repeats):
        if (
            repeats >= settings.min_repeats
            and time.perf_counter() - loop_start > settings.time_budget
        ):
            break
        if not timed:
            break
        # Rotate the order every repetition, so no method always runs right after
        # the same neighbour (caches, frequency scaling).
        shift = rep % len(timed)
        for method in timed[shift:] + timed[:shift]:
            seconds = call(method)
            if method in timed:
                samples[method].append(seconds)
        repeats += 1
    for method in samples:
        if samples[method] and method in timed:
            result.median[method] = statistics.median(samples[method])
            result.repeats[method] = len(samples[method])
    return repeats


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _status(result: SparseResult, method: str) -> str | None:
    """The cell text of a method that has no number to show."""
    if method in result.failed:
        error = result.failed[method]
        return "failed: " + _escape(error if len(error) <= 80 else error[:77] + "...")
    if method in result.skipped:
        return f"skipped ({_escape(result.skipped[method])})"
    return None


def _wrong_mark(result: SparseResult, method: str) -> str:
    return "**WRONG** " if method in result.wrong else ""


def _fmt_ratio(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}×" if value >= 0.1 else f"{value:.2g}×"


def _fmt_nnz(result: SparseResult, method: str) -> str:
    nnz = result.nnz.get(method)
    if nnz is None:
        return "—"
    if nnz >= result.m * result.n:
        return f"{nnz:,} (dense)"
    return f"{nnz:,}"


def _runtime_cells(result: SparseResult, methods: Sequence[str]) -> list[str]:
    """The median runtime of each method, or why there is none."""
    cells = []
    for method in methods:
        status = _status(result, method) if method not in result.median else None
        value = status or _fmt_time(result.median.get(method))
        cells.append(_wrong_mark(result, method) + value)
    return cells


def render_runtimes(results: Sequence[SparseResult]) -> str:
    header = [
        "task",
        "n → m",
        "nnz jacve",
        "nnz asdex",
        *METHODS,
        "asdex / jacve sparse",
        "best(jacfwd, jacrev) / jacve dense",
    ]
    rows = []
    for r in results:
        cells = _runtime_cells(r, METHODS)
        rows.append(
            [
                r.task.name,
                f"{r.n:,} → {r.m:,}",
                _fmt_nnz(r, JACVE_SPARSE),
                _fmt_nnz(r, ASDEX),
                *cells,
                _fmt_ratio(r.ratio([ASDEX], JACVE_SPARSE)),
                _fmt_ratio(r.ratio([JACFWD, JACREV], JACVE_DENSE)),
            ]
        )
    return "\n".join(
        [
            "## Runtime\n",
            "Median runtime of one Jacobian evaluation. Ratios above 1 mean jacve is "
            "faster.\n",
            _table(header, rows),
        ]
    )


def render_orders(results: Sequence[SparseResult]) -> str:
    if not any(JACVE_AUTO in r.median for r in results):
        return ""
    named = ORDER_METHODS[1:]
    header = ["task", "auto picks", *ORDER_METHODS, "auto / best named"]
    rows = []
    for r in results:
        cells = _runtime_cells(r, ORDER_METHODS)
        ratio = r.ratio(
            [JACVE_AUTO], min(named, key=lambda m: r.median.get(m, math.inf))
        )
        rows.append([r.task.name, r.auto_pick or "—", *cells, _fmt_ratio(ratio)])
    return "\n".join(
        [
            "\n## Orders\n",
            "Sparse jacve (`sparse_representation=True`) in the order `auto` picks and "
            "in forward, reverse and Markowitz order, timed together with interleaved "
            "repetitions (a second group, after sparse jacve and asdex, before the "
            "dense methods). The last column is "
            "auto's time over the fastest of the three named orders: at most 1.2 is "
            "the target.\n",
            _table(header, rows),
        ]
    )


def render_first_calls(results: Sequence[SparseResult]) -> str:
    header = ["task", *METHODS, "asdex preparation (detection)", "asdex colours"]
    rows = []
    for r in results:
        cells = []
        for method in METHODS:
            if method in r.first_call:
                cell = (
                    f"{_fmt_time(r.first_call[method])} "
                    f"({_fmt_time(r.lower_time.get(method))})"
                )
            else:
                cell = _status(r, method) or "—"
            memory = r.memory.get(method)
            if memory is not None or method in r.first_call:
                cell += f" / {_fmt_bytes(memory)}"
            cells.append(cell)
        prep = "—"
        if r.asdex_prep is not None:
            prep = f"{_fmt_time(r.asdex_prep)} ({_fmt_time(r.asdex_detect)})"
        colours = "—"
        if r.asdex_colors is not None:
            colours = f"{r.asdex_colors} ({r.asdex_mode})"
        rows.append([r.task.name, *cells, prep, colours])
    return "\n".join(
        [
            "\n## First call and memory\n",
            "Per method: first call (trace, compile and first run; the lowering part "
            "in parentheses) / memory XLA plans for the compiled program (temporaries "
            "plus outputs). asdex's preparation (sparsity detection and colouring, "
            "detection alone in parentheses) is not part of its first call; asdex's "
            "one-off start-up is paid before the first task.\n",
            _table(header, rows),
        ]
    )


def render_errors(results: Sequence[SparseResult]) -> str:
    checked = METHODS + tuple(
        m for m in ORDER_METHODS[1:] if any(m in r.error for r in results)
    )
    header = ["task", "reference", "compared", *checked]
    rows = []
    for r in results:
        cells = []
        for method in checked:
            if method == r.reference:
                cells.append("reference")
            elif method in r.error:
                cells.append(_wrong_mark(r, method) + f"{r.error[method]:.1e}")
            else:
                cells.append("—")
        compared = (
            "dense" if r.check == "dense" else f"J · V, V {r.n:,}×{PROBE_COLUMNS}"
        )
        rows.append([r.task.name, r.reference or "none", compared, *cells])
    tolerance = TOLERANCE_EPS * float(jnp.finfo(DTYPE).eps)
    return "\n".join(
        [
            "\n## Correctness\n",
            "Largest absolute difference from the reference, divided by "
            "max(1, largest reference entry); above "
            f"{tolerance:.1g} a result is marked WRONG. Jacobians with more than "
            f"{DENSE_CHECK_ENTRIES:,} entries are compared through their product "
            "with a fixed random matrix V.\n",
            _table(header, rows),
        ]
    )


def render_tasks(results: Sequence[SparseResult]) -> str:
    lines = ["\n## Tasks\n"]
    for r in results:
        lines.append(
            f"- **{r.task.name}**: {r.task.summary}; input {r.in_shape}, "
            f"output {r.out_shape} (`benchmarks.sparse_tasks`)."
        )
    return "\n".join(lines)


def render_header(settings: Settings, command: str, elapsed: float | None) -> str:
    versions = []
    if asdex is not None:
        versions.append(f"asdex {_distribution_version('asdex')}")
    lines = ["# Sparse Jacobian benchmarks\n", *run_lines(command, elapsed, versions)]
    if GRAPHAX_IMPORT_ERROR is not None:
        lines.append(f"- `graphax_eqx` could not be imported ({GRAPHAX_IMPORT_ERROR}).")
    if ASDEX_IMPORT_ERROR is not None:
        lines.append(
            f"- `asdex` could not be imported ({ASDEX_IMPORT_ERROR}); install the "
            "`benchmark` extra."
        )
    lines.append("")
    lines.append(
        f"All arithmetic is {jnp.dtype(DTYPE).name}"
        + (", at the small test sizes" if settings.small else "")
        + ". Runtimes are medians after one warm-up call. The repetitions of the "
        "methods compared with each other are interleaved (order rotated every "
        "repetition): sparse jacve with asdex, "
        + (
            "then sparse jacve in the order `auto` picks and in forward, reverse and "
            "Markowitz order, "
            if settings.orders
            else ""
        )
        + "then dense jacve with `jax.jacfwd` and `jax.jacrev`, so the "
        "multi-gigabyte dense calls do not disturb the sparse ones"
        + f"; up to {settings.repeats} repetitions or "
        f"{settings.time_budget:.0f} s per group and task. After a call of a program "
        f"that plans {SETTLE_BYTES // 2**20} MiB or more, the next call waits "
        f"{SETTLE_SECONDS:g} s, so it does not pay for the release of the previous "
        "call's buffers. "
        f"A method is skipped when its compiled program plans more than "
        f"{settings.memory_limit / 1024**3:.1f} GiB, or when its first call or any "
        f"timed call takes more than {settings.skip_after:g} s. nnz counts the stored "
        "(structural) entries of the sparse results: `to_bcoo()` of jacve's, the "
        "detected pattern of asdex's."
    )
    lines.append("")
    return "\n".join(lines)


def _distribution_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def render_wrong(results: Sequence[SparseResult]) -> str:
    wrong = [(r.task.name, m, e) for r in results for m, e in r.wrong.items()]
    if not wrong:
        return ""
    lines = ["\n## WRONG RESULTS\n"]
    for name, method, error in wrong:
        lines.append(f"- **{name}**, {method}: relative error {error:.3g}")
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def _default_memory_limit() -> int:
    """Half the memory of the first device, or of the host on CPU."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) // 2
    except Exception:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 * 1024**3


def _warm_up_asdex() -> None:
    """Detect and colour a tiny pattern once, so that asdex's one-off start-up cost
    (compiling its colouring kernels) is not charged to the first task."""
    if asdex is None:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", asdex.DenseColoringWarning)
            for mode in ("fwd", "rev"):
                sparsity = asdex.jacobian_sparsity(
                    lambda u: u[1:] * u[:-1], jnp.ones(4, DTYPE)
                )
                asdex.jacobian_coloring_from_sparsity(sparsity, mode=mode)
    except Exception as error:
        _log(f"asdex warm-up failed: {_short_error(error)}")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks --suite sparse",
        description="Benchmark sparse Jacobians: graphax_eqx.jacve against asdex, "
        "jax.jacfwd and jax.jacrev.",
    )
    parser.add_argument(
        "--tasks",
        default=None,
        help="comma-separated task names (default: all); available: "
        + ", ".join(sparse_tasks.SPARSE_TASKS),
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=200,
        help="timed repetitions, within the time budget (default: 200)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=30.0,
        help="seconds of timing per group of compared methods and task; at least 3 "
        "repetitions (default: 30)",
    )
    parser.add_argument(
        "--skip-after",
        type=float,
        default=10.0,
        help="skip a method whose first call or one timed call takes longer "
        "(seconds, default: 10)",
    )
    parser.add_argument(
        "--hard-limit",
        type=float,
        default=300.0,
        help="interrupt tracing after this many seconds (default: 300)",
    )
    parser.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        help="GiB a compiled program may plan before it is skipped "
        "(default: half the device or host memory)",
    )
    parser.add_argument(
        "--small", action="store_true", help="tiny problem sizes, for a smoke run"
    )
    parser.add_argument(
        "--size",
        action="append",
        default=[],
        metavar="TASK:NAME=VALUE",
        help="run TASK with one size parameter changed, e.g. Bratu2D:grid=512 "
        "(repeatable; the parameters are those of the task's `full` sizes)",
    )
    parser.add_argument(
        "--no-orders",
        action="store_true",
        help="do not time sparse jacve in forward, reverse and Markowitz order",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="also write the Markdown report here"
    )
    return parser.parse_args(argv)


def _resized(
    available: dict[str, sparse_tasks.SparseTask], sizes: Sequence[str]
) -> dict[str, sparse_tasks.SparseTask]:
    """`available` with the `--size TASK:NAME=VALUE` changes applied."""
    tasks = dict(available)
    for spec in sizes:
        name, _, assignment = spec.partition(":")
        key, _, value = assignment.partition("=")
        task = tasks.get(name)
        if task is None or key not in task.full or not value.isdigit():
            known = "; ".join(f"{t.name}: {', '.join(t.full)}" for t in tasks.values())
            raise SystemExit(
                f"--size {spec!r}: use TASK:NAME=VALUE with a task and one of its "
                f"size parameters ({known})."
            )
        tasks[name] = dataclasses.replace(task, full={**task.full, key: int(value)})
    return tasks


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    options = _parse(arguments)
    available = sparse_tasks.SPARSE_TASKS
    if options.tasks:
        names = [name.strip() for name in options.tasks.split(",") if name.strip()]
        unknown = [name for name in names if name not in available]
        if unknown:
            raise SystemExit(
                f"Unknown task(s) {unknown}; choose from {list(available)}."
            )
    else:
        names = list(available)
    available = _resized(available, options.size)
    memory_limit = (
        _default_memory_limit()
        if options.memory_limit is None
        else int(options.memory_limit * 1024**3)
    )
    settings = Settings(
        small=options.small,
        repeats=max(1, options.repeats),
        min_repeats=min(3, max(1, options.repeats)),
        time_budget=options.time_budget,
        skip_after=options.skip_after,
        hard_limit=options.hard_limit,
        memory_limit=memory_limit,
        orders=not options.no_orders,
    )
    command = " ".join(["python -m benchmarks --suite sparse", *arguments])
    if GRAPHAX_IMPORT_ERROR is not None:
        _log(f"graphax_eqx unavailable ({GRAPHAX_IMPORT_ERROR}).")
    if ASDEX_IMPORT_ERROR is not None:
        _log(f"asdex unavailable ({ASDEX_IMPORT_ERROR}).")

    start = time.perf_counter()
    _warm_up_asdex()
    failures: list[Failure] = []
    results = [
        benchmark_task(available[name], index, settings, failures)
        for index, name in enumerate(names)
    ]
    elapsed = time.perf_counter() - start

    report = (
        "\n".join(
            part
            for part in (
                render_header(settings, command, elapsed),
                render_wrong(results),
                render_runtimes(results),
                render_orders(results),
                render_first_calls(results),
                render_errors(results),
                render_tasks(results),
                render_failures(failures),
            )
            if part
        )
        + "\n"
    )
    print(report)
    if options.out is not None:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(report, encoding="utf-8")
        _log(f"wrote {options.out}")
    errors = [f for f in failures if f.detail]
    if errors:
        _log(f"{len(errors)} failure(s); one traceback per distinct error:")
        for group in _group_failures(errors):
            _log(f"--- {group[0].part}, {group[0].what}\n{group[0].detail}")
    if any(r.wrong for r in results):
        _log("!!! Some Jacobians are WRONG; see the report. !!!")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
