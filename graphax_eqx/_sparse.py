"""Structured partial Jacobians and their algebra.

A partial Jacobian `∂v/∂u` has shape `v.shape + u.shape`. Most of those entries are
structurally zero or repeated, so a `graphax_eqx.SparseTensor` stores only a value
array plus one *label* per axis of the full Jacobian:

- two axes (one of `v`, one of `u`) that share a label are *tied*: the Jacobian is zero
  off their diagonal (a Kronecker delta joins them);
- a label listed in `val_labels` indexes an axis of the value array; a label that is
  not listed is constant along its axes (a pure delta when tied, a broadcast when not).

With that representation, the chain rule is one `jnp.einsum` whose subscripts are the
labels, and a tied pair meeting a dense axis simply relabels it.

Index-moving linear maps whose Jacobian is not a tie pattern (reshape, slice, gather,
convolution, ...) are kept as a `graphax_eqx._sparse.LinearMap`: a function and its
transpose, applied to neighbouring partials instead of being materialised.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import string
from collections.abc import Callable, Hashable, Sequence
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import sparse as jsparse
from jaxtyping import Array

from . import _jax_private as jp


#
# Thin helpers on `lax` primitives: this code runs once per product at trace time, and
# the jitted `jnp` wrappers cost far more to trace than the primitives they emit.
#


def _cast(x: Array, dtype) -> Array:
    dtype = jnp.dtype(dtype)
    return x if x.dtype == dtype else lax.convert_element_type(x, dtype)


def _transpose(x: Array, perm) -> Array:
    perm = tuple(perm)
    return x if perm == tuple(range(x.ndim)) else lax.transpose(x, perm)


def _eye_mask(shape, i1: int, i2: int) -> Array:
    """A boolean array of `shape` that is true where axes `i1` and `i2` agree."""
    return lax.eq(
        lax.broadcasted_iota(np.int32, tuple(shape), i1),
        lax.broadcasted_iota(np.int32, tuple(shape), i2),
    )


def _sum_axes(x: Array, axes) -> Array:
    axes, shape = tuple(axes), tuple(x.shape)
    # Axes of size 1 hold one term each: dropped by a reshape, not reduced.
    ones = [a for a in axes if shape[a] == 1]
    axes = tuple(a for a in axes if shape[a] != 1)
    if ones:
        kept = [a for a in range(len(shape)) if a not in ones]
        x = lax.reshape(x, tuple(shape[a] for a in kept))
        axes = tuple(kept.index(a) for a in axes)
    if not axes:
        return x
    return lax.reduce(x, np.array(0, x.dtype), lax.add, axes)


def einsum2(a: Array, sa: str, b: Array, sb: str, so: str, dtype) -> Array:
    """`einsum(f"{sa},{sb}->{so}", a, b)` as one `dot_general` (plus sums/transpose)."""
    a = _sum_axes(a, [i for i, c in enumerate(sa) if c not in so and c not in sb])
    sa = "".join(c for c in sa if c in so or c in sb)
    b = _sum_axes(b, [i for i, c in enumerate(sb) if c not in so and c not in sa])
    sb = "".join(c for c in sb if c in so or c in sa)
    batch = [c for c in sa if c in sb and c in so]
    contract = [c for c in sa if c in sb and c not in so]
    dims = (
        (tuple(sa.index(c) for c in contract), tuple(sb.index(c) for c in contract)),
        (tuple(sa.index(c) for c in batch), tuple(sb.index(c) for c in batch)),
    )
    out = lax.dot_general(a, b, dims, preferred_element_type=dtype)
    order = batch + [c for c in sa if c not in sb] + [c for c in sb if c not in sa]
    return _transpose(out, [order.index(c) for c in so])


def einsum1(a: Array, sa: str, so: str) -> Array:
    a = _sum_axes(a, [i for i, c in enumerate(sa) if c not in so])
    sa = "".join(c for c in sa if c in so)
    return _transpose(a, [sa.index(c) for c in so])


#
# Patterns: the static part of a partial.
#


@dataclasses.dataclass(frozen=True)
class Pattern:
    """The static structure of a `graphax_eqx.SparseTensor`.

    `labels` has one entry per axis of the full Jacobian (output axes first). Labels
    are canonical: numbered `0, 1, ...` in order of first appearance, so two partials
    with the same structure have equal patterns. `val_labels` is ascending and lists
    the labels that index the value array, in the value array's axis order.
    """

    out_shape: tuple[int, ...]
    in_shape: tuple[int, ...]
    labels: tuple[int, ...]
    val_labels: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.out_shape + self.in_shape

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        sizes = [0] * self.num_labels
        for label, size in zip(self.labels, self.shape, strict=True):
            sizes[label] = size
        return tuple(sizes)

    @property
    def num_labels(self) -> int:
        return max(self.labels, default=-1) + 1

    @property
    def val_shape(self) -> tuple[int, ...]:
        return tuple(self.sizes[label] for label in self.val_labels)

    @property
    def val_size(self) -> int:
        return math.prod(self.val_shape)

    def is_diagonal_on_in(self) -> bool:
        """Whether every input axis is tied to an output axis."""
        out_labels = set(self.labels[: len(self.out_shape)])
        return all(label in out_labels for label in self.labels[len(self.out_shape) :])

    def is_diagonal_on_out(self) -> bool:
        """Whether every output axis is tied to an input axis."""
        in_labels = set(self.labels[len(self.out_shape) :])
        return all(label in in_labels for label in self.labels[: len(self.out_shape)])


def make_pattern(
    out_shape: tuple[int, ...],
    in_shape: tuple[int, ...],
    labels: tuple,
    val_labels: tuple,
) -> tuple[Pattern, tuple[int, ...]]:
    """Canonicalise arbitrary labels.

    Returns the canonical pattern and the permutation that takes a value array whose
    axes are labelled `val_labels` (in that order) to the canonical value order.
    """
    out_shape = tuple(int(s) for s in out_shape)
    in_shape = tuple(int(s) for s in in_shape)
    assert len(labels) == len(out_shape) + len(in_shape)
    relabel: dict[Any, int] = {}
    for label in labels:
        relabel.setdefault(label, len(relabel))
    canon = tuple(relabel[label] for label in labels)
    nout = len(out_shape)
    for label in set(canon):
        axes = [k for k, c in enumerate(canon) if c == label]
        assert len(axes) <= 2, "a label joins at most two axes"
        if len(axes) == 2:
            k1, k2 = axes
            assert k1 < nout <= k2, "ties join an output axis to an input axis"
            assert (out_shape + in_shape)[k1] == (out_shape + in_shape)[k2]
    canon_val = [relabel[label] for label in val_labels]
    assert len(set(canon_val)) == len(canon_val)
    perm = tuple(int(i) for i in np.argsort(canon_val, kind="stable"))
    pattern = Pattern(out_shape, in_shape, canon, tuple(sorted(canon_val)))
    return pattern, perm


def dense_pattern(out_shape: tuple[int, ...], in_shape: tuple[int, ...]) -> Pattern:
    n = len(out_shape) + len(in_shape)
    return Pattern(tuple(out_shape), tuple(in_shape), tuple(range(n)), tuple(range(n)))


#
# SparseTensor
#


_LETTERS = string.ascii_letters


class BlockShape:
    """Shape accessors shared by the structured Jacobian blocks (via `pattern`)."""

    pattern: Any

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the full Jacobian, `out_shape + in_shape`."""
        return self.pattern.shape

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.pattern.out_shape

    @property
    def in_shape(self) -> tuple[int, ...]:
        return self.pattern.in_shape

    @property
    def ndim(self) -> int:
        return len(self.shape)


def vmapped_axes(val: Array | None, shape: tuple[int, ...]) -> int:
    """How many leading axes `jax.vmap` added to a result's value array of `shape`
    (0 when it was not vmapped, or stores no values).

    The mapped axes must lead, as `jax.vmap`'s default `out_axes=0` puts them: a
    value array whose trailing axes are not `shape` had them put elsewhere."""
    if val is None:
        return 0
    batch = max(0, jnp.ndim(val) - len(shape))
    if batch and tuple(jnp.shape(val)[batch:]) != tuple(shape):
        raise ValueError(
            f"This structured Jacobian block stores values of shape {tuple(shape)} "
            f"per batch element, but its value array has shape {jnp.shape(val)}: "
            "`jax.vmap` put the mapped axes elsewhere than in front (`out_axes` other "
            "than 0). Map sparse results with `out_axes=0`, then move the axes of "
            "`.dense()` (`jnp.moveaxis`)."
        )
    return batch


# A dense result at least this many times larger than its stored values has them
# computed once before they are spread (`SparseTensor.dense`).
SPREAD = 8


def weak_as(val: Array | None, out: Array) -> Any:
    """`out`, weakly typed where the stored values `val` are: the Jacobian with
    respect to a Python scalar is weak, as `jax.jacrev` gives it."""
    if val is not None and getattr(jax.typeof(val), "weak_type", False):
        return jp.as_weak_type(out)
    return out


