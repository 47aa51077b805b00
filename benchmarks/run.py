"""The benchmark script behind `python -m benchmarks`.

One run measures, for every task in [`benchmarks.tasks.TASKS`][]:

- multiplication counts of the forward, reverse, Markowitz and automatic elimination
  orders (`jacve(..., count_ops=True)` on one unbatched example, traced abstractly);
- runtime of `jax.jit(jax.vmap(jacve(f, order=o)))` for every order against
  `jax.jit(jax.vmap(jax.jacfwd(f)))` and `jax.jit(jax.vmap(jax.jacrev(f)))` at several
  batch sizes (batch 1 means the unbatched `jax.jit(jacve(f))`, i.e. latency), with
  the repetitions of all methods interleaved;
- first-call time (trace, compile and first run) and the memory XLA plans for each
  compiled program;

plus Equinox training steps of an MLP and a CNN (`filter_value_and_jacve` against
`eqx.filter_value_and_grad`) and a scaling report of trace-and-lower time on long
unrolled recurrences. Results are printed as Markdown and written to
`docs/benchmarks.md` and `docs/benchmarks_speedup.png`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import math
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import tasks as task_registry


try:
    import graphax_eqx

    if not hasattr(graphax_eqx, "jacve"):
        raise ImportError("graphax_eqx does not define `jacve`")
    GRAPHAX_IMPORT_ERROR: str | None = None
except Exception as error:  # any failure to import leaves the JAX baselines running
    graphax_eqx = None
    GRAPHAX_IMPORT_ERROR = f"{type(error).__name__}: {error}"


ORDERS = ("fwd", "rev", "markowitz", "auto")
JACVE_METHODS = tuple(f"jacve[{order}]" for order in ORDERS)
JAX_METHODS = ("jax.jacfwd", "jax.jacrev")
METHODS = JACVE_METHODS + JAX_METHODS
# The report's tables show these; the other orders are folded under each table, so
# that every table stays narrow enough to read on one page.
HEADLINE_METHODS = ("jacve[auto]", *JAX_METHODS)
DETAIL_METHODS = tuple(m for m in METHODS if m not in HEADLINE_METHODS)
DTYPE = jnp.float32
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Settings:
    """How much work one run does."""

    batch_sizes: tuple[int, ...]
    repeats: dict[int, int]
    min_repeats: int
    # Wall-clock budget of the interleaved timing loop of one (task, batch size).
    time_budget: dict[int, float]
    # A first call (trace + compile + run) slower than this counts as a failure.
    first_call_limit: float
    train_steps: int
    scaling_targets: tuple[int, ...]
    scaling_limit: float


FULL = Settings(
    batch_sizes=(1, 512, 4096),
    repeats={1: 2000, 512: 60, 4096: 20},
    min_repeats=5,
    time_budget={1: 3.0, 512: 6.0, 4096: 8.0},
    first_call_limit=180.0,
    train_steps=40,
    scaling_targets=(1000, 2000, 5000),
    scaling_limit=90.0,
)
QUICK = Settings(
    batch_sizes=(1, 16),
    repeats={1: 5, 16: 3},
    min_repeats=2,
    time_budget={1: 1.0, 16: 1.0},
    first_call_limit=60.0,
    train_steps=3,
    scaling_targets=(200,),
    scaling_limit=30.0,
)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _TimeLimit(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the Python code in the block after `seconds` (main thread only).

    Tracing and elimination are Python, so a pathological graph is stopped;
    a running XLA compilation finishes first.
    """

    def handler(signum, frame):
        raise _TimeLimit(f"timed out after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _short_error(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if len(first) > 200:
        first = first[:197] + "..."
    return f"{type(error).__name__}: {first}"


def _traceback_tail(lines: int = 30) -> str:
    return "\n".join(traceback.format_exc().rstrip().splitlines()[-lines:])


def _block(tree: Any) -> Any:
    return jax.block_until_ready(tree)


# ---------------------------------------------------------------------------
# Measurement records
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Failure:
    """One thing that raised: `part` of the run (a task name, "training", ...),
    `what` within it, the one-line `error` and the end of its traceback."""

    part: str
    what: str
    error: str
    detail: str


@dataclasses.dataclass
class TaskResult:
    task: task_registry.Task
    num_eqns: int | None = None
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    auto_choice: str | None = None
    # Keyed by (batch size, method).
    median: dict[tuple[int, str], float] = dataclasses.field(default_factory=dict)
    first_call: dict[tuple[int, str], float] = dataclasses.field(default_factory=dict)
    trace_time: dict[tuple[int, str], float] = dataclasses.field(default_factory=dict)
    memory: dict[tuple[int, str], int | None] = dataclasses.field(default_factory=dict)
    error: dict[tuple[int, str], float] = dataclasses.field(default_factory=dict)
    repeats: dict[int, int] = dataclasses.field(default_factory=dict)
    failed: dict[tuple[int, str], str] = dataclasses.field(default_factory=dict)

    def speedup(self, batch: int) -> float | None:
        auto = self.median.get((batch, "jacve[auto]"))
        baselines = [self.median.get((batch, m)) for m in JAX_METHODS]
        baselines = [b for b in baselines if b is not None]
        if auto is None or not baselines:
            return None
        return min(baselines) / auto


# ---------------------------------------------------------------------------
# Jacobian programs
# ---------------------------------------------------------------------------


def _jacobian(task: task_registry.Task, method: str) -> Callable[..., Any]:
    if method == "jax.jacfwd":
        return jax.jacfwd(task.reference_fn, argnums=task.argnums)
    if method == "jax.jacrev":
        return jax.jacrev(task.reference_fn, argnums=task.argnums)
    assert graphax_eqx is not None
    order = method[len("jacve[") : -1]
    return graphax_eqx.jacve(task.fn, order=order, argnums=task.argnums)


def _program(task: task_registry.Task, method: str, batch: int) -> Callable[..., Any]:
    jac = _jacobian(task, method)
    return jax.jit(jac if batch == 1 else jax.vmap(jac))


def _args(task: task_registry.Task, batch: int) -> tuple[jax.Array, ...]:
    key = jax.random.key(batch)
    if batch == 1:
        return task.make_args(key, DTYPE)
    return task_registry.make_batch(task, key, DTYPE, batch)


def _relative_error(value: Any, reference: Any) -> float:
    leaves = jax.tree_util.tree_leaves(value)
    ref_leaves = jax.tree_util.tree_leaves(reference)
    if len(leaves) != len(ref_leaves):
        return math.inf
    worst = 0.0
    for leaf, ref in zip(leaves, ref_leaves, strict=True):
        if jnp.shape(leaf) != jnp.shape(ref):
            return math.inf
        leaf = np.asarray(leaf, np.float64)
        ref = np.asarray(ref, np.float64)
        scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
        diff = float(np.max(np.abs(leaf - ref))) if ref.size else 0.0
        worst = max(worst, diff / scale)
    return worst


def _memory_bytes(compiled: Any) -> int | None:
    try:
        stats = compiled.memory_analysis()
    except Exception:
        return None
    if stats is None:
        return None
    return int(stats.temp_size_in_bytes) + int(stats.output_size_in_bytes)


def _count_ops(task: task_registry.Task, order: str, args) -> dict[str, Any]:
    assert graphax_eqx is not None
    counted = graphax_eqx.jacve(
        task.fn, order=order, argnums=task.argnums, count_ops=True
    )
    found: dict[str, Any] = {}

    def run(*inner):
        jac, counts = counted(*inner)
        found.update(counts)
        return jac

    # Counts are Python integers fixed at trace time: an abstract evaluation gives
    # them without running any arithmetic.
    jax.eval_shape(run, *args)
    return found


# ---------------------------------------------------------------------------
# The per-task benchmark
# ---------------------------------------------------------------------------


def benchmark_task(
    task: task_registry.Task, settings: Settings, failures: list[Failure]
) -> TaskResult:
    result = TaskResult(task)
    methods = METHODS if graphax_eqx is not None else JAX_METHODS
    example = task.make_args(jax.random.key(0), DTYPE)
    try:
        result.num_eqns = len(jax.make_jaxpr(task.reference_fn)(*example).jaxpr.eqns)
        if graphax_eqx is not None and task.fn is not task.reference_fn:
            result.num_eqns = len(jax.make_jaxpr(task.fn)(*example).jaxpr.eqns)
    except Exception as error:
        failures.append(Failure(task.name, "make_jaxpr", _short_error(error), ""))

    for index, batch in enumerate(settings.batch_sizes):
        _log(f"[{task.name}] batch {batch}")
        args = _args(task, batch)
        programs: dict[str, Callable[..., Any]] = {}
        outputs: dict[str, Any] = {}
        # The first method built for a task also warms JAX's own tracing caches;
        # rotating the build order spreads that over the methods.
        shift = (2 * index) % len(methods)
        for method in methods[shift:] + methods[:shift]:
            try:
                with _time_limit(settings.first_call_limit):
                    start = time.perf_counter()
                    program = _program(task, method, batch)
                    lowered = program.lower(*args)  # type: ignore[attr-defined]
                    traced = time.perf_counter()
                    compiled = lowered.compile()
                    outputs[method] = _block(compiled(*args))
                    end = time.perf_counter()
                result.first_call[batch, method] = end - start
                result.trace_time[batch, method] = traced - start
                result.memory[batch, method] = _memory_bytes(compiled)
                programs[method] = program
            except Exception as error:
                message = _short_error(error)
                result.failed[batch, method] = message
                failures.append(
                    Failure(
                        task.name,
                        f"batch {batch} {method}",
                        message,
                        _traceback_tail(),
                    )
                )
                _log(f"  {method}: FAILED {message}")

        reference = outputs.get("jax.jacrev", outputs.get("jax.jacfwd"))
        for method, out in outputs.items():
            if reference is not None:
                result.error[batch, method] = _relative_error(out, reference)

        timed = [method for method in methods if method in programs]
        for program in programs.values():
            for _ in range(2):
                _block(program(*args))
        samples: dict[str, list[float]] = {method: [] for method in timed}
        budget = settings.time_budget[batch]
        loop_start = time.perf_counter()
        repeats = 0
        for rep in range(settings.repeats[batch]):
            if (
                repeats >= settings.min_repeats
                and time.perf_counter() - loop_start > budget
            ):
                break
            # Rotate the order every repetition, so no method always runs right
            # after the same neighbour (caches, frequency scaling).
            shift = rep % max(1, len(timed))
            for method in timed[shift:] + timed[:shift]:
                program = programs[method]
                start = time.perf_counter()
                _block(program(*args))
                samples[method].append(time.perf_counter() - start)
            repeats += 1
        result.repeats[batch] = repeats
        for method, values in samples.items():
            if values:
                result.median[batch, method] = statistics.median(values)
        line = ", ".join(
            f"{m} {_fmt_time(result.median.get((batch, m)))}" for m in timed
        )
        _log(f"  {repeats} reps: {line}")

    if graphax_eqx is not None:
        found_by_order = {}
        for order in ORDERS:
            try:
                with _time_limit(settings.first_call_limit):
                    found_by_order[order] = _count_ops(task, order, example)
                result.counts[order] = int(found_by_order[order]["num_muls"])
            except Exception as error:
                message = _short_error(error)
                failures.append(
                    Failure(
                        task.name,
                        f"count_ops order={order}",
                        message,
                        _traceback_tail(),
                    )
                )
        auto = found_by_order.get("auto")
        if auto is not None:
            for order in ("fwd", "rev", "markowitz"):
                other = found_by_order.get(order)
                if other is not None and list(other["order"]) == list(auto["order"]):
                    result.auto_choice = order
                    break
    return result


# ---------------------------------------------------------------------------
# Equinox training step
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class TrainingResult:
    model: str
    step_time: dict[str, float]
    first_call: dict[str, float]
    final_loss: dict[str, float]
    grad_error: float | None
    steps: int
    skipped: str | None = None
    # Both gradients at the parameters the Equinox run ends with.
    final_grad_error: float | None = None


def _training_models(eqx) -> dict[str, tuple[str, Any, jax.Array]]:
    """The classifiers trained: `name -> (description, model, inputs)`."""
    key_mlp, key_cnn, key_x = jax.random.split(jax.random.key(0), 3)
    mlp = eqx.nn.MLP(64, 10, 256, depth=3, key=key_mlp)
    keys = jax.random.split(key_cnn, 3)
    cnn = eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(3, 8, 3, padding=1, key=keys[0]),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.AvgPool2d(2, 2),
            eqx.nn.Conv2d(8, 16, 3, padding=1, key=keys[1]),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.MaxPool2d(2, 2),
            eqx.nn.Lambda(jnp.ravel),
            eqx.nn.Linear(16 * 4 * 4, 10, key=keys[2]),
        ]
    )
    keys = jax.random.split(jax.random.fold_in(key_cnn, 1), 5)
    deep_cnn = eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(3, 32, 3, padding=1, key=keys[0]),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Conv2d(32, 32, 3, padding=1, key=keys[1]),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.MaxPool2d(2, 2),
            eqx.nn.Conv2d(32, 64, 3, padding=1, key=keys[2]),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Conv2d(64, 64, 3, padding=1, key=keys[3]),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.MaxPool2d(2, 2),
            eqx.nn.Lambda(jnp.ravel),
            eqx.nn.Linear(64 * 8 * 8, 10, key=keys[4]),
        ]
    )
    key_a, key_b = jax.random.split(key_x)
    key_c = jax.random.fold_in(key_x, 1)
    return {
        "MLP": (
            "an `eqx.nn.MLP` classifier 64 → 256 → 256 → 256 → 10 (ReLU), batch 256",
            mlp,
            jax.random.normal(key_a, (256, 64), DTYPE),
        ),
        "CNN": (
            "a CNN on 3 × 16 × 16 images: `eqx.nn.Conv2d` 3 → 8 (3 × 3, ReLU, "
            "`eqx.nn.AvgPool2d(2, 2)`), `eqx.nn.Conv2d` 8 → 16 (3 × 3, ReLU, "
            "`eqx.nn.MaxPool2d(2, 2)`), then `eqx.nn.Linear` 256 → 10, batch 32",
            cnn,
            jax.random.normal(key_b, (32, 3, 16, 16), DTYPE),
        ),
        "DeepCNN": (
            "a CNN on 3 × 32 × 32 images: `eqx.nn.Conv2d` 3 → 32 → 32 (3 × 3, ReLU "
            "after each), `eqx.nn.MaxPool2d(2, 2)`, `eqx.nn.Conv2d` 32 → 64 → 64 (3 × "
            "3, ReLU after each), `eqx.nn.MaxPool2d(2, 2)`, then `eqx.nn.Linear` "
            "4096 → 10, batch 32",
            deep_cnn,
            jax.random.normal(key_c, (32, 3, 32, 32), DTYPE),
        ),
    }


