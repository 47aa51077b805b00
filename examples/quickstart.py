"""Quickstart: train an Equinox MLP with gradients from vertex elimination.

Fits a small `eqx.nn.MLP` to a synthetic regression problem with `optax`, taking
gradients with `graphax_eqx.filter_value_and_jacve` inside `eqx.filter_jit`. Then it
looks at the trained model: the Jacobian of its output with respect to every layer,
and how many multiplications each elimination order needs for the same Jacobian.

Run with `python examples/quickstart.py`; `--help` lists the size options.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import graphax_eqx as gx


def make_data(key, num_samples):
    x = jr.uniform(key, (num_samples, 2), minval=-2.0, maxval=2.0)
    y = jnp.sin(x[:, :1]) * jnp.cos(x[:, 1:]) + 0.1 * x[:, :1]
    return x, y


def loss(model, x, y):
    pred = jax.vmap(model)(x)
    return jnp.mean((pred - y) ** 2)


def train(model, x, y, *, steps, learning_rate, print_every):
    optim = optax.adam(learning_rate)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    # One elimination pass gives both the loss and its gradient; `filter_jit` traces
    # and eliminates once, later steps reuse the compiled program.
    loss_and_grad = eqx.filter_jit(gx.filter_value_and_jacve(loss))

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        value, grads = loss_and_grad(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, value

    start = time.perf_counter()
    for i in range(steps):
        model, opt_state, value = step(model, opt_state, x, y)
        if i % print_every == 0 or i == steps - 1:
            print(f"step {i:4d}   loss {float(value):.5f}")
    print(f"trained {steps} steps in {time.perf_counter() - start:.1f}s")
    return model


def describe_jacobians(model, x):
    # Jacobian of the model output (shape (1,)) with respect to every parameter,
    # shaped like the model: each leaf has shape (1,) + parameter.shape.
    jac = gx.filter_jacve(lambda m, x: m(x))(model, x)
    print("\nJacobian of model(x) with respect to each layer")
    print(f"{'layer':<7}{'param':<8}{'param shape':<14}{'jacobian shape':<17}norm")
    for i, layer in enumerate(jac.layers):
        for name in ("weight", "bias"):
            leaf = getattr(layer, name)
            param = getattr(model.layers[i], name)
            print(
                f"{i:<7}{name:<8}{str(param.shape):<14}{str(leaf.shape):<17}"
                f"{float(jnp.linalg.norm(leaf)):.4f}"
            )
    print(f"non-array leaves stay None, e.g. jac.activation = {jac.activation}")


def compare_orders(model, x, y):
    print("\nMultiplications needed by each elimination order")
    tasks = {
        "gradient of the loss": (loss, (x, y)),
        "Jacobian of model(x)": (lambda m, x: m(x), (x[0],)),
    }
    for task, (fun, args) in tasks.items():
        print(f"  {task}:")
        chosen = {}
        for order in ("fwd", "rev", "markowitz", "auto"):
            _, counts = gx.filter_jacve(fun, order=order, count_ops=True)(model, *args)
            chosen[order] = counts["order"]
            note = ""
            if order == "auto":
                # "auto" reports the vertex order it ran; name the strategy it matches.
                same = [
                    o for o in chosen if o != "auto" and chosen[o] == chosen["auto"]
                ]
                note = f"  (chose {same[0]})" if same else ""
            print(f"    {order:<10} {counts['num_muls']:>12,d}{note}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--print-every", type=int, default=50)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=5e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    data_key, model_key = jr.split(jr.PRNGKey(args.seed))
    x, y = make_data(data_key, args.samples)
    model = eqx.nn.MLP(
        2,
        1,
        width_size=args.width,
        depth=args.depth,
        activation=jnp.tanh,
        key=model_key,
    )
    model = train(
        model,
        x,
        y,
        steps=args.steps,
        learning_rate=args.learning_rate,
        print_every=max(1, args.print_every),
    )
    describe_jacobians(model, x[0])
    compare_orders(model, x, y)


if __name__ == "__main__":
    main()