def batched_dense(block, batch: int) -> Array:
    """`block.dense()` of a result vmapped over `batch` leading axes."""
    fn = type(block)._dense_ops
    for _ in range(batch):
        fn = jax.vmap(fn)
    return fn(block)


def without_tangent_mask(block):
    """`block` without its mask where the mask is a tangent's placeholder: a result
    differentiated by `jax.jvp` or `jax.linearize` has a tangent with the result's
    structure, whose boolean mask becomes an array of dtype `float0`. The tangent's
    values are exactly zero where the result's mask holds (they are the derivatives
    of values selected to zero there), so it needs no mask to be read."""
    mask = block.mask
    if mask is not None and jnp.dtype(mask.dtype) == jax.dtypes.float0:
        return dataclasses.replace(block, mask=None)
    return block


def eager_compiled(fn: Callable, block) -> Any:
    """`fn(block)`, as one compiled program where the block's arrays are known now
    (an eager result). Run operation by operation, the writes that make a dense array
    or a BCOO's entries from a structured block compile one small program each, which
    took seconds on a first call. Under a trace, the operations join the traced
    program instead. `fn` is defined once, in a module or a class (the programs are
    cached per function and block structure)."""
    if all(jp.is_concrete(leaf) for leaf in jax.tree.leaves(block)):
        return _compiled_call(fn, block)
    return fn(block)


@functools.partial(jax.jit, static_argnums=0)
def _compiled_call(fn: Callable, block) -> Any:
    return fn(block)


def batched_bcoo(block, batch: int) -> jsparse.BCOO:
    """`block.to_bcoo()` of a result vmapped over `batch` leading axes: a BCOO with
    `batch` batch dimensions, its indices the same in every batch element."""
    lead = tuple(jax.tree.leaves(block)[0].shape[:batch])
    size = math.prod(lead)  # not `-1`: a block may store no entries
    flat = jax.tree.map(lambda x: x.reshape((size,) + x.shape[batch:]), block)
    first = type(block).to_bcoo(jax.tree.map(lambda x: x[0], flat))
    data = jax.vmap(lambda b: type(b).to_bcoo(b).data)(flat)
    data = data.reshape(lead + data.shape[1:])
    indices = jnp.broadcast_to(first.indices, lead + first.indices.shape)
    return jsparse.BCOO((data, indices), shape=lead + tuple(first.shape))


class SparseTensor(BlockShape, eqx.Module):
    """A structured (sparse) Jacobian block of shape `out_shape + in_shape`.

    Returned by `graphax_eqx.jacve` with `sparse_representation=True`. It is a
    pytree whose only child is the value array, so it passes through `jax.jit`,
    `jax.vmap` and `eqx.filter_jit`.

    Under `jax.vmap` the value array (and mask) gain the mapped axes in front, and
    `.dense()` and `.to_bcoo()` (a BCOO with as many batch dimensions) return them,
    as `jax.vmap(jax.jacfwd(f))` would. (A result always stores its values, a
    scalar one for an identity, so that every leaf gains the mapped axes.)

    Each axis of the full Jacobian carries a label. Axes that share a label are tied by
    a Kronecker delta; labels listed in `pattern.val_labels` index the value array;
    other labels are constant (a pure delta when tied, a broadcast otherwise). The repr
    shows the pattern, e.g. `SparseTensor(f32[3 | 3], out=(a), in=(a), val[a])` is a
    diagonal matrix storing its 3 diagonal entries.

    **Attributes:**

    - `val`: the value array, or `None` when every stored entry is exactly one.
        (While a Jacobian is computed, the index maps of a vectorised batch hold
        NumPy arrays here, known when the program is traced; results never do.)
    - `pattern`: the static `graphax_eqx._sparse.Pattern`.
    - `dtype`: the dtype of the Jacobian.
    - `mask`: `None`, or a boolean array marking *selected-away* entries: zeros
        that come from a selection (`jnp.where`, a custom rule that ignores its
        tangent), not from a multiplication. A product with such an entry is exactly
        zero even when the other factor is infinite or NaN, as in JAX, where the
        selection discards the other branch's derivative. It has the axes of `val`,
        each either of `val`'s size or of size one (where it does not vary), and
        products carry it on: an entry of a product is selected away when every
        term that makes it is. Stored values are zero where it is true.
    - `layout`: on a mesh with explicit axes, the `PartitionSpec` of the dense
        block (`jax.jacrev`'s), which `.dense()` gives it; else `None`.
    """

    val: Array | None
    pattern: Pattern = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    mask: Array | None = None
    layout: Any = eqx.field(static=True, default=None)

    def dense(self) -> Array:
        """The Jacobian as a dense array of shape `out_shape + in_shape` (with the
        leading axes `jax.vmap` added, if any)."""
        block = without_tangent_mask(self)
        return eager_compiled(type(block)._dense_ops, block)

    def _dense_ops(self) -> Array:
        """`dense`, as the operations that compute it (not compiled apart)."""
        p = self.pattern
        batch = vmapped_axes(self.val, p.val_shape)
        if batch:
            return batched_dense(self, batch)
        out = weak_as(self.val, self._dense_values())
        return jp.laid_out(out, self.layout, self.val)

    def _dense_values(self) -> Array:
        p = self.pattern
        target = dense_pattern(p.out_shape, p.in_shape)
        st = self
        if st.val is not None and target.val_size >= SPREAD * st.val.size:
            # Spread over many more entries, the values are written once first: XLA
            # would otherwise fuse their computation into the kernel that writes
            # the dense array and redo it at every entry, zeros included.
            st = dataclasses.replace(st, val=jp.compute_once(st.val))
        return refine(st, target).val  # pyright: ignore

    def todense(self) -> Array:
        """Alias of `graphax_eqx.SparseTensor.dense`."""
        return self.dense()

    @property
    def nse(self) -> int:
        """The number of entries `to_bcoo` stores: one per combination of the
        distinct labels."""
        return math.prod(self.pattern.sizes)

    def to_bcoo(self) -> jsparse.BCOO:
        """The Jacobian as a `jax.experimental.sparse.BCOO` matrix.

        Only the structurally nonzero entries are stored: one per combination of the
        distinct labels.
        """
        block = without_tangent_mask(self)
        p = block.pattern
        batch = vmapped_axes(block.val, p.val_shape)
        if batch:
            return batched_bcoo(block, batch)
        sizes = p.sizes
        grids = np.indices(sizes, dtype=np.int32).reshape(len(sizes), math.prod(sizes))
        if p.labels:
            indices = np.stack([grids[label] for label in p.labels], axis=-1)
        else:  # a scalar block: one entry, no coordinates
            indices = np.zeros((1, 0), np.int32)
        data = eager_compiled(_bcoo_data, block)
        return jsparse.BCOO((data, jnp.asarray(indices)), shape=p.shape)

    def __repr__(self) -> str:
        return _pattern_repr(self.pattern, self.dtype, _scalar_text(self.val))


def _bcoo_data(st: SparseTensor) -> Array:
    """The entries `SparseTensor.to_bcoo` stores, in its order."""
    return _broadcast_val(st, tuple(range(st.pattern.num_labels))).reshape(-1)


def _scalar_text(val) -> str | None:
    """A constant value as text: its number when concrete, empty under a trace."""
    if val is None:
        return None
    if not isinstance(val, (jax.Array, np.ndarray, np.generic, int, float)):
        return type(val).__name__  # leaves replaced by `jax.tree.map`, say
    if jnp.ndim(val) != 0:
        return "array"
    try:
        return f"{float(val):g}"
    except (TypeError, jax.errors.ConcretizationTypeError):
        return ""


def _dtype_str(dtype) -> str:
    name = jnp.dtype(dtype).name
    return {
        "float32": "f32",
        "float64": "f64",
        "float16": "f16",
        "bfloat16": "bf16",
    }.get(name, name)


def _pattern_repr(p: Pattern, dtype, scalar: Any = None) -> str:
    """The pattern as text; `scalar` is the constant value of a pattern that carries
    no label (`None` when every stored entry is exactly one)."""

    def letter(label):
        return _LETTERS[label % len(_LETTERS)]

    nout = len(p.out_shape)
    shape = " ".join(map(str, p.out_shape)) + " | " + " ".join(map(str, p.in_shape))
    out = " ".join(letter(label) for label in p.labels[:nout])
    inn = " ".join(letter(label) for label in p.labels[nout:])
    if p.val_labels:
        val = "val[" + " ".join(letter(label) for label in p.val_labels) + "]"
    elif scalar is None:
        val = "val=1"
    else:
        val = f"val=c ({scalar})" if scalar else "val=c"
    notes = []
    for label in range(p.num_labels):
        axes = [k for k, c in enumerate(p.labels) if c == label]
        carried = label in p.val_labels
        if len(axes) == 2:
            kind = "identity" if scalar is None or p.val_labels else "c·identity"
            notes.append(f"{letter(label)}: {'diagonal' if carried else kind}")
        elif not carried:
            notes.append(f"{letter(label)}: broadcast")
    note = ("; " + ", ".join(notes)) if notes else ""
    return (
        f"SparseTensor({_dtype_str(dtype)}[{shape.strip()}], out=({out}), "
        f"in=({inn}), {val}{note})"
    )


