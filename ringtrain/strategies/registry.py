"""The one table of strategies: each strategy's flags (its ``options`` module) and, per framework,
its run object, named by module so that only the chosen framework is imported (one framework's
Horovod per process).  Every way into a trainer (``python -m launch...``, ``launch.ray``'s
workers, the tests' probes) ends in :func:`train`, which checks Horovod's build, quiets
TensorFlow's start-up log, imports the run object and runs the loop.

Adding a strategy: its package under ``ringtrain/strategies/`` (an ``options`` module with
``NAME``, ``HELP``, ``NEEDS_MPI``, ``add_args``, ``implied``, ``check_unused``, ``validate``,
``check_world``), its run object in each framework package, and one entry here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from types import ModuleType

from ringtrain import flags
from ringtrain.errors import UserError
from ringtrain.faults import termination
from ringtrain.horovod_build import import_entry
from ringtrain.output.summary import Summary
from ringtrain.strategies.pipeline import options as pipeline_options
from ringtrain.strategies.ps import options as ps_options
from ringtrain.strategies.ring import options as ring_options
from ringtrain.training.elastic import check_launcher
from ringtrain.training.fixed_loop import FixedLoop


@dataclass(frozen=True)
class Strategy:
    options: ModuleType
    runs: dict[str, str]  # framework -> "module:RunClass"
    elastic: dict[str, str] = field(default_factory=dict)  # framework -> "module:train" (--elastic)


STRATEGIES = {
    "ring": Strategy(ring_options, {"torch": "torch_models.run:TorchRun",
                                    "tf": "tf_models.run:KerasRun"},
                     elastic={"torch": "torch_models.elastic:train",
                              "tf": "tf_models.elastic:train"}),
    "pipeline": Strategy(pipeline_options, {"torch": "torch_models.pipeline:TorchPipelineRun",
                                            "tf": "tf_models.pipeline:KerasPipelineRun"},
                         elastic={"torch": "torch_models.pipeline_elastic:train",
                                  "tf": "tf_models.pipeline_elastic:train"}),
    "ps": Strategy(ps_options, {"torch": "torch_models.ps:TorchPSRun",
                                "tf": "tf_models.ps:KerasPSRun"}),
}


# --- flags -----------------------------------------------------------------------------------------

def add_strategy_args(parser: argparse.ArgumentParser) -> None:
    """``--strategy`` and every strategy's own flags."""
    g = parser.add_argument_group("strategy")
    g.add_argument("--strategy", choices=tuple(STRATEGIES), default=None,
                   help="; ".join(s.options.HELP for s in STRATEGIES.values()))
    for strategy in STRATEGIES.values():
        strategy.options.add_args(parser)


def add_trainer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every trainer flag: the shared ones (:mod:`ringtrain.flags`) and the strategies'."""
    return flags.add_trainer_args(parser, add_strategy_args)


def choose(args: argparse.Namespace) -> str:
    """The strategy the flags ask for: ``--strategy``, else the one they imply, else the ring."""
    if args.strategy is not None:
        return args.strategy
    implied = [name for name, s in STRATEGIES.items() if s.options.implied(args)]
    return implied[0] if implied else "ring"


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """The shared checks, then the chosen strategy's (``args.strategy`` is then its name), then
    that no other strategy's flags were given."""
    flags.validate(args)
    name = choose(args)
    if args.strategy == "ring" and pipeline_options.implied(args):
        raise UserError(f"--strategy ring with --pipeline-stages {args.pipeline_stages}: stages "
                        f"split the model (--strategy pipeline); drop one of the two")
    args.strategy = name
    STRATEGIES[name].options.validate(args)
    for other, strategy in STRATEGIES.items():
        if other != name:
            strategy.options.check_unused(args)
    return args


def check_world(args: argparse.Namespace, world_size: int) -> None:
    """The chosen strategy's checks that need the world size (right after ``hvd.init()``)."""
    STRATEGIES[args.strategy].options.check_world(args, world_size)


def needs_mpi(args: argparse.Namespace) -> str | None:
    """Why the chosen strategy cannot run on Gloo alone (Ray's workers), or None."""
    return STRATEGIES[args.strategy].options.NEEDS_MPI


# --- the run -----------------------------------------------------------------------------------------

def entry(framework: str, args: argparse.Namespace) -> str:
    """``module:name`` of what trains ``args`` on ``framework``: the strategy's run object, or
    under ``--elastic`` its elastic job."""
    strategy = STRATEGIES[args.strategy]
    table = strategy.elastic if args.elastic else strategy.runs
    return table[framework]


def train(framework: str, args: argparse.Namespace, own_signals: bool = True) -> Summary:
    """Run a checked command line (:func:`validate`) on ``framework``: Horovod's build checked,
    the strategy's run object opened and trained by the fixed-size loop, or under ``--elastic``
    its elastic job.  ``own_signals``: this process is the trainer's (not a Ray actor's)."""
    check_launcher(args.elastic)
    if own_signals:
        termination.install()  # SIGTERM: finish a save under way, then exit 143 with one line
    target = import_entry(framework, entry(framework, args))
    if args.elastic:
        return target(args)
    run = target(args)
    return FixedLoop(args, run, start_epoch=run.start_epoch).train()
