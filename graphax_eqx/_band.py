"""Banded partials stored by diagonals.

A Jacobian block whose structural nonzeros lie on a few diagonals of its flattened
`(rows, cols)` matrix, `cols - rows ∈ offsets`, is stored as `val[k, r] = J[r, r +
offsets[k]]`: one row per diagonal, one slot per row, zero where a diagonal leaves the
matrix or the block has a structural zero. Slicing rows is then a slice, scaling by an
elementwise partial a broadcast multiply, and the product of two banded blocks a sum
of shifted elementwise products: no index arrays and no gathers, which on CPU cost
about as much per entry as a whole fused elementwise expression.

Explicit stencils, finite-difference residuals and time steps of 1-D PDEs produce such
partials, and forward or reverse accumulation through several steps keeps them banded
(the band widens by the stencil's reach per step). Coordinate partials
([`graphax_eqx._indexed.CooPattern`][]) become banded when two of them, large, tie-free
and dense on few diagonals, meet in a product; a banded partial meeting anything else
is converted back to exact coordinates. The exact structural pattern is carried along,
so the result's coordinates, `nse` and counts of structural nonzeros are unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._indexed import (
    CooPattern,
    CooTensor,
    _take_last,
)
from ._sparse import BlockShape, Pattern, SparseTensor, _broadcast_val, full_mask


Array = Any

# Partials with fewer rows stay coordinates: exact and cheap either way.
BAND_MIN_ROWS = 1024
# At most this many diagonals, each at least this full on average (structural
# nonzeros over stored slots), else coordinates are cheaper.
BAND_MAX_OFFSETS = 64
BAND_MIN_FILL = 0.5


@dataclasses.dataclass(frozen=True, eq=False)
class BandPattern:
    """The static structure of a [`BandTensor`][]: its diagonals and its exact
    coordinates (`exact`, a tie-free `CooPattern`)."""

    offsets: tuple[int, ...]
    exact: CooPattern

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.exact.out_shape

    @property
    def in_shape(self) -> tuple[int, ...]:
        return self.exact.in_shape

    @property
    def shape(self) -> tuple[int, ...]:
        return self.exact.shape

    @property
    def n_rows(self) -> int:
        return math.prod(self.out_shape)

    @property
    def n_cols(self) -> int:
        return math.prod(self.in_shape)

    @property
    def val_size(self) -> int:
        return len(self.offsets) * self.n_rows

    @functools.cached_property
    def positions(self) -> np.ndarray:
        """The flat slot in the `(diagonal, row)` value array of each exact entry."""
        e = self.exact
        k = np.searchsorted(np.asarray(self.offsets), e.cols - e.rows)
        return k * self.n_rows + e.rows

    @functools.cached_property
    def stored(self) -> np.ndarray:
        """`(diagonal, row)` booleans: whether the slot holds an exact entry."""
        mask = np.zeros(self.val_size, bool)
        mask[self.positions] = True
        return mask.reshape(len(self.offsets), self.n_rows)

    def __hash__(self):
        return hash((self.offsets, self.exact))

    def __eq__(self, other):
        return (
            isinstance(other, BandPattern)
            and self.offsets == other.offsets
            and self.exact == other.exact
        )


class BandTensor(BlockShape, eqx.Module):
    """A banded partial: `val[k, r]` is entry `(r, r + pattern.offsets[k])` of the
    flattened block, zero outside its exact pattern."""

    val: Array
    pattern: BandPattern = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    mask: Array | None = None  # selected-away slots, shaped like `val`


#
# Becoming banded, and back.
#


def _banded(exact: CooPattern, relaxed: bool = False) -> BandPattern | None:
    """`exact` as a band, if it is a large, tie-free 1-D pattern dense on few
    diagonals. `relaxed`: any size and density (for an operand meeting a band)."""
    if not (_one_axis(exact.out_shape) and _one_axis(exact.in_shape)):
        return None
    if any(exact.out_shape[o] != 1 for o, _ in exact.ties):
        return None
    if exact.ties:
        # Ties of axes of length 1 add nothing to the flat indices: drop them.
        exact = CooPattern(
            exact.out_shape, exact.in_shape, (), (), exact.rows, exact.cols
        )
    if exact.nnz == 0:
        return None
    return _band_if_worth(exact, np.unique(exact.cols - exact.rows), relaxed)


def _band_if_worth(
    exact: CooPattern, offsets, relaxed: bool = False
) -> BandPattern | None:
    """`exact` on the diagonals `offsets` as a band, if they are few and, unless
    `relaxed`, the band has enough rows and is full enough."""
    n_rows = math.prod(exact.out_shape)
    if len(offsets) > BAND_MAX_OFFSETS:
        return None
    if not relaxed and (
        n_rows < BAND_MIN_ROWS or exact.nnz < BAND_MIN_FILL * len(offsets) * n_rows
    ):
        return None
    return BandPattern(tuple(int(d) for d in offsets), exact)


@functools.lru_cache(maxsize=4096)
def band_of(p: Any, relaxed: bool = False) -> BandPattern | None:
    """The band a partial of pattern `p` converts to, or `None`.

    Bands stay bands; tie-free coordinate patterns qualify by `_banded`; a labeled
    pattern qualifies when it is elementwise on one axis (the main diagonal). Only
    one axis of the output and one of the input may be longer than 1: unit axes
    (a reshape to `(1, 1, n)` for a convolution, say) do not change the flattened
    matrix.
    `relaxed` drops the size and density conditions: for an operand meeting a band.
    """
    if isinstance(p, BandPattern):
        return p
    if isinstance(p, CooPattern):
        return _banded(p, relaxed)
    if isinstance(p, Pattern) and _is_elementwise(p):
        n = math.prod(p.out_shape)
        if n < BAND_MIN_ROWS and not relaxed:
            return None
        idx = np.arange(n, dtype=np.int64)
        exact = CooPattern(p.out_shape, p.in_shape, (), (), idx, idx)
        return BandPattern((0,), exact)
    return None


def _one_axis(shape: tuple[int, ...]) -> bool:
    """Whether at most one axis of `shape` is longer than 1."""
    return sum(d != 1 for d in shape) <= 1


def _is_elementwise(p: Pattern) -> bool:
    """Whether `p` is the diagonal of one axis, up to axes of length 1."""
    if not (_one_axis(p.out_shape) and _one_axis(p.in_shape)):
        return False
    k = len(p.out_shape)
    out = [label for label, d in zip(p.labels[:k], p.out_shape) if d != 1]
    inn = [label for label, d in zip(p.labels[k:], p.in_shape) if d != 1]
    return len(out) == 1 and out == inn


def to_band(x, bp: BandPattern, dtype) -> BandTensor:
    """A partial whose pattern `band_of` maps to `bp`, as a `BandTensor`."""
    if isinstance(x, BandTensor):
        return x
    n_diag, n_rows = len(bp.offsets), bp.n_rows
    if isinstance(x, SparseTensor):
        # One axis, elementwise: its (broadcast) value is the main diagonal.
        # Stored values are already zero where selected away.
        mask = full_mask(x)
        # Every label: the diagonal's, and those of axes of length 1.
        labels = tuple(range(x.pattern.num_labels))
        diag = _broadcast_val(x, labels)
        if mask is not None:
            selected = SparseTensor(mask, x.pattern, jnp.dtype(bool))
            mask = _broadcast_val(selected, labels).reshape(1, n_rows)
        return BandTensor(
            diag.reshape(1, n_rows).astype(dtype), bp, jnp.dtype(dtype), mask
        )
    assert isinstance(x, CooTensor)
    if x.val is None:
        flat = np.zeros(bp.val_size, np.dtype(dtype))
        flat[bp.positions] = 1
        return BandTensor(
            jnp.asarray(flat.reshape(n_diag, n_rows)), bp, jnp.dtype(dtype)
        )

    def slots(entries, fill):
        flat = jnp.full((bp.val_size,), fill, entries.dtype)
        flat = flat.at[jnp.asarray(bp.positions)].set(
            entries, unique_indices=True, mode="promise_in_bounds"
        )
        return flat.reshape(n_diag, n_rows)

    # A tie of axes of length 1 that varies gives the values a leading unit axis.
    val = slots(x.val.astype(dtype).reshape(-1), 0)
    mask = (
        None
        if x.mask is None
        else slots(jnp.broadcast_to(x.mask, x.val.shape).reshape(-1), True)
    )
    return BandTensor(val, bp, jnp.dtype(dtype), mask)


def to_coo(x: BandTensor) -> CooTensor:
    """`x` as exact coordinates (one gather)."""
    bp = x.pattern
    val = _take_last(x.val.reshape(-1), bp.positions)
    mask = None if x.mask is None else _take_last(x.mask.reshape(-1), bp.positions)
    return CooTensor(val, bp.exact, x.dtype, mask)


@functools.lru_cache(maxsize=256)
def _diagonal_runs(bp: BandPattern) -> tuple[tuple[int, int, int], ...] | None:
    """`(diagonal, first row, row past the last)` of each diagonal's stored slots, if
    they are one run of rows on every diagonal."""
    runs = []
    for k in range(len(bp.offsets)):
        rows = np.flatnonzero(bp.stored[k])
        if rows.size == 0:
            continue
        if rows[-1] - rows[0] + 1 != rows.size:
            return None
        runs.append((k, int(rows[0]), int(rows[-1]) + 1))
    return tuple(runs)


@functools.lru_cache(maxsize=256)
def _diagonal_major(bp: BandPattern, runs) -> CooPattern:
    rows = np.concatenate([np.arange(lo, hi, dtype=np.int64) for _, lo, hi in runs])
    cols = np.concatenate(
        [np.arange(lo, hi, dtype=np.int64) + bp.offsets[k] for k, lo, hi in runs]
    )
    return CooPattern(bp.out_shape, bp.in_shape, (), (), rows, cols)


def to_result_coo(x: BandTensor) -> CooTensor:
    """`x` as exact coordinates, for a Jacobian block handed to the caller.

    The entries are listed diagonal by diagonal, so that a band whose diagonals each
    store one run of rows becomes slices of its value array rather than a gather. (XLA
    fuses the product that made the band into its consumer; a gather evaluates it
    entry by entry, a concatenate of slices row-vectorised.)
    """
    bp = x.pattern
    runs = _diagonal_runs(bp)
    if not runs:
        return to_coo(x)
    val = jnp.concatenate([x.val[k, lo:hi] for k, lo, hi in runs])
    return CooTensor(val, _diagonal_major(bp, runs), x.dtype)


#
# Products and sums.
#


@dataclasses.dataclass(frozen=True, eq=False)
class BandProductPlan:
    pattern: Any  # the result's BandPattern (Any: plans are read generically)
    muls: int
    band_a: BandPattern
    band_b: BandPattern
    terms: tuple[tuple[int, int, int], ...]  # (diagonal of A, of B, of the result)
    has_val = True


def _operands(pa: Any, pb: Any) -> tuple[BandPattern | None, BandPattern | None]:
    """Both operands as bands: strictly, or relaxed for one that meets a band."""
    relax_a = isinstance(pb, BandPattern)
    relax_b = isinstance(pa, BandPattern)
    return band_of(pa, relax_a), band_of(pb, relax_b)


def unbanded(pa: Any, a_val: bool, pb: Any, b_val: bool):
    """The operands with bands replaced by their exact coordinates (which store
    values): `(pa, a_val, pb, b_val)`."""
    if isinstance(pa, BandPattern):
        pa, a_val = pa.exact, True
    if isinstance(pb, BandPattern):
        pb, b_val = pb.exact, True
    return pa, a_val, pb, b_val


def _shifted_mask(mask: np.ndarray, shift: int, n: int) -> np.ndarray:
    """`mask[:, shift + r]` for `r` in `0..n-1`, `False` where out of range."""
    out = np.zeros((mask.shape[0], n), bool)
    lo, hi = max(0, -shift), min(n, mask.shape[1] - shift)
    if lo < hi:
        out[:, lo:hi] = mask[:, lo + shift : hi + shift]
    return out


def _from_diagonals(
    out_shape, in_shape, stored: dict[int, np.ndarray]
) -> BandPattern | None:
    """The band whose entries are `(r, r + d)` where `stored[d][r]`, if it is worth
    one (`_band_if_worth`). Its coordinates come in the order coordinate plans
    produce (ascending row, then column)."""
    offsets = sorted(d for d, m in stored.items() if m.any())
    if not offsets:
        return None
    mask = np.stack([stored[d] for d in offsets])
    n_diag, n_rows = mask.shape
    if mask.all():
        rows = np.repeat(np.arange(n_rows, dtype=np.int64), n_diag)
        k = np.tile(np.arange(n_diag, dtype=np.int64), n_rows)
    else:
        rows, k = np.divmod(np.flatnonzero(mask.T), n_diag)
    cols = rows + np.asarray(offsets, np.int64)[k]
    exact = CooPattern(out_shape, in_shape, (), (), rows, cols)
    band = _band_if_worth(exact, offsets)
    if band is not None:
        # Known here already: spare the band finding them again from `exact`.
        band.__dict__["positions"] = k * n_rows + rows
        band.__dict__["stored"] = mask
    return band


def _product_band(ba: BandPattern, bb: BandPattern) -> BandPattern | None:
    """The band of `A · B`, from the operands' stored slots (the coordinates
    `coo_product_plan` would find, without joining coordinate lists)."""
    n = ba.n_rows
    stored: dict[int, np.ndarray] = {}
    for ka, da in enumerate(ba.offsets):
        hit = ba.stored[ka][None, :] & _shifted_mask(bb.stored, da, n)
        for kb, db in enumerate(bb.offsets):
            d = da + db
            stored[d] = hit[kb] if d not in stored else stored[d] | hit[kb]
    return _from_diagonals(ba.out_shape, bb.in_shape, stored)


def _sum_band(ba: BandPattern, bb: BandPattern) -> BandPattern | None:
    """The band of `A + B`: the union of the operands' entries."""
    stored: dict[int, np.ndarray] = {}
    for band in (ba, bb):
        for k, d in enumerate(band.offsets):
            m = band.stored[k]
            stored[d] = m if d not in stored else stored[d] | m
    return _from_diagonals(ba.out_shape, ba.in_shape, stored)