def from_labeled(
    val: Array | None,
    val_labels: Sequence[Hashable],
    out_shape: tuple[int, ...],
    in_shape: tuple[int, ...],
    labels: Sequence[Hashable],
    dtype=None,
) -> SparseTensor:
    """Build a `graphax_eqx.SparseTensor` from arbitrary (hashable) labels.

    `val`'s axes are labelled by `val_labels` in order; the result is canonical.
    """
    pattern, perm = make_pattern(out_shape, in_shape, tuple(labels), tuple(val_labels))
    if val is not None:
        dtype = val.dtype if dtype is None else dtype
        val = _cast(jnp.asarray(val), dtype)
        assert val.ndim == len(val_labels), (val.shape, val_labels)
        val = _transpose(val, perm)
        assert val.shape == pattern.val_shape, (val.shape, pattern)
    assert dtype is not None
    return SparseTensor(val, pattern, jnp.dtype(dtype))


def with_mask(st: SparseTensor, mask: Array | None) -> SparseTensor:
    """`st` whose entries are selected away where `mask` is true (see `mask`)."""
    if mask is None or st.val is None:
        return st
    assert tuple(jnp.shape(mask)) == tuple(st.val.shape), (jnp.shape(mask), st)
    mask = jnp.asarray(mask, bool)
    val = lax.select(mask, lax.full_like(st.val, 0), st.val)
    return SparseTensor(val, st.pattern, st.dtype, mask)


def full_mask(x) -> Array | None:
    """The mask of a partial broadcast to the shape of its value array."""
    if x.mask is None or tuple(x.mask.shape) == tuple(x.val.shape):
        return x.mask
    return jnp.broadcast_to(x.mask, x.val.shape)


def diagonal(val: Array | None, shape: tuple[int, ...], dtype=None) -> SparseTensor:
    """An elementwise partial: every output axis tied to the same input axis.

    `val` has shape `shape` (a varying diagonal), `()` (a constant times identity) or is
    `None` (the identity).
    """
    n = len(shape)
    labels = tuple(range(n)) * 2
    if val is None or jnp.ndim(val) == 0:
        return from_labeled(val, (), shape, shape, labels, dtype)
    return from_labeled(val, tuple(range(n)), shape, shape, labels, dtype)


def dense(val: Array, out_shape: tuple[int, ...], in_shape: tuple[int, ...]):
    """A partial stored densely, `val.shape == out_shape + in_shape`."""
    p = dense_pattern(tuple(out_shape), tuple(in_shape))
    assert tuple(val.shape) == p.shape, (val.shape, p.shape)
    return SparseTensor(val, p, jnp.dtype(val.dtype))


#
# LinearMap: a partial that is applied, not stored.
#


@dataclasses.dataclass(frozen=True)
class LinearPattern:
    """Static description of a `graphax_eqx._sparse.LinearMap`."""

    out_shape: tuple[int, ...]
    in_shape: tuple[int, ...]
    muls: int  # multiplications per application to one vector
    size: int = 1  # primitive applications when the composed function is unfolded

    @property
    def shape(self):
        return self.out_shape + self.in_shape


# A linear map this small is cheaper stored than applied.
_MATERIALISE_ENTRIES = 256
# Composed linear maps re-run shared pieces; beyond this many pieces, store instead.
_MAX_UNFOLDED = 16


def should_materialise(p: LinearPattern) -> bool:
    entries = math.prod(p.in_shape) * math.prod(p.out_shape)
    return entries <= _MATERIALISE_ENTRIES or p.size > _MAX_UNFOLDED


@dataclasses.dataclass(frozen=True, eq=False)
class LinearMap:
    """A partial Jacobian given as a linear function and its transpose.

    `fn` maps an array of `in_shape` to one of `out_shape`; `tfn` is its transpose.
    Used for index-moving primitives (reshape, slice, gather, pad, ...) and
    convolutions, whose Jacobians are large but cheap to apply.

    `probe` (and its transpose `tprobe`), where given, is a cheaper function with
    `fn`'s structure: NaN in its result wherever some NaN of its argument reaches
    through an entry the map stores, whatever that entry's value (see
    `_apply_masked`). Elsewhere `fn` itself serves.
    """

    fn: Callable[[Array], Array]
    tfn: Callable[[Array], Array]
    pattern: LinearPattern
    dtype: Any
    # `(group, slot)`: `fn` (or `tfn`) is output `slot` of a `SharedApply`, which
    # computes its sibling maps' outputs in the same pass.
    shared_fn: tuple[SharedApply, int] | None = None
    shared_tfn: tuple[SharedApply, int] | None = None
    probe: Callable[[Array], Array] | None = None
    tprobe: Callable[[Array], Array] | None = None

    @property
    def shape(self):
        return self.pattern.shape

    @property
    def out_shape(self):
        return self.pattern.out_shape

    @property
    def in_shape(self):
        return self.pattern.in_shape


class SharedApply:
    """Several linear maps computed by one function: the partials of one primitive
    from one of its inputs to all of its outputs (or their transposes, from one
    output to all inputs), whose maps share one pass (a linearised loop run once for
    every output). `fn(x)` gives every map's output as a tuple.

    Applied to the same array several times (as the products of one vertex's
    elimination apply each sibling to the same neighbour), `fn` runs once and each
    map takes its own output.
    """

    def __init__(self, fn: Callable[[Array], tuple[Array, ...]]):
        self.fn = fn
        self._seen: list[tuple[tuple, tuple[Array, ...]]] = []
        self._derived: list[tuple[str, Any, SharedApply]] = []

    def then(self, tag: str, other: Any, make: Callable[[], Callable]) -> SharedApply:
        """The group of these maps each composed with `other` the same way (`tag`),
        made once: siblings composed with one neighbour stay siblings."""
        for seen_tag, seen, group in self._derived:
            if seen_tag == tag and seen is other:
                return group
        group = SharedApply(make())
        self._derived.append((tag, other, group))
        return group

    def apply(self, how: Callable, x: Array, n: int, slot: int, key: tuple) -> Array:
        """`how(self.fn, x, n=n)[slot]`, computed once per `(how, n, key)`: `key`
        names `x` (the partial it was read from, how, and which of its arrays), as
        the same partial met twice is read into distinct but equal arrays."""
        for seen, outs in self._seen:
            if _same_key(seen, (how, n) + key):
                return outs[slot]
        outs = how(self.fn, x, n=n)
        self._seen.append(((how, n) + key, outs))
        return outs[slot]


