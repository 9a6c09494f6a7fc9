"""Where each rank sits in a pipeline of S stages replicated R times (world size S x R).

``rank = replica * S + stage``: the S ranks of one replica are contiguous.  Launchers give
consecutive ranks to the slots of one host (``horovodrun -H a:4,b:4`` puts ranks 0-3 on a), so a
replica's stages, which exchange activations and gradients every micro-batch, share a host
whenever a host has S slots (or a multiple of S), and only the stage allreduces (one per
optimizer step, between the replicas of a stage) cross hosts.  Stage ``s``'s process set is
``{s, S + s, 2S + s, ...}``: the ranks that hold the same layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringtrain.errors import UserError


def check_world(stages: int, size: int) -> None:
    """S must divide the world size: every replica needs all S stages."""
    if stages > 1 and size % stages:
        raise UserError(f"--pipeline-stages {stages} must divide the number of processes, not "
                        f"{size}: run a multiple of {stages} processes (S stages x R replicas) "
                        f"or change --pipeline-stages")


@dataclass(frozen=True)
class Placement:
    """This rank's stage and replica, and its neighbours, in a world of ``size`` ranks."""

    stages: int
    size: int
    rank: int

    def __post_init__(self) -> None:
        check_world(self.stages, self.size)

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def replica(self) -> int:
        return self.rank // self.stages

    @property
    def replicas(self) -> int:
        return self.size // self.stages

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def rank_of(self, stage: int, replica: int) -> int:
        return replica * self.stages + stage

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks holding stage ``stage``: one per replica, its process set."""
        return [self.rank_of(stage, r) for r in range(self.replicas)]

    @property
    def previous(self) -> int | None:
        """The rank this one receives activations from (and sends gradients to)."""
        return None if self.first else self.rank - 1

    @property
    def next(self) -> int | None:
        """The rank this one sends activations to (and receives gradients from)."""
        return None if self.last else self.rank + 1

    @property
    def stage_root(self) -> int:
        """Replica 0 of this stage: its weights are broadcast, it writes the stage's checkpoint.
        A global rank, as Horovod 0.28.1's broadcasts take it also within a process set."""
        return self.rank_of(self.stage, 0)

    def describe(self) -> str:
        return f"rank {self.rank} (stage {self.stage}, replica {self.replica})"
