"""How much each part runs: the full suite (about 20 minutes on a quiet 2-core machine, more than
half of it the time-to-99% runs), ``--quick`` (5-10 minutes) or ``--smoke`` (:mod:`bench.parts.smoke`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Config:
    quick: bool = False
    nps: list[int] = field(default_factory=lambda: [1, 2, 4])
    # training throughput: untimed warm-up steps, then timed steps (per run)
    warmup_steps: int = 8
    steps: int = 40
    trainer_steps: int = 40  # --max-steps per epoch of the real trainers (2 epochs, 2nd is timed)
    loop_mnist: bool = True  # also run the bench loop on MNIST (splits pipeline from trainer code)
    gloo_loops: bool = True  # also run the Horovod loop under horovodrun --gloo at -np > 1
    # collectives
    coll_nps: list[int] = field(default_factory=lambda: [2, 4])
    coll_sizes: list[int] = field(default_factory=lambda: [4 ** k * 1024 for k in range(1, 9)])
    coll_warmup: int = 3
    coll_reps: int = 15
    coll_budget_s: float = 2.0  # per size: stop repeating once this much time was spent
    # time to accuracy
    acc_nps: list[int] = field(default_factory=lambda: [1, 2, 4])
    acc_target: float = 0.99
    acc_args: list[str] = field(default_factory=list)  # extra trainer flags (quick proxy)
    acc_proxy: str | None = None  # label when the accuracy part is a proxy
    timeout_s: float = 900
    runs: list[str] | None = None  # throughput: only these runs (names as printed), not the plan
    copy_bytes: int = 256 << 20  # buffer of the memory copy bandwidth measurement

    def to_dict(self) -> dict:
        return asdict(self)


def full() -> Config:
    return Config()


def quick() -> Config:
    """A few minutes end to end: -np 1 and 2, short runs, no Gloo-controller or MNIST-loop
    variants, collectives up to 4 MiB at -np 2, and a tiny time-to-accuracy proxy at -np 2
    (6,000 images, target 90%), labelled as such everywhere."""
    return Config(
        quick=True, nps=[1, 2], warmup_steps=3, steps=15, trainer_steps=15, loop_mnist=False,
        gloo_loops=False,
        coll_nps=[2], coll_sizes=[4 ** k * 1024 for k in range(1, 7)], coll_warmup=2, coll_reps=5,
        coll_budget_s=1.0, acc_nps=[2], acc_target=0.90,
        acc_args=["--epochs", "2", "--train-samples", "6000", "--test-samples", "2000"],
        acc_proxy="quick proxy: 6,000 training images, 2 epochs, target 90% (not the 99% benchmark)",
        timeout_s=300)
