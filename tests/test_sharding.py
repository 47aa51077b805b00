"""`jacve` on sharded inputs, on meshes with Explicit and with Auto axes.

The host device count must be set before JAX starts, so the checks run in a fresh
process (one per mesh kind, many checks each) that prints one line per failure.
Each result is compared with `jax.jacrev` (or `eqx.filter_value_and_grad`): values,
types (`jax.typeof`, which carry shardings on Explicit axes), and the concrete
`.sharding`: always on Explicit meshes; on Auto meshes for eager calls only, since
under `jit` the partitioner places results of both.
"""

import textwrap

import pytest

from .helpers import run_on_host_devices


_SCRIPT = textwrap.dedent(
    """
    import sys, traceback
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import graphax_eqx as gx

    KIND = sys.argv[1]
    EXPLICIT = KIND == "explicit"
    failures = []
    checked = [0]

    def compare(got, want, placement):
        got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
        if jax.tree.structure(got) != jax.tree.structure(want):
            return f"structure {jax.tree.structure(got)} != {jax.tree.structure(want)}"
        for g, w in zip(got_leaves, want_leaves):
            if g.shape != w.shape or not np.allclose(
                np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6
            ):
                return f"values differ ({g.shape} vs {w.shape})"
            if jax.typeof(g) != jax.typeof(w):
                return f"type {jax.typeof(g)} != {jax.typeof(w)}"
            if placement and not g.sharding.is_equivalent_to(w.sharding, g.ndim):
                return f"sharding {g.sharding.spec} != {w.sharding.spec}"
        return None

    def check(name, fn, ref, placement=True):
        checked[0] += 1
        try:
            want = ref()
        except Exception as e:
            failures.append(f"{name}: reference raised {type(e).__name__}: {e}")
            return
        try:
            problem = compare(fn(), want, placement and (EXPLICIT or not jit_))
        except Exception as e:
            problem = "".join(traceback.format_exception_only(e)).strip()[-600:]
        if problem:
            failures.append(f"{name}: {problem}")

    axis_type = AxisType.Explicit if EXPLICIT else AxisType.Auto
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(axis_type,))
    batch = NamedSharding(mesh, P("batch"))
    x = jax.device_put(jnp.linspace(-1.0, 1.0, 16, dtype=jnp.float32), batch)
    xb = jax.device_put(
        jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32).reshape(8, 4), batch
    )
    W = jnp.linspace(0.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)

    def per_example(v):
        return jnp.tanh(W @ v) * jnp.sum(v**2)

    def batched(X):
        return jnp.sin(X) * jnp.sum(X**2, axis=1, keepdims=True)

    def mapped(v):
        spec = P("batch")
        sin = jax.shard_map(jnp.sin, mesh=mesh, in_specs=spec, out_specs=spec)
        return sin(v) * v

    def control(X):
        c, _ = jax.lax.scan(lambda c, r: (c * jnp.cos(r), None), jnp.ones(8), X.T)
        y = jax.lax.cond(jnp.sum(X) > 0, jnp.sin, jnp.cos, X)
        z = jax.lax.fori_loop(0, 3, lambda i, z: jnp.sin(z), X)
        return (y + z) * c[:, None]

    def structural(X):
        # Gather, pad, select, reductions (params such as `GatherDimensionNumbers`).
        Y = jnp.pad(X, ((0, 0), (1, 1)))[:, jnp.array([0, 2, 3])]
        Z = jax.nn.softmax(jnp.where(Y > 0, Y, jnp.sin(Y)), axis=-1)
        return Z * jnp.linalg.norm(X)

    two = jnp.stack([x, 2 * x])
    jit_ = False
    for order in ("fwd", "rev", "auto"):
        check(
            f"vmap per-example {order}",
            lambda: jax.vmap(gx.jacve(per_example, order=order))(xb),
            lambda: jax.vmap(jax.jacrev(per_example))(xb),
        )
        check(
            f"batched {order}",
            lambda: gx.jacve(batched, order=order)(xb),
            lambda: jax.jacrev(batched)(xb),
        )
        check(
            f"shard_map {order}",
            lambda: gx.jacve(mapped, order=order)(x),
            lambda: jax.jacrev(mapped)(x),
        )
    check(
        "shard_map vmap",
        lambda: jax.vmap(gx.jacve(mapped))(two),
        lambda: jax.vmap(jax.jacrev(mapped))(two),
    )
    check(
        "control flow",
        lambda: gx.jacve(control)(xb),
        lambda: jax.jacrev(control)(xb),
    )

    def updated_in_a_loop(X):
        # An update slice in a loop body that reads its operand through a reshape,
        # which XLA CPU applies wrongly unless the update is written apart.
        def step(c, t):
            c = c.reshape(8, 4, 1)
            c = jnp.where(c > 0, c, 0.5 * c)
            update = jnp.tanh(c[:, :3, 0])
            return jax.lax.dynamic_update_slice(c.reshape(8, 4), update, (0, t % 2))

        return jax.lax.scan(lambda c, t: (step(c, t), None), X, jnp.arange(3))[0]

    # (On Explicit axes, `jax.jacrev` of it needs `jax.set_mesh`, as `jacve` does.)
    for order in ("fwd", "rev") if not EXPLICIT else ():
        check(
            f"update slice in a loop {order}",
            lambda: gx.jacve(updated_in_a_loop, order=order)(xb),
            lambda: jax.jacrev(updated_in_a_loop)(xb),
        )
    check(
        "value_and_jacve has_aux",
        lambda: gx.value_and_jacve(
            lambda X, y: (batched(X) * y, jnp.sum(X)), argnums=(0, 1), has_aux=True
        )(xb, 2.0),
        lambda: (
            (batched(xb) * 2.0, jnp.sum(xb)),
            jax.jacrev(lambda X, y: batched(X) * y, argnums=(0, 1))(xb, 2.0),
        ),
    )
    check(
        "sparse_representation",
        lambda: gx.jacve(batched, sparse_representation=True)(xb).dense(),
        lambda: jax.jacrev(batched)(xb),
        placement=False,
    )

    jit_ = True
    check(
        "batched jit",
        lambda: jax.jit(gx.jacve(batched))(xb),
        lambda: jax.jit(jax.jacrev(batched))(xb),
    )
    check(
        "shard_map jit",
        lambda: jax.jit(gx.jacve(mapped))(x),
        lambda: jax.jit(jax.jacrev(mapped))(x),
    )
    sparse_dense = lambda X: gx.jacve(batched, sparse_representation=True)(X).dense()
    check(
        "sparse_representation jit",
        lambda: jax.jit(sparse_dense)(xb),
        lambda: jax.jacrev(batched)(xb),
        placement=False,
    )

    # Coordinate blocks (their values stored by entry, not along the sharded axis):
    # `.dense()` is typed as `jax.jacrev`'s leaf.
    def rolled(X):
        return jnp.roll(X, 1, axis=-1) - 2 * X + jnp.roll(X, -1, axis=-1) + jnp.sin(X)

    def columns(X):
        return jnp.stack([X[:, 1] * X[:, 0], jnp.sin(X[:, 2]), X[:, 3] ** 2], axis=1)

    for fn in (rolled, columns):
        for order in ("rev", "auto"):
            for jit_ in (False, True):
                wrap = jax.jit if jit_ else (lambda f: f)
                sparse = gx.jacve(fn, order=order, sparse_representation=True)
                check(
                    f"sparse {fn.__name__} {order} jit={jit_}",
                    lambda: wrap(lambda X: sparse(X).dense())(xb),
                    lambda: jax.jacrev(fn)(xb),
                    placement=False,
                )
    jit_ = True

    # A linear map: its Jacobian is computed from constants alone, on one device, and
    # under `jit` the program uses none of its arguments (JAX refuses to lower a
    # program typed on a mesh that uses no argument). On Auto axes the placement of
    # such a constant is the partitioner's choice: types and values compared.
    linear = lambda v: jnp.convolve(v, jnp.array([1.0, -2.0, 0.5]), mode="same")
    for jit_ in (False, True):
        wrap = jax.jit if jit_ else (lambda f: f)
        # Under `jit`, `jax.jacrev` types this constant unsharded where its eager
        # call shards it: there values alone are compared.
        plain = np.asarray if jit_ else (lambda a: a)
        for order in ("rev", "auto"):
            check(
                f"linear map {order} jit={jit_}",
                lambda: plain(wrap(gx.jacve(linear, order=order))(x)),
                lambda: plain(wrap(jax.jacrev(linear))(x)),
                placement=EXPLICIT and not jit_,
            )
        check(
            f"linear map sparse jit={jit_}",
            lambda: np.asarray(
                wrap(lambda v: gx.jacve(linear, sparse_representation=True)(v).dense())(
                    x
                )
            ),
            lambda: np.asarray(jax.jacrev(linear)(x)),
            placement=False,
        )

    # `with_sharding_constraint`: on Explicit axes JAX allows it only as an assertion,
    # and `jax.jacrev` then fails, so there it constrains an Auto axis of a mixed mesh.
    if EXPLICIT:
        mixed = jax.make_mesh(
            (4, 2), ("batch", "model"), axis_types=(AxisType.Explicit, AxisType.Auto)
        )
        arg = jnp.linspace(-1.0, 1.0, 8)
        arg = jax.device_put(arg, NamedSharding(mixed, P("batch")))
        hint = NamedSharding(mixed, P(None, "model"))
        w = jnp.linspace(0.0, 1.0, 4)

        def constrained(v):
            return jnp.sin(jax.lax.with_sharding_constraint(jnp.outer(v, w), hint))

    else:
        def constrained(v):
            return jax.lax.with_sharding_constraint(jnp.sin(v), batch) * v

        arg = x
    jit_ = False
    # On the mixed mesh the Auto axis is placed by the partitioner: types compared.
    check(
        "with_sharding_constraint",
        lambda: gx.jacve(constrained)(arg),
        lambda: jax.jacrev(constrained)(arg),
        placement=not EXPLICIT,
    )
    jit_ = True
    check(
        "with_sharding_constraint jit",
        lambda: jax.jit(gx.jacve(constrained))(arg),
        lambda: jax.jit(jax.jacrev(constrained))(arg),
        placement=False,
    )

    # Data-parallel training: replicated model, batch sharded, under the mesh.
    with jax.set_mesh(mesh):
        model = eqx.nn.MLP(4, 1, 8, 2, key=jax.random.PRNGKey(0))
        target = jnp.linspace(0.0, 1.0, 8).reshape(8, 1)
        loss = lambda m, X: jnp.mean((jax.vmap(m)(X) - target) ** 2)
        jit_ = True
        check(  # `jax.jacrev` needs the mesh set here
            "structural ops",
            lambda: jax.jit(gx.jacve(structural))(xb),
            lambda: jax.jit(jax.jacrev(structural))(xb),
        )
        jit_ = False
        check(  # eager operations under `vmap` place new arrays on the set mesh
            "vmap per-example, mesh set",
            lambda: jax.vmap(gx.jacve(per_example))(xb),
            lambda: jax.vmap(jax.jacrev(per_example))(xb),
        )
        check(
            "filter_value_and_jacve",
            lambda: gx.filter_value_and_jacve(loss)(model, xb),
            lambda: eqx.filter_value_and_grad(loss)(model, xb),
        )
        jit_ = True
        check(
            "filter_jacve",
            lambda: eqx.filter_jit(gx.filter_jacve(loss))(model, xb),
            lambda: eqx.filter_jit(eqx.filter_grad(loss))(model, xb),
        )
        both = lambda mx: loss(*mx)
        check(
            "eqx_jacve",
            lambda: eqx.filter_jit(gx.eqx_jacve(loss, argnums=(0, 1)))(model, xb),
            lambda: eqx.filter_jit(eqx.filter_grad(both))((model, xb)),
        )
        optim = optax.adam(1e-2)

        def train(value_and_grad):
            @eqx.filter_jit
            def step(m, state, X):
                value, grads = value_and_grad(loss)(m, X)
                updates, state = optim.update(grads, state, m)
                return eqx.apply_updates(m, updates), state, value

            m, state, values = model, optim.init(eqx.filter(model, eqx.is_array)), []
            for _ in range(3):
                m, state, value = step(m, state, xb)
                values.append(value)
            return eqx.filter(m, eqx.is_array), values

        check(
            "optax adam steps",
            lambda: train(gx.filter_value_and_jacve),
            lambda: train(eqx.filter_value_and_grad),
        )

    # Collectives over the axes of a `shard_map` that `jacve` runs inside: JAX's own
    # modes disagree there (`psum(sin(x)) * x` gives three different answers), so
    # they are refused; the whole map's Jacobian, and the data-parallel pattern the
    # error message names, agree with `jax.jacrev`.
    def refused(name, fn):
        checked[0] += 1
        try:
            fn()
        except TypeError as e:
            if "cannot differentiate through the collective" not in str(e):
                failures.append(f"{name}: unclear error {e}")
        except Exception as e:
            failures.append(f"{name}: {type(e).__name__}: {e}")
        else:
            failures.append(f"{name}: no error")

    spec = P("batch")
    collective = lambda v: jax.lax.psum(jnp.sin(v), "batch") * v
    local_loss = lambda w, X: jnp.mean(jnp.tanh(X @ w) ** 2)
    w4 = jnp.linspace(-0.5, 0.5, 4)
    jit_ = True
    for order in ("fwd", "rev", "auto"):
        refused(
            f"psum inside shard_map {order}",
            lambda: jax.jit(
                jax.shard_map(
                    gx.jacve(collective, order=order),
                    mesh=mesh,
                    in_specs=spec,
                    out_specs=spec,
                )
            )(x),
        )
        whole = jax.shard_map(collective, mesh=mesh, in_specs=spec, out_specs=spec)
        check(
            f"Jacobian of a whole shard_map with a psum {order}",
            lambda: jax.jit(gx.jacve(whole, order=order))(x),
            lambda: jax.jit(jax.jacrev(whole))(x),
        )
    refused(
        "replicated argument inside shard_map",
        lambda: jax.jit(
            jax.shard_map(
                lambda w, X: gx.jacve(local_loss)(w, X)[None],
                mesh=mesh,
                in_specs=(P(), spec),
                out_specs=spec,
            )
        )(w4, xb),
    )

    def data_parallel(w, X):
        w = jax.lax.pcast(w, "batch", to="varying")
        return jax.lax.psum(gx.jacve(local_loss)(w, X), "batch")

    check(
        "data-parallel Jacobian summed over the batch axis",
        lambda: jax.jit(
            jax.shard_map(data_parallel, mesh=mesh, in_specs=(P(), spec), out_specs=P())
        )(w4, xb),
        lambda: jax.jit(
            jax.shard_map(
                jax.jacrev(local_loss), mesh=mesh, in_specs=(P(), spec), out_specs=P()
            )
        )(w4, xb),
        placement=False,
    )

    for failure in failures:
        print("FAIL " + failure.replace("\\n", " | "))
    print(f"CHECKED {checked[0]}")
    """
)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_sharded_inputs(kind):
    # Each mesh kind in a fresh process of its own, so that pytest-xdist can run the
    # two side by side (the checks are mostly single-threaded compilation).
    lines = run_on_host_devices(_SCRIPT, kind).splitlines()
    assert any(line.startswith("CHECKED ") for line in lines), lines[-20:]
    failures = [line for line in lines if line.startswith("FAIL ")]
    assert not failures, "\n".join(failures)
