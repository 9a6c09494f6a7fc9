"""What the user sees while a run goes: the progress bar and one line per epoch on rank 0's terminal,
and the same numbers as TensorBoard scalars.  One display for both frameworks and both loops.

Other ranks construct a silent :class:`Progress`, so trainer code never branches on rank for
output: N ranks printing the same progress bar into one terminal is noise, not information.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from ringtrain.output.files import atomic_write_bytes
from ringtrain.output.summary import EpochRecord, Summary
from ringtrain.output.tensorboard import EPOCH_TAGS, STEP_LOSS, STEP_LR, EventWriter

Loss = float | Callable[[], float]  # a number, or a callable read only when the value is shown


class Progress:
    """Rank 0's terminal and TensorBoard for one run; silent elsewhere.

    ``samples_per_epoch`` puts per-step scalars on the axis of samples seen by all ranks together,
    which means the same at every world size, elastic resizes included.
    """

    def __init__(self, args: argparse.Namespace, rank: int, samples_per_epoch: int,
                 stream=None) -> None:
        self.enabled, self.epochs = rank == 0, args.epochs
        self.stream = stream or sys.stdout
        self.bar = not args.no_progress and self.enabled and self.stream.isatty()
        self._last_draw = 0.0
        self.board = EventWriter(args.tensorboard) if args.tensorboard and self.enabled else None
        self.board_steps = args.tensorboard_steps
        self.samples_per_epoch = samples_per_epoch

    def info(self, message: str) -> None:
        if self.enabled:  # one write per line: MPI's output tagging splits separate writes
            self.stream.write(message + "\n")
            self.stream.flush()

    def step(self, epoch: int, step: int, steps: int, *, loss: Loss, lr: float, consumed: int) -> None:
        """Optimizer step ``step`` (from 1) of ``steps`` in ``epoch`` has completed; ``loss`` is
        this rank's mean loss over the step's batch, ``consumed`` the samples of this epoch that
        all ranks together have trained on so far.  A callable ``loss`` is read only when shown
        (reading a GPU tensor's value waits for the GPU)."""
        if self.board is not None and self.board_steps:
            self.board.scalars((epoch - 1) * self.samples_per_epoch + consumed,
                               {STEP_LOSS: loss() if callable(loss) else loss, STEP_LR: lr})
        self._draw(epoch, step, steps, loss)

    def _draw(self, epoch: int, step: int, steps: int, loss: Loss) -> None:
        """Redraw the bar at most ~10 times a second."""
        if not self.bar:
            return
        now = time.monotonic()
        if step < steps and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        width = 30
        filled = int(width * step / max(steps, 1))
        bar = "#" * filled + "." * (width - filled)
        if callable(loss):
            loss = loss()
        tail = f" loss {loss:.4f}" if loss is not None else ""
        self.stream.write(f"\repoch {epoch}/{self.epochs} [{bar}] {step}/{steps}{tail}")
        if step >= steps:
            self.stream.write("\r" + " " * (width + 60) + "\r")
        self.stream.flush()

    def epoch(self, rec: EpochRecord) -> None:
        """The epoch line and the epoch's TensorBoard scalars."""
        if self.board is not None:
            self.board.scalars(rec.epoch, {tag: getattr(rec, key) for key, tag in EPOCH_TAGS.items()})
            self.board.flush()
        self.info(
            f"epoch {rec.epoch}/{self.epochs}: train loss {rec.train_loss:.4f}  "
            f"test loss {rec.test_loss:.4f}  test acc {100 * rec.test_accuracy:.2f}%  "
            f"lr {rec.lr:.4g}  {rec.seconds:.1f}s  {rec.images_per_second:.0f} img/s"
        )

    def finish(self, path: str | None, summary: Summary) -> None:
        """Write the summary (``--metrics-out``), close TensorBoard, print the final line."""
        if not self.enabled:
            return
        if path:
            atomic_write_bytes(path, summary.to_json().encode())
        if self.board is not None:
            self.board.close()
        self.info(f"final test accuracy {100 * summary.final_test_accuracy:.2f}% "
                  f"({summary.images_per_second:.0f} img/s over {summary.total_seconds:.1f}s of "
                  f"training)")