def _banded_result(pa: Any, pb: Any, band_of_result):
    """`(A's band, B's band, the result's band)` if all three are bands, else
    `None`; `band_of_result(A's band, B's band)` gives the result's band or `None`."""
    ba, bb = _operands(pa, pb)
    if ba is None or bb is None:
        return None
    result = band_of_result(ba, bb)
    if result is None:
        return None
    return ba, bb, result


@functools.lru_cache(maxsize=4096)
def band_product_plan(pa: Any, pb: Any) -> BandProductPlan | None:
    """Plan `A · B` on bands, if both operands convert to bands and so does the
    result."""
    found = _banded_result(pa, pb, _product_band)
    if found is None:
        return None
    ba, bb, result = found
    offsets = result.offsets
    index = {d: k for k, d in enumerate(offsets)}
    terms = []
    for ka, da in enumerate(ba.offsets):
        for kb, db in enumerate(bb.offsets):
            kc = index.get(da + db)
            if kc is not None:
                terms.append((ka, kb, kc))
    muls = len(terms) * ba.n_rows
    return BandProductPlan(result, muls, ba, bb, tuple(terms))


def _window(val: Array, lo: int, hi: int, shift: int, n: int) -> Array:
    """`val[lo:hi, shift + r]` for `r` in `0..n-1`, zero where out of range: a slice,
    padded with zeros where it leaves `val`."""
    rows, cols = val.shape
    start, stop = max(0, shift), min(cols, shift + n)
    if (lo, hi, start, stop) != (0, rows, 0, cols):
        val = lax.slice(val, (lo, start), (hi, stop))
    pad_lo, pad_hi = start - shift, shift + n - stop
    if pad_lo or pad_hi:
        zero = lax.full((), 0, val.dtype)
        val = lax.pad(val, zero, ((0, 0, 0), (pad_lo, pad_hi, 0)))
    return val


