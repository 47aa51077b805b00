"""Train a classifier with `optax`, taking gradients by vertex elimination.

The data set is generated on the fly: points on three interleaved spiral arms in the
plane, labelled by arm, split into a training and a test set. An `eqx.nn.MLP` is
trained on mini-batches with `optax.adamw`; gradients and the batch accuracy (as
auxiliary output) come from `graphax_eqx.filter_value_and_jacve`. A `tqdm` bar shows
progress, and train and test accuracy are reported after every epoch.

Run with `python examples/train_optax.py`; `--help` lists the size options.
"""

import argparse
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from tqdm import tqdm

import graphax_eqx as gx


def make_spirals(key, num_samples, num_classes=3, noise=0.08):
    label_key, radius_key, noise_key = jr.split(key, 3)
    labels = jr.randint(label_key, (num_samples,), 0, num_classes)
    radius = jr.uniform(radius_key, (num_samples,), minval=0.1, maxval=1.0)
    angle = 3.0 * radius + 2 * math.pi * labels / num_classes
    points = radius[:, None] * jnp.stack([jnp.cos(angle), jnp.sin(angle)], axis=-1)
    points = points + noise * jr.normal(noise_key, points.shape)
    return points, labels


class Classifier(eqx.Module):
    mlp: eqx.nn.MLP
    num_classes: int = eqx.field(static=True)

    def __init__(self, num_classes, width, depth, *, key):
        self.mlp = eqx.nn.MLP(
            6,
            num_classes,
            width_size=width,
            depth=depth,
            activation=jax.nn.gelu,
            key=key,
        )
        self.num_classes = num_classes

    def __call__(self, x):
        # A few periodic features make the spiral arms easier to separate.
        features = jnp.concatenate([x, jnp.sin(3 * x), jnp.cos(3 * x)])
        return self.mlp(features)


def loss_fn(model, x, y):
    logits = jax.vmap(model)(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == y)
    return loss, {"accuracy": accuracy, "batch_size": x.shape[0]}


@eqx.filter_jit
def accuracy(model, x, y):
    return jnp.mean(jnp.argmax(jax.vmap(model)(x), axis=-1) == y)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--train-samples", type=int, default=2048)
    parser.add_argument("--test-samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument(
        "--order", default="auto", help="elimination order: fwd, rev, markowitz, auto"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    key = jr.PRNGKey(args.seed)
    train_key, test_key, model_key = jr.split(key, 3)
    x_train, y_train = make_spirals(train_key, args.train_samples)
    x_test, y_test = make_spirals(test_key, args.test_samples)
    model = Classifier(3, args.width, args.depth, key=model_key)

    optim = optax.adamw(args.learning_rate, weight_decay=1e-4)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    loss_and_grad = gx.filter_value_and_jacve(loss_fn, order=args.order, has_aux=True)

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        (loss, aux), grads = loss_and_grad(model, x, y)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optim.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss, aux["accuracy"]

    num_batches = max(1, args.train_samples // args.batch_size)
    rng = np.random.default_rng(args.seed)
    for epoch in range(args.epochs):
        perm = rng.permutation(args.train_samples)
        bar = tqdm(range(num_batches), desc=f"epoch {epoch + 1}/{args.epochs}")
        for b in bar:
            idx = perm[b * args.batch_size : (b + 1) * args.batch_size]
            model, opt_state, loss, batch_acc = step(
                model, opt_state, x_train[idx], y_train[idx]
            )
            bar.set_postfix(loss=f"{float(loss):.4f}", acc=f"{float(batch_acc):.3f}")
        bar.close()
        train_acc = float(accuracy(model, x_train, y_train))
        test_acc = float(accuracy(model, x_test, y_test))
        print(
            f"epoch {epoch + 1:3d}   train accuracy {train_acc:.3f}   "
            f"test accuracy {test_acc:.3f}"
        )


if __name__ == "__main__":
    main()
