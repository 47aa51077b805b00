"""Inspect the Jacobians of an Equinox model, layer by layer.

For a small `eqx.nn.MLP` this computes, with `graphax_eqx`:

1. the Jacobian of the model output with respect to every layer's parameters, in one
   call to `filter_jacve`, shaped like the model;
2. the Jacobian of each layer's output with respect to that layer's input.

It prints a table per kind (shape, norm, fraction of exact zeros), shows the
structure vertex elimination keeps for a layer's weight Jacobian
(`sparse_representation=True`), and saves a figure of the Jacobian magnitudes.

Run with `python examples/per_layer_jacobians.py --out jacobians.png`.
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import matplotlib

import graphax_eqx as gx


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def zero_fraction(array):
    return float(jnp.mean(array == 0))


def layer_function(model, i):
    """The map from the input of layer `i` to its (activated) output."""
    last = i == len(model.layers) - 1
    activation = model.final_activation if last else model.activation
    return lambda layer, h: activation(layer(h))


def parameter_jacobians(model, x):
    jac = gx.filter_jacve(lambda m, x: m(x))(model, x)
    rows = []
    for i, layer_jac in enumerate(jac.layers):
        for name in ("weight", "bias"):
            leaf = getattr(layer_jac, name)
            if leaf is not None:
                rows.append((f"layers[{i}].{name}", leaf))
    return jac, rows


def input_jacobians(model, x):
    """Each layer's input-output Jacobian, and the activations along the way."""
    rows = []
    h = x
    for i, layer in enumerate(model.layers):
        f = layer_function(model, i)
        # Differentiate with respect to the input `h` (argument 1) only.
        jac = gx.eqx_jacve(f, argnums=1)(layer, h)
        rows.append((f"layers[{i}]", h, jac))
        h = f(layer, h)
    return rows


def print_table(title, rows):
    print(f"\n{title}")
    print(f"{'':<18}{'shape':<16}{'norm':>10}{'zeros':>9}")
    for name, array in rows:
        print(
            f"{name:<18}{str(array.shape):<16}{float(jnp.linalg.norm(array)):>10.4f}"
            f"{zero_fraction(array):>9.1%}"
        )


def show_structure(model, x):
    # The Jacobian of a linear layer with respect to its weight is mostly zeros:
    # output row r depends only on weight row r. The sparse representation keeps
    # that as a tie between the two axes instead of storing the zeros.
    layer = model.layers[0]
    jac = gx.filter_jacve(lambda l, x: l(x), sparse_representation=True)(layer, x)
    print("\nStructure of d layers[0](x) / d layers[0].weight")
    print(f"  {jac.weight!r}")
    dense = jac.weight.dense()
    print(
        f"  dense shape {dense.shape}, {zero_fraction(dense):.1%} zeros, stored "
        f"values {sum(v.size for v in jax.tree.leaves(jac.weight))} of {dense.size}"
    )


def plot(param_jac, input_rows, path):
    plt.rcParams.update({"font.size": 11, "axes.titlesize": 11})
    # One column per layer: |d out / d weight| and |d out / d bias| summed over the
    # model outputs, then the layer's own input-output Jacobian.
    n = len(param_jac.layers)
    fig, axes = plt.subplots(3, n, figsize=(4.0 * n, 10.5), squeeze=False)
    for i, (layer_jac, (_, _, in_jac)) in enumerate(zip(param_jac.layers, input_rows)):
        weight = jnp.abs(layer_jac.weight).sum(axis=0)
        image = axes[0, i].imshow(weight, cmap="viridis", aspect="auto")
        fig.colorbar(image, ax=axes[0, i], fraction=0.046)
        axes[0, i].set_title(f"|d out / d layers[{i}].weight|")
        axes[0, i].set_xlabel("fan in")
        axes[0, i].set_ylabel("fan out")

        bias = jnp.abs(layer_jac.bias).sum(axis=0)
        axes[1, i].bar(range(bias.shape[0]), bias, color="tab:blue")
        axes[1, i].set_title(f"|d out / d layers[{i}].bias|")
        axes[1, i].set_xlabel("fan out")

        image = axes[2, i].imshow(jnp.abs(in_jac), cmap="magma", aspect="auto")
        fig.colorbar(image, ax=axes[2, i], fraction=0.046)
        axes[2, i].set_title(f"|d layers[{i}](h) / d h|")
        axes[2, i].set_xlabel("input")
        axes[2, i].set_ylabel("output")
    for ax in axes.ravel():
        # Rows and columns are array indices: whole numbers only.
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (*axes[0], *axes[2]):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle("Per-layer Jacobian magnitudes", fontsize=14)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="per_layer_jacobians.png")
    parser.add_argument("--in-size", type=int, default=6)
    parser.add_argument("--out-size", type=int, default=3)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    model_key, x_key = jr.split(jr.PRNGKey(args.seed))
    model = eqx.nn.MLP(
        args.in_size,
        args.out_size,
        width_size=args.width,
        depth=args.depth,
        activation=jax.nn.relu,
        key=model_key,
    )
    x = jr.normal(x_key, (args.in_size,))

    param_jac, param_rows = parameter_jacobians(model, x)
    print_table(
        "Jacobian of the model output w.r.t. each layer's parameters", param_rows
    )
    input_rows = input_jacobians(model, x)
    print_table(
        "Jacobian of each layer's output w.r.t. its input",
        [(name, jac) for name, _, jac in input_rows],
    )
    show_structure(model, x)
    plot(param_jac, input_rows, args.out)
    print(f"\nsaved figure to {args.out}")


if __name__ == "__main__":
    main()
