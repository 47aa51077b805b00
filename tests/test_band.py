"""Banded partials stored by diagonals (`graphax_eqx._band`).

Programs on 1-D arrays long enough for banded storage (`BAND_MIN_ROWS`) must give the
same Jacobians, structural nonzeros, NaN positions and operation counts as the exact
coordinate path, and match `jax.jacfwd`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import graphax_eqx as gx
from graphax_eqx import _band

from .helpers import ORDERS


N = _band.BAND_MIN_ROWS + 76


def _stencil(u):
    return u[2:] - 2 * u[1:-1] + u[:-2] + jnp.sin(u[1:-1]) ** 3


def _heat(u):
    for _ in range(3):
        mean = 0.5 * (u[1:] + u[:-1])
        flux = (1.0 + 0.5 * mean * mean) * (u[1:] - u[:-1])
        u = jnp.concatenate([u[:1], u[1:-1] + 0.2 * (flux[1:] - flux[:-1]), u[-1:]])
    return u


def _burgers(u):
    du = jnp.diff(u)
    return -u[1:] * du + 0.01 * jnp.diff(jnp.pad(du, (1, 0)))


def _wide(u):
    # A reach of three on each side, then a product of two banded factors.
    v = jnp.exp(0.1 * u[3:-3]) * (u[6:] - u[:-6]) + jnp.cos(u[2:-4]) * u[4:-2]
    return v[1:] * v[:-1]


PROGRAMS = {"stencil": _stencil, "heat": _heat, "burgers": _burgers, "wide": _wide}


def _input(dtype):
    x = np.linspace(0.1, 1.0, N) + 0.05 * np.sin(np.arange(N))
    return jnp.asarray(x, dtype)


def _without_bands(monkeypatch):
    monkeypatch.setattr(_band, "BAND_MIN_ROWS", 10**12)
    _clear()


def _clear():
    _band.band_of.cache_clear()
    _band.band_product_plan.cache_clear()
    _band.band_sum_plan.cache_clear()


@pytest.fixture
def count_band_products(monkeypatch):
    calls = []
    original = _band.band_product

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(_band, "band_product", counted)
    _clear()
    yield calls
    _clear()


@pytest.mark.parametrize("order", [o for o in ORDERS if o != "random"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_band_matches_jacfwd_and_coordinates(name, order, count_band_products):
    f = PROGRAMS[name]
    x = _input(jnp.float64)
    ref = np.asarray(jax.jacfwd(f)(x))
    sparse = jax.jit(gx.jacve(f, order=order, sparse_representation=True))(x)
    dense = gx.jacve(f, order=order)(x)
    if order != "auto":
        assert count_band_products, "the band path was not taken"
    np.testing.assert_allclose(np.asarray(sparse.dense()), ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(dense), ref, rtol=1e-10, atol=1e-12)
    # These programs have no accidental zeros: stored entries are the nonzeros.
    assert sparse.to_bcoo().nse == int(np.count_nonzero(ref))


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_band_counts_match_the_simulator(name):
    f = PROGRAMS[name]
    x = _input(jnp.float32)
    for order in ("fwd", "rev", "markowitz"):
        _, counts = gx.jacve(f, order=order, count_ops=True)(x)
        cost = gx.elimination_cost(f, order=order)(x)
        assert counts["num_muls"] == cost.num_muls
        assert counts["num_adds"] == cost.num_adds


def test_band_nan_positions_equal_coordinates(monkeypatch):
    # sqrt at 0 gives infinite partials inside the band.
    def f(u):
        for _ in range(3):
            s = jnp.sqrt(jnp.abs(u[1:-1]))
            lap = u[2:] - 2 * u[1:-1] + u[:-2]
            u = jnp.concatenate([u[:1], u[1:-1] + 0.1 * lap * s, u[-1:]])
        return u

    x = jnp.linspace(-1.0, 1.0, N).at[N // 2].set(0.0).at[100].set(0.0)
    with_bands = {o: np.asarray(gx.jacve(f, order=o)(x)) for o in ("fwd", "min_fill")}
    _without_bands(monkeypatch)
    for order, got in with_bands.items():
        want = np.asarray(gx.jacve(f, order=order)(x))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(
            np.nan_to_num(got, nan=0.0), np.nan_to_num(want, nan=0.0), rtol=1e-6
        )
    _clear()


def test_band_under_vmap_and_float32():
    f = _heat
    xs = jnp.stack([_input(jnp.float32), 0.5 * _input(jnp.float32)])
    got = jax.vmap(gx.jacve(f, order="min_fill"))(xs)
    want = jax.vmap(jax.jacfwd(f))(xs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-6)


def test_jacve_of_jacve_through_bands():
    def f(u):
        return jnp.sum(_stencil(u) ** 2)

    x = _input(jnp.float64)[:N]
    got = gx.jacve(gx.jacve(f, order="rev"), order="fwd")(x)
    want = jax.jacfwd(jax.jacrev(f))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-9, atol=1e-9)


def _producer(jaxpr) -> str:
    """The primitive that computes the program's (single) output."""
    (out,) = jaxpr.outvars
    (eqn,) = [e for e in jaxpr.eqns if out in e.outvars]
    return eqn.primitive.name


