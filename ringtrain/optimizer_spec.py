"""``--optimizer``, ``--weight-decay``, ``--clip-grad-norm`` and ``--precision``: how the ring's
update is computed, checked before any framework is imported.

Framework-free: the flags' syntax and their combinations are checked here with the other flags
(one line, exit status 2, before TensorFlow or PyTorch loads); a user's factory
(``package.module:function``) is imported, called and its result checked by the framework's
optimizer module (:mod:`torch_models.optimizers`, :mod:`tf_models.optimizers`) right after
``hvd.init()``, on every rank, as ``--model``'s builder is.

The built-in optimizers take the same hyperparameters in both frameworks, PyTorch's defaults
(:data:`BETAS`, :data:`EPS`, :data:`RMSPROP_ALPHA`), so that ``--optimizer adam`` is one
algorithm whichever trainer runs it; ``--weight-decay`` means the same in both too (see
:data:`DECOUPLED`).  SGD with momentum 0.9, no weight decay, no clipping, float32 is the default,
and its arithmetic is the one the trainers always had.
"""

from __future__ import annotations

import argparse
import math

from ringtrain import user_code
from ringtrain.errors import UserError

BUILTIN = ("sgd", "adamw", "adam", "rmsprop")
PRECISIONS = ("fp32", "bf16")
SGD_MOMENTUM = 0.9  # --momentum's default with --optimizer sgd (what the trainers always ran)
BETAS, EPS, RMSPROP_ALPHA = (0.9, 0.999), 1e-8, 0.99  # PyTorch's defaults, used by both frameworks
# The optimizers whose --weight-decay is decoupled (Loshchilov & Hutter: w -= lr * wd * w beside
# the update, PyTorch's AdamW and Keras' AdamW alike).  The others take it as an L2 term added to
# the gradient (after clipping, before momentum or Adam's moments), PyTorch's ``weight_decay`` of
# SGD, Adam and RMSprop; Keras' own ``weight_decay`` of those is decoupled, so the TF trainer adds
# the L2 term itself (tf_models.optimizers).
DECOUPLED = ("adamw",)
# --momentum is a hyperparameter of these; Adam's moments are its betas.
TAKES_MOMENTUM = {"sgd": SGD_MOMENTUM, "rmsprop": 0.0}


def add_args(group: argparse._ArgumentGroup) -> None:
    """The flags, in the trainers' "training" group."""
    group.add_argument("--optimizer", default="sgd", metavar="NAME|pkg.mod:fn",
                       help="sgd (default, with --momentum), adamw, adam, rmsprop (PyTorch's "
                            "hyperparameters in both frameworks), or package.module:function, "
                            "your own factory: PyTorch calls function(params, lr=...) and wants a "
                            "torch.optim.Optimizer, Keras calls function(learning_rate=...) and "
                            "wants a keras.optimizers.Optimizer; the LR rule sets its LR every "
                            "step (see docs/training.md, 'Choosing an optimizer')")
    group.add_argument("--weight-decay", type=float, default=0.0, metavar="W",
                       help="weight decay (default 0): decoupled with adamw (w -= lr x W x w), an "
                            "L2 term W x w added to the gradient with sgd, adam and rmsprop "
                            "(PyTorch's weight_decay; the same in both frameworks)")
    group.add_argument("--clip-grad-norm", type=float, default=None, metavar="X",
                       help="scale the gradients so that their global norm over all parameters "
                            "is at most X, after Horovod averaged them (default: no clipping)")
    group.add_argument("--precision", choices=PRECISIONS, default="fp32",
                       help="fp32 (default), or bf16: bfloat16 compute with float32 weights and "
                            "optimizer (PyTorch autocast, Keras mixed_bfloat16); no loss scaling")
    group.add_argument("--shard-optimizer", action="store_true",
                       help="ZeRO stage 1 on the ring: gradients reduce-scattered, each rank "
                            "updates 1/N of the flat weights and holds the optimizer state of that "
                            "slice only, the weights allgathered; the same update (checkpoints "
                            "hold the whole state: they resume sharded or not, at any -np)")


def check(args: argparse.Namespace) -> None:
    """The flags' syntax and combinations, before any framework import; fills in --momentum's
    default for the optimizer (idempotent: the checks may run twice)."""
    spec = args.optimizer
    user = spec not in BUILTIN
    if user and not user_code.SPEC.match(spec):
        raise UserError(f"--optimizer must be {', '.join(BUILTIN)} or package.module:function (a "
                        f"function that returns your optimizer), got {spec!r}")
    if not math.isfinite(args.weight_decay) or args.weight_decay < 0:
        raise UserError(f"--weight-decay must be a number >= 0, got {args.weight_decay}")
    clip = args.clip_grad_norm
    if clip is not None and not (math.isfinite(clip) and clip > 0):
        raise UserError(f"--clip-grad-norm must be a positive number (the largest global "
                        f"gradient norm), got {clip}")
    if args.precision == "bf16" and args.amp:
        raise UserError("--precision bf16 and --amp (float16 with loss scaling) are two kinds of "
                        "mixed precision; drop one of the two flags")
    if args.shard_optimizer:
        _check_shard(args)
    if user and args.weight_decay:
        raise UserError(f"--weight-decay with --optimizer {spec}: your factory sets its own weight "
                        f"decay; drop --weight-decay")
    if args.momentum is not None:
        if spec not in TAKES_MOMENTUM:
            raise UserError(f"--momentum is a hyperparameter of sgd and rmsprop; --optimizer "
                            f"{spec} has its own (Adam's betas, or your factory's); drop --momentum")
        if not 0 <= args.momentum < 1:
            raise UserError(f"--momentum must be in [0, 1), got {args.momentum}")
    else:
        args.momentum = TAKES_MOMENTUM.get(spec)