def training_benchmark(
    settings: Settings, failures: list[Failure]
) -> list[TrainingResult]:
    import equinox as eqx

    if graphax_eqx is None or not hasattr(graphax_eqx, "filter_value_and_jacve"):
        reason = (
            "graphax_eqx is not importable"
            if graphax_eqx is None
            else "graphax_eqx.filter_value_and_jacve does not exist yet"
        )
        print(f"Training benchmark skipped: {reason}.", flush=True)
        return [TrainingResult("", {}, {}, {}, None, 0, skipped=reason)]
    results = []
    for name, (_, model, x) in _training_models(eqx).items():
        results.append(_train(name, model, x, settings, failures))
    return results


def _train(
    model_name: str, model, x: jax.Array, settings: Settings, failures: list[Failure]
) -> TrainingResult:
    import equinox as eqx
    import optax

    y = jax.random.randint(jax.random.key(1), (x.shape[0],), 0, 10)
    optimiser = optax.adam(1e-3)
    part = f"training {model_name}"

    def loss_fn(model, x, y):
        logits = jax.vmap(model)(x)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.sum(jax.nn.one_hot(y, 10) * log_probs, axis=-1))

    transforms = {
        "filter_value_and_jacve": graphax_eqx.filter_value_and_jacve,
        "eqx.filter_value_and_grad": eqx.filter_value_and_grad,
    }

    def make_step(value_and_grad):
        @eqx.filter_jit
        def step(model, opt_state, x, y):
            loss, grads = value_and_grad(loss_fn)(model, x, y)
            params = eqx.filter(model, eqx.is_array)
            updates, opt_state = optimiser.update(grads, opt_state, params)
            return eqx.apply_updates(model, updates), opt_state, loss

        return step

    grads, gradients = {}, {}
    for name, transform in transforms.items():
        try:
            gradients[name] = eqx.filter_jit(transform(loss_fn))
            grads[name] = gradients[name](model, x, y)[1]
        except Exception as error:
            failures.append(
                Failure(
                    part, f"gradient {name}", _short_error(error), _traceback_tail()
                )
            )
    grad_error = None
    if len(grads) == 2:
        grad_error = _relative_error(*grads.values())

    states: dict[str, Any] = {}
    steps: dict[str, Any] = {}
    first_call: dict[str, float] = {}
    for name, transform in transforms.items():
        try:
            with _time_limit(settings.first_call_limit):
                start = time.perf_counter()
                step = make_step(transform)
                opt_state = optimiser.init(eqx.filter(model, eqx.is_array))
                state = step(model, opt_state, x, y)
                _block(state[2])
                first_call[name] = time.perf_counter() - start
            states[name] = state
            steps[name] = step
        except Exception as error:
            failures.append(
                Failure(part, f"step {name}", _short_error(error), _traceback_tail())
            )

    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(settings.train_steps):
        for name, step in steps.items():
            current_model, opt_state, _ = states[name]
            start = time.perf_counter()
            state = step(current_model, opt_state, x, y)
            _block(state)
            samples[name].append(time.perf_counter() - start)
            states[name] = state
    step_time = {name: statistics.median(v) for name, v in samples.items() if v}
    final_loss = {name: float(state[2]) for name, state in states.items()}
    # The runs' losses drift apart where rounding differs and Adam rescales small
    # gradients; compared at the same parameters, the gradients should still agree.
    final_grad_error = None
    reference = "eqx.filter_value_and_grad"
    if len(gradients) == 2 and reference in states:
        final = states[reference][0]
        final_grad_error = _relative_error(
            *(g(final, x, y)[1] for g in gradients.values())
        )
    return TrainingResult(
        model_name,
        step_time,
        first_call,
        final_loss,
        grad_error,
        settings.train_steps,
        final_grad_error=final_grad_error,
    )


