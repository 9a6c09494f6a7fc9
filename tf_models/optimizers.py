"""The ring's Keras optimizer (``--optimizer``, ``--weight-decay``, ``--clip-grad-norm``): built,
a user's factory checked, and ``--precision bf16``'s policy.

:func:`build` makes the built-in optimizers with the hyperparameters both frameworks share
(:mod:`ringtrain.optimizer_spec`), or calls the user's ``package.module:function`` as
``function(learning_rate=...)`` and checks what it returns, on every rank right after
``hvd.init()``: every failure is one :class:`~ringtrain.errors.UserError` line, as for
``--model``.

Clipping is Keras' ``global_clipnorm``, and it clips the averaged gradients: Keras 3 clips inside
``Optimizer.apply``, and both ways the trainer reaches the optimizer average first (Horovod's
``DistributedOptimizer`` as patched for Keras 3 allreduces in its ``apply`` and then calls the
wrapped optimizer's; the elastic job's :class:`~tf_models.horovod_keras.DistributedModel`
allreduces before ``apply_gradients``).  The built-ins are Keras' own classes with
:class:`RingUpdate` mixed in, for what Keras does otherwise than PyTorch (see there).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator

import keras
import tensorflow as tf
from keras import ops

from ringtrain import optimizer_spec, user_code
from ringtrain.errors import UserError


class RingUpdate:
    """What the built-in optimizers need beyond Keras' own classes, to compute PyTorch's update:

    * ``l2``: ``--weight-decay`` of SGD, Adam and RMSprop, PyTorch's L2 term ``W x w`` added to
      the (clipped) gradient before the update; Keras' own ``weight_decay`` of those is
      decoupled (``w -= lr x W x w`` beside it), which with momentum is another algorithm.
    * ``micro_steps``: ``--backward-passes-per-step K`` of the fixed job.  Horovod's Keras
      ``DistributedOptimizer`` counts every micro-batch step in the optimizer's ``iterations``
      (as Keras 2 did); Adam's bias correction reads ``iterations``, so it is read here as
      optimizer steps (micro-batch steps // K), as Keras' own ``gradient_accumulation_steps``
      reads it.  The elastic job applies once per optimizer step: K = 1 there.

    Both are in ``get_config`` (``DistributedOptimizer`` rebuilds the optimizer from its config),
    and the classes are registered, so that Keras can rebuild them by name (the wrapped
    ``LossScaleOptimizer`` of ``--amp`` does)."""

    def __init__(self, *args, l2: float = 0.0, micro_steps: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.l2, self.micro_steps = float(l2), int(micro_steps)

    @property
    def iterations(self):
        steps = super().iterations
        return steps if self.micro_steps == 1 else ops.floor_divide(steps, self.micro_steps)

    def update_step(self, gradient, variable, learning_rate):
        if self.l2:
            if isinstance(gradient, tf.IndexedSlices):  # a sparse gradient: every row decays
                gradient = tf.convert_to_tensor(gradient)
            gradient = ops.add(ops.cast(gradient, variable.dtype),
                               ops.multiply(ops.cast(self.l2, variable.dtype), variable))
        return super().update_step(gradient, variable, learning_rate)

    def get_config(self) -> dict:
        return {**super().get_config(), "l2": self.l2, "micro_steps": self.micro_steps}


@keras.saving.register_keras_serializable(package="ringtrain")
class RingSGD(RingUpdate, keras.optimizers.SGD):
    """Keras' SGD, with PyTorch's L2 weight decay and Horovod's step count (:class:`RingUpdate`)."""


@keras.saving.register_keras_serializable(package="ringtrain")
class RingAdam(RingUpdate, keras.optimizers.Adam):
    """Keras' Adam, with PyTorch's L2 weight decay and Horovod's step count (:class:`RingUpdate`)."""


@keras.saving.register_keras_serializable(package="ringtrain")
class RingAdamW(RingUpdate, keras.optimizers.AdamW):
    """Keras' AdamW (decoupled decay, PyTorch's too), with Horovod's step count."""


@keras.saving.register_keras_serializable(package="ringtrain")
class RingRMSprop(RingUpdate, keras.optimizers.RMSprop):
    """Keras' RMSprop, with PyTorch's L2 weight decay and Horovod's step count."""


def build(args: argparse.Namespace, lr: float, micro_steps: int) -> keras.optimizers.Optimizer:
    """``--optimizer`` at ``lr``; ``micro_steps``: the micro-batch steps Horovod's
    ``DistributedOptimizer`` counts per optimizer step (K in the fixed job, 1 in the elastic)."""
    spec = args.optimizer
    if spec == "sgd" and not args.weight_decay and args.clip_grad_norm is None:  # as always
        return keras.optimizers.SGD(learning_rate=lr, momentum=args.momentum)
    if spec not in optimizer_spec.BUILTIN:
        return from_factory(spec, lr, args.clip_grad_norm)
    wd, eps = args.weight_decay, optimizer_spec.EPS
    beta_1, beta_2 = optimizer_spec.BETAS
    common = {"learning_rate": lr, "global_clipnorm": args.clip_grad_norm,
              "micro_steps": micro_steps}
    if spec == "adamw":
        return RingAdamW(weight_decay=wd, beta_1=beta_1, beta_2=beta_2, epsilon=eps, **common)
    if spec == "adam":
        return RingAdam(l2=wd, beta_1=beta_1, beta_2=beta_2, epsilon=eps, **common)
    if spec == "rmsprop":
        return RingRMSprop(l2=wd, rho=optimizer_spec.RMSPROP_ALPHA, momentum=args.momentum,
                           epsilon=eps, **common)
    return RingSGD(l2=wd, momentum=args.momentum, **common)


def from_factory(spec: str, lr: float, clip: float | None) -> keras.optimizers.Optimizer:
    """The user's ``function(learning_rate=...)``: a ``keras.optimizers.Optimizer`` whose LR the
    trainer can set every step (a float, not a schedule); ``--clip-grad-norm`` becomes its
    ``global_clipnorm`` unless it clips by itself."""
    factory = user_code.import_function("--optimizer", spec, "returns an optimizer")
    optimizer = user_code.call("--optimizer", spec, factory, {"learning_rate": lr})
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        got = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        raise UserError(f"--optimizer {spec} returned a {got}, but --framework tf needs a "
                        f"keras.optimizers.Optimizer")
    if not isinstance(getattr(optimizer, "_learning_rate", None), keras.Variable):
        raise UserError(f"--optimizer {spec} returned an optimizer whose learning rate is a "
                        f"schedule or a function; the trainer sets it every step (--base-lr, "
                        f"--warmup-epochs, --lr-decay): give it a number")
    if clip is not None:
        if any(getattr(optimizer, k, None) is not None
               for k in ("clipnorm", "clipvalue", "global_clipnorm")):
            raise UserError(f"--clip-grad-norm with --optimizer {spec}, which clips gradients "
                            f"itself (clipnorm, clipvalue or global_clipnorm); drop one of the two")
        optimizer.global_clipnorm = clip
    return optimizer


def wrap(spec: str, wrapper: Callable[[], keras.optimizers.Optimizer]) -> keras.optimizers.Optimizer:
    """``wrapper()``, Horovod's ``DistributedOptimizer``: it rebuilds the optimizer from its
    ``get_config()``, which a class of the user's may not support; that is one line."""
    try:
        return wrapper()
    except Exception as err:  # Keras raises many types from a class's (from_)config
        raise UserError(f"--optimizer {spec}: Horovod's DistributedOptimizer rebuilds the optimizer "
                        f"as its class's from_config(get_config()), which failed: "
                        f"{type(err).__name__}: {user_code.one_line(err)}") from None


@contextlib.contextmanager
def policy(args: argparse.Namespace) -> Iterator[str | None]:
    """While the model is built: ``--precision bf16``'s global ``mixed_bfloat16`` policy (every
    layer made then computes in bfloat16 and keeps float32 weights, a user's model too), put back
    after (the layers keep theirs; later runs in the same process are not changed).  Yields the
    policy the built-in models take, None for the default."""
    if args.precision != "bf16":
        yield "mixed_float16" if args.amp else None
        return
    before = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        yield "mixed_bfloat16"
    finally:
        keras.mixed_precision.set_global_policy(before)