def _same_key(a: tuple, b: tuple) -> bool:
    """Keys are equal: objects compared by identity, patterns and names by value."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        same = x == y if isinstance(x, (str, int, Pattern)) else x is y
        if not same:
            return False
    return True


def linear_map(
    fn: Callable[[Array], Array],
    in_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    dtype,
    tfn: Callable[[Array], Array] | None = None,
    muls: int = 0,
    probe: Callable[[Array], Array] | None = None,
) -> LinearMap:
    """Wrap a linear function as a partial; JAX derives its transpose if not given.
    `probe`: see [`graphax_eqx._sparse.LinearMap`][] (its transpose is derived)."""
    in_shape = tuple(int(s) for s in in_shape)
    out_shape = tuple(int(s) for s in out_shape)

    def derived(f: Callable[[Array], Array]) -> Callable[[Array], Array]:
        # Derived where it is used (in that trace): transposing traces `f`, and
        # whatever in it does not depend on its input (a loop map's zero tangents)
        # would be emitted into the program even when the transpose is never used.
        out_dtype = []  # `f`'s output dtype, found on first use

        def transposed(ct: Array) -> Array:
            like = jax.ShapeDtypeStruct(in_shape, dtype)
            # A product carries the dtype it was computed in: float32 where a
            # bfloat16 value met a partial of a float32 sum, say. The cotangent
            # enters in `f`'s output dtype, as JAX's own transpose would carry it.
            if not out_dtype:
                out_dtype.append(jax.eval_shape(f, like).dtype)
            expected = out_dtype[0]
            if ct.dtype != expected:
                ct = lax.convert_element_type(ct, expected)
            (out,) = jax.linear_transpose(f, like)(ct)
            return out

        return transposed

    if tfn is None:
        tfn = derived(fn)
    pattern = LinearPattern(out_shape, in_shape, int(muls))
    tprobe = None if probe is None else derived(probe)
    return LinearMap(fn, tfn, pattern, dtype, probe=probe, tprobe=tprobe)


Partial = Any  # SparseTensor | LinearMap | _indexed.CooTensor
AnyPattern = Any  # Pattern | LinearPattern | _indexed.CooPattern


#
# Refinement: rewrite a partial into a less structured pattern.
#


def _label_map(src: Pattern, target: Pattern) -> dict[int, list[int]]:
    """For each source label, the target labels on the same axes (1 or 2 of them)."""
    mapping: dict[int, list[int]] = {}
    for s, t in zip(src.labels, target.labels, strict=True):
        ts = mapping.setdefault(s, [])
        if t not in ts:
            ts.append(t)
    return mapping


def _broadcast_val(st: SparseTensor, target_val_labels: tuple[int, ...], target=None):
    """The value array of `st` laid out over `target_val_labels` of `target`.

    Missing axes are broadcast, and ties of `st` that `target` separates are
    materialised with a diagonal mask (a select, no multiplications).
    """
    p = st.pattern
    target = p if target is None else target
    mapping = _label_map(p, target)
    tsizes = target.sizes
    val = np.ones((), st.dtype) if st.val is None else st.val
    if is_known(val):
        # The same layout of a block known now, computed now (see `known`).
        plain = SparseTensor(cast(Array, np.asarray(val)), p, st.dtype)
        with jax.ensure_compile_time_eval():
            out = _broadcast_val(plain, target_val_labels, target)
        return known(np.asarray(out))
    # Each carried source label goes to the last target label on its axes: for a tie
    # being separated, its input axis. Either is exact; on sharded inputs this lets the
    # partitioner lay dense blocks out as `jax.jacrev`'s (input axes sharded).
    primary = [mapping[label][-1] for label in p.val_labels]
    assert all(t in target_val_labels for t in primary), (p, target, target_val_labels)
    order = sorted(
        range(len(primary)), key=lambda i: target_val_labels.index(primary[i])
    )
    val = _transpose(jnp.asarray(val), order)
    full_shape = tuple(tsizes[t] for t in target_val_labels)
    if tuple(val.shape) != full_shape:
        positions = tuple(sorted(target_val_labels.index(t) for t in primary))
        val = lax.broadcast_in_dim(val, full_shape, positions)
    for ts in mapping.values():
        if len(ts) == 2:
            t1, t2 = ts
            assert t1 in target_val_labels and t2 in target_val_labels
            i1, i2 = target_val_labels.index(t1), target_val_labels.index(t2)
            mask = _eye_mask(full_shape, i1, i2)
            val = lax.select(mask, val, lax.full_like(val, 0))
    return val


class _Known(np.ndarray):
    """A block known when the program is traced: an index map of a vectorised batch
    (see `_indexed._densified`), or a product or sum of such blocks. Only these are
    applied by selection (`_select_contraction`); other NumPy values are not."""


def known(x: np.ndarray) -> Array:
    """`x` marked as a known block, typed as the array it stands for: `lax` and
    `jnp` operations take it as one."""
    return cast(Array, np.asarray(x).view(_Known))


def is_known(x) -> bool:
    """Whether `x` is a known block (see `known`)."""
    return isinstance(x, _Known)


def _selects(e) -> bool:
    return isinstance(e, SparseTensor) and is_known(e.val)


def _traced_block(e) -> bool:
    # Known blocks, and other NumPy values, are not computed by the program.
    return (
        isinstance(e, SparseTensor)
        and e.val is not None
        and not isinstance(e.val, np.ndarray)
    )


def compute_selected_once(ins: dict, outs: dict) -> None:
    """Before a vertex is eliminated: every traced block (an accumulated tangent or
    cotangent) that two or more known blocks select from is computed once (see
    `_jax_private.compute_once`). Such a block is a state vector's derivative read
    back component by component (`x[:, i]` of a stacked `(B, n)` state, step after
    step). Its selections are cheap slices, so XLA CPU fuses the block's whole
    computation into each of them: one more copy per component, compounding over
    the steps of an integrator (two RK4 steps of a double pendulum ran 20x slower
    in forward mode and 3x slower in reverse mode than with the block written
    once). Updates `ins` and `outs` in place."""
    for near, far in ((ins, outs), (outs, ins)):
        if sum(_selects(e) for e in far.values()) < 2:
            continue
        for k, e in near.items():
            if _traced_block(e):
                near[k] = dataclasses.replace(e, val=jp.compute_once(e.val))


def refine(st: SparseTensor, target: Pattern) -> SparseTensor:
    """Rewrite `st` in `target`, a pattern with fewer ties / more carried labels."""
    if st.pattern == target and st.val is not None:
        return st
    val = _broadcast_val(st, target.val_labels, target)
    return SparseTensor(val, target, st.dtype)


def _untie_pattern(p: Pattern, side: str) -> Pattern:
    """`p` with every axis of one side (`"out"` or `"in"`) separately labelled and
    carried; axes of the other side that were tied to them become dense too."""
    nout = len(p.out_shape)
    untie = range(nout) if side == "out" else range(nout, len(p.labels))
    freed = {p.labels[k] for k in untie}
    labels, val_labels = [], set()
    for k, label in enumerate(p.labels):
        if label in freed:
            labels.append(("own", k))
            val_labels.add(("own", k))
        else:
            labels.append(("old", label))
            if label in p.val_labels:
                val_labels.add(("old", label))
    relabel: dict[Any, int] = {}
    for label in labels:
        relabel.setdefault(label, len(relabel))
    canon = tuple(relabel[label] for label in labels)
    canon_val = tuple(sorted(relabel[label] for label in val_labels))
    return Pattern(p.out_shape, p.in_shape, canon, canon_val)


#
# Products (the chain rule).
#


# A contraction of at least this many multiplications runs as a matrix product at
# several times the rate of a broadcast product (see `_orders.CONTRACTION_SPEEDUP`);
# smaller ones (a scalar program's 4 × 4 blocks, batched by `vmap`) are dominated by
# their overheads, as broadcast products are.
MIN_CONTRACTED_MULS = 1 << 16


@dataclasses.dataclass(frozen=True)
class _ProductPlan:
    pattern: AnyPattern
    kind: str
    muls: int
    a_sub: str = ""
    b_sub: str = ""
    out_sub: str = ""
    factor: int = 1
    refined: Pattern | None = None
    materialise: bool = False
    lazy: LinearPattern | None = None  # the linear map's pattern, before settling
    # Multiplications beyond one per result entry of an einsum that contracts, if it
    # is large enough to run as an efficient matrix product (`MIN_CONTRACTED_MULS`).
    contracted: int = 0


def _settle(plan: _ProductPlan) -> _ProductPlan:
    """Store a composed linear map instead of keeping it lazy, when that is better."""
    p = plan.pattern
    if isinstance(p, LinearPattern) and not should_materialise(p):
        return dataclasses.replace(plan, lazy=p)
    if isinstance(p, LinearPattern):
        return dataclasses.replace(
            plan,
            lazy=p,
            pattern=dense_pattern(p.out_shape, p.in_shape),
            muls=plan.muls + materialise_muls(p),
            materialise=True,
        )
    return plan


@functools.lru_cache(maxsize=65536)
def _coordinates(p: AnyPattern) -> bool:
    """Whether `p` is a static sparse pattern (coordinates or a band)."""
    from ._band import BandPattern

    return isinstance(p, (_indexed.CooPattern, BandPattern))


def product_plan(pa: AnyPattern, pb: AnyPattern, a_val: bool, b_val: bool):
    """Plan `A · B` for `A: w ← v`, `B: v ← u` from their patterns alone."""
    assert pa.in_shape == pb.out_shape, (pa, pb)
    if _coordinates(pa) or _coordinates(pb):
        return _indexed.mixed_product_plan(pa, pb, a_val, b_val)
    if isinstance(pa, LinearPattern) and isinstance(pb, LinearPattern):
        p = LinearPattern(
            pa.out_shape, pb.in_shape, pa.muls + pb.muls, pa.size + pb.size
        )
        return _settle(_ProductPlan(p, "linear-linear", 0))
    if isinstance(pa, LinearPattern):
        assert isinstance(pb, Pattern)
        if pb.is_diagonal_on_out():
            muls = _matvec_muls(pb, b_val)
            p = LinearPattern(pa.out_shape, pb.in_shape, pa.muls + muls, pa.size + 1)
            return _settle(_ProductPlan(p, "linear-diag", 0))
        refined = _untie_pattern(pb, "out")
        nv = len(pb.out_shape)
        rest = [label for label in refined.val_labels if label >= nv]
        batch = math.prod(refined.sizes[label] for label in rest)
        nw = len(pa.out_shape)
        labels = tuple(range(nw)) + tuple(
            label - nv + nw for label in refined.labels[nv:]
        )
        val_labels = tuple(range(nw)) + tuple(label - nv + nw for label in rest)
        p = Pattern(pa.out_shape, pb.in_shape, labels, val_labels)
        return _ProductPlan(p, "linear-apply", pa.muls * batch, refined=refined)
    if isinstance(pb, LinearPattern):
        if pa.is_diagonal_on_in():
            muls = _matvec_muls(pa, a_val)
            p = LinearPattern(pa.out_shape, pb.in_shape, pb.muls + muls, pb.size + 1)
            return _settle(_ProductPlan(p, "diag-linear", 0))
        refined = _untie_pattern(pa, "in")
        nw = len(pa.out_shape)
        kw = max(refined.labels[:nw], default=-1) + 1
        wcarried = [label for label in refined.val_labels if label < kw]
        batch = math.prod(refined.sizes[label] for label in wcarried)
        nu = len(pb.in_shape)
        labels = refined.labels[:nw] + tuple(range(kw, kw + nu))
        val_labels = tuple(wcarried) + tuple(range(kw, kw + nu))
        p = Pattern(pa.out_shape, pb.in_shape, labels, val_labels)
        return _ProductPlan(p, "apply-linear", pb.muls * batch, refined=refined)
    return _sparse_product_plan(pa, pb, a_val, b_val)


def product_muls(pa: AnyPattern, pb: AnyPattern, a_val: bool, b_val: bool) -> int:
    """The multiplications of `product_plan(pa, pb, a_val, b_val)`, planning only
    what counting needs."""
    if _coordinates(pa) or _coordinates(pb):
        return _indexed.mixed_product_muls(pa, pb, a_val, b_val)
    return product_plan(pa, pb, a_val, b_val).muls


def has_val(partial: Partial) -> bool:
    """Whether `partial` stores values (a linear map always counts as storing them)."""
    if isinstance(partial, (SparseTensor, _indexed.CooTensor)):
        return partial.val is not None
    return True


def plan_has_val(plan, a_val: bool, b_val: bool) -> bool:
    """Whether the product `plan` describes stores a value array."""
    if isinstance(plan, _ProductPlan):
        if plan.kind == "einsum":
            return a_val or b_val or plan.factor != 1
        return True
    return plan.has_val


def _matvec_muls(p: Pattern, has_val: bool) -> int:
    if not has_val:
        return 0
    return math.prod(p.sizes)


def _sparse_product_plan(pa: Pattern, pb: Pattern, a_val: bool, b_val: bool):
    nw, nv, nu = len(pa.out_shape), len(pa.in_shape), len(pb.in_shape)
    na = pa.num_labels
    parent = list(range(na + pb.num_labels))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i in range(nv):
        ra, rb = find(pa.labels[nw + i]), find(na + pb.labels[i])
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    size = {}
    for label, s in enumerate(pa.sizes):
        size[find(label)] = s
    for label, s in enumerate(pb.sizes):
        size[find(na + label)] = s
    res_nodes = [find(pa.labels[i]) for i in range(nw)] + [
        find(na + pb.labels[nv + j]) for j in range(nu)
    ]
    canon: dict[int, int] = {}
    for r in res_nodes:
        canon.setdefault(r, len(canon))
    a_classes = [find(label) for label in pa.val_labels] if a_val else []
    b_classes = [find(na + label) for label in pb.val_labels] if b_val else []
    carried = set(a_classes) | set(b_classes)
    all_classes = {find(label) for label in pa.labels} | {
        find(na + label) for label in pb.labels
    }
    result = set(res_nodes)
    factor = math.prod(
        size[c] for c in all_classes if c not in result and c not in carried
    )
    out_classes = sorted((c for c in result if c in carried), key=lambda c: canon[c])
    letters = {}
    for c in list(a_classes) + list(b_classes):
        letters.setdefault(c, _LETTERS[len(letters)])
    a_sub = "".join(letters[c] for c in a_classes)
    b_sub = "".join(letters[c] for c in b_classes)
    out_sub = "".join(letters[c] for c in out_classes)
    pattern = Pattern(
        pa.out_shape,
        pb.in_shape,
        tuple(canon[r] for r in res_nodes),
        tuple(canon[c] for c in out_classes),
    )
    out_size = math.prod(size[c] for c in out_classes)
    contracted = 0
    if a_val and b_val:
        muls = math.prod(size[c] for c in set(a_classes) | set(b_classes))
        if muls >= MIN_CONTRACTED_MULS:
            contracted = muls - out_size
    else:
        muls = 0
    if factor != 1:
        muls += out_size
    return _ProductPlan(
        pattern, "einsum", muls, a_sub, b_sub, out_sub, factor, contracted=contracted
    )


def _composed_probes(a, b) -> tuple[Any, Any]:
    """`(probe, tprobe)` of the map `A · B` (see `LinearMap`), where either factor
    that is a map has a probe: each map factor applies its probe or else its own
    function, a diagonal its values (NaN times any number is NaN)."""
    maps = [x for x in (a, b) if isinstance(x, LinearMap)]
    if not any(x.probe is not None for x in maps):
        return None, None

    def forward(x):
        if isinstance(x, LinearMap):
            return x.probe or x.fn
        return functools.partial(matvec, x)

    def backward(x):
        if isinstance(x, LinearMap):
            return x.tprobe or x.tfn
        return functools.partial(rmatvec, x)

    fa, fb, ta, tb = forward(a), forward(b), backward(a), backward(b)
    return (lambda x: fa(fb(x))), (lambda y: tb(ta(y)))


def _apply_masked(
    apply,
    val: Array,
    st: SparseTensor,
    refined: Pattern,
    apply_probe=None,
    final: bool = False,
):
    """`apply(val)` for a linear map met by the refined values of `st`, and the
    result's mask when `st` has one.

    The map is also applied (by `apply_probe`, `apply` unless given) to a probe that
    is NaN on the entries of `st` that are stored and not selected away, and zero
    elsewhere: an entry of the result that no such entry reaches is made only of
    selected-away terms. A `final` product (see `product`) skips the probe, a second
    run of the map (a transposed convolution, say): its mask would only matter
    against a later factor, and the result keeps what the map gives, as the
    (co)tangent JAX's own pass carries through it would.
    """
    out = apply(val)
    mask = full_mask(st)
    if mask is None or final:
        return out, None
    assert st.val is not None
    nan = lax.full_like(st.val, jnp.nan)
    probe = SparseTensor(_select_away(nan, mask), st.pattern, st.dtype)
    apply_probe = apply if apply_probe is None else apply_probe
    reached = apply_probe(refine(probe, refined).val)
    out_mask = lax.eq(reached, reached)
    return _select_away(out, out_mask), out_mask


def _apply_map(
    how,
    fn,
    shared,
    st: SparseTensor,
    refined: Pattern,
    n: int,
    final: bool = False,
    probe=None,
):
    """`how(fn, ·, n=n)` (`_apply_leading` or `_apply_trailing`) applied to the
    refined values of `st`, and the result's mask (see `_apply_masked`, which
    applies `probe` where given); through the sibling group `shared` (`(group,
    slot)`) when the map has one."""
    val = refine(st, refined).val
    assert val is not None
    if shared is None:
        apply = functools.partial(how, fn, n=n)
        apply_probe = None if probe is None else functools.partial(how, probe, n=n)
        return _apply_masked(apply, val, st, refined, apply_probe, final)
    group, slot = shared

    def shared_apply(role: str):
        key = (st, refined, role)
        return functools.partial(group.apply, how, n=n, slot=slot, key=key)

    return _apply_masked(
        shared_apply("val"), val, st, refined, shared_apply("probe"), final
    )


def _apply_leading(fn, x: Array, n: int):
    """Apply `fn` to the leading `n` axes of `x`, vmapped over the trailing ones
    (`fn` may return a tuple of arrays)."""
    rest = tuple(x.shape[n:])
    if not rest:
        return fn(x)
    k = len(rest)
    moved = _transpose(x, tuple(range(n, x.ndim)) + tuple(range(n)))
    flat = lax.reshape(moved, (math.prod(rest),) + tuple(x.shape[:n]))

    def unflatten(out):
        out = lax.reshape(out, rest + tuple(out.shape[1:]))
        m = out.ndim - k
        return _transpose(out, tuple(range(k, k + m)) + tuple(range(k)))

    return jax.tree.map(unflatten, jax.vmap(fn)(flat))


def _apply_trailing(fn, x: Array, n: int):
    """Apply `fn` to the trailing `n` axes of `x`, vmapped over the leading ones
    (`fn` may return a tuple of arrays)."""
    lead = tuple(x.shape[: x.ndim - n])
    if not lead:
        return fn(x)
    flat = lax.reshape(x, (math.prod(lead),) + tuple(x.shape[x.ndim - n :]))
    return jax.tree.map(
        lambda out: lax.reshape(out, lead + tuple(out.shape[1:])), jax.vmap(fn)(flat)
    )


def matvec(st: SparseTensor, x: Array) -> Array:
    """`st` applied to `x` (shape `in_shape`), giving an array of `out_shape`."""
    xs = dense(x, st.in_shape, ())
    out, _ = product(st, xs)
    assert isinstance(out, SparseTensor)
    return out.dense()


def rmatvec(st: SparseTensor, y: Array) -> Array:
    """The transpose of `st` applied to `y` (shape `out_shape`)."""
    ys = dense(y, (), st.out_shape)
    out, _ = product(ys, st)
    assert isinstance(out, SparseTensor)
    return out.dense()


def _align(val: Array, sub: str, out_sub: str) -> Array:
    """`val`'s axes (named by `sub`) transposed into their order in `out_sub`."""
    present = [c for c in out_sub if c in sub]
    return _transpose(val, [sub.index(c) for c in present])


