"""Complex intermediate values, as pairs of real vertices.

A real function may compute through complex values (`jnp.abs(jnp.fft.fft(x))`,
`jnp.linalg.eigvals`, `x * jnp.exp(1j * x)`). [`graphax_eqx._complex.realify`][]
rewrites such a program so that every complex variable becomes two real variables,
its real and imaginary parts, and every equation touching a complex value becomes a
[`graphax_eqx._complex.RealView`][] of it: the same primitive, seen as a function of
real arrays. The graph then only has real vertices and real edges.

Why real pairs rather than complex partials: a complex partial `∂w/∂z` is only the
derivative of a holomorphic map, and many maps here are not (`abs`, `real`, `conj`,
`angle`). Every one of them is real-linear in its tangent, so a 2x2 real block per
element (`∂(re w, im w)/∂(re z, im z)`) is exact for all of them. Operation counts are
then counts of real multiplications.

Elementwise primitives give 2x2 blocks of diagonals, from one forward probe per real
operand; linear ones (`real`, `imag`, `complex`, `conj`, `neg`, `add`, `sub`,
conversions) give pure ties. Every other primitive (`fft`, `dot_general`, reductions,
`eig`, `scan` with complex carries, ...) takes the exact dense fallback on its real
view.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _jax_private as jp
from ._rules import zero_derivative
from ._rules._base import shape_of
from ._rules.elementwise import _broadcast_partial, elementwise_primitives
from ._rules.fallback import _FORWARD_ONLY, _REVERSE_ONLY, dense_jacobian


if TYPE_CHECKING:
    from ._graph import Atom, Program


def _is_complex(dtype) -> bool:
    # Extended dtypes (PRNG keys) have no `kind`.
    return getattr(dtype, "kind", None) == "c"


def _atom_dtype(atom, avals):
    if isinstance(atom, int):
        return avals[atom][1]
    value = atom.value
    dtype = getattr(value, "dtype", None)
    return jnp.result_type(value) if dtype is None else dtype


def _real_dtype(dtype):
    return jnp.finfo(dtype).dtype


@dataclasses.dataclass(frozen=True)
class RealView:
    """A primitive seen as a function of real arrays only.

    Each complex operand of `prim` is passed as two real arrays (real part, then
    imaginary part), and each complex result comes back as two. `in_layout` and
    `out_layout` hold, per operand / result of `prim`, its complex dtype, or `None`
    when it is real (passed through unchanged).

    It duck-types as a JAX primitive (`bind`, `get_bind_params`, `multiple_results`)
    so that [`graphax_eqx._jax_private.bind`][] and the dense fallback work on it.
    """

    prim: Any
    in_layout: tuple[Any, ...]
    out_layout: tuple[Any, ...]

    multiple_results: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return str(self)

    def __str__(self) -> str:
        return f"{self.prim}[re,im]"

    def get_bind_params(self, params: dict[str, Any]) -> dict[str, Any]:
        return params

    def bind(self, *args, **params) -> list:
        it = iter(args)
        operands = []
        for layout in self.in_layout:
            if layout is None:
                operands.append(next(it))
            else:
                re, im = next(it), next(it)
                if jnp.shape(im) != jnp.shape(re):  # the zero of a promoted real
                    im = jnp.broadcast_to(im, jnp.shape(re))
                operands.append(lax.complex(re, im))
        assert next(it, None) is None
        outs = jp.bind(self.prim, params, *operands)
        results = []
        for out, layout in zip(outs, self.out_layout, strict=True):
            if layout is None:
                results.append(out)
            else:
                results.extend([lax.real(out), lax.imag(out)])
        return results

    def in_slots(self) -> list[tuple[int, ...]]:
        """For each operand of `prim`: the indices of its real arguments."""
        return _slots(self.in_layout)

    def out_slots(self) -> list[tuple[int, ...]]:
        """For each result of `prim`: the indices of its real results."""
        return _slots(self.out_layout)


def _slots(layout) -> list[tuple[int, ...]]:
    slots, k = [], 0
    for entry in layout:
        n = 1 if entry is None else 2
        slots.append(tuple(range(k, k + n)))
        k += n
    return slots


#
# The program transformation.
#


def _has_complex(program: Program) -> bool:
    from ._graph import Lit

    if any(map(_is_complex, {dtype for _, dtype in program.avals.values()})):
        return True
    return any(
        type(a) is Lit and _is_complex(_atom_dtype(a, None))
        for eqn in program.eqns
        for a in eqn.invars
    )


def _split_value(value) -> tuple[Any, Any]:
    if isinstance(value, jax.Array):  # tracers included
        return lax.real(value), lax.imag(value)
    value = np.asarray(value, dtype=jnp.result_type(value))
    return np.real(value), np.imag(value)


def realify(program: Program) -> Program:
    """Replace every complex variable of `program` by a pair of real variables.

    Equations touching a complex value become [`graphax_eqx._complex.RealView`][]
    equations on real variables; complex literals become pairs of real literals.
    Complex program inputs and closed-over arrays (never differentiated) are split by
    leading `real` / `imag` equations where first used, and complex outputs are
    rebuilt by a trailing `complex` equation, so the program's interface is unchanged.
    A program without complex values is returned as it is.
    """
    from ._graph import Eqn, Lit

    if not _has_complex(program):
        return program
    avals = dict(program.avals)
    fresh = itertools.count(max(avals, default=-1) + 1)
    pairs: dict[int, tuple[Atom, Atom]] = {}
    defined: set[int] = set()  # complex variables whose equation was rewritten
    promoted: dict[int, Eqn] = {}  # complex variables that are real ones converted
    eqns: list[Eqn] = []

    def new_pair(v: int) -> tuple[int, int]:
        shape, dtype = avals[v]
        re, im = next(fresh), next(fresh)
        avals[re] = avals[im] = (shape, _real_dtype(dtype))
        pairs[v] = (re, im)
        return re, im

    def promotion(eqn: Eqn) -> bool:
        """Whether `eqn` converts a real value to complex of the same precision."""
        if eqn.prim is not lax.convert_element_type_p:
            return False
        (a,), (v,) = eqn.invars, eqn.outvars
        return _atom_dtype(a, avals) == _real_dtype(avals[v][1])

    def split(atom: Atom) -> tuple[Atom, Atom]:
        if isinstance(atom, Lit):
            re, im = _split_value(atom.value)
            return Lit(re), Lit(im)
        if atom not in pairs:
            re, im = new_pair(atom)
            eqns.append(Eqn(lax.real_p, {}, (atom,), (re,)))
            eqns.append(Eqn(lax.imag_p, {}, (atom,), (im,)))
        return pairs[atom]

    for eqn in program.eqns:
        in_dtypes = [_atom_dtype(a, avals) for a in eqn.invars]
        if not any(map(_is_complex, in_dtypes)) and not any(
            _is_complex(avals[v][1]) for v in eqn.outvars
        ):
            eqns.append(eqn)
            continue
        if promotion(eqn):
            # Its real part is the real value and its imaginary part a constant
            # zero: no vertex, and no partials with respect to a zero.
            (a,), (v,) = eqn.invars, eqn.outvars
            pairs[v] = (a, Lit(np.zeros((), _real_dtype(avals[v][1]))))
            defined.add(v)
            promoted[v] = eqn
            continue
        in_layout, args = [], []
        for a, dtype in zip(eqn.invars, in_dtypes, strict=True):
            if _is_complex(dtype):
                in_layout.append(np.dtype(dtype))
                args.extend(split(a))
            else:
                in_layout.append(None)
                args.append(a)
        out_layout, outs = [], []
        for v in eqn.outvars:
            dtype = avals[v][1]
            if _is_complex(dtype):
                out_layout.append(np.dtype(dtype))
                outs.extend(new_pair(v))
                defined.add(v)
            else:
                out_layout.append(None)
                outs.append(v)
        view = RealView(eqn.prim, tuple(in_layout), tuple(out_layout))
        if eqn.prim in zero_derivative:
            zero_derivative.add(view)
        eqns.append(Eqn(view, eqn.params, tuple(args), tuple(outs)))
    rebuilt = set()
    for atom in program.outvars:
        if isinstance(atom, int) and atom in pairs and atom not in rebuilt:
            if atom in promoted:
                eqns.append(promoted[atom])
            elif atom in defined:
                eqns.append(Eqn(lax.complex_p, {}, pairs[atom], (atom,)))
            rebuilt.add(atom)
    for v in defined - rebuilt:
        del avals[v]
    return dataclasses.replace(program, eqns=tuple(eqns), avals=avals)


#
# The rule of a real view.
#


# Elementwise primitives that only exist for complex values.
_COMPLEX_ELEMENTWISE = {lax.real_p, lax.imag_p, lax.complex_p, lax.conj_p}
_ELEMENTWISE = elementwise_primitives | _COMPLEX_ELEMENTWISE

# Linear elementwise primitives `out = sum_i scale_i * operand_i`, part by part.
_SUM_SCALES = {
    lax.add_p: (1, 1),
    jp.add_any_p: (1, 1),
    lax.sub_p: (1, -1),
    lax.neg_p: (-1,),
    lax.convert_element_type_p: (1,),
    lax.reduce_precision_p: (1,),
    lax.copy_p: (1,),
    jp.compute_once_p: (1,),
    jp.write_apart_p: (1,),
}


def _parts(layout) -> tuple[int, ...]:
    return (0,) if layout is None else (0, 1)


def _linear_terms(view: RealView) -> list[tuple[int, int, int, int]] | None:
    """The constant partials of a linear elementwise primitive, else `None`.

    As `(result part, operand, operand part, scale)`, part 0 being the real part and
    part 1 the imaginary part; parts not listed do not depend on each other.
    """
    prim = view.prim
    if len(view.out_layout) != 1:
        return None
    (out_layout,) = view.out_layout
    if prim is lax.real_p:
        return [(0, 0, 0, 1)]
    if prim is lax.imag_p:
        return [(0, 0, 1, 1)]
    if prim is lax.complex_p:
        return [(0, 0, 0, 1), (1, 1, 0, 1)]
    if prim is lax.conj_p:
        return [(p, 0, p, 1 if p == 0 else -1) for p in _parts(view.in_layout[0])]
    scales = _SUM_SCALES.get(prim)
    if scales is None:
        return None
    out_parts = _parts(out_layout)
    return [
        (p, i, p, scale)
        for i, (layout, scale) in enumerate(zip(view.in_layout, scales, strict=True))
        for p in _parts(layout)
        if p in out_parts
    ]


def _broadcasts_to(in_shape, out_shape) -> bool:
    """Whether an operand of `in_shape` meets each output element once."""
    if in_shape == () or in_shape == out_shape:
        return True
    return len(in_shape) == len(out_shape) and all(
        a in (1, b) for a, b in zip(in_shape, out_shape, strict=True)
    )


def _elementwise(view: RealView, primals, outs) -> bool:
    if view.prim not in _ELEMENTWISE:
        return False
    out_shape = shape_of(outs[0])
    return all(shape_of(o) == out_shape for o in outs) and all(
        _broadcasts_to(shape_of(x), out_shape) for x in primals
    )


def realview_rule(view: RealView):
    """The rule for a real view: 2x2 blocks of diagonals, else the dense fallback."""
    if view.prim in _FORWARD_ONLY:
        modes = ("fwd",)
    elif view.prim in _REVERSE_ONLY:
        modes = ("rev",)
    else:
        modes = None
    terms = _linear_terms(view)
    in_slots, out_slots = view.in_slots(), view.out_slots()

    def rule(primals, active, **params):
        outs = view.bind(*primals, **params)
        if not _elementwise(view, primals, outs):
            return outs, dense_jacobian(view, params, primals, active, outs, modes)
        out_shape = shape_of(outs[0])
        partials = {}
        if terms is not None:
            for out_part, i, in_part, scale in terms:
                k, j = out_slots[0][out_part], in_slots[i][in_part]
                if active[j]:
                    dtype = outs[k].dtype
                    val = None if scale == 1 else jnp.asarray(scale, dtype)
                    partials[(k, j)] = _broadcast_partial(
                        val, out_shape, shape_of(primals[j]), dtype
                    )
            return outs, partials
        float_outs = [
            k for k, o in enumerate(outs) if jnp.issubdtype(o.dtype, jnp.floating)
        ]
        for j, a in enumerate(active):
            if not a:
                continue

            def f(xj, j=j):
                args = list(primals)
                args[j] = xj
                res = view.bind(*args, **params)
                return [res[k] for k in float_outs]

            x = primals[j]
            _, tangents = jax.jvp(f, (x,), (jnp.ones_like(x),))
            for k, t in zip(float_outs, tangents, strict=True):
                dtype = outs[k].dtype
                partials[(k, j)] = _broadcast_partial(
                    t.astype(dtype), out_shape, shape_of(x), dtype
                )
        return outs, partials

    return rule