def _windows(val: Array, shifts: list[int], n: int):
    """A function `(row, shift) -> _window(val, row, row + 1, shift, n)` for shifts
    among `shifts`, reading slices of `val` padded once with the zeros every window
    needs, instead of padding each window (every pad is a separate loop on CPU)."""
    cols = val.shape[1]
    lo = max(0, -min(shifts))
    hi = max(0, max(shifts) + n - cols)
    if lo or hi:
        val = _window(val, 0, val.shape[0], -lo, cols + lo + hi)

    def window(row: int, shift: int) -> Array:
        start = shift + lo
        return lax.slice(val, (row, start), (row + 1, start + n))

    return window


def _contiguous(at: list[int]) -> bool:
    return at == list(range(at[0], at[0] + len(at)))


def _place(rows: Array, at: list[int], n_out: int) -> Array:
    """A `(n_out, n)` array holding `rows[j]` at row `at[j]` (contiguous), zero
    elsewhere."""
    if len(at) == n_out:
        return rows
    zero = lax.full((), 0, rows.dtype)
    return lax.pad(rows, zero, ((at[0], n_out - at[-1] - 1, 0), (0, 0, 0)))


# A product of an A with at least this many diagonals and a B with one is taken as one
# block. (With fewer diagonals of A, one row per term fuses as well and runs faster:
# the stacked windows index by division.)
BAND_A_ROWS = 4