def _check_shard(args: argparse.Namespace) -> None:
    """--shard-optimizer's combinations that the framework-free flags can refuse (--strategy ps
    refuses it in :func:`check_servers`, which its checks call)."""
    if getattr(args, "pipeline_stages", 1) > 1 or getattr(args, "strategy", None) == "pipeline":
        raise UserError("--shard-optimizer with --pipeline-stages: stages already split the "
                        "model and its state; sharding a stage's state over its replicas is not "
                        "supported for now; drop --shard-optimizer")
    if args.optimizer not in BUILTIN:
        # A slice's update equals the whole's only for an element-wise rule; a factory's may
        # read a whole tensor (LAMB's and LARS's per-layer norms), which no slice holds.
        raise UserError(f"--shard-optimizer with --optimizer {args.optimizer}: only the built-in "
                        f"optimizers ({', '.join(BUILTIN)}) are known to update element by "
                        f"element, as a slice of the flat weights needs; drop one of the two")
    for flag, why in (("elastic", "an elastic job's ranks come and go, and each slice's state "
                                  "would go with them: not supported for now"),
                      ("adasum", "Adasum combines whole gradients pairwise, not a "
                                 "reduce-scatter of their average"),
                      ("amp", "float16 loss scaling unscales and checks the whole gradient "
                              "before the step; use --precision bf16, which needs no scaling")):
        if getattr(args, flag, False):
            raise UserError(f"--shard-optimizer with --{flag}: {why}; drop one of the two flags")


def plain_sgd(args: argparse.Namespace) -> bool:
    """SGD (with or without momentum) and no weight decay: the update the trainers always ran,
    whose optimizer state Horovod's own broadcast may create by a step of zero gradients."""
    return args.optimizer == "sgd" and not args.weight_decay


def state_slots(args: argparse.Namespace) -> int:
    """Tensors of optimizer state per weight, what memory and checkpoint sizes are estimated
    from: SGD's momentum buffer (none without momentum), Adam-type first and second moments,
    RMSprop's square average (and its momentum buffer); a user's factory is assumed Adam-like."""
    optimizer, momentum = getattr(args, "optimizer", "sgd"), bool(args.momentum)
    if optimizer == "sgd":
        return int(momentum)
    if optimizer == "rmsprop":
        return 1 + int(momentum)
    return 2


def given(args: argparse.Namespace) -> list[str]:
    """The flags of this module set to other than their defaults, as the user typed them."""
    found = []
    if args.optimizer != "sgd":
        found.append(f"--optimizer {args.optimizer}")
    if args.weight_decay:
        found.append(f"--weight-decay {args.weight_decay:g}")
    if args.clip_grad_norm is not None:
        found.append(f"--clip-grad-norm {args.clip_grad_norm:g}")
    if args.precision != "fp32":
        found.append(f"--precision {args.precision}")
    if getattr(args, "shard_optimizer", False):
        found.append("--shard-optimizer")
    return found


def check_servers(args: argparse.Namespace, strategy: str) -> None:
    """The parameter servers apply the built-in optimizers (--weight-decay and --clip-grad-norm
    too, and their workers compute in bfloat16 under --precision bf16); they refuse, in one line,
    a factory's optimizer (the servers update slices element by element with their own
    arithmetic) and --shard-optimizer."""
    if getattr(args, "shard_optimizer", False):
        why = ("the servers already hold each slice's optimizer state once"
               if "ps" in strategy else "stages already split the model; not supported for now")
        raise UserError(f"--shard-optimizer works on the ring only ({strategy}: {why}); drop "
                        f"--shard-optimizer")
    if args.optimizer not in BUILTIN:
        raise UserError(f"--optimizer {args.optimizer} with {strategy}: the servers apply a "
                        f"built-in optimizer ({', '.join(BUILTIN)}) to their slices, element by "
                        f"element, not your factory's; use a built-in, or the ring")


def describe(args: argparse.Namespace, bf16_instructions: bool | None = None) -> str | None:
    """The banner's line on the update, when it is not the default's (None then).
    ``bf16_instructions``: whether the device computes bfloat16 natively (None: a GPU, or not
    known), for the warning that emulated bfloat16 is slower than float32."""
    if not given(args):
        return None
    parts = [f"optimizer {args.optimizer}"]
    if args.momentum:
        parts.append(f"momentum {args.momentum:g}")
    if args.weight_decay:
        kind = "decoupled" if args.optimizer in DECOUPLED else "L2"
        parts.append(f"weight decay {args.weight_decay:g} ({kind})")
    if args.clip_grad_norm is not None:
        parts.append(f"gradients clipped to global norm {args.clip_grad_norm:g} after averaging")
    if getattr(args, "shard_optimizer", False):
        parts.append("optimizer state sharded over the ranks (ZeRO stage 1)")
    if args.precision == "bf16":
        parts.append("bfloat16 compute, float32 weights")
        if bf16_instructions is False:
            parts.append("this CPU has no bfloat16 instructions (avx512_bf16, amx_bf16): "
                         "emulated, about 2x slower than --precision fp32 (docs/training.md)")
    return ", ".join(parts)


def cpu_has_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU has bfloat16 instructions (x86: ``avx512_bf16`` or ``amx_bf16``; Arm:
    ``bf16``), from ``/proc/cpuinfo``'s flags; None where that file is not there (not Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