def _multiply_aligned(operands, subs, out_sub: str, sizes: dict[str, int]) -> Array:
    """Elementwise product of operands whose letters all appear in `out_sub`."""
    shape = tuple(sizes[c] for c in out_sub)
    val = None
    for operand, sub in zip(operands, subs, strict=True):
        x = _align(operand, sub, out_sub)
        dims = tuple(out_sub.index(c) for c in out_sub if c in sub)
        if tuple(x.shape) != shape:
            x = lax.broadcast_in_dim(x, shape, dims)
        val = x if val is None else lax.mul(val, x)
    assert val is not None, "no operands to multiply"
    return val


def _result_dtype(a, b):
    return jnp.result_type(a.dtype, b.dtype)


def product(a: Partial, b: Partial, final: bool = False) -> tuple[Partial, int]:
    """`A · B` for `A: w ← v`, `B: v ← u`; returns it and its multiplications.

    `final`: the product is never multiplied again (it runs from an input to an
    output vertex), so where a linear map is applied it needs no mask of the entries
    it selects away (see `_apply_masked`).
    """
    a_val, b_val = has_val(a), has_val(b)
    plan = product_plan(a.pattern, b.pattern, a_val, b_val)
    if not isinstance(plan, _ProductPlan):
        return _indexed.run_product(a, b, plan, _result_dtype(a, b), final)
    out, muls = _product(a, b, plan, a_val, b_val, final)
    if plan.materialise:
        out = to_sparse(out)
    return out, muls