def _as_one_block(plan: BandProductPlan) -> bool:
    """Whether `plan` is taken as one block: B has one diagonal, A several, and every
    diagonal of A lands on consecutive diagonals of the result."""
    if len(plan.band_b.offsets) != 1 or len(plan.band_a.offsets) < BAND_A_ROWS:
        return False
    kas = [ka for ka, _, _ in plan.terms]
    kcs = [kc for _, _, kc in plan.terms]
    return _contiguous(kas) and _contiguous(kcs)


def _stacked_windows(val: Array, row: int, shifts: list[int], n: int) -> Array:
    """`val[row, shift + r]` for each shift in `shifts` (one row each) and `r` in
    `0..n-1`, zero where out of range."""
    if len(shifts) == 1:
        return _window(val, row, row + 1, shifts[0], n)
    k = len(shifts)
    if shifts != list(range(shifts[0], shifts[0] + k)):
        rows = [_window(val, row, row + 1, shift, n) for shift in shifts]
        return lax.concatenate(rows, 0)
    # Consecutive shifts: the row, padded to the `m = n + k - 1` entries every window
    # reads, repeated `k + 1` times and read as `k` rows of `m + 1` entries starts
    # each row one entry later: `out[j, r] = row[r + j]`. One fusible expression, where
    # a concatenate of `k` windows would compile to `k` separate loops.
    m = n + k - 1
    row_vals = _window(val, row, row + 1, shifts[0], m).reshape(m)
    tiled = lax.broadcast_in_dim(row_vals, (k + 1, m), (1,)).reshape((k + 1) * m)
    rows = lax.slice(tiled, (0,), (k * (m + 1),)).reshape(k, m + 1)
    return lax.slice(rows, (0, 0), (k, n))


