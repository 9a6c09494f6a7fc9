"""The seam between the library and a framework: one run object per framework and strategy.

A run object (``torch_models.run.TorchRun``, ``tf_models.run.KerasRun``, and the strategies
built on them) opens the run once, between ``hvd.init()`` and the first step: Horovod, the
device, the data, the model, the optimizer, the resume and the broadcast.  From then on the
framework-free loops (:class:`ringtrain.training.fixed_loop.FixedLoop`,
:func:`ringtrain.training.elastic.train_world`) ask it for everything that needs the framework,
through the methods below, and for nothing else.  Its :class:`RunIdentity` says what is being
trained, once, for the summary, the checkpoints and the banner.

A test can stand a fake run object in for a framework (``tests/fake_run.py``): the loops never
look behind these methods.
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from ringtrain import model_spec
from ringtrain.data.dataset import DataInfo
from ringtrain.horovod_tools import HorovodTools
from ringtrain.lr import scaled_lr
from ringtrain.output.progress import Loss
from ringtrain.training.world import World

# (epoch, step, this rank's mean loss of the step) of a step after which the weights stopped
# being finite numbers: what the divergence stop names.
StepTag = tuple[int, int, Loss]


@dataclass(frozen=True)
class RunIdentity:
    """What is being trained, fixed when the run opens: the summary's, the checkpoints' and the
    banner's one source.  ``model`` is ``--model`` as given, ``model_name`` what checkpoints
    carry (``mnist-cnn-v1`` for the built-in CNN on MNIST)."""

    framework: str
    versions: Mapping[str, str]
    model: str
    model_name: str
    param_count: int
    data: DataInfo
    strategy: str = "ring"
    extra: Mapping[str, Any] = field(default_factory=dict)  # a strategy's own facts (stages...)

    def __post_init__(self) -> None:
        object.__setattr__(self, "versions", MappingProxyType(dict(self.versions)))
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    @classmethod
    def of(cls, args: argparse.Namespace, framework: str, versions: Mapping[str, str],
           data: DataInfo, param_count: int, **kw: Any) -> RunIdentity:
        return cls(framework, versions, args.model, model_spec.model_name(args.model, data.name),
                   param_count, data, **kw)

    def versions_line(self) -> str:
        return " + ".join(f"{k} {v}" for k, v in self.versions.items())


class FrameworkRun(ABC):
    """One rank's run, as the shared loops see it.

    ``world`` is this rank's :class:`World` (replaced after every elastic re-form), ``identity``
    the :class:`RunIdentity`, ``args`` the checked flags.  Every method is called on every rank
    in the same order, so the collectives inside them stay matched.
    """

    args: argparse.Namespace
    world: World
    identity: RunIdentity
    # --timeline-out, --autotune: set by the ring's run objects (TorchRun, KerasRun); a pipeline
    # and --strategy ps refuse the flags (ringtrain.flags)
    tools: HorovodTools | None = None

    # --- who reads which data, and the LR rule's world size ------------------------------------

    @property
    def shard_rank(self) -> int:
        """This rank's position among the data-parallel ranks that read disjoint shards."""
        return self.world.rank

    @property
    def shard_size(self) -> int:
        """How many shards the data is split into each epoch: the data-parallel width."""
        return self.world.size

    @property
    def target_lr(self) -> float:
        """The LR after warm-up: the base LR scaled by the data-parallel width."""
        a = self.args
        return scaled_lr(a.base_lr, self.shard_size, a.lr_scaling, a.adasum)

    # --- one optimizer step ----------------------------------------------------------------------

    @abstractmethod
    def batches(self, steps: Sequence[np.ndarray]) -> Iterator[Any]:
        """The data of ``steps`` (one index array of this rank's shard per optimizer step, K x
        batch-size indices), one item per step, in order."""

    @abstractmethod
    def step(self, batch: Any, lr: float) -> tuple[Loss, int]:
        """One optimizer step at ``lr`` on ``batch`` (K micro-batches, one gradient allreduce,
        one update): this rank's mean loss of the step (a callable where reading it would wait
        for a device) and its examples.  The step's loss sum is added to :meth:`take_loss_sum`."""

    @abstractmethod
    def take_loss_sum(self) -> float:
        """This rank's summed training loss since the last call (then reset to zero)."""

    def train_sums(self, images: int) -> list[float]:
        """This rank's share of the epoch's exact train loss: (loss sum, examples), summed over
        every rank by the loop; ``images`` the examples its steps reported.  A rank that computes
        no loss (a pipeline's earlier stages) gives zeros, so each example counts once."""
        return [self.take_loss_sum(), images]

    @abstractmethod
    def diverged(self, tag: StepTag) -> StepTag | None:
        """After a step: the tag of the step after which the weights stopped being finite
        numbers, or None.  Identical on every rank, since the weights are.  May answer one step
        late (a GPU's queue is not waited for); :meth:`flush_diverged` reads the last answer."""

    def flush_diverged(self) -> StepTag | None:
        return None

    # --- the epoch's end and the run's -------------------------------------------------------------

    @property
    @abstractmethod
    def problem(self) -> str | None:
        """The first data problem this rank met (a file that did not decode), or None."""

    @abstractmethod
    def sync_buffers(self) -> None:
        """Average non-trained state (BatchNorm's statistics) over the ranks that hold it."""

    @abstractmethod
    def eval_sums(self) -> list[float]:
        """This rank's test (loss sum, correct, count, problems) over its share of the test set."""

    @abstractmethod
    def save(self, epoch: int) -> None:
        """Write the checkpoint of ``epoch`` (called where :func:`checkpoint.save_if_due` says)."""

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this rank writes checkpoints: rank 0, which holds the whole model (a pipeline:
        each stage's first replica, one file per stage)."""
        return self.world.rank == 0

    @abstractmethod
    def parameters(self) -> Iterable[np.ndarray]:
        """The model's floating-point state, in model order, for the checksums (read once: an
        iterator may hand the arrays out one at a time)."""

    def strategy_note(self) -> str | None:
        """What the banner adds about a strategy other than the ring (who serves, who works)."""
        return None

    def describe(self) -> list[str]:
        """Lines rank 0 prints under the run's banner (a pipeline's stages); none by default."""
        return []

    def summary_fields(self) -> dict[str, Any]:
        """Fields of the ``--metrics-out`` summary this strategy fills at the end, called on every
        rank (it may gather); none by default."""
        return {}

    # --- who drives the steps ---------------------------------------------------------------------

    def fit(self, fixed: Any) -> None:
        """Train every epoch of ``fixed``, a fixed-size job's
        :class:`~ringtrain.training.fixed_loop.FixedLoop` (which imports this module).  By default the
        library's loop (:meth:`FixedLoop.step_epochs`) calls :meth:`step`; a framework whose own loop runs the
        steps (Keras' ``model.fit``) overrides this and reports each step to ``fixed``."""
        fixed.step_epochs()