def _product(
    a: Partial,
    b: Partial,
    plan: _ProductPlan,
    a_val: bool,
    b_val: bool,
    final: bool = False,
):
    dtype = _result_dtype(a, b)
    lazy = plan.lazy
    if plan.kind == "linear-linear":
        assert isinstance(a, LinearMap) and isinstance(b, LinearMap)
        assert lazy is not None
        fa, fb, ta, tb = a.fn, b.fn, a.tfn, b.tfn
        out = LinearMap(
            lambda x: fa(fb(x)),
            lambda y: tb(ta(y)),
            lazy,
            dtype,
            _then(a.shared_fn, "after", b, lambda f: lambda x: f(fb(x))),
            _then(b.shared_tfn, "before", a, lambda f: lambda y: f(ta(y))),
            *_composed_probes(a, b),
        )
        return out, plan.muls
    if plan.kind == "linear-diag":
        assert isinstance(a, LinearMap) and isinstance(b, SparseTensor)
        assert lazy is not None
        fa, ta = a.fn, a.tfn
        out = LinearMap(
            lambda x: fa(matvec(b, x)),
            lambda y: rmatvec(b, ta(y)),
            lazy,
            dtype,
            _then(a.shared_fn, "after", b, lambda f: lambda x: f(matvec(b, x))),
            None,
            *_composed_probes(a, b),
        )
        return out, plan.muls
    if plan.kind == "diag-linear":
        assert isinstance(a, SparseTensor) and isinstance(b, LinearMap)
        assert lazy is not None
        fb, tb = b.fn, b.tfn
        out = LinearMap(
            lambda x: matvec(a, fb(x)),
            lambda y: tb(rmatvec(a, y)),
            lazy,
            dtype,
            None,
            _then(b.shared_tfn, "before", a, lambda f: lambda y: f(rmatvec(a, y))),
            *_composed_probes(a, b),
        )
        return out, plan.muls
    if plan.kind == "linear-apply":
        assert isinstance(a, LinearMap) and isinstance(b, SparseTensor)
        assert plan.refined is not None
        n = len(b.out_shape)
        val, mask = _apply_map(
            _apply_leading, a.fn, a.shared_fn, b, plan.refined, n, final, a.probe
        )
        return SparseTensor(_cast(val, dtype), plan.pattern, dtype, mask), plan.muls
    if plan.kind == "apply-linear":
        assert isinstance(a, SparseTensor) and isinstance(b, LinearMap)
        assert plan.refined is not None
        n = len(a.in_shape)
        val, mask = _apply_map(
            _apply_trailing, b.tfn, b.shared_tfn, a, plan.refined, n, final, b.tprobe
        )
        return SparseTensor(_cast(val, dtype), plan.pattern, dtype, mask), plan.muls
    assert isinstance(a, SparseTensor) and isinstance(b, SparseTensor)
    operands, subs = [], []
    if a_val:
        operands.append(a.val)
        subs.append(plan.a_sub)
    if b_val:
        operands.append(b.val)
        subs.append(plan.b_sub)
    # Selected-away entries stay exactly zero, whatever they multiply.
    masks, owners = [], []
    for x, sub, at in ((a, plan.a_sub, 0), (b, plan.b_sub, int(a_val))):
        if has_val(x) and x.mask is not None:
            masks.append(_compact_mask(x.mask, sub))
            owners.append(at)
    out_mask = None
    known_ops = [is_known(x) for x in operands]
    if operands and all(known_ops):
        # Index maps of a vectorised batch (see `_indexed._densified`): composed
        # when the program is traced.
        # Small integers, exact in float64 (NumPy has no bfloat16 einsum).
        wide = [np.asarray(x, np.float64) for x in operands]
        val = np.einsum(f"{','.join(subs)}->{plan.out_sub}", *wide)
        val = known((val * plan.factor).astype(np.dtype(dtype)))
        return SparseTensor(val, plan.pattern, jnp.dtype(dtype)), plan.muls
    if any(known_ops) and len(operands) == 2:
        val, out_mask = _select_contraction(operands, subs, masks, plan.out_sub, dtype)
        if plan.factor != 1:
            val = lax.mul(val, lax.full_like(val, plan.factor))
        return SparseTensor(val, plan.pattern, jnp.dtype(dtype), out_mask), plan.muls
    if not operands:
        val = None if plan.factor == 1 else jnp.asarray(plan.factor, dtype)
    elif not all(set(sub) <= set(plan.out_sub) for _, sub in masks):
        operands = [_cast(x, dtype) for x in operands]
        val, out_mask = _masked_contraction(
            operands, subs, masks, owners, plan.out_sub, dtype
        )
        if plan.factor != 1:
            val = lax.mul(val, lax.full_like(val, plan.factor))
    else:
        operands = [_cast(x, dtype) for x in operands]
        if len(operands) == 1:
            val = einsum1(operands[0], subs[0], plan.out_sub)
        elif set("".join(subs)) <= set(plan.out_sub):
            # Nothing is summed: a broadcast multiply fuses better than a dot.
            sizes = {}
            for x, sub in zip(operands, subs, strict=True):
                sizes.update(zip(sub, x.shape, strict=True))
            val = _multiply_aligned(operands, subs, plan.out_sub, sizes)
        else:
            a, b = operands
            val = einsum2(a, subs[0], b, subs[1], plan.out_sub, dtype)
        val = _cast(val, dtype)
        if plan.factor != 1:
            val = lax.mul(val, lax.full_like(val, plan.factor))
        if masks:
            # Every term of an entry shares the selected factor.
            out_mask = _union_mask(masks, plan.out_sub, tuple(val.shape))
            val = _select_away(val, out_mask)
    return SparseTensor(val, plan.pattern, jnp.dtype(dtype), out_mask), plan.muls