@pytest.mark.parametrize("name", ["stencil", "heat"])
def test_band_results_are_read_by_slices(name):
    # A banded result whose diagonals each hold one run of rows is handed out
    # diagonal by diagonal: slices of its values, no gather for XLA to fuse the last
    # product into.
    f = PROGRAMS[name]
    x = _input(jnp.float64)
    ref = np.asarray(jax.jacfwd(f)(x))
    for order in ("fwd", "rev", "min_fill"):
        jac = gx.jacve(f, order=order, sparse_representation=True)
        assert _producer(jax.make_jaxpr(jac)(x).jaxpr) == "concatenate"
        got = jac(x)
        bcoo = got.to_bcoo()
        rows, cols = np.asarray(bcoo.indices).T
        assert bcoo.nse == int(np.count_nonzero(ref))
        assert set(zip(rows.tolist(), cols.tolist())) == set(zip(*np.nonzero(ref)))
        np.testing.assert_allclose(np.asarray(bcoo.todense()), ref, rtol=1e-10)


def test_band_result_with_a_gap_in_a_diagonal():
    # Structural zeros inside the diagonals (entries replaced by constants): the
    # result is gathered from its band, and still exact.
    def f(u):
        return _stencil(jnp.concatenate([u[:100], jnp.full(40, 0.5), u[140:]]))

    x = _input(jnp.float64)
    ref = np.asarray(jax.jacfwd(f)(x))
    for order in ("fwd", "rev", "min_fill"):
        jac = gx.jacve(f, order=order, sparse_representation=True)
        assert _producer(jax.make_jaxpr(jac)(x).jaxpr) == "gather"
        got = jax.jit(jac)(x)
        assert got.to_bcoo().nse == int(np.count_nonzero(ref))
        np.testing.assert_allclose(np.asarray(got.dense()), ref, rtol=1e-12)


def test_band_results_claim_no_sorted_order_they_lack():
    # A banded result lists its entries by diagonal; scattering them to a dense
    # block must not tell XLA they are sorted (an accelerator may rely on it).
    def f(u):
        return u[2:] - 2 * u[1:-1] + u[:-2] + jnp.sin(u[1:-1]) ** 3

    x = jnp.linspace(0.1, 1.0, 1100, dtype=jnp.float32)
    jac = gx.jacve(f, order="fwd", sparse_representation=True)(x)
    p = jac.pattern
    flat = p.rows * p.n_in_free + p.cols
    assert not np.all(flat[1:] > flat[:-1])  # the case this test is about
    closed = jax.make_jaxpr(type(jac).dense)(jac)
    scatters = [e for e in closed.jaxpr.eqns if "scatter" in e.primitive.name]
    assert scatters
    assert not any(e.params["indices_are_sorted"] for e in scatters)
    np.testing.assert_allclose(jac.dense(), jax.jacfwd(f)(x), rtol=1e-5, atol=1e-6)


