"""The trainer's flags, the same for both frameworks and every command, and their checks.

A user who learns ``launch.torch_mnist`` already knows ``launch.tf_mnist``; only the framework glue
behind the flags differs.  :func:`validate` runs before any framework is imported (a bad flag is
one line in a second, not after TensorFlow loads).  Each strategy's own flags and checks are its
package's (``ringtrain/strategies/*/options.py``), put together with these by
:mod:`ringtrain.strategies.registry`; the checks that need the world size run right after
``hvd.init()``, on every rank.  The commands that parse them are in :mod:`launch.cli`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ringtrain import horovod_tools, model_spec, optimizer_spec
from ringtrain.data import dataset, decoded_cache, images, mnist
from ringtrain.errors import UserError
from ringtrain.lr import DECAY_RULES, SCALING_RULES

FRAMEWORKS = ("torch", "tf")


def add_trainer_args(parser: argparse.ArgumentParser,
                     strategy_args: Callable[[argparse.ArgumentParser], None] | None = None,
                     ) -> argparse.ArgumentParser:
    """Add the trainer flags (shared by both frameworks and every strategy) to ``parser``, with
    ``strategy_args`` adding the strategies' own (:mod:`ringtrain.strategies.registry`) among
    them."""
    g = parser.add_argument_group("model")
    g.add_argument("--model", default="cnn",
                   help="cnn (default: the reference CNN), mlp (one hidden layer), or "
                        "package.module:function, your own builder: called as function("
                        "input_shape=..., num_classes=...), it returns a torch.nn.Module "
                        "(--framework torch) or a keras.Model (tf) mapping a batch of inputs to "
                        "logits; see README")
    g.add_argument("--dropout", type=float, default=0.5,
                   help="dropout before the classifier of the built-in models (default 0.5)")

    g = parser.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=4, help="passes over the training set (default 4)")
    g.add_argument("--batch-size", type=int, default=64,
                   help="images per rank per step; the global batch is this x world size (default 64)")
    g.add_argument("--base-lr", type=float, default=0.01,
                   help="single-worker learning rate, scaled by --lr-scaling (default 0.01)")
    g.add_argument("--lr-scaling", choices=SCALING_RULES, default="linear",
                   help="LR = base x world size (linear), x sqrt(world size) (sqrt), or base (none)")
    g.add_argument("--warmup-epochs", type=float, default=1.0,
                   help="ramp the LR linearly from --base-lr to the scaled LR over this many "
                        "epochs (Goyal et al. 2017; default 1, 0 disables)")
    g.add_argument("--lr-decay", choices=DECAY_RULES, default="cosine",
                   help="after warm-up: cosine-anneal the LR to 0 by the last epoch, or keep it")
    g.add_argument("--momentum", type=float, default=None,
                   help="momentum of --optimizer sgd (default 0.9; 0 = plain SGD) or rmsprop "
                        "(default 0)")
    optimizer_spec.add_args(g)  # --optimizer, --weight-decay, --clip-grad-norm, --precision
    g.add_argument("--seed", type=int, default=42,
                   help="seeds weights (rank 0's are broadcast) and the per-epoch data order")
    g.add_argument("--amp", action="store_true",
                   help="mixed precision (CUDA GPUs only): float16 compute, float32 weights")
    g.add_argument("--no-shuffle", action="store_true",
                   help="keep the data in file order every epoch (for reproducibility checks)")

    g = parser.add_argument_group("data")
    g.add_argument("--data", default="mnist", metavar="SPEC",
                   help="mnist (default); folder:DIR, an image folder with DIR/train/<class>/* and "
                        "DIR/test/<class>/* (or val/), JPEG or PNG; or package.module:function, "
                        "your own dataset (see README, 'Your own data')")
    g.add_argument("--data-dir", default=None,
                   help="with --data mnist: folder with the four MNIST .gz files (default: "
                        "$MNIST_DIR, then ../shared/data/mnist if present, else "
                        "~/.cache/ringtrain/mnist; missing files are downloaded by rank 0)")
    g.add_argument("--image-size", default=None, metavar="N|HxW",
                   help="with --data folder:DIR: resize every image to N x N or H x W pixels "
                        "(default: the size of the first training image)")
    g.add_argument("--normalize", choices=("data", "imagenet"), default="data",
                   help="with --data folder:DIR: per-channel mean and std computed from 1000 "
                        "training images (data, the default), or ImageNet's (imagenet); both "
                        "are recorded in the summary and the checkpoints")
    g.add_argument("--max-image-pixels", type=int, default=images.MAX_PIXELS, metavar="N",
                   help=f"with --data folder:DIR: refuse images of more than N pixels, read from "
                        f"their headers before decoding (default {images.MAX_PIXELS:,}: a "
                        f"24-megapixel photo fits)")
    g.add_argument("--workers", type=int, default=None,
                   help="processes (PyTorch) or threads (TensorFlow) per rank that decode images "
                        "of a folder or your own data (default: the cores a rank has, at least 1)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="use only N training images (quick runs): MNIST's first N; of a folder or "
                        "your own data, N drawn once with a fixed seed")
    g.add_argument("--test-samples", type=int, default=None,
                   help="evaluate on only N test images (quick runs), taken the same way")
    g.add_argument("--max-steps", type=int, default=None,
                   help="stop each epoch after this many steps (tests and benchmarks)")

    g = parser.add_argument_group("horovod")
    g.add_argument("--fp16-allreduce", action="store_true",
                   help="compress gradients to float16 for the allreduce (halves traffic)")
    g.add_argument("--adasum", action="store_true",
                   help="combine gradients with Adasum instead of averaging (disables LR scaling)")
    g.add_argument("--backward-passes-per-step", type=int, default=1,
                   help="accumulate gradients locally over K batches before each allreduce")
    g.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                   help="divide gradients by F before the sum and by size/F after (fp16 range)")

    g.add_argument("--elastic", action="store_true",
                   help="keep training when workers leave or join (horovodrun --min-np/--max-np "
                        "--host-discovery-script ...; see docs/fault-tolerance.md)")
    g.add_argument("--commit-every", type=int, default=20,
                   help="with --elastic: commit the training state every N steps; a lost worker "
                        "costs at most N steps of redone work; with --strategy ps and "
                        "--checkpoint-dir: each server snapshots its slice every N updates, so "
                        "that --resume after a lost server loses at most N of them (default 20)")
    g.add_argument("--stall-timeout", type=float, default=120.0,
                   help="seconds without a finished step or collective (a frozen, dead, cut-off or "
                        "stuck rank) before the watchdog ends the job with one line naming the rank, "
                        "instead of hanging; also arms Horovod's stall check (default 120; 0 = never)")

    if strategy_args is not None:  # --strategy and each strategy's flags (their own packages)
        strategy_args(parser)

    g = parser.add_argument_group("output")
    g.add_argument("--checkpoint-dir", default=None,
                   help="rank 0 writes one checkpoint per epoch here (atomically)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir (any world size)")
    g.add_argument("--metrics-out", default=None,
                   help="rank 0 writes a JSON summary here (framework, world size, per-epoch "
                        "metrics, per-rank parameter checksums)")
    g.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="rank 0 writes TensorBoard scalars here after every epoch (train loss, "
                        "test loss, test accuracy, LR, images/s); view with: tensorboard --logdir DIR")
    g.add_argument("--tensorboard-steps", action="store_true",
                   help="with --tensorboard: also write rank 0's loss and the LR after every step")
    g.add_argument("--no-progress", action="store_true", help="no progress bar, only epoch lines")
    add_performance_args(parser)
    return parser


def add_performance_args(parser: argparse.ArgumentParser) -> None:
    """Horovod's own tools (--timeline-out, --autotune) and the decoded-image cache (issue 41)."""
    g = parser.add_argument_group("performance")
    g.add_argument("--timeline-out", default=None, metavar="FILE",
                   help="rank 0 writes Horovod's timeline here: every collective of every tensor "
                        "and its phases, a Chrome trace (open in chrome://tracing or Perfetto); "
                        "see docs/profiling.md")
    g.add_argument("--autotune", nargs="?", const=horovod_tools.DEFAULT_AUTOTUNE_LOG, default=None,
                   metavar="LOG",
                   help="let Horovod's autotuner pick the fusion threshold and response cache by "
                        "measured allreduce throughput (HOROVOD_AUTOTUNE); its log (one CSV row "
                        f"per sample) goes to LOG (default {horovod_tools.DEFAULT_AUTOTUNE_LOG}), "
                        "the choice is printed at the end and kept in --metrics-out. The cycle "
                        "time it also tries no longer paces the rounds of ringtrain's Horovod "
                        "(a round starts when a tensor arrives): see docs/profiling.md")
    g.add_argument("--decode-cache", default=None, metavar="DIR",
                   help="with --data folder:DIR: keep each decoded image's pixels (uint8) in a "
                        "file per folder split under DIR, shared by the ranks of a host, so that "
                        "epochs after the first read them instead of decoding (default "
                        f"${decoded_cache.ENV}, else {decoded_cache.DEFAULT_DIR}); a folder "
                        "without room or that cannot be written means no cache, with a warning")
    g.add_argument("--no-decode-cache", action="store_true",
                   help="with --data folder:DIR: decode every image in every epoch (no cache)")


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """Reject impossible settings before any process starts working."""
    positive = {"--epochs": args.epochs, "--batch-size": args.batch_size,
                "--backward-passes-per-step": args.backward_passes_per_step}
    for flag, value in positive.items():
        if value <= 0:
            raise UserError(f"{flag} must be a positive integer, got {value}")
    kind, _ = dataset.parse_spec(args.data)
    dataset.parse_image_size(args.image_size)
    if kind != "mnist" and args.data_dir is not None:
        raise UserError(f"--data-dir is MNIST's folder; with --data {args.data} drop it (a "
                        f"folder's path is part of --data folder:DIR)")
    if kind != "folder" and args.image_size is not None:
        raise UserError("--image-size works with --data folder:DIR only; your own data's images "
                        "arrive at their size")
    if args.max_image_pixels < 1:
        raise UserError(f"--max-image-pixels must be a positive number of pixels, got "
                        f"{args.max_image_pixels}")
    if kind != "folder" and args.max_image_pixels != images.MAX_PIXELS:
        raise UserError("--max-image-pixels works with --data folder:DIR only; drop it")
    if args.workers is not None and args.workers < 0:
        raise UserError(f"--workers must be 0 (decode in the training process) or more, got "
                        f"{args.workers}")
    if kind == "mnist" and args.train_samples is not None and not 1 <= args.train_samples <= mnist.TRAIN_SIZE:
        raise UserError(f"--train-samples must be between 1 and {mnist.TRAIN_SIZE} (the training "
                        f"set), got {args.train_samples}")
    if args.train_samples is not None and args.train_samples < 1:  # other data: bounded once open
        raise UserError(f"--train-samples must be positive, got {args.train_samples}")
    if args.test_samples is not None and args.test_samples <= 0:
        raise UserError(f"--test-samples must be positive, got {args.test_samples}")
    if args.max_steps is not None and args.max_steps <= 0:
        raise UserError(f"--max-steps must be positive, got {args.max_steps}")
    if args.base_lr <= 0:
        raise UserError(f"--base-lr must be positive, got {args.base_lr}")
    if args.warmup_epochs < 0:
        raise UserError(f"--warmup-epochs must be >= 0, got {args.warmup_epochs}")
    if not 0 <= args.dropout < 1:
        raise UserError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.gradient_predivide_factor <= 0:
        raise UserError("--gradient-predivide-factor must be positive")
    if args.adasum and args.gradient_predivide_factor != 1.0:
        raise UserError("--gradient-predivide-factor works only with averaging, not --adasum")
    if args.commit_every <= 0:
        raise UserError(f"--commit-every must be a positive number of steps, got {args.commit_every}")
    if args.elastic and args.amp:
        raise UserError("--amp is not supported with --elastic yet; drop one of the two flags")
    if args.elastic and args.adasum:
        raise UserError("--adasum needs a power-of-two world size, which an --elastic job cannot "
                        "promise; drop one of the two flags")
    if args.stall_timeout < 0:
        raise UserError(f"--stall-timeout must be >= 0 seconds, got {args.stall_timeout}")
    if args.resume and not args.checkpoint_dir:
        raise UserError("--resume needs --checkpoint-dir (the folder to resume from)")
    if args.tensorboard_steps and not args.tensorboard:
        raise UserError("--tensorboard-steps needs --tensorboard DIR (where to write)")
    model_spec.check_spec(args.model)
    optimizer_spec.check(args)
    validate_performance(args, kind)
    return args


def validate_performance(args: argparse.Namespace, data_kind: str) -> None:
    """The checks of :func:`add_performance_args`' flags."""
    horovod_tools.check_flags(args)
    if data_kind != "folder" and (args.no_decode_cache or args.decode_cache is not None):
        flag = "--no-decode-cache" if args.no_decode_cache else "--decode-cache"
        raise UserError(f"{flag} works with --data folder:DIR only (the decoded images of an "
                        f"image folder); drop it")
    if args.no_decode_cache and args.decode_cache is not None:
        raise UserError("--decode-cache DIR and --no-decode-cache contradict each other; drop one")
    if args.decode_cache is not None and not args.decode_cache.strip():
        raise UserError("--decode-cache needs a folder, got ''")