def _select_contraction(operands, subs, masks, out_sub: str, dtype):
    """The contraction of a block of zeros and ones known when the program is traced
    (an index map of a vectorised batch, see `_indexed._densified`) with a traced
    block, as selections and sums of the traced block's slices: no entry is
    multiplied, so an infinite or NaN entry reaches only the entries the index map
    takes it to, as through coordinates. Returns the values and, where the traced
    block selects entries away, the mask of result entries all of whose terms are
    selected away (or that have none)."""
    at = 0 if is_known(operands[0]) else 1
    block, sk = np.asarray(operands[at]), subs[at]
    other, so_ = operands[1 - at], subs[1 - at]
    sizes = dict(zip(sk, block.shape))
    sizes.update(zip(so_, other.shape))
    # Letters only the traced block has, summed there first (with its mask).
    own = [i for i, c in enumerate(so_) if c not in out_sub and c not in sk]
    mask = None
    if masks:
        ((mask, mask_sub),) = masks
        mask = _align_full(mask, mask_sub, so_, tuple(other.shape))
    if own:
        other = _sum_axes(other, own)
        if mask is not None:
            mask = jnp.all(mask, axis=tuple(own))
        so_ = "".join(c for i, c in enumerate(so_) if i not in own)
    own_known = [i for i, c in enumerate(sk) if c not in out_sub and c not in so_]
    if own_known:
        block = block.sum(axis=tuple(own_known))
        sk = "".join(c for i, c in enumerate(sk) if i not in own_known)
    contract = [c for c in sk if c in so_ and c not in out_sub]
    rest_k = "".join(c for c in sk if c not in contract)
    rest_o = "".join(c for c in so_ if c not in contract)
    count = math.prod(sizes[c] for c in contract)
    block = np.transpose(
        block, [sk.index(c) for c in contract] + [sk.index(c) for c in rest_k]
    ).reshape((count,) + tuple(sizes[c] for c in rest_k))
    # The traced block's pieces are sliced where they lie, never transposed: a
    # transposed view of a block written to memory, read next to the block itself
    # by a kernel that XLA CPU lets write its result over the block, was read after
    # being overwritten (3 Euler steps of Lorenz-96 on a batch, forward mode).
    axes = [so_.index(c) for c in contract]
    starts = list(np.ndindex(*(sizes[c] for c in contract)))

    def piece_of(x, at):
        for axis, i in sorted(zip(axes, at), reverse=True):
            x = lax.index_in_dim(x, int(i), axis, keepdims=False)
        return x

    shape = tuple(sizes[c] for c in out_sub)
    out = out_mask = None
    for k in range(count):
        coefficient = block[k]
        if not coefficient.any():
            continue
        piece = piece_of(other, starts[k])
        term = _multiply_aligned([_cast(piece, dtype)], [rest_o], out_sub, sizes)
        if not (coefficient == 1).all():
            if not ((coefficient == 0) | (coefficient == 1)).all():
                c = _multiply_aligned(
                    [jnp.asarray(coefficient, dtype)], [rest_k], out_sub, sizes
                )
                term = lax.mul(term, c)
            if not (coefficient != 0).all():
                live = _multiply_aligned(
                    [jnp.asarray(coefficient != 0)], [rest_k], out_sub, sizes
                )
                term = lax.select(live, term, lax.full_like(term, 0))
        out = term if out is None else lax.add(out, term)
        if mask is not None:
            dead = _multiply_aligned(
                [piece_of(mask, starts[k])], [rest_o], out_sub, sizes
            )
            if not (coefficient != 0).all():
                idle = _multiply_aligned(
                    [jnp.asarray(coefficient == 0)], [rest_k], out_sub, sizes
                )
                dead = lax.bitwise_or(dead, idle)
            out_mask = dead if out_mask is None else lax.bitwise_and(out_mask, dead)
    if out is None:
        out = jnp.zeros(shape, dtype)
        if mask is not None:
            out_mask = known(np.ones((1,) * len(shape), bool))
    if out_mask is not None:
        out = _select_away(out, out_mask)
    return out, out_mask


def _align_full(mask: Array, sub: str, full_sub: str, shape) -> Array:
    """A compact mask over `sub` laid out over `full_sub` at full `shape`."""
    dims = tuple(full_sub.index(c) for c in full_sub if c in sub)
    return lax.broadcast_in_dim(_align(mask, sub, full_sub), tuple(shape), dims)


def _then(shared, tag: str, other, compose):
    """`shared` (a map's `(group, slot)`) for the map composed with `other`: the
    group's function composed the same way (`compose(group.fn)`), same slot."""
    if shared is None:
        return None
    group, slot = shared
    return group.then(tag, other, lambda: compose(group.fn)), slot


def _compact_mask(mask: Array, sub: str) -> tuple[Array, str]:
    """`mask` without the axes it is broadcast along, and the letters it keeps."""
    keep = [k for k, size in enumerate(mask.shape) if size != 1]
    letters = "".join(sub[k] for k in keep)
    return lax.reshape(mask, tuple(mask.shape[k] for k in keep)), letters


def _union_mask(masks, out_sub: str, shape: tuple[int, ...]) -> Array:
    """The union of compact masks laid out over `out_sub` (of full sizes `shape`),
    with size-one axes where none of them varies."""
    varying = set("".join(sub for _, sub in masks))
    target = tuple(n if c in varying else 1 for c, n in zip(out_sub, shape))
    out = None
    for mask, sub in masks:
        dims = tuple(out_sub.index(c) for c in out_sub if c in sub)
        mask = lax.broadcast_in_dim(_align(mask, sub, out_sub), target, dims)
        out = mask if out is None else lax.bitwise_or(out, mask)
    assert out is not None
    return out


def _select_away(val: Array, mask: Array | None) -> Array:
    """`val` set to zero where `mask` (broadcastable to it) is true."""
    if mask is None:
        return val
    if tuple(mask.shape) != tuple(val.shape):
        mask = jnp.broadcast_to(mask, val.shape)
    return lax.select(mask, lax.full_like(val, 0), val)


# A masked contraction over at most this many summed entries forms and selects its
# terms one by one (see `_masked_contraction`).
SMALL_CONTRACTION = 32

# Values up to this many entries are checked for infinite entries at trace time (see
# `_known_finite`); larger ones are taken as possibly infinite.
_MAX_FINITE_CHECK = 1 << 24


def _known_finite(x) -> bool:
    """Whether `x` is a value known at trace time (a constant, not traced) with no
    infinite or NaN entry. A selection moved onto such a factor changes nothing (its
    selected terms are zero times a finite number), so the select is left out: it
    would write a copy of the factor, a weight matrix say, on every call."""
    if not jp.is_concrete(x) or not isinstance(x, (jax.Array, np.ndarray)):
        return False
    if x.size > _MAX_FINITE_CHECK:
        return False
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return True
    return bool(np.isfinite(np.asarray(x)).all())


def _masked_contraction(operands, subs, masks, owners, out_sub: str, dtype):
    """The contraction of `operands` into `out_sub` where a mask varies along a
    summed letter, and its mask: an entry is selected away when all its terms are.

    A selection along summed letters is moved onto the other operand (its factor in
    those terms is set to zero too), so that the contraction stays one product. Where
    it cannot be moved (it also varies along a letter the other operand lacks), every
    term is formed and selected when the summed letters hold at most
    `SMALL_CONTRACTION` entries (the blocks of a vectorised batch); beyond that the
    product is taken as it is: forming every term would cost a factor of the summed
    size, and the selected entries are zero already, which is exact unless the other
    factor is infinite there.
    """
    sizes = {}
    for x, sub in zip(operands, subs, strict=True):
        sizes.update(zip(sub, x.shape, strict=True))
    summed = "".join(sorted(set("".join(subs)) - set(out_sub)))
    every = out_sub + summed
    axes = tuple(range(len(out_sub), len(every)))
    term_mask = _union_mask(masks, every, tuple(sizes[c] for c in every))
    out_mask = jnp.all(term_mask, axis=axes)
    if len(operands) == 1:
        # Selected-away entries are zeros that nothing multiplies: sum as usual.
        return einsum1(operands[0], subs[0], out_sub), out_mask
    moved = list(operands)
    stuck = any(
        set(letters) & set(summed)
        and not set(letters) <= set(subs[1 - owner])
        and not _known_finite(moved[1 - owner])
        for (_, letters), owner in zip(masks, owners, strict=True)
    )
    if stuck and math.prod(sizes[c] for c in summed) <= SMALL_CONTRACTION:
        terms = _multiply_aligned(
            [_cast(x, dtype) for x in operands], subs, every, sizes
        )
        terms = _select_away(terms, term_mask)
        return _select_away(_sum_axes(terms, axes), out_mask), out_mask
    for (mask, letters), owner in zip(masks, owners, strict=True):
        if not set(letters) & set(summed):
            continue  # selected away on the result
        other = 1 - owner
        if not set(letters) <= set(subs[other]) or _known_finite(moved[other]):
            continue
        shape = tuple(moved[other].shape)
        moved[other] = _select_away(
            moved[other], _union_mask([(mask, letters)], subs[other], shape)
        )
    val = einsum2(moved[0], subs[0], moved[1], subs[1], out_sub, dtype)
    return _select_away(val, out_mask), out_mask


#
# Sums (accumulating parallel paths).
#


@functools.lru_cache(maxsize=65536)
def sum_plan(pa: AnyPattern, pb: AnyPattern, a_val: bool, b_val: bool):
    """The pattern of `A + B` and the number of additions it costs."""
    assert pa.shape == pb.shape, (pa, pb)
    if _coordinates(pa) or _coordinates(pb):
        plan = _indexed.mixed_sum_plan(pa, pb, a_val, b_val)
        return plan.pattern, plan.adds
    if isinstance(pa, LinearPattern) or isinstance(pb, LinearPattern):
        ma = pa.muls if isinstance(pa, LinearPattern) else _matvec_muls(pa, a_val)
        mb = pb.muls if isinstance(pb, LinearPattern) else _matvec_muls(pb, b_val)
        sa = pa.size if isinstance(pa, LinearPattern) else 1
        sb = pb.size if isinstance(pb, LinearPattern) else 1
        lazy = LinearPattern(pa.out_shape, pa.in_shape, ma + mb, sa + sb)
        if not should_materialise(lazy) and not (
            _mostly_stored(pa, a_val) or _mostly_stored(pb, b_val)
        ):
            return lazy, 0
        # Store both terms and add them.
        dense_p = dense_pattern(pa.out_shape, pa.in_shape)
        return dense_p, dense_p.val_size
    if pa.labels == pb.labels:
        val_labels = tuple(sorted(set(pa.val_labels) | set(pb.val_labels)))
        target = Pattern(pa.out_shape, pa.in_shape, pa.labels, val_labels)
        if not val_labels and not a_val and not b_val:
            return target, 1
        return target, target.val_size
    # Keep a tie only where both operands have it.
    labels = []
    for k in range(len(pa.labels)):
        la, lb = pa.labels[k], pb.labels[k]
        pa_axes = tuple(j for j, c in enumerate(pa.labels) if c == la)
        pb_axes = tuple(j for j, c in enumerate(pb.labels) if c == lb)
        if len(pa_axes) == 2 and pa_axes == pb_axes:
            labels.append(("tie", pa_axes))
        else:
            labels.append(("own", k))
    relabel: dict[Any, int] = {}
    for label in labels:
        relabel.setdefault(label, len(relabel))
    canon = tuple(relabel[label] for label in labels)
    val = set()
    for p in (pa, pb):
        mapping = _label_map(p, Pattern(pa.out_shape, pa.in_shape, canon, ()))
        for label, ts in mapping.items():
            if label in p.val_labels or len(ts) == 2:
                val.update(ts)
    target = Pattern(pa.out_shape, pa.in_shape, canon, tuple(sorted(val)))
    return target, target.val_size