def band_product(a, b, plan: BandProductPlan, dtype):
    ta = to_band(a, plan.band_a, dtype)
    tb = to_band(b, plan.band_b, dtype)
    va, vb = ta.val.astype(dtype), tb.val.astype(dtype)
    n = plan.pattern.n_rows
    n_c = len(plan.pattern.offsets)
    # Where an operand has selected-away slots, each term is selected too, and a slot
    # of the result is selected away when all of its terms are.
    masked = ta.mask is not None or tb.mask is not None
    la, lb = _live_slots(ta), _live_slots(tb)  # constants unless masked
    kbs = [kb for _, kb, _ in plan.terms]
    kcs = [kc for _, _, kc in plan.terms]
    live = None
    if len(plan.band_a.offsets) == 1 and _contiguous(kbs) and _contiguous(kcs):
        # One diagonal of A (an elementwise partial or a shift): every diagonal of B
        # at once, as one broadcast multiply.
        da = plan.band_a.offsets[0]
        lo, hi = kbs[0], kbs[-1] + 1
        rows_b = _window(vb, lo, hi, da, n)
        block = lax.mul(
            lax.broadcast_in_dim(_window(va, 0, 1, 0, n), rows_b.shape, (0, 1)), rows_b
        )
        if masked:
            hit = lax.bitwise_and(_window(la, 0, 1, 0, n), _window(lb, lo, hi, da, n))
            block = lax.select(hit, block, lax.full_like(block, 0))
            live = _place(hit, kcs, n_c)
        val = _place(block, kcs, n_c)
    elif _as_one_block(plan):
        # One diagonal of B (a column scaling or a shift) and many of A (reverse mode
        # through a widening band): each diagonal of A meets B's row shifted by its
        # own offset, and each diagonal of the result has one term. The shifted rows
        # are stacked and multiplied by A's diagonals at once.
        kas = [ka for ka, _, _ in plan.terms]
        shifts = [plan.band_a.offsets[ka] for ka in kas]
        block = lax.mul(
            _window(va, kas[0], kas[-1] + 1, 0, n), _stacked_windows(vb, 0, shifts, n)
        )
        if masked:
            hit = lax.bitwise_and(
                _window(la, kas[0], kas[-1] + 1, 0, n),
                _stacked_windows(lb, 0, shifts, n),
            )
            block = lax.select(hit, block, lax.full_like(block, 0))
            live = _place(hit, kcs, n_c)
        val = _place(block, kcs, n_c)
    else:
        # Rows are kept as `(1, n)` arrays; A's are taken once per diagonal.
        acc: dict[int, Array] = {}
        hits: dict[int, Array] = {}
        rows_a: dict[int, Array] = {}
        live_a: dict[int, Array] = {}
        shifts = [plan.band_a.offsets[ka] for ka, _, _ in plan.terms]
        window_b = _windows(vb, shifts, n)
        live_b = _windows(lb, shifts, n) if masked else None
        for ka, kb, kc in plan.terms:
            # Entry (r, r + da) of A meets row r + da of B's diagonal kb.
            da = plan.band_a.offsets[ka]
            if ka not in rows_a:
                rows_a[ka] = _window(va, ka, ka + 1, 0, n)
            term = lax.mul(rows_a[ka], window_b(kb, da))
            if live_b is not None:
                if ka not in live_a:
                    live_a[ka] = _window(la, ka, ka + 1, 0, n)
                hit = lax.bitwise_and(live_a[ka], live_b(kb, da))
                term = lax.select(hit, term, lax.full_like(term, 0))
                hits[kc] = hit if kc not in hits else lax.bitwise_or(hits[kc], hit)
            acc[kc] = term if kc not in acc else lax.add(acc[kc], term)
        zeros = lax.full((1, n), 0, dtype)
        val = lax.concatenate([acc.get(k, zeros) for k in range(n_c)], 0)
        if masked:
            dead = lax.full((1, n), False, jnp.dtype(bool))
            live = lax.concatenate([hits.get(k, dead) for k in range(n_c)], 0)
    # Slots off the exact pattern stay exactly zero, as coordinates would leave them
    # (a term reaches them only through a zero slot of an operand, which is not a
    # zero against an infinite partial).
    stored = plan.pattern.stored
    if not stored.all():
        val = lax.select(jnp.asarray(stored), val, lax.full_like(val, 0))
    mask = None if live is None else lax.bitwise_not(live)
    return BandTensor(val, plan.pattern, jnp.dtype(dtype), mask)


