"""Property-based parity: random compositions of operations, random orders.

The number of examples defaults to a small budget; set the environment variable
`GRAPHAX_HYPOTHESIS_EXAMPLES` to an integer for a longer search.
"""

import dataclasses
import os
from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings

from .helpers import check_jacve, graph_of, reference_jacobians


MAX_EXAMPLES = int(os.environ.get("GRAPHAX_HYPOTHESIS_EXAMPLES", "10"))

# Every unary operation here is smooth (or has JAX-defined one-sided behaviour) on all
# of the reals, so random compositions stay inside each operation's domain.
_UNARY = {
    "sin": jnp.sin,
    "cos": jnp.cos,
    "tanh": jnp.tanh,
    "logistic": jax.nn.sigmoid,
    "atan": jnp.arctan,
    "asinh": jnp.arcsinh,
    "square": jnp.square,
    "half_neg": lambda x: -0.5 * x,
    "softplus": jax.nn.softplus,
    "exp_tanh": lambda x: jnp.exp(jnp.tanh(x)),
}

_BINARY = {
    "add": jnp.add,
    "sub": jnp.subtract,
    "mul": jnp.multiply,
    "max": jnp.maximum,
    "min": jnp.minimum,
    "safe_div": lambda x, y: x / (1.0 + y * y),
}

_REDUCE = {"sum": jnp.sum, "max": jnp.max, "mean": jnp.mean}


def _apply(op: tuple, values: list[Any]) -> Any:
    kind = op[0]
    if kind == "unary":
        _, name, i = op
        return _UNARY[name](values[i])
    if kind == "binary":
        _, name, i, j = op
        return _BINARY[name](values[i], values[j])
    if kind == "reduce":
        _, name, i, axis, keepdims = op
        return _REDUCE[name](values[i], axis=axis, keepdims=keepdims)
    if kind == "reshape":
        _, i, shape = op
        return jnp.reshape(values[i], shape)
    if kind == "transpose":
        _, i = op
        return jnp.transpose(values[i])
    if kind == "slice":
        _, i, axis, start, step = op
        index = [slice(None)] * values[i].ndim
        index[axis] = slice(start, None, step)
        return values[i][tuple(index)]
    if kind == "matmul":
        _, i, j = op
        return values[i] @ values[j]
    if kind == "concatenate":
        _, i, j, axis = op
        return jnp.concatenate([values[i], values[j]], axis=axis)
    if kind == "where":
        _, i, j, k = op
        return jnp.where(values[i] > 0, values[j], values[k])
    if kind == "cumsum":
        _, i, axis = op
        return jnp.cumsum(values[i], axis=axis)
    if kind == "gather":
        _, i, axis = op
        return jnp.take(values[i], np.array([0, -1, 0]), axis=axis)
    if kind == "pad":
        _, i, axis = op
        widths = [(0, 0)] * values[i].ndim
        widths[axis] = (1, 2)
        return jnp.pad(values[i], widths)
    raise AssertionError(kind)


@dataclasses.dataclass(frozen=True)
class RandomProgram:
    input_shapes: tuple[tuple[int, ...], ...]
    ops: tuple[tuple, ...]
    outputs: tuple[int, ...]
    dtype: str
    seed: int

    def __call__(self, *inputs):
        values = list(inputs)
        for op in self.ops:
            values.append(_apply(op, values))
        if len(self.outputs) == 1:
            return values[self.outputs[0]]
        return tuple(values[i] for i in self.outputs)

    def args(self) -> tuple[Any, ...]:
        rng = np.random.default_rng(self.seed)
        return tuple(
            jnp.asarray(rng.uniform(-1.0, 1.0, shape), self.dtype)
            for shape in self.input_shapes
        )

    @property
    def argnums(self) -> tuple[int, ...]:
        return tuple(range(len(self.input_shapes)))


def _result_shape(op: tuple, shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    """The shape `op` produces, or None if it is not valid for these shapes."""
    structs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    try:
        return tuple(jax.eval_shape(lambda *v: _apply(op, list(v)), *structs).shape)
    except (TypeError, ValueError, IndexError):
        return None


@st.composite
def random_programs(draw) -> RandomProgram:
    m = draw(st.integers(2, 3))
    n = draw(st.integers(2, 4))
    shape = st.lists(st.sampled_from([1, m, n]), min_size=0, max_size=2).map(tuple)
    input_shapes = draw(st.lists(shape, min_size=1, max_size=2))
    shapes: list[tuple[int, ...]] = list(input_shapes)
    ops: list[tuple] = []
    num_ops = draw(st.integers(1, 6))
    while len(ops) < num_ops:
        live = st.integers(0, len(shapes) - 1)
        kind = draw(
            st.sampled_from(
                ["unary", "unary", "binary", "binary", "reduce", "reshape"]
                + ["transpose", "slice", "matmul", "concatenate", "where"]
                + ["cumsum", "gather", "pad"]
            )
        )
        i = draw(live)
        if kind == "unary":
            op = ("unary", draw(st.sampled_from(sorted(_UNARY))), i)
        elif kind == "binary":
            op = ("binary", draw(st.sampled_from(sorted(_BINARY))), i, draw(live))
        elif kind == "reduce":
            rank = len(shapes[i])
            axis = draw(st.none() | st.integers(0, max(rank - 1, 0)))
            op = ("reduce", draw(st.sampled_from(sorted(_REDUCE))), i, axis)
            op = op + (draw(st.booleans()),)
        elif kind == "reshape":
            size = int(np.prod(shapes[i], dtype=int))
            candidates = [(size,), (1, size), (size, 1)]
            if len(shapes[i]) == 2:
                candidates.append(shapes[i][::-1])
            op = ("reshape", i, draw(st.sampled_from(candidates)))
        elif kind == "transpose":
            op = ("transpose", i)
        elif kind == "slice":
            rank = len(shapes[i])
            if rank == 0:
                continue
            axis = draw(st.integers(0, rank - 1))
            start = draw(st.sampled_from([None, 1]))
            step = draw(st.sampled_from([None, 2, -1]))
            op = ("slice", i, axis, start, step)
        elif kind == "matmul":
            op = ("matmul", i, draw(live))
        elif kind == "concatenate":
            axis = draw(st.integers(0, max(len(shapes[i]) - 1, 0)))
            op = ("concatenate", i, draw(live), axis)
        elif kind == "where":
            op = ("where", i, draw(live), draw(live))
        else:
            rank = len(shapes[i])
            if rank == 0:
                continue
            op = (kind, i, draw(st.integers(0, rank - 1)))
        out_shape = _result_shape(op, shapes)
        if out_shape is None or 0 in out_shape:
            continue
        ops.append(op)
        shapes.append(out_shape)
    last = len(shapes) - 1
    extra = draw(st.lists(st.integers(0, last), max_size=1))
    dtype = draw(st.sampled_from(["float32", "float64"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return RandomProgram(tuple(input_shapes), tuple(ops), (last, *extra), dtype, seed)


@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(program=random_programs(), data=st.data())
def test_random_programs_all_orders(program, data):
    args = program.args()
    argnums = program.argnums
    references = reference_jacobians(program, args, argnums=argnums, jit=False)
    graph = graph_of(program, args, argnums=argnums)
    random_order = data.draw(
        st.permutations([int(v) for v in graph.intermediates]), label="order"
    )
    orders = ("fwd", "rev", "markowitz", "relative_markowitz", "min_fill", "auto")
    for order in (*orders, random_order):
        check_jacve(program, args, order, argnums=argnums, references=references)