# A sum of two labeled partials whose ties differ stores every combination of the
# axes it separates; where that is more than this many times the operands' entries,
# the two are summed as coordinates instead.
SEPARATED_SUM_GROWTH = 4


def separating_sum(pa: AnyPattern, pb: AnyPattern) -> bool:
    """Whether `A + B`, two labeled patterns with different ties, is summed as
    coordinates: the labeled sum would grow past `SEPARATED_SUM_GROWTH` times the
    entries of its terms (`x[:, None] - x[None, :]`: two broadcasts of `n²` entries
    each, whose labeled sum is an `n × n × n` block)."""
    if not (isinstance(pa, Pattern) and isinstance(pb, Pattern)):
        return False
    if pa.labels == pb.labels:
        return False
    entries = sum(math.prod(p.sizes) for p in (pa, pb))
    if max(_indexed._free_entries(pa), _indexed._free_entries(pb)) > (
        _indexed.MAX_CONVERT
    ):
        return False
    target, _ = sum_plan(pa, pb, True, True)
    assert isinstance(target, Pattern)
    return target.val_size > SEPARATED_SUM_GROWTH * entries


def _mostly_stored(p: AnyPattern, has_val: bool) -> bool:
    """Whether `p` stores at least half of a dense block with values that mix.

    Such a block is not kept inside a sum of linear maps: applying it to the unit
    basis when the sum is stored would multiply each of its entries by zeros, and an
    infinite one would spread NaN across its row. The map is stored instead, which
    costs no more memory than the block."""
    if not isinstance(p, Pattern) or not has_val:
        return False
    if p.is_diagonal_on_in() and p.is_diagonal_on_out():
        return False
    return 2 * p.val_size >= math.prod(p.out_shape) * math.prod(p.in_shape)


def add(a: Partial, b: Partial) -> tuple[Partial, int]:
    """`A + B`; returns the sum and its number of additions."""
    a_val, b_val = has_val(a), has_val(b)
    dtype = _result_dtype(a, b)
    if separating_sum(a.pattern, b.pattern):
        a, b = _indexed.to_coo(a), _indexed.to_coo(b)
    if _coordinates(a.pattern) or _coordinates(b.pattern):
        plan = _indexed.mixed_sum_plan(a.pattern, b.pattern, a_val, b_val)
        return _indexed.run_add(a, b, plan, dtype)
    target, adds = sum_plan(a.pattern, b.pattern, a_val, b_val)
    if isinstance(target, LinearPattern):
        fa = a.fn if isinstance(a, LinearMap) else functools.partial(matvec, a)
        fb = b.fn if isinstance(b, LinearMap) else functools.partial(matvec, b)
        ta = a.tfn if isinstance(a, LinearMap) else functools.partial(rmatvec, a)
        tb = b.tfn if isinstance(b, LinearMap) else functools.partial(rmatvec, b)
        out = LinearMap(
            lambda x: fa(x) + fb(x), lambda y: ta(y) + tb(y), target, jnp.dtype(dtype)
        )
        return out, adds
    a, b = to_sparse(a), to_sparse(b)
    known_a, known_b = is_known(a.val), is_known(b.val)
    if known_a and known_b:
        va = _broadcast_val(a, target.val_labels, target)
        vb = _broadcast_val(b, target.val_labels, target)
        val = known(np.add(va, vb).astype(np.dtype(dtype)))
        return SparseTensor(val, target, jnp.dtype(dtype)), adds
    # A known block (see `_indexed._densified`) holds no term where it is zero.
    if known_a and b.mask is not None:
        a = SparseTensor(a.val, a.pattern, a.dtype, known(np.equal(a.val, 0)))
    if known_b and a.mask is not None:
        b = SparseTensor(b.val, b.pattern, b.dtype, known(np.equal(b.val, 0)))
    # Met by a traced block, a known one is laid out in the program: `_broadcast_val`
    # of a known block computes its layout now, which would embed one copy of the
    # block per batch entry as a constant (2 x 295 KB in a 3-mass spring chain at
    # B = 4,096).
    a, b = _unknown(a), _unknown(b)
    if a.val is None and b.val is None and not target.val_labels:
        return SparseTensor(jnp.asarray(2, dtype), target, jnp.dtype(dtype)), adds
    va = _broadcast_val(a, target.val_labels, target)
    vb = _broadcast_val(b, target.val_labels, target)
    va, vb = _cast(jnp.asarray(va), dtype), _cast(jnp.asarray(vb), dtype)
    # Selected away where neither term stores a live entry.
    mask = None
    if a.mask is not None or b.mask is not None:
        dead_a, dead_b = _dead(a, target), _dead(b, target)
        if dead_a is not None and dead_b is not None:
            mask = lax.bitwise_and(dead_a, dead_b)
    return SparseTensor(lax.add(va, vb), target, jnp.dtype(dtype), mask), adds


def _unknown(st: SparseTensor) -> SparseTensor:
    """`st` with its known value and mask (see `known`) as constants of the program."""
    val, mask = st.val, st.mask
    if is_known(val):
        val = jnp.asarray(np.asarray(val))
    if is_known(mask):
        mask = jnp.asarray(np.asarray(mask))
    if val is st.val and mask is st.mask:
        return st
    return SparseTensor(val, st.pattern, st.dtype, mask)


def _dead(st: SparseTensor, target: Pattern) -> Array | None:
    """Where `st`, laid out in `target`, stores no entry or a selected-away one; None
    where that is nowhere (no selection, and no tie that `target` separates)."""
    separated = any(len(ts) == 2 for ts in _label_map(st.pattern, target).values())
    if not separated:
        if st.mask is None:
            return None
        selected = SparseTensor(full_mask(st), st.pattern, jnp.dtype(bool))
        return _broadcast_val(selected, target.val_labels, target)
    ind = None
    if st.val is not None:
        mask = full_mask(st)
        ind = jnp.ones(st.val.shape, bool) if mask is None else lax.bitwise_not(mask)
    live = SparseTensor(ind, st.pattern, jnp.dtype(bool))
    return lax.bitwise_not(_broadcast_val(live, target.val_labels, target).astype(bool))


#
# Materialisation of linear maps.
#


def to_sparse(partial: Partial) -> SparseTensor:
    """A `graphax_eqx.SparseTensor` for any partial (linear maps become dense)."""
    if isinstance(partial, SparseTensor):
        return partial
    p = partial.pattern
    n_in, n_out = math.prod(p.in_shape), math.prod(p.out_shape)

    def basis_images(fill):
        """The map applied to each basis vector (scaled by `fill`), as a block."""
        n = min(n_in, n_out)
        eye = jnp.eye(n, dtype=partial.dtype)
        if fill is not None:
            eye = _select_away(
                lax.full_like(eye, fill), lax.eq(eye, lax.full_like(eye, 0))
            )
        if n_in <= n_out:
            cols = jax.vmap(partial.fn)(eye.reshape((n,) + p.in_shape))
            val = jnp.moveaxis(cols.reshape((n,) + p.out_shape), 0, -1)
            return val.reshape(p.out_shape + p.in_shape)
        rows = jax.vmap(partial.tfn)(eye.reshape((n,) + p.out_shape))
        return rows.reshape(p.out_shape + p.in_shape)

    st = dense(basis_images(None).astype(partial.dtype), p.out_shape, p.in_shape)
    if n_in * n_out <= _MATERIALISE_ENTRIES:
        # Entries the map never reaches hold no term (a NaN basis shows them): kept
        # as selected-away zeros, they stay zero against an infinite partial.
        reached = basis_images(jnp.nan)
        st = with_mask(st, lax.eq(reached, reached))
    return st


def materialise_muls(p: LinearPattern) -> int:
    return p.muls * min(math.prod(p.in_shape), math.prod(p.out_shape))


from . import _indexed  # noqa: E402  (it builds on the names above)