def _live_slots(x: BandTensor) -> Array:
    """Where `x` stores a slot of its exact pattern that is not selected away."""
    live = jnp.asarray(x.pattern.stored)
    if x.mask is not None:
        live = lax.bitwise_and(live, lax.bitwise_not(x.mask))
    return live


@dataclasses.dataclass(frozen=True, eq=False)
class BandSumPlan:
    pattern: Any  # the result's BandPattern (Any: plans are read generically)
    adds: int
    band_a: BandPattern
    band_b: BandPattern
    has_val = True


@functools.lru_cache(maxsize=4096)
def band_sum_plan(pa: Any, pb: Any) -> BandSumPlan | None:
    """Plan `A + B` on bands, if both operands convert to bands and so does the
    result."""
    found = _banded_result(pa, pb, _sum_band)
    if found is None:
        return None
    ba, bb, result = found
    assert set(result.offsets) == set(ba.offsets) | set(bb.offsets)
    adds = len(set(ba.offsets) & set(bb.offsets)) * ba.n_rows
    return BandSumPlan(result, adds, ba, bb)


def band_add(a, b, plan: BandSumPlan, dtype):
    ta = to_band(a, plan.band_a, dtype)
    tb = to_band(b, plan.band_b, dtype)
    n = plan.pattern.n_rows
    n_c = len(plan.pattern.offsets)
    index = {d: k for k, d in enumerate(plan.pattern.offsets)}
    at_a = [index[d] for d in plan.band_a.offsets]
    at_b = [index[d] for d in plan.band_b.offsets]
    va, vb = ta.val.astype(dtype), tb.val.astype(dtype)
    if _contiguous(at_a) and _contiguous(at_b):
        val = lax.add(_place(va, at_a, n_c), _place(vb, at_b, n_c))
    else:
        zeros = jnp.zeros((n,), dtype)
        ia = dict(zip(at_a, range(len(at_a))))
        ib = dict(zip(at_b, range(len(at_b))))
        rows = []
        for k in range(n_c):
            xa = va[ia[k]] if k in ia else None
            xb = vb[ib[k]] if k in ib else None
            if xa is None:
                rows.append(zeros if xb is None else xb)
            else:
                rows.append(xa if xb is None else lax.add(xa, xb))
        val = jnp.stack(rows)
    mask = None
    if ta.mask is not None or tb.mask is not None:
        # Selected away where neither term has a live slot.
        la, lb = _live_slots(ta), _live_slots(tb)
        live = lax.bitwise_or(_place_slots(la, at_a, n_c), _place_slots(lb, at_b, n_c))
        mask = lax.bitwise_not(live)
    return BandTensor(val, plan.pattern, jnp.dtype(dtype), mask)


def _place_slots(live: Array, at: list[int], n_c: int) -> Array:
    """Rows of `live` at rows `at` of an `(n_c, n)` array, false elsewhere."""
    out = [None] * n_c
    for j, k in enumerate(at):
        out[k] = live[j]
    dead = jnp.zeros(live.shape[1:], bool)
    return jnp.stack([dead if row is None else row for row in out])