def test_band_products_as_one_block(monkeypatch):
    # Reverse mode multiplies a widening band by elementwise partials: one block
    # each. A `where` whose discarded branch has infinite partials (sqrt at 0) gives
    # selected-away slots, which must stay out of the result exactly as on
    # coordinates.
    def f(u):
        for _ in range(3):
            root = jnp.sqrt(jnp.abs(u[1:-1]))
            lap = u[2:] - 2 * u[1:-1] + u[:-2]
            step = jnp.where(u[1:-1] > 0.2, 0.1 * lap * root, 0.05 * lap)
            u = jnp.concatenate([u[:1], u[1:-1] + step, u[-1:]])
        return u

    taken = []
    original = _band._as_one_block

    def spy(plan):
        used = original(plan)
        taken.append(used)
        return used

    x = jnp.linspace(-1.0, 1.0, N).at[N // 2].set(0.0).at[100].set(0.0)
    ref = np.asarray(jax.jacfwd(f)(x))
    monkeypatch.setattr(_band, "_as_one_block", spy)
    _clear()
    got = {o: np.asarray(gx.jacve(f, order=o)(x)) for o in ("rev", "markowitz")}
    assert any(taken), "no product was taken as one block"
    _without_bands(monkeypatch)
    for order, value in got.items():
        want = np.asarray(gx.jacve(f, order=order)(x))
        np.testing.assert_array_equal(np.isnan(value), np.isnan(want))
        np.testing.assert_array_equal(np.isnan(value), np.isnan(ref))
        np.testing.assert_allclose(
            np.nan_to_num(value, nan=0.0), np.nan_to_num(ref, nan=0.0), rtol=1e-6
        )
    _clear()


@pytest.mark.parametrize("shifts", [[-3, -2, -1, 0, 1], [2, 3], [-1], [0, 2, 5]])
def test_stacked_windows(shifts):
    val = np.arange(3 * 12, dtype=np.float32).reshape(3, 12)
    n = 10
    got = np.asarray(_band._stacked_windows(jnp.asarray(val), 1, shifts, n))
    want = np.zeros((len(shifts), n), np.float32)
    for j, s in enumerate(shifts):
        for r in range(n):
            if 0 <= r + s < val.shape[1]:
                want[j, r] = val[1, r + s]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shifts", [[-3, 0, 2], [0], [1, 4], [-5, -1], [-2, 3]])
@pytest.mark.parametrize("n", [8, 10, 13])
def test_windows_read_one_padded_copy(shifts, n):
    val = np.arange(3 * 10, dtype=np.float32).reshape(3, 10) + 1
    window = _band._windows(jnp.asarray(val), shifts, n)
    for row in range(3):
        for shift in shifts:
            got = np.asarray(window(row, shift))
            want = np.asarray(_band._window(jnp.asarray(val), row, row + 1, shift, n))
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("gaps", [False, True])
def test_bands_from_diagonals_know_their_slots(gaps):
    # `_from_diagonals` fills in `positions` and `stored` from the masks it was
    # given; they must be what the band finds from its exact coordinates.
    n = _band.BAND_MIN_ROWS + 5
    rng = np.random.default_rng(3)
    masks = {d: np.ones(n, bool) for d in (-2, 0, 1, 4)}
    masks[-2][:2] = False  # columns r - 2 start at row 2
    masks[7] = np.zeros(n, bool)  # an empty diagonal is dropped
    if gaps:
        for m in masks.values():
            m &= rng.random(n) < 0.9
    band = _band._from_diagonals((n,), (n + 4,), masks)
    assert band is not None
    assert band.offsets == (-2, 0, 1, 4)
    fresh = _band.BandPattern(band.offsets, band.exact)
    np.testing.assert_array_equal(band.positions, fresh.positions)
    np.testing.assert_array_equal(band.stored, fresh.stored)
    # Coordinates in ascending row, then column.
    key = band.exact.rows * (n + 4) + band.exact.cols
    assert np.all(np.diff(key) > 0)
    for k, d in enumerate(band.offsets):
        np.testing.assert_array_equal(band.stored[k], masks[d])
