"""Draw the sparsity pattern of a spring mesh's stiffness matrix for docs/sparse.md.

Nodes sit on a 10 x 10 grid, joined by springs along the grid lines and one diagonal
per cell. The forces are computed with gathers and `jax.ops.segment_sum` over constant
edge index arrays; their Jacobian comes from `graphax_eqx.jacve` as a sparse matrix,
and the plot shows the coordinates of `.to_bcoo()`.

    python docs/make_spy_plot.py            # writes docs/sparse_spy.png
    python docs/make_spy_plot.py out.png    # or any other path
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import graphax_eqx as gx


NX = NY = 10


def mesh(nx: int, ny: int):
    """Spring endpoints `i`, `j`, rest lengths and node positions of a grid mesh."""
    node = np.arange(nx * ny).reshape(ny, nx)
    pairs = [
        (node[:, :-1], node[:, 1:], 1.0),  # along x
        (node[:-1, :], node[1:, :], 1.0),  # along y
        (node[:-1, :-1], node[1:, 1:], np.sqrt(2.0)),  # one diagonal per cell
    ]
    i = np.concatenate([a.ravel() for a, _, _ in pairs])
    j = np.concatenate([b.ravel() for _, b, _ in pairs])
    rest = np.concatenate([np.full(a.size, r) for a, _, r in pairs])
    grid = np.stack(np.meshgrid(np.arange(nx), np.arange(ny)), axis=-1)
    x = 1.1 * grid.reshape(-1, 2) + 0.05 * np.sin(np.arange(2 * nx * ny)).reshape(-1, 2)
    return i, j, rest[:, None], jnp.asarray(x, jnp.float32)


def main(path: pathlib.Path) -> None:
    i, j, rest, x = mesh(NX, NY)
    n = NX * NY

    def forces(x):
        d = x[j] - x[i]
        length = jnp.sqrt(jnp.sum(d**2, axis=1, keepdims=True))
        f = (length - rest) * d / length
        return jax.ops.segment_sum(f, i, n) - jax.ops.segment_sum(f, j, n)

    jac = jax.jit(gx.jacve(forces, sparse_representation=True))(x)
    bcoo = jac.to_bcoo()
    idx = np.asarray(bcoo.indices)  # (nse, 4): node, coordinate, node, coordinate
    rows = idx[:, 0] * 2 + idx[:, 1]
    cols = idx[:, 2] * 2 + idx[:, 3]
    size = 2 * n

    plt.switch_backend("Agg")
    fig, ax = plt.subplots(figsize=(4.2, 4.4))
    ax.scatter(cols, rows, s=1.2, marker="s", linewidths=0, color="#303f9f")
    ax.set_xlim(-0.5, size - 0.5)
    ax.set_ylim(size - 0.5, -0.5)
    ax.set_aspect("equal")
    ax.set_xlabel("input (node, coordinate)")
    ax.set_ylabel("output (node, coordinate)")
    ax.set_title(
        f"{size} x {size} stiffness matrix, {bcoo.nse} structural nonzeros",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path} ({bcoo.nse} of {size * size} entries)")


if __name__ == "__main__":
    default = pathlib.Path(__file__).resolve().parent / "sparse_spy.png"
    main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else default)