# ---------------------------------------------------------------------------
# Scaling with graph size
# ---------------------------------------------------------------------------

RECURRENCE_WIDTH = 8


def recurrence(steps: int) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """h ← tanh(W h + x), unrolled `steps` times in Python (three equations a step)."""
    rng = np.random.default_rng(7)
    q, _ = np.linalg.qr(rng.standard_normal((RECURRENCE_WIDTH, RECURRENCE_WIDTH)))
    weight = 0.9 * q

    def fn(h0, x):
        w = jnp.asarray(weight, dtype=h0.dtype)
        h = h0
        for _ in range(steps):
            h = jnp.tanh(w @ h + x)
        return h

    return fn


@dataclasses.dataclass
class ScalingRow:
    target: int
    steps: int
    num_eqns: int
    seconds: dict[str, float | str]


def scaling_benchmark(settings: Settings, failures: list[Failure]) -> list[ScalingRow]:
    h0 = jnp.zeros((RECURRENCE_WIDTH,), DTYPE)
    x = jnp.linspace(-1.0, 1.0, RECURRENCE_WIDTH, dtype=DTYPE)

    def eqns(steps):
        return len(jax.make_jaxpr(recurrence(steps))(h0, x).jaxpr.eqns)

    base = eqns(1)
    per_step = eqns(2) - base
    methods = (JACVE_METHODS if graphax_eqx is not None else ()) + JAX_METHODS
    given_up: set[str] = set()
    rows = []
    for target in settings.scaling_targets:
        steps = max(1, round((target - base) / per_step) + 1)
        fn = recurrence(steps)
        row = ScalingRow(target, steps, eqns(steps), {})
        _log(f"[scaling] {row.num_eqns} equations")
        for method in methods:
            if method in given_up:
                row.seconds[method] = "skipped"
                continue
            if method.startswith("jacve"):
                order = method[len("jacve[") : -1]
                jac = graphax_eqx.jacve(fn, order=order, argnums=(0, 1))
            elif method == "jax.jacfwd":
                jac = jax.jacfwd(fn, argnums=(0, 1))
            else:
                jac = jax.jacrev(fn, argnums=(0, 1))
            try:
                with _time_limit(settings.scaling_limit):
                    start = time.perf_counter()
                    jax.jit(jac).lower(h0, x)
                    row.seconds[method] = time.perf_counter() - start
            except _TimeLimit as error:
                row.seconds[method] = f"> {settings.scaling_limit:.0f} s"
                given_up.add(method)
                _log(f"  {method}: {error}")
            except Exception as error:
                message = _short_error(error)
                row.seconds[method] = "failed"
                given_up.add(method)
                failures.append(
                    Failure(
                        "scaling",
                        f"{row.num_eqns} eqns {method}",
                        message,
                        _traceback_tail(),
                    )
                )
            _log(f"  {method}: {row.seconds[method]}")
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def _fmt_first_call(result: TaskResult, batch: int, method: str) -> str:
    total = result.first_call.get((batch, method))
    traced = result.trace_time.get((batch, method))
    if total is None or traced is None:
        return "—"
    return f"{_fmt_time(total)} ({_fmt_time(traced)})"


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    if n < 1024:
        return f"{n} B"
    if n < 1024**2:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 1024**2:.1f} MiB"


