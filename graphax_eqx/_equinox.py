"""Filtered Jacobians for Equinox models.

The transforms here sit on top of `graphax_eqx.jacve` and
`graphax_eqx.value_and_jacve`. They split each differentiated argument into its
floating-point array leaves and everything else, hand only flat lists of arrays to the
core engine, and rebuild the results so that every Jacobian has the shape of the
object it was taken with respect to (`None` wherever a leaf was not differentiated).
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, ParamSpec, TypeVar, cast, overload

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jaxtyping import PyTree

from ._jacve import (
    _check_argnums,
    _describe_value,
    _JacVE,
    _normalise_argnums,
    named_after,
)
from ._orders import normalise_order


_P = ParamSpec("_P")
_F = TypeVar("_F", bound=Callable[..., Any])

Order = str | Sequence[int]


def _normalise_order(order: Order, api: str) -> Order:
    # Checked early, and explicit orders become tuples so that they are hashable: the
    # wrappers keep the order as static metadata, which `eqx.filter_jit` hashes. A
    # saved `graphax_eqx.Order` comes back as itself: hashable, and a sequence of ids
    # in all but its declared type.
    return cast(Order, normalise_order(order, api))


def _refuses_argnums(api: str) -> Callable[[_F], _F]:
    """Make `argnums=` an error that says what to do instead.

    The decorated transform keeps its own signature (`help` and the docs show it);
    any other unexpected keyword is Python's usual `TypeError`.
    """

    def decorator(transform: _F) -> _F:
        @functools.wraps(transform)
        def wrapper(*args, **kwargs):
            if "argnums" in kwargs:
                raise ValueError(
                    f"`{api}` does not take `argnums` (got "
                    f"`argnums={kwargs['argnums']!r}`). It always differentiates the "
                    "first positional argument. To differentiate several objects, "
                    "pack them into a tuple and pass that tuple as the first "
                    "argument, e.g. `fun((model, x), y)`; or use "
                    "`graphax_eqx.eqx_jacve`, which takes `argnums`."
                )
            return transform(*args, **kwargs)

        # `functools.wraps` keeps the name, docstring and signature of `transform`.
        return cast(_F, wrapper)

    return decorator


def _resolve_argnums(
    api: str, argnums: int | tuple[int, ...], num_args: int
) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else argnums
    if num_args == 0:
        raise TypeError(
            f"Functions wrapped with `{api}` must be called with at least one "
            "positional argument (the object that is differentiated); got none. "
            "Pass the differentiated object by position, not by keyword."
        )
    return _check_argnums(nums, num_args, api)


def _check_callable(fun: Any, api: str) -> None:
    if not callable(fun):
        raise TypeError(f"`{api}` expects a callable, got {type(fun).__name__}.")


def _split_output(api: str, out: Any) -> tuple[Any, Any]:
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise TypeError(
            f"`{api}(..., has_aux=True)` requires the function to return a pair "
            f"`(output, aux)`; it returned {_describe_value(out)}."
        )
    return out[0], out[1]


def _split_complex(leaves: list[Any], complex_at: list[int]) -> list[Any]:
    """`leaves` with each leaf at `complex_at` replaced by its real and imaginary
    parts."""
    out = []
    for k, leaf in enumerate(leaves):
        out.extend((jnp.real(leaf), jnp.imag(leaf)) if k in complex_at else (leaf,))
    return out


def _join_complex(parts: list[Any], complex_at: list[int], sign: int = 1) -> list[Any]:
    """The inverse of `_split_complex` (`sign=1`); with `sign=-1`, Jacobian blocks by
    real and imaginary part combined per complex leaf, `d/d(real) - 1j d/d(imag)`."""
    out, it = [], iter(parts)
    for k in range(len(parts) - len(complex_at)):
        if k in complex_at:
            re, im = next(it), next(it)
            out.append(lax.complex(re, im if sign > 0 else -im))
        else:
            out.append(next(it))
    return out


def _differentiate(
    api: str,
    fun: Callable,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    argnums: int | tuple[int, ...],
    *,
    order: Order,
    has_aux: bool,
    count_ops: bool,
    sparse_representation: bool,
    with_value: bool,
) -> Any:
    nums = _resolve_argnums(api, argnums, len(args))
    args_list = list(args)
    diff_leaves: list[Any] = []
    diff_treedefs = []
    diff_sizes = []
    for i in nums:
        diff, nondiff = eqx.partition(args_list[i], eqx.is_inexact_array)
        leaves, treedef = jtu.tree_flatten(diff)
        diff_leaves.extend(leaves)
        diff_treedefs.append(treedef)
        diff_sizes.append(len(leaves))
        args_list[i] = nondiff
    # Everything else reaches `fun` as it was passed, as in `equinox.filter_jacrev`:
    # the other arguments and the keyword arguments are not taken apart and rebuilt
    # (their classes may check what they are built from, and `fun` may keep or
    # update them in place), and arrays among them are closed over (concrete eagerly,
    # so Python may branch on them; traced under `jit` or `vmap`).

    # Complex leaves (inexact arrays, so differentiated as Equinox does) enter the
    # engine as their real and imaginary parts; their Jacobian blocks are combined
    # as `jax.vjp` gives them: `d/d(real) - 1j d/d(imag)`.
    complex_at = [k for k, leaf in enumerate(diff_leaves) if jnp.iscomplexobj(leaf)]
    if complex_at and sparse_representation:
        raise TypeError(
            f"`{api}(..., sparse_representation=True)` does not support complex "
            "leaves to differentiate; use the default dense result, or differentiate "
            "with respect to their real and imaginary parts."
        )
    engine_leaves = _split_complex(diff_leaves, complex_at)

    # A new engine each call: like `jax.jacrev`, every call traces `fun` anew, so
    # values it closes over are read afresh. The engine caches the analysed graph by
    # its structure, so repeated calls do not analyse it again. `traced` receives
    # structures only known once `fun` has run.
    traced: dict[str, Any] = {}

    def flat_fun(flat_diff):
        flat_diff = _join_complex(flat_diff, complex_at)
        call_args = list(args_list)
        start = 0
        for i, treedef, size in zip(nums, diff_treedefs, diff_sizes, strict=True):
            diff = jtu.tree_unflatten(treedef, flat_diff[start : start + size])
            call_args[i] = eqx.combine(diff, call_args[i])
            start += size
        out = fun(*call_args, **kwargs)
        if not has_aux:
            out_leaves, traced["out"] = jtu.tree_flatten(out)
            return out_leaves
        out, aux = _split_output(api, out)
        out_leaves, traced["out"] = jtu.tree_flatten(out)
        # `aux` may hold arbitrary Python objects; only its arrays cross the engine.
        aux_dynamic, aux_static = eqx.partition(aux, eqx.is_array)
        aux_leaves, aux_treedef = jtu.tree_flatten(aux_dynamic)
        traced["aux"] = (aux_treedef, aux_static)
        return out_leaves, aux_leaves

    named_after(flat_fun, fun)
    # The engine's errors (non-float outputs, an order made for another graph) name
    # the function the user called.
    if with_value:
        engine = _JacVE(flat_fun, order, 0, has_aux, False, False, True, api)
    else:
        engine = _JacVE(
            flat_fun, order, 0, has_aux, count_ops, sparse_representation, False, api
        )

    counts = None
    if not diff_leaves:
        # Nothing to differentiate (e.g. a model holding only integer arrays): every
        # Jacobian is the `None`-holed structure of the argument, no elimination runs.
        result = flat_fun(engine_leaves)
        out_leaves, aux_leaves = result if has_aux else (result, None)
        rows = [[] for _ in out_leaves]
        counts = {"num_muls": 0, "num_adds": 0, "order": [], "order_counts": []}
    elif with_value:
        value, rows = engine(engine_leaves)
        out_leaves, aux_leaves = value if has_aux else (value, None)
    else:
        result = engine(engine_leaves)
        if count_ops:
            result, counts = result
        rows, aux_leaves = result if has_aux else (result, None)
        out_leaves = None
    assert "out" in traced, "the core engine did not trace the function"

    out_treedef = traced["out"]
    is_tuple = not isinstance(argnums, int)
    per_output = []
    for row in rows:
        row = _join_complex(list(row), complex_at, sign=-1)
        trees = []
        start = 0
        for treedef, size in zip(diff_treedefs, diff_sizes, strict=True):
            trees.append(jtu.tree_unflatten(treedef, row[start : start + size]))
            start += size
        per_output.append(tuple(trees) if is_tuple else trees[0])
    jac = jtu.tree_unflatten(out_treedef, per_output)

    if has_aux:
        aux_treedef, aux_static = traced["aux"]
        assert aux_leaves is not None
        aux = eqx.combine(jtu.tree_unflatten(aux_treedef, aux_leaves), aux_static)
    else:
        aux = None

    if with_value:
        assert out_leaves is not None
        out = jtu.tree_unflatten(out_treedef, out_leaves)
        return ((out, aux), jac) if has_aux else (out, jac)
    result = (jac, aux) if has_aux else jac
    return (result, counts) if count_ops else result


class _JacveWrapper(eqx.Module):
    _fun: Callable
    _api: str = eqx.field(static=True)
    _argnums: int | tuple[int, ...] = eqx.field(static=True)
    _order: Order = eqx.field(static=True)
    _has_aux: bool = eqx.field(static=True)
    _count_ops: bool = eqx.field(static=True)
    _sparse_representation: bool = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self._fun

    def __call__(self, /, *args, **kwargs):
        return _differentiate(
            self._api,
            self._fun,
            args,
            kwargs,
            self._argnums,
            order=self._order,
            has_aux=self._has_aux,
            count_ops=self._count_ops,
            sparse_representation=self._sparse_representation,
            with_value=False,
        )

    def __get__(self, instance, owner):
        del owner
        # Accessed on an instance: bind it as the first (differentiated) argument.
        if instance is None:
            return self
        return eqx.Partial(self, instance)


class _ValueAndJacveWrapper(eqx.Module):
    _fun: Callable
    _order: Order = eqx.field(static=True)
    _has_aux: bool = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self._fun

    def __call__(self, /, *args, **kwargs):
        return _differentiate(
            "filter_value_and_jacve",
            self._fun,
            args,
            kwargs,
            0,
            order=self._order,
            has_aux=self._has_aux,
            count_ops=False,
            sparse_representation=False,
            with_value=True,
        )

    def __get__(self, instance, owner):
        del owner
        if instance is None:
            return self
        return eqx.Partial(self, instance)


@overload
def filter_jacve(
    *,
    order: Order = "auto",
    has_aux: bool = False,
    count_ops: bool = False,
    sparse_representation: bool = False,
) -> Callable[[Callable[_P, Any]], Callable[_P, Any]]: ...


@overload
def filter_jacve(
    fun: Callable[_P, Any],
    has_aux: bool = False,
    *,
    order: Order = "auto",
    count_ops: bool = False,
    sparse_representation: bool = False,
) -> Callable[_P, Any]: ...


@_refuses_argnums("filter_jacve")
def filter_jacve(
    fun: Callable | None = None,
    has_aux: bool = False,
    *,
    order: Order = "auto",
    count_ops: bool = False,
    sparse_representation: bool = False,
) -> Callable:
    """Creates a function that computes the Jacobian of `fun` with respect to every
    floating-point array in its first argument, by vertex elimination.

    This is the filtered counterpart of `graphax_eqx.jacve`, in the way that
    `equinox.filter_jacrev` is the filtered counterpart of `jax.jacrev`. The first
    positional argument may be any PyTree, typically an `equinox.Module`: its
    floating-point JAX and NumPy arrays are differentiated; every other leaf (integer
    arrays, Python scalars, strings, functions, static fields) is held fixed and gets
    `None` in the result. The remaining positional and keyword arguments are passed
    through undifferentiated and may be arbitrary Python objects.

    The Jacobian nests like `equinox.filter_jacrev`'s: the structure of the output of
    `fun` outermost, then the structure of the first argument, with leaves of shape
    `out.shape + leaf.shape`. In particular, when `fun` returns a scalar the result
    has exactly the shape of the first argument, like a gradient from
    `equinox.filter_grad`.

    Can be used directly, `filter_jacve(fun)`, or as a decorator with or without
    arguments, `@filter_jacve` or `@filter_jacve(order="fwd")`. When it decorates a
    method, `self` is the differentiated argument.

    **Arguments:**

    - `fun`: the function to differentiate. Its output must be a PyTree of arrays.
        If it is omitted, the result is a decorator that takes `fun`.
    - `has_aux`: if `True`, `fun` returns a pair `(output, aux)`; only `output` is
        differentiated and `aux` is handed back unchanged. `aux` may be any Python
        object, not only arrays. It may be passed by position, as to
        `equinox.filter_jacrev`.
    - `order`: the vertex elimination order: `"fwd"`, `"rev"`, `"markowitz"`,
        `"auto"` (the cheapest of the three, the default), or an explicit sequence of
        vertex ids. The order changes the cost, never the result (up to rounding).
    - `count_ops`: if `True`, also return the operation counts of the elimination.
    - `sparse_representation`: if `True`, the Jacobian leaves are
        `graphax_eqx.SparseTensor`s or `graphax_eqx.CooTensor`s that keep
        the structure of the Jacobian, instead of dense arrays.

    `argnums` is not accepted: pass several objects as one tuple in the first
    argument instead, or use `graphax_eqx.eqx_jacve`.

    **Returns:**

    A function with the same arguments as `fun`. It returns the Jacobian; or
    `(jacobian, aux)` if `has_aux=True`; and either of these is paired with a dict of
    operation counts, `(result, counts)`, if `count_ops=True`. The counts are Python
    integers under the keys `"num_muls"` and `"num_adds"`, together with the order
    used (`"order"`, `"order_counts"`).

    **Example:**

    ```python
    import equinox as eqx
    import jax.numpy as jnp
    import jax.random as jr
    import graphax_eqx as gx

    model = eqx.nn.MLP(3, 2, width_size=8, depth=2, key=jr.PRNGKey(0))
    x = jnp.ones(3)

    @gx.filter_jacve(order="markowitz")
    def forward(model, x):
        return model(x)

    jac = forward(model, x)
    jac.layers[0].weight.shape  # (2, 8, 3): output shape + weight shape
    jac.activation  # None: not differentiated
    ```

    **Tip:** to differentiate with respect to both a model and its input, pack them:
    `filter_jacve(lambda mx: mx[0](mx[1]))((model, x))`.
    """
    if fun is None:

        def decorator(fun):
            return filter_jacve(
                fun,
                order=order,
                has_aux=has_aux,
                count_ops=count_ops,
                sparse_representation=sparse_representation,
            )

        return decorator
    _check_callable(fun, "filter_jacve")
    if not isinstance(has_aux, bool | np.bool_):
        # `equinox.filter_jacrev(fun, has_aux)` takes it by position too; anything
        # else there (an order) belongs in a keyword.
        raise TypeError(
            "`filter_jacve`'s second argument is `has_aux`, a bool; got "
            f"{has_aux!r}. Pass the other options by keyword, e.g. "
            "`filter_jacve(fun, order='fwd')`."
        )
    wrapper = _JacveWrapper(
        fun,
        "filter_jacve",
        0,
        _normalise_order(order, "filter_jacve"),
        has_aux,
        count_ops,
        sparse_representation,
    )
    return eqx.module_update_wrapper(wrapper)


@overload
def filter_value_and_jacve(
    *, order: Order = "auto", has_aux: Literal[False] = False
) -> Callable[[Callable[_P, Any]], Callable[_P, tuple[Any, PyTree]]]: ...


@overload
def filter_value_and_jacve(
    *, order: Order = "auto", has_aux: Literal[True]
) -> Callable[[Callable[_P, Any]], Callable[_P, tuple[tuple[Any, Any], PyTree]]]: ...


@overload
def filter_value_and_jacve(
    fun: Callable[_P, Any], *, order: Order = "auto", has_aux: Literal[False] = False
) -> Callable[_P, tuple[Any, PyTree]]: ...


@overload
def filter_value_and_jacve(
    fun: Callable[_P, Any], *, order: Order = "auto", has_aux: Literal[True]
) -> Callable[_P, tuple[tuple[Any, Any], PyTree]]: ...


@_refuses_argnums("filter_value_and_jacve")
def filter_value_and_jacve(
    fun: Callable | None = None, *, order: Order = "auto", has_aux: bool = False
) -> Callable:
    """Creates a function that evaluates `fun` and its Jacobian with respect to the
    first argument, in one pass.

    The counterpart of `equinox.filter_value_and_grad`: differentiation is with
    respect to every floating-point JAX or NumPy array in the first positional
    argument, all other leaves get `None`, and the other arguments are passed through
    undifferentiated. The Jacobian is laid out as in `graphax_eqx.filter_jacve`;
    for a scalar loss it is a gradient shaped like the model, ready for `optax`.

    Works as `filter_value_and_jacve(fun)`, `@filter_value_and_jacve` and
    `@filter_value_and_jacve(order=...)`, and on methods.

    **Arguments:**

    - `fun`: the function to evaluate and differentiate. Its output must be a PyTree
        of arrays. If it is omitted, the result is a decorator that takes `fun`.
    - `order`: the vertex elimination order, as in `graphax_eqx.filter_jacve`.
    - `has_aux`: if `True`, `fun` returns a pair `(output, aux)`; `aux` may be any
        Python object and is returned unchanged.

    `argnums` is not accepted: pack several objects into a tuple in the first
    argument instead.

    **Returns:**

    A function with the same arguments as `fun`, returning `(value, jacobian)`, or
    `((value, aux), jacobian)` if `has_aux=True`.

    **Example:**

    ```python
    import equinox as eqx
    import jax.numpy as jnp
    import jax.random as jr
    import optax
    import graphax_eqx as gx

    model = eqx.nn.MLP(2, 1, width_size=16, depth=2, key=jr.PRNGKey(0))
    optim = optax.adam(1e-2)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        def loss(model, x, y):
            pred = eqx.filter_vmap(model)(x)
            return jnp.mean((pred - y) ** 2)

        value, grads = gx.filter_value_and_jacve(loss)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, value
    ```
    """
    if fun is None:

        def decorator(fun):
            return filter_value_and_jacve(fun, order=order, has_aux=has_aux)

        return decorator
    _check_callable(fun, "filter_value_and_jacve")
    wrapper = _ValueAndJacveWrapper(
        fun, _normalise_order(order, "filter_value_and_jacve"), has_aux
    )
    return eqx.module_update_wrapper(wrapper)


def eqx_jacve(
    fun: Callable[_P, Any],
    order: Order = "auto",
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    count_ops: bool = False,
    sparse_representation: bool = False,
) -> Callable[_P, Any]:
    """Like `graphax_eqx.jacve`, but each differentiated argument may be any
    PyTree, such as an `equinox.Module`.

    Every argument selected by `argnums` is split into its floating-point array
    leaves, which are differentiated, and everything else, which is held fixed and
    gets `None` in the result. The Jacobian nests as `jax.jacrev(fun, argnums)` would
    nest it: output structure outermost, then a tuple over `argnums` if `argnums` is
    a sequence, then the structure of each argument, with leaves of shape
    `out.shape + leaf.shape`. Arguments not in `argnums`, and keyword arguments, are
    passed through undifferentiated and may be arbitrary Python objects.

    **Arguments:**

    - `fun`: the function to differentiate. Its output must be a PyTree of arrays.
    - `order`: the vertex elimination order, as in `graphax_eqx.jacve`.
    - `argnums`: an integer or a sequence of integers: which positional arguments to
        differentiate.
    - `has_aux`: if `True`, `fun` returns a pair `(output, aux)`; `aux` may be any
        Python object and is returned unchanged.
    - `count_ops`: if `True`, also return the operation counts of the elimination.
    - `sparse_representation`: if `True`, the Jacobian leaves are
        `graphax_eqx.SparseTensor`s or `graphax_eqx.CooTensor`s instead of
        dense arrays.

    **Returns:**

    A function with the same arguments as `fun`, returning the Jacobian; or
    `(jacobian, aux)` if `has_aux=True`; paired with the operation counts,
    `(result, counts)`, if `count_ops=True`.

    **Example:**

    ```python
    import equinox as eqx
    import jax.numpy as jnp
    import jax.random as jr
    import graphax_eqx as gx

    linear = eqx.nn.Linear(3, 2, key=jr.PRNGKey(0))
    x = jnp.ones(3)

    def f(linear, x):
        return jnp.tanh(linear(x))

    d_linear, d_x = gx.eqx_jacve(f, argnums=(0, 1))(linear, x)
    d_linear.weight.shape  # (2, 2, 3)
    d_x.shape  # (2, 3)
    ```
    """
    _check_callable(fun, "eqx_jacve")
    flat_nums, as_tuple = _normalise_argnums(argnums, "eqx_jacve")
    nums: int | tuple[int, ...] = flat_nums if as_tuple else flat_nums[0]
    wrapper = _JacveWrapper(
        fun,
        "eqx_jacve",
        nums,
        _normalise_order(order, "eqx_jacve"),
        has_aux,
        count_ops,
        sparse_representation,
    )
    return eqx.module_update_wrapper(wrapper)