def _fmt_speedup(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _fmt_int(value: int | None) -> str:
    return "—" if value is None else f"{value:,}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _method_cell(result: TaskResult, batch: int, method: str, value: str) -> str:
    if (batch, method) in result.failed:
        return "failed"
    return value


def _details(summary: str, body: str) -> str:
    """`body` folded under `summary`; GitHub and the docs site (`md_in_html`) both
    render the Markdown inside, and the site styles it as a collapsed note."""
    return (
        f'\n<details class="note" markdown="1">\n<summary>{summary}</summary>\n\n'
        f"{body}\n\n</details>\n"
    )


def _method_tables(
    lead_header: Sequence[str],
    rows: Sequence[tuple[Sequence[str], Callable[[str], str], Sequence[str]]],
    trail_header: Sequence[str] = (),
    keep: int = 1,
) -> str:
    """The headline methods' table, then the other orders' table folded away.

    Each row is `(lead, cell, trail)`: its first cells, a function from method to
    cell, and cells that follow the headline methods. The folded table repeats only
    the first `keep` lead cells, which name the row.
    """
    headline = _table(
        [*lead_header, *HEADLINE_METHODS, *trail_header],
        [
            [*lead, *(cell(m) for m in HEADLINE_METHODS), *trail]
            for lead, cell, trail in rows
        ],
    )
    detail = _table(
        [*lead_header[:keep], *DETAIL_METHODS],
        [[*lead[:keep], *(cell(m) for m in DETAIL_METHODS)] for lead, cell, _ in rows],
    )
    orders = ", ".join(f"<code>{m}</code>" for m in DETAIL_METHODS)
    return headline + "\n" + _details(f"Other elimination orders: {orders}", detail)


def _per_batch_tables(results, settings: Settings, cell) -> list[str]:
    """One `### Batch N` section per batch size, a row per task, a column per method."""
    parts = []
    for batch in settings.batch_sizes:
        parts.append(f"\n### Batch {batch}\n")
        rows = [([r.task.name], functools.partial(cell, r, batch), ()) for r in results]
        parts.append(_method_tables(["task"], rows))
    return parts


def render_tasks(results: Sequence[TaskResult], settings: Settings) -> str:
    parts = ["## Summary\n"]
    parts.append(
        'Speed-up of `jacve` with `order="auto"` over the faster of `jax.jacfwd` and '
        "`jax.jacrev`, per batch size (median runtime ratio; above 1 means `jacve` is "
        "faster).\n"
    )
    parts.append("![Speed-up per task and batch size](benchmarks_speedup.png)\n")
    parts.append(
        _table(
            ["task", *[f"batch {b}" for b in settings.batch_sizes], "function"],
            [
                [
                    r.task.name,
                    *[_fmt_speedup(r.speedup(b)) for b in settings.batch_sizes],
                    r.task.summary,
                ]
                for r in results
            ],
        )
    )
    parts.append("\n### Multiplications\n")
    parts.append(
        "Multiplications of the Jacobian by each elimination order; `auto` names the "
        "order it picked.\n"
    )
    count_rows = []
    for r in results:
        counts = [_fmt_int(r.counts.get(order)) for order in ORDERS]
        if r.auto_choice is not None and r.counts.get("auto") is not None:
            counts[3] = f"{counts[3]} ({r.auto_choice})"
        count_rows.append([r.task.name, _fmt_int(r.num_eqns), *counts])
    parts.append(_table(["task", "eqns", *ORDERS], count_rows))

    for batch in settings.batch_sizes:
        what = (
            "unbatched `jax.jit(jac(f))` (latency)"
            if batch == 1
            else f"`jax.jit(jax.vmap(jac(f)))` on {batch} examples"
        )
        parts.append(f"\n## Runtime, batch {batch}\n")
        parts.append(f"Median wall time per call of {what}.\n")
        rows = []
        for r in results:

            def cell(m, r=r, batch=batch):
                return _method_cell(r, batch, m, _fmt_time(r.median.get((batch, m))))

            lead = [r.task.name, _fmt_speedup(r.speedup(batch))]
            rows.append((lead, cell, [str(r.repeats.get(batch, 0))]))
        parts.append(_method_tables(["task", "speed-up auto"], rows, ["repeats"]))

    parts.append("\n## First call\n")
    parts.append(
        "Time from building the transformed function to the end of its first call: "
        "tracing and lowering (for `jacve` this includes building the graph and "
        "eliminating it; the part in parentheses), then XLA compilation and one run. "
        "Each method and batch size gets a freshly built `jacve` / `jax.jacfwd` / "
        "`jax.jacrev`, so no trace is reused; the runtime measurements call the same "
        "jitted function, which reuses this executable.\n"
    )
    parts.extend(
        _per_batch_tables(
            results,
            settings,
            lambda r, batch, m: _method_cell(r, batch, m, _fmt_first_call(r, batch, m)),
        )
    )

    parts.append("\n## Memory\n")
    parts.append(
        "Temporary plus output bytes of the compiled program, from "
        "`jax.jit(...).lower(...).compile().memory_analysis()` (n/a where the backend "
        "does not report it). Inputs are not included.\n"
    )
    parts.extend(
        _per_batch_tables(
            results,
            settings,
            lambda r, batch, m: (
                _method_cell(r, batch, m, _fmt_bytes(r.memory.get((batch, m))))
                if (batch, m) in r.memory or (batch, m) in r.failed
                else "—"
            ),
        )
    )

    parts.append("\n## Agreement with `jax.jacrev`\n")
    parts.append(
        "Largest |J - J_jacrev| / max(1, max |J_jacrev|) over all batch sizes "
        "(float32).\n"
    )
    rows = []
    for r in results:

        def cell(m, r=r):
            errors = [r.error[b, m] for b in settings.batch_sizes if (b, m) in r.error]
            return "—" if not errors else f"{max(errors):.1e}"

        rows.append(([r.task.name], cell, ()))
    parts.append(_method_tables(["task"], rows))
    return "\n".join(parts)


def render_training(results: Sequence[TrainingResult] | None) -> str:
    if not results:
        return ""
    parts = ["\n## Equinox training steps\n"]
    if results[0].skipped is not None:
        parts.append(f"Skipped: {results[0].skipped}.\n")
        return "\n".join(parts)
    import equinox as eqx

    described = _training_models(eqx)
    parts.append(
        "One jitted optax Adam step with softmax cross-entropy, for each of: "
        + "; ".join(f"**{r.model}**, {described[r.model][0]}" for r in results)
        + f". Step time is the median over {results[0].steps} alternating steps of "
        "each method.\n"
    )
    rows = []
    for r in results:
        for name in ("filter_value_and_jacve", "eqx.filter_value_and_grad"):
            rows.append(
                [
                    r.model,
                    f"`{name}`",
                    _fmt_time(r.step_time.get(name)),
                    _fmt_time(r.first_call.get(name)),
                    "—" if name not in r.final_loss else f"{r.final_loss[name]:.4f}",
                ]
            )
    parts.append(
        _table(
            ["model", "gradient", "step time", "first call", "loss after steps"], rows
        )
    )
    agree = [
        f"{r.model} {r.grad_error:.1e}" for r in results if r.grad_error is not None
    ]
    if agree:
        parts.append(
            "\nGradients at initialisation agree to "
            + ", ".join(agree)
            + " (relative, largest leaf difference)."
        )
    final = [
        f"{r.model} {r.final_grad_error:.1e}"
        for r in results
        if r.final_grad_error is not None
    ]
    if final:
        parts.append(
            "At the parameters the `eqx.filter_value_and_grad` run ends with, they "
            "agree to " + ", ".join(final) + ". The two runs' losses can still "
            "drift apart: their gradients round differently, and Adam rescales small "
            "gradients, so the runs follow different paths."
        )
    return "\n".join(parts)


def render_scaling(rows: Sequence[ScalingRow] | None) -> str:
    if rows is None:
        return ""
    parts = ["\n## Scaling with graph size\n"]
    parts.append(
        f"Trace and lower (no compilation, no run) `jax.jit(jac(f))` for "
        f"h ← tanh(W h + x) with {RECURRENCE_WIDTH}-vectors unrolled K times, "
        "Jacobian with respect to (h₀, x). Equations counted by `jax.make_jaxpr(f)`.\n"
    )
    table_rows = []
    for row in rows:

        def cell(m, row=row):
            value = row.seconds.get(m)
            if value is None:
                return "—"
            return _fmt_time(value) if isinstance(value, float) else str(value)

        table_rows.append(([_fmt_int(row.num_eqns), str(row.steps)], cell, ()))
    parts.append(_method_tables(["eqns", "K"], table_rows, keep=2))
    return "\n".join(parts)


def _group_failures(failures: Sequence[Failure]) -> list[list[Failure]]:
    groups: dict[tuple[str, str], list[Failure]] = {}
    for failure in failures:
        groups.setdefault((failure.part, failure.error), []).append(failure)
    return list(groups.values())


def render_failures(failures: Sequence[Failure]) -> str:
    if not failures:
        return ""
    parts = ["\n## Failures\n"]
    for group in _group_failures(failures):
        where = "; ".join(failure.what for failure in group)
        parts.append(f"- **{group[0].part}** ({where}): `{group[0].error}`")
    return "\n".join(parts)


def run_lines(command: str, elapsed: float | None, versions: Sequence[str]) -> list:
    """The command, date, machine, versions and wall time of a benchmark run."""
    import jaxlib

    cpu = _cpu_model() or platform.processor() or "unknown processor"
    versions = [
        f"python {platform.python_version()}",
        f"jax {jax.__version__}",
        f"jaxlib {jaxlib.__version__}",
        f"numpy {np.__version__}",
        *versions,
    ]
    if graphax_eqx is not None:
        versions.append(f"graphax_eqx {getattr(graphax_eqx, '__version__', '?')}")
    now = datetime.datetime.now().astimezone()
    lines = [
        f"- Command: `{command}`",
        f"- Date: {now.isoformat(timespec='seconds')}",
        f"- Machine: {platform.platform()}, {cpu}, {os.cpu_count()} CPUs, "
        f"JAX backend `{jax.default_backend()}` ({jax.device_count()} device)",
        f"- Versions: {', '.join(versions)}",
    ]
    if elapsed is not None:
        lines.append(f"- Wall time of this run: {elapsed / 60:.1f} min")
    return lines


def render_header(settings: Settings, command: str, elapsed: float | None) -> str:
    import equinox

    lines = ["# Benchmarks\n"]
    lines.append(
        "Generated by the benchmark script; do not edit by hand. Regenerate with the "
        "command below.\n"
    )
    lines += run_lines(command, elapsed, [f"equinox {equinox.__version__}"])
    if GRAPHAX_IMPORT_ERROR is not None:
        lines.append(
            f"- `graphax_eqx` could not be imported ({GRAPHAX_IMPORT_ERROR}); only "
            "the JAX baselines were measured."
        )
    lines.append("")
    lines.append(
        "All arithmetic is float32. Runtimes are medians after two warm-up calls; the "
        "repetitions of all methods are interleaved (method order rotated every "
        "repetition) so that machine noise affects them alike, with "
        + ", ".join(
            f"up to {settings.repeats[b]} repetitions or "
            f"{settings.time_budget[b]:.0f} s at batch {b}"
            for b in settings.batch_sizes
        )
        + ". Multiplication counts come from `jacve(f, order=o, count_ops=True)` on "
        "one unbatched example, evaluated abstractly; the order named next to the "
        '`auto` count is the one `order="auto"` chose. Baselines follow the design: '
        "`jax.vmap(jax.jacfwd(f))` and `jax.vmap(jax.jacrev(f))` per example, never "
        "`jax.jacrev(jax.vmap(f))`."
    )
    lines.append("")
    lines.append(
        "`BlackScholes_Jacobian` differentiates the first-order Greeks a second time. "
        "For `jacve` the differentiated function is "
        "`jacve(pricer, argnums=(0, 1, 2, 3, 4))`; for the JAX baselines it is "
        "`jax.jacrev(pricer, argnums=(0, 1, 2, 3, 4))`, so the `jax.jacfwd` column "
        "is forward-over-reverse and the `jax.jacrev` column reverse-over-reverse — "
        "each library nested with itself, as a user would write it."
    )
    lines.append("")
    lines.append(
        "Reading the numbers: at batch 1 the scalar tasks return one buffer per "
        "Jacobian entry (up to 121), so their latency is mostly dispatch overhead; "
        "arithmetic shows from batch 512 on. Multiplication counts "
        "describe the elimination, not XLA's fused kernels, so a lower count need not "
        "mean a faster program. In the first-call tables, the total minus the part in "
        "parentheses is XLA compilation plus one run. Each table shows `jacve` with "
        '`order="auto"` next to the JAX baselines; the forward, reverse and Markowitz '
        "orders are folded underneath it."
    )
    lines.append("")
    return "\n".join(lines)


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def plot_speedups(
    results: Sequence[TaskResult], settings: Settings, path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    names = [r.task.name for r in results]
    batches = settings.batch_sizes
    width = 0.8 / len(batches)
    # Text no smaller than the page's: the figure is shown scaled down on the site.
    # At 120 dpi a 11-inch figure is drawn at about half size in the 688 px page
    # column, so 16 pt text appears at about 14 px.
    with plt.rc_context({"font.size": 16}):
        fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names) + 2), 6.5))
        positions = np.arange(len(names))
        for i, batch in enumerate(batches):
            offsets = positions + (i - (len(batches) - 1) / 2) * width
            values = [r.speedup(batch) for r in results]
            heights = [np.nan if v is None else v for v in values]
            ax.bar(offsets, heights, width, label=f"batch {batch}")
            for x, value in zip(offsets, values, strict=True):
                if value is None:
                    ax.text(x, 1.0, "n/a", ha="center", va="bottom", rotation=90)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_locator(LogLocator(base=2))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        low, high = ax.get_ylim()
        ax.set_ylim(min(low, 0.5), max(high, 2.0))
        ax.set_xticks(positions)
        ax.set_xticklabels(names, rotation=30, ha="right")
        ax.set_ylabel(
            'speed-up of jacve(order="auto")\nover faster of jax.jacfwd / jacrev'
        )
        ax.set_title("Jacobian runtime, jacve vs JAX (above 1: jacve faster)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark graphax_eqx.jacve against jax.jacfwd / jax.jacrev.",
    )
    parser.add_argument(
        "--suite",
        choices=("dense", "sparse"),
        default="dense",
        help="dense: the tasks below (default); sparse: large sparse Jacobians, "
        "see `python -m benchmarks --suite sparse --help`",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="few repetitions and small batches, for a smoke test",
    )
    parser.add_argument(
        "--tasks",
        default=None,
        help="comma-separated task names (default: all); available: "
        + ", ".join(task_registry.TASKS),
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=REPO_ROOT / "docs",
        help="where benchmarks.md and benchmarks_speedup.png go",
    )
    parser.add_argument(
        "--no-write", action="store_true", help="print the report only, write no files"
    )
    parser.add_argument(
        "--no-training", action="store_true", help="skip the Equinox training benchmark"
    )
    parser.add_argument(
        "--no-scaling", action="store_true", help="skip the graph-size scaling report"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    suite = argparse.ArgumentParser(add_help=False)
    suite.add_argument("--suite", choices=("dense", "sparse"), default="dense")
    chosen, rest = suite.parse_known_args(arguments)
    if chosen.suite == "sparse":
        from . import sparse

        return sparse.main(rest)
    options = _parse(arguments)
    settings = QUICK if options.quick else FULL
    if options.tasks:
        names = [name.strip() for name in options.tasks.split(",") if name.strip()]
        unknown = [name for name in names if name not in task_registry.TASKS]
        if unknown:
            raise SystemExit(
                f"Unknown task(s) {unknown}; choose from {list(task_registry.TASKS)}."
            )
    else:
        names = list(task_registry.TASKS)
    command = " ".join(["python -m benchmarks", *arguments])
    if GRAPHAX_IMPORT_ERROR is not None:
        _log(f"graphax_eqx unavailable ({GRAPHAX_IMPORT_ERROR}); JAX baselines only.")

    start = time.perf_counter()
    failures: list[Failure] = []
    results = []
    for name in names:
        results.append(benchmark_task(task_registry.TASKS[name], settings, failures))
    training = None if options.no_training else training_benchmark(settings, failures)
    scaling = None if options.no_scaling else scaling_benchmark(settings, failures)
    elapsed = time.perf_counter() - start

    report = (
        "\n".join(
            part
            for part in (
                render_header(settings, command, elapsed),
                render_tasks(results, settings),
                render_training(training),
                render_scaling(scaling),
                render_failures(failures),
            )
            if part
        )
        + "\n"
    )
    print(report)
    if not options.no_write:
        options.out_dir.mkdir(parents=True, exist_ok=True)
        (options.out_dir / "benchmarks.md").write_text(report, encoding="utf-8")
        plot_speedups(results, settings, options.out_dir / "benchmarks_speedup.png")
        _log(f"wrote {options.out_dir / 'benchmarks.md'} and benchmarks_speedup.png")
    if failures:
        _log(f"{len(failures)} failure(s); one traceback per distinct error:")
        for group in _group_failures(failures):
            _log(f"--- {group[0].part}, {group[0].what}\n{group[0].detail}")
    return 0
