"""``--strategy ps``: a fixed-size job on parameter servers, the same for both frameworks.

:class:`ParameterServerRun` is the half of a parameter-server run object that needs no
framework: mixed into a framework's run object (``torch_models.ps.TorchPSRun``,
``tf_models.ps.KerasPSRun``), it takes over :meth:`fit` and drives the engine
(:mod:`ringtrain.strategies.ps.engine`) through the shared :class:`~ringtrain.training.fixed_loop.FixedLoop`:
the same shards, the same LR rule, the same epoch records, exact metrics and checkpoints.  The
framework's half only moves the model's trainable parameters to and from one flat float32 vector
and computes a step's gradient as one (:meth:`get_flat`, :meth:`set_flat`, :meth:`flat_gradient`;
:meth:`get_state`, :meth:`set_state` for server 0's checkpoints: the optimizer's state arrays
by the servers' names, :func:`ringtrain.strategies.ps.engine.state_names`, and its step count).

The run opens with every rank holding rank 0's weights (fresh or resumed: one ``Bcast``), and
server 0 handing each server the optimizer state of its slice (and its step count). Each epoch:
servers serve and workers work (:meth:`Server.serve_epoch`, :meth:`Worker.work_epoch`); server 0's
verdict on dead workers reaches every survivor; the servers exchange their slices, so that every
rank ends the epoch with the servers' weights (the workers got them in the reply to their FINAL);
every rank learns whether the weights stayed finite; then :meth:`FixedLoop.end_epoch` as for the
ring: exact test metrics on those weights, split over all ranks, and server 0's checkpoint
(today's format, so ``--resume`` works across strategies and any number of servers).

Faults (docs/parameter-servers.md): a worker whose heartbeat stops for half the
``--stall-timeout`` is dead or frozen.  At any staleness the job goes on without it, if the
launcher survives a rank's death (Open MPI 4's ``mpirun --enable-recovery``, which
``python -m launch.horovodrun`` passes for ``--strategy ps``; without it, mpirun ends every rank
when one dies, so the job ends now, in one line saying so): the servers drop it from the bound,
its batches go to the others, the LR follows the workers left, and the summary names it.  A
dropped worker that comes back (it was frozen) is told so and leaves with a warning line.  A
server that dies takes its slice with it: one line.  Server 0 itself dead: the workers' watchdogs
name it.  With a ``--checkpoint-dir`` each server snapshots its slice every ``--commit-every``
updates (:mod:`ringtrain.strategies.ps.snapshot`), and ``--resume`` restarts every server from
its newest snapshot of the epoch the checkpoint resumes, at most ``--commit-every`` of its
updates lost (:meth:`ParameterServerRun._open_snapshots`).
"""

from __future__ import annotations

import dataclasses
import time
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from ringtrain.errors import UserError
from ringtrain.faults import watchdog
from ringtrain.lr import lr_at, scaled_lr
from ringtrain.output import files
from ringtrain.strategies.ps import engine as ps
from ringtrain.strategies.ps import options as flags
from ringtrain.strategies.ps import snapshot
from ringtrain.strategies.ps import transport as ps_mpi
from ringtrain.training.fixed_loop import FixedLoop
from ringtrain.training.run import FrameworkRun
from ringtrain.training.world import World


class ParameterServerRun(FrameworkRun):
    """The framework-free half: ``class TorchPSRun(ParameterServerRun, TorchModelRun)`` (the
    framework's whole-model rank), whose constructor calls :meth:`open_run` with its own steps."""

    momentum_rule: str  # "torch" | "keras": how the framework's SGD keeps momentum

    # --- the framework's half -------------------------------------------------------------------

    @abstractmethod
    def get_flat(self) -> np.ndarray:
        """The model's trainable parameters, in model order, as one float32 vector (a copy)."""

    @abstractmethod
    def set_flat(self, flat: np.ndarray) -> None:
        """Copy ``flat`` into the model's trainable parameters."""

    @abstractmethod
    def flat_gradient(self, batch: Any) -> tuple[np.ndarray, float, int]:
        """One step's gradient on ``batch`` (K micro-batches, their mean), as one float32
        vector; the step's mean loss and examples (its loss sum added to take_loss_sum)."""

    @abstractmethod
    def get_state(self) -> tuple[dict[str, np.ndarray], int]:
        """Rank 0: the optimizer's state (restored, or zeros), each array flat under the
        servers' name for it (:func:`~ringtrain.strategies.ps.engine.state_names`), and its
        step count (Adam's bias correction; 0 fresh)."""

    @abstractmethod
    def set_state(self, arrays: dict[str, np.ndarray], count: int, steps: int, lr: float) -> None:
        """Rank 0, before a checkpoint: the servers' optimizer state (flat, by name) and their
        step count ``count`` into the optimizer, which also learns the schedule's position as
        the ring's would hold it (the optimizer steps done, the last LR)."""

    def state_names(self) -> tuple[str, ...]:
        """The names of the servers' optimizer state arrays for this run's flags."""
        a = self.args
        return ps.state_names(a.momentum, getattr(a, "optimizer", "sgd"))

    @abstractmethod
    def buffer_values(self) -> np.ndarray:
        """The model's non-trained floating-point state (BatchNorm's statistics), flat, float64
        (empty without any)."""

    @abstractmethod
    def set_buffers(self, flat: np.ndarray) -> None:
        """Copy ``flat`` (as :meth:`buffer_values` gave it) into that state."""

    # --- roles --------------------------------------------------------------------------------

    @property
    def roles(self) -> ps.Roles:
        return self._roles

    @property
    def serves(self) -> bool:
        return self.roles.serves(self._rank)

    @property
    def shard_rank(self) -> int:
        """A worker reads the shard of its index among the workers (a server reads none: 0)."""
        return 0 if self.serves else self.roles.worker_index(self._rank)

    @property
    def shard_size(self) -> int:
        """The data-parallel width is the number of workers: it sizes the shards, the steps per
        epoch and the LR's scaling, as the world size does for the ring."""
        return self.roles.workers

    def strategy_note(self) -> str | None:
        p, n = self.roles.servers, self.roles.workers
        k = flags.staleness(self.args)
        def span(a: int, b: int) -> str:
            return f"rank {a}" if a == b else f"ranks {a}-{b}"

        return (f"parameter servers: {span(0, p - 1)} serve{'s' if p == 1 else ''}, "
                f"{span(p, p + n - 1)} work{'s' if n == 1 else ''}, --staleness "
                f"{'inf' if k is None else k}")

    def role_ranks(self, world: World) -> None:
        """Call once the world and the identity are known, before the LR needs the shards."""
        self._rank = world.rank
        self._roles = ps.Roles(flags.ps_servers(self.args), world.size)
        k = flags.staleness(self.args)
        self.identity = dataclasses.replace(
            self.identity, strategy="ps", extra={"servers": self._roles.servers,
                                                 "workers": self._roles.workers,
                                                 "staleness": "inf" if k is None else k})

    # --- opening -------------------------------------------------------------------------------

    def open_run(self, hvd, open_model: Callable[[], None],
                 open_optimizer: Callable[[], None]) -> None:
        """The run's opening, in order: MPI initialised by mpi4py; the framework's start-up and
        whole model (``open_model``: Horovod's collectives check and open the data); the roles;
        server 0's optimizer and the resume (``open_optimizer``); Horovod (``hvd``, the
        framework's module) shut down, its start-up collectives done; then :meth:`open_servers`.
        Horovod stays when it already ran in this process (an earlier ring run in the tests'
        probe): it owns MPI then, and shutting it down would finalise MPI."""
        running = hvd.is_initialized()
        MPI = ps_mpi.start()
        open_model()
        self.role_ranks(self.world)
        open_optimizer()
        if not running:
            # Horovod: shut down once the run is open: the servers exchange nothing through it.
            hvd.shutdown()
        self.open_servers(MPI)

    def open_servers(self, MPI) -> None:
        """After Horovod: this run's own communicators (one for the engine's messages, one for
        its collectives), its :class:`World` over mpi4py, and every rank holding rank 0's
        weights, every server the momentum of its slice."""
        self.link_comm = MPI.COMM_WORLD.Dup()
        self.world_comm = self.all_comm = MPI.COMM_WORLD.Dup()
        self.world = ps_mpi.world(self.world_comm)
        self.link = ps_mpi.MpiLink(self.link_comm)
        flat = self.get_flat()
        self.world_comm.Bcast(flat, root=0)
        watchdog.progress()  # a collective completed
        self.set_flat(flat)
        self.size = len(flat)
        self.lost: list[int] = []
        self.state0: dict[str, np.ndarray] | None = None
        names = self.state_names()
        full, count = self.get_state() if self._rank == 0 and names else ({}, 0)
        counts = np.array([count], np.int64)  # the step count: every rank, one collective
        self.world_comm.Bcast(counts, root=0)
        self.steps0 = int(counts[0])
        if self.serves:
            try:
                self.state0 = self._share_state(MPI, names, full)
            except ps.BadMessage as err:  # the slice refused: its one line, as the engine's
                watchdog.end_job(self._silent_line(err))
        self.velocity0 = None if self.state0 is None else self.state0.get("velocity")

    def _share_state(self, MPI, names: tuple[str, ...],
                     full: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """Server 0's optimizer state (restored or zeros), one message per server holding its
        slice of every array, point to point.  A server checks what it received (the
        ``Status``'s count): a short message would have left the rest of ``np.empty`` as state;
        a longer one is MPI's ``MPI_ERR_TRUNCATE``.  Either is
        :class:`~ringtrain.strategies.ps.engine.BadMessage`."""
        if not names:
            return None
        bounds = ps.split(self.size, self.roles.servers)
        if self._rank == 0:
            arrays = [full.get(name) for name in names]
            arrays = [np.zeros(self.size, np.float32) if a is None else a for a in arrays]
            for s in range(1, self.roles.servers):
                out = np.concatenate([a[bounds[s]:bounds[s + 1]] for a in arrays])
                self.link_comm.Send([np.ascontiguousarray(out, np.float32), MPI.FLOAT],
                                    dest=s, tag=ps.TAG_PEER)
            return {name: a[bounds[0]:bounds[1]].copy() for name, a in zip(names, arrays, strict=True)}
        n = bounds[self._rank + 1] - bounds[self._rank]
        mine = np.empty(n * len(names), np.float32)
        status = MPI.Status()
        try:
            self.link_comm.Recv([mine, MPI.FLOAT], source=0, tag=ps.TAG_PEER, status=status)
            count = status.Get_count(MPI.FLOAT)
            got = ps.values(count if count != MPI.UNDEFINED else -1)
        except MPI.Exception as err:
            if err.Get_error_class() != MPI.ERR_TRUNCATE:
                raise
            count, got = None, "more values than that (MPI_ERR_TRUNCATE)"
        if count != len(mine):
            what = ("its momentum slice" if names == ("velocity",) else
                    f"its optimizer state slices ({', '.join(names)})")
            per = ("the length of this server's slice" if len(names) == 1 else
                   f"{len(names)} times the length of this server's slice")
            ps.refuse(f"server rank {self._rank}", "server rank 0", f"{what} of {got}",
                      f"{len(mine)} values, {per}")
        return {name: mine[i * n:(i + 1) * n] for i, name in enumerate(names)}

    # --- the epochs -------------------------------------------------------------------------------

    def step(self, batch: Any, lr: float) -> tuple[float, int]:
        """Not the servers' way: :meth:`fit` runs their loop and the workers' (a worker's step is
        a pull, :meth:`flat_gradient` and a push), so the library's step loop never calls this."""
        raise RuntimeError("a parameter-server run's steps are run by its fit(), not step()")


    def config(self, fixed: FixedLoop) -> ps.Config:
        a = self.args
        # The engine's own deadline is a backstop: the watchdog ends a stalled job first, at
        # --stall-timeout, naming the silent rank from its heartbeats.
        deadline = a.stall_timeout + 2 * watchdog.GRACE if a.stall_timeout > 0 else None

        def live_lr(epoch: int, step: int, n: int) -> float:
            # FixedLoop.lr's rule with the target scaled for the n workers left, not the
            # workers the job started with: the survivors' ring would use that one.
            return lr_at(epoch - 1 + step / fixed.steps, a.base_lr,
                         scaled_lr(a.base_lr, n, a.lr_scaling, a.adasum), a.warmup_epochs,
                         a.epochs, a.lr_decay)

        return ps.Config(self.roles, self.size, flags.staleness(a), a.momentum,
                         self.momentum_rule, fixed.steps, fixed.lr, deadline=deadline,
                         live_lr=live_lr, optimizer=getattr(a, "optimizer", "sgd"),
                         weight_decay=getattr(a, "weight_decay", 0.0),
                         clip=getattr(a, "clip_grad_norm", None))

    def live_workers(self) -> int:
        """The workers still training: server 0's own count during an epoch (it drops them), the
        run-wide verdict's on every rank between epochs."""
        if self._rank == 0 and hasattr(self, "server"):
            return self.roles.workers - len(self.server.dead)
        return self.roles.workers - len(self.lost)

    def lr_now(self, epoch: int, step: int) -> float:
        """The LR of ``step`` for the workers still training (what the servers apply)."""
        return self.cfg.lr_for(epoch, step, self.live_workers())

    def fit(self, fixed: FixedLoop) -> None:
        cfg = self.config(fixed)
        self.cfg, self.fixed = cfg, fixed
        self.epoch_marks: list[dict[str, Any]] = []
        store = self._store(fixed) if self.serves and self.args.checkpoint_dir else None
        if self.serves:
            self.server = ps.Server(cfg, self.link, self._rank, self.get_flat()[cfg.slice(self._rank)],
                                    state=self.state0, steps=self.steps0,
                                    silent=self._silent, on_dead=self._on_dead,
                                    progress=lambda: watchdog.progress(step=True),
                                    on_step=self._on_step, store=store)
        else:
            self.worker = ps.Worker(cfg, self.link, self.roles.worker_index(self._rank),
                                    progress=lambda: watchdog.progress(step=True))
        if self.args.checkpoint_dir:
            self._open_snapshots(fixed, store)
        for epoch in fixed.epochs():
            t0 = time.perf_counter()
            self.images = 0
            try:
                dead = self._train_epoch(epoch)
            except ps.Dropped as err:
                self._leave_dropped(err)
            except ps.PeerSilent as err:
                watchdog.end_job(self._silent_line(err))
            if dead != self.lost:
                self._go_on_without(dead)
            self._epoch_weights(epoch)
            self._stop_if_diverged()
            fixed.end_epoch(epoch, train_sums=[self.take_loss_sum(), self.images],
                            seconds=time.perf_counter() - t0, lr=self.lr_now(epoch, fixed.steps - 1))
            self._report_epoch(epoch)
        self._report_run()

    # --- snapshots ------------------------------------------------------------------------------

    def _store(self, fixed: FixedLoop) -> snapshot.Store:
        """This server's snapshots: its layout (the model, its slice, the optimizer's state, the
        epoch's batches as this job cuts them) in --checkpoint-dir, every --commit-every updates."""
        a, ident = self.args, self.identity
        batches = {"workers": self.roles.workers, "steps": fixed.steps,
                   "rows": a.batch_size * a.backward_passes_per_step, "seed": a.seed,
                   "shuffle": not a.no_shuffle, "train_size": fixed.n_train}
        layout = snapshot.Layout(ident.framework, ident.model_name, ident.param_count, self.size,
                                 self._rank, self.roles.servers, self.momentum_rule,
                                 self.state_names(), batches, getattr(a, "optimizer", "sgd"))
        return snapshot.Store(a.checkpoint_dir, layout, a.commit_every)

    def _open_snapshots(self, fixed: FixedLoop, store: snapshot.Store | None) -> None:
        """Every rank, before the first epoch (one allgather, then nothing more on a fresh run).

        Each server checks that it can write its snapshots.  A fresh run: server 0 removes every
        snapshot and update mark in the folder, each other server its own (an earlier run's would
        otherwise be resumed as this one's; all before the allgather, the marks made after it).
        Under ``--resume``: each server reads its own newest snapshot of the epoch the checkpoint
        resumes (each its own newest, not a set common to all: every snapshot records the batches
        of the epoch its slice holds, so any mix is consistent) and its last session's update
        mark.  A problem on any server is every rank's one line.  Then each
        server starts its mark, takes its snapshot's slice and state, and server 0 learns the
        batches every server holds: the epoch goes on with the others, which every server lacking
        one applies and every server holding one receives and skips.  A server without a
        snapshot of the epoch starts it from the checkpoint's slice, holding no batch of it."""
        a, epoch = self.args, fixed.start_epoch + 1
        problem, snap, mark = None, None, None
        if store is not None:
            try:
                files.ensure_writable(a.checkpoint_dir)  # each server's host: the folder may be local
                if a.resume:
                    snap, mark = store.newest(epoch), store.read_mark()
                else:
                    snapshot.remove_all(a.checkpoint_dir, None if self._rank == 0 else
                                        store.layout.stem())
            except UserError as err:
                problem = str(err)
        found = self.world.gather({"problem": problem,
                                   "done": None if snap is None else snap.done}, "ps_snapshots")
        problems = [f["problem"] for f in found if f["problem"]]
        if problems:  # every rank raises it: rank 0 prints it, every rank exits 2
            raise UserError(problems[0])
        if store is None:
            return
        try:
            store.start()
        except OSError as err:  # the resume's count of lost updates would be unknown: said then
            store.warn(f"cannot record its updates in {store.mark_path.name} ({err.strerror})")
        if not a.resume:
            return
        masks, everyone = snapshot.held([f["done"] for f in found[:self.roles.servers]],
                                        store.layout.workers, store.layout.steps)
        since = snap.updates if snap is not None else 0
        self.server.resume(epoch, since, masks[self._rank], everyone,
                           None if snap is None else snap.weights,
                           None if snap is None else snap.state,
                           None if snap is None else snap.steps)
        self.server.books.resumed = {
            "epoch": epoch, "from_update": since,
            "updates_lost": snapshot.lost_updates(mark, epoch, since),
            "snapshot": None if snap is None else snap.path.name,
            "batches_done": int(everyone.sum())}

    def _train_epoch(self, epoch: int) -> list[int]:
        fixed = self.fixed
        if self.serves:
            self.server.serve_epoch(epoch)
            return self.server.verdict()
        own = iter(self.batches(fixed.index_batches(epoch)))

        def fetch(owner: int, t: int) -> Any:
            return next(iter(self.batches([fixed.index_batches(epoch, shard=owner)[t]])))

        def gradient(batch: Any) -> tuple[np.ndarray, float]:
            grad, loss, used = self.flat_gradient(batch)
            self.images += used
            return grad, loss

        self.worker.work_epoch(epoch, own, fetch, self.set_flat, gradient)
        return self.worker.verdict()

    def _epoch_weights(self, epoch: int) -> None:
        """Every rank: the servers' weights of the epoch's end into the model (server 0: their
        momentum into the optimizer, for the checkpoint)."""
        if not self.serves:
            self.set_flat(self.worker.weights)
            return
        full = np.empty(self.size, np.float32)
        state = ({name: np.empty(self.size, np.float32) for name in self.state_names()}
                 if self._rank == 0 else None)
        try:
            self.server.exchange(full, state)
        except ps.PeerSilent as err:
            watchdog.end_job(self._silent_line(err))
        self.set_flat(full)
        if self._rank == 0:
            fixed = self.fixed
            self.set_state(state, self.server.opt.steps, epoch * fixed.steps,
                           self.lr_now(epoch, fixed.steps - 1))

    def _stop_if_diverged(self) -> None:
        """Every rank learns the first server whose weights stopped being finite, and all stop
        with the ring's line (the workers' last losses name those that went first)."""
        mine = list(self.server.diverged) if self.serves and self.server.diverged else None
        found = [tuple(d) for d in self.world.gather(mine, "ps_divergence") if d]
        if found:
            epoch, step, _ = min(found)
            loss = 0.0 if self.serves else self.worker.books.last_loss
            self.fixed.stop_if((int(epoch), int(step), loss))

    def sync_buffers(self) -> None:
        """BatchNorm's statistics: the workers' average (a server's never trained: it adds 0)."""
        mine = self.buffer_values()
        if not mine.size:
            return
        total = np.asarray(self.world.sum((mine * (not self.serves)).tolist(), "ps_buffers"))
        self.set_buffers(total / (self.roles.workers - len(self.lost)))

    # --- dead workers -----------------------------------------------------------------------

    def _silent(self) -> dict[int, float]:
        """Ranks whose heartbeat has been silent for half the --stall-timeout (rank 0 hears them
        all; the watchdog's own measure of a dead or frozen rank: a rank's watchdog thread beats
        every second while it computes).  Half, so that this verdict, which names the worker and
        says what the staleness makes of it, comes before the watchdog's own at the timeout."""
        return watchdog.silent_ranks()

    def _on_dead(self, rank: int, quiet: float) -> bool:
        """A worker is dead or frozen: go on without it (True), at any staleness, where the
        launcher survives a rank's death; else end the job with one line saying what it needs."""
        who = f"worker {watchdog.describe_rank(rank)}"
        k = flags.staleness(self.args)
        if not ps_mpi.recovery_enabled():
            watchdog.end_job(f"{who} is dead, frozen or cut off (no heartbeat for {quiet:.0f} s); "
                             f"the servers would train on without it, but Open MPI's mpirun "
                             f"ends every rank once one dies unless it runs with "
                             f"--enable-recovery (python -m launch.horovodrun passes it for "
                             f"--strategy ps; plain horovodrun needs "
                             f"--mpi-args=--enable-recovery), so the job ends now")
        left = self.roles.workers - len(self.server.dead) - 1
        # rank 0 draws the progress bar: the warning starts a line of its own
        bar = "\n" if getattr(getattr(self, "fixed", None), "progress", None) is not None \
            and self.fixed.progress.bar else ""
        print(f"{bar}warning: {who} is dead, frozen or cut off (no heartbeat for {quiet:.0f} s); "
              f"--staleness {'inf' if k is None else k} trains on with {left} worker(s): nobody "
              f"waits for it, the batch it was computing and its batches not yet handed out go "
              f"to the others, the LR follows {left} worker(s)", flush=True)
        return True

    def _leave_dropped(self, err: ps.Dropped) -> None:
        """This worker was frozen (or cut off) long enough for the servers to go on without it,
        and has come back: it leaves, with a warning (the job is not failing), without MPI's
        finalize (its closing fence would wait for ranks that never join it) and without
        MPI_Abort (under --enable-recovery that would end only this rank, but its guardian would
        then stop the launcher, and the job with it)."""
        print(f"warning: {err}; the job trains on without it, so it leaves", flush=True)
        watchdog.disarm()  # its guardian leaves too, without killing it
        ps_mpi.leave(0)

    def _go_on_without(self, dead: list[int]) -> None:
        """Every survivor: the run's collectives from now on over the ranks still alive."""
        ranks = [self.roles.worker_rank(w) for w in dead]
        if not self.lost:
            ps_mpi.bound_finalize_after_losing()
        self.world_comm = ps_mpi.without(self.all_comm, ranks)
        self.world = ps_mpi.world(self.world_comm)
        self.fixed.world = self.world
        self.lost = list(dead)

    def _silent_line(self, err: ps.PeerSilent) -> str:
        if isinstance(err, ps.BadMessage):  # a peer's message refused: its line names them
            return str(err)
        what = str(err)
        if what.startswith("server rank "):
            rank = int(what.split()[-1])
            return (f"server {watchdog.describe_rank(rank)} is dead, frozen or cut off: its part of "
                    f"the parameters is gone, so the job ends")
        return (f"{what} sent nothing for {self.cfg.deadline:.0f} s while rank {self._rank} waited "
                f"for it (--stall-timeout {self.args.stall_timeout:g}): dead, frozen or cut off; "
                f"the job ends")

    # --- what the user sees ---------------------------------------------------------------------

    def _on_step(self, epoch: int, updates: int, loss: float) -> None:
        """Server 0's progress bar and per-step TensorBoard: a step is one update at K = 0, N
        applied gradients (one round of the workers) above."""
        live = self.live_workers()
        fixed, per = self.fixed, 1 if self.cfg.staleness == 0 else live
        this_epoch = self.server.epoch_updates  # a resumed epoch: its snapshot's updates included
        if this_epoch % per == 0:
            step = min(this_epoch // per, fixed.steps)
            rows = self.args.batch_size * self.args.backward_passes_per_step
            fixed.progress.step(epoch, step, fixed.steps, loss=loss, lr=self.lr_now(epoch, step - 1),
                                consumed=step * rows * live)

    def _books(self) -> dict[str, Any]:
        if self.serves:
            return {"server": self._rank, **self.server.books.record()}
        return {"worker": self.roles.worker_index(self._rank), **self.worker.books.record()}

    def _report_epoch(self, epoch: int) -> None:
        """Rank 0's TensorBoard: the epoch's staleness histogram and the servers' and workers'
        rates (one allgather of every rank's counters)."""
        books = self.world.gather(self._books(), "ps_books")
        self.books = books
        board = self.fixed.progress.board
        if board is None or self.world.rank != 0:
            return
        mark = summary_record(books, self.cfg, self.fixed.steps, self.lost)
        prev = self.epoch_marks[-1] if self.epoch_marks else None
        self.epoch_marks.append(mark)
        counts = Counter({int(k): v for k, v in mark["staleness_histogram"].items()})
        if prev:
            counts.subtract({int(k): v for k, v in prev["staleness_histogram"].items()})
        board.histogram(epoch, "ps/staleness", {k: v for k, v in counts.items() if v > 0})
        server0 = [b for b in books if b.get("server") == 0][0]
        waits = [b["wait_seconds"] for b in books if "worker" in b]
        spent = [b["seconds"] for b in books if "worker" in b]
        b_in, b_out = server0["epoch_bytes"][-1]
        board.scalars(epoch, {"ps/updates_per_second": server0["epoch_updates"][-1]
                              / max(server0["epoch_seconds"][-1], 1e-9),
                              "ps/server_bytes_in_per_step": b_in / self.fixed.steps,
                              "ps/server_bytes_out_per_step": b_out / self.fixed.steps,
                              "ps/worker_wait_fraction": sum(waits) / max(sum(spent), 1e-9)})
        board.flush()

    def _report_run(self) -> None:
        """The summary's ``ps`` record on every rank (rank 0 writes it) and rank 0's lines."""
        self.record = summary_record(self.books, self.cfg, self.fixed.steps, self.lost)
        for line in report_lines(self.record):
            self.fixed.progress.info(line)

    def summary_fields(self) -> dict[str, Any]:
        """The ``ps`` record, once the epochs ran (none when resumed at the end)."""
        record = getattr(self, "record", None)
        return {"ps": record} if record is not None else {}


def summary_record(books: list[dict[str, Any]], cfg: ps.Config, steps: int,
                   lost: list[int]) -> dict[str, Any]:
    """The ``ps`` record of the summary from every rank's counters (``books``: servers' and
    workers' :meth:`record`, as gathered)."""
    servers = sorted((b for b in books if "server" in b), key=lambda b: b["server"])
    workers = sorted((b for b in books if "worker" in b), key=lambda b: b["worker"])
    pushed = {b["worker"]: b["pushed"] for b in workers}
    n_steps = steps * max(len(servers[0]["epoch_seconds"]), 1)
    # a gradient a server's snapshot held already (a resumed epoch) is received and skipped
    skipped = [s.get("skipped") or [0] * cfg.roles.workers for s in servers]
    exact = all(s["applied"][w] + skip[w] == s["received"][w] == pushed[w]
                for s, skip in zip(servers, skipped, strict=True) for w in pushed)
    resumed = [s.get("resumed") for s in servers]
    k = cfg.staleness
    return {
        "servers": cfg.roles.servers, "workers": cfg.roles.workers,
        "staleness": "inf" if k is None else k, "momentum_rule": cfg.rule,
        "slice_values": [cfg.length(s) for s in range(cfg.roles.servers)],
        "gradients_pushed": sum(pushed.values()),
        "gradients_applied": [sum(s["applied"]) for s in servers],
        "exactly_once": exact,
        "pushed": [pushed.get(w) for w in range(cfg.roles.workers)],
        "applied": [s["applied"] for s in servers],
        "received": [s["received"] for s in servers],
        "staleness_histogram": servers[0]["staleness"],
        "staleness_histograms": [s["staleness"] for s in servers],
        "updates_per_second": [s["updates"] / s["seconds"] if s["seconds"] else 0.0
                               for s in servers],
        "bytes_in_per_step": [s["bytes_in"] / n_steps for s in servers],
        "bytes_out_per_step": [s["bytes_out"] / n_steps for s in servers],
        "batches_handed_over": servers[0]["stolen"],
        "worker_wait_seconds": [b["wait_seconds"] for b in workers],
        "worker_seconds": [b["seconds"] for b in workers],
        "worker_batches": [[b["own"], b["taken"]] for b in workers],
        "lost_workers": [cfg.roles.worker_rank(w) for w in lost],
        # when each was lost, as server 0 saw it: epoch, its updates by then, seconds into
        # training, seconds of silence
        "lost": [x for x in servers[0].get("lost", [])
                 if x["rank"] in {cfg.roles.worker_rank(w) for w in lost}],
        # snapshots (docs/parameter-servers.md, "Snapshots and --resume"): --commit-every where
        # written, how many and how long each server's took (mean, longest)
        "commit_every": servers[0].get("snapshot_every"),
        "snapshots_written": [s.get("snapshots", 0) for s in servers],
        "snapshot_seconds": [[s["snapshot_seconds"] / s["snapshots"], s["snapshot_max_seconds"]]
                             if s.get("snapshots") else None for s in servers],
        "skipped": [sum(x) for x in skipped],
        # --resume: the epoch it resumed, each server's snapshot (its updates of that epoch; 0:
        # the epoch's start) and the updates it had applied after it that are gone (None: unknown)
        "resumed_epoch": resumed[0]["epoch"] if resumed[0] else None,
        "resumed_from_update": [r["from_update"] for r in resumed] if resumed[0] else None,
        "updates_lost": [r["updates_lost"] for r in resumed] if resumed[0] else None,
        "resumed_snapshots": [r["snapshot"] for r in resumed] if resumed[0] else None,
        "batches_resumed": resumed[0]["batches_done"] if resumed[0] else None,
    }


def report_lines(record: dict[str, Any]) -> list[str]:
    """Rank 0's closing lines: the staleness histogram, the counters, the rates."""
    r = record
    waits = r["worker_wait_seconds"]
    spent = r["worker_seconds"]
    applied = r["gradients_applied"]
    skipped = r.get("skipped") or [0] * len(applied)
    once = ("every pushed gradient applied exactly once" if r["exactly_once"]
            else "COUNTERS DISAGREE: " + f"pushed {r['pushed']}, applied {r['applied']}")
    # a lost worker's books left with it: its gradients are those the servers applied beyond
    by_lost = (f" (and {applied[0] + skipped[0] - r['gradients_pushed']} by the lost worker(s))"
               if r["lost_workers"] else "")
    each = (f"{applied[0]} applied by each server" if not any(skipped)
            else f"{', '.join(map(str, applied))} applied by the servers and "
                 f"{', '.join(map(str, skipped))} already in their snapshots")
    lines = [
        f"ps: {r['servers']} server(s), {r['workers']} worker(s), --staleness {r['staleness']}: "
        f"{r['gradients_pushed']} gradients pushed{by_lost}, {each} "
        f"({once}); {r['batches_handed_over']} batches handed to another worker",
        f"ps: staleness (server updates behind, per applied gradient): "
        f"{ps.histogram_line(r['staleness_histogram'])}",
        f"ps: servers {', '.join(f'{u:.0f}' for u in r['updates_per_second'])} updates/s; "
        f"bytes per step in {', '.join(f'{b / 1e6:.2f}' for b in r['bytes_in_per_step'])} MB, "
        f"out {', '.join(f'{b / 1e6:.2f}' for b in r['bytes_out_per_step'])} MB; workers waited "
        f"{sum(waits) / len(waits):.1f} s of {sum(spent) / len(spent):.1f} s each (mean)",
    ]
    if r["lost_workers"]:
        when = {x["rank"]: x for x in r.get("lost", [])}
        said = [f"rank {rank}" + (f" in epoch {when[rank]['epoch']}: dropped {when[rank]['seconds']:.0f} "
                                  f"s into training, after {when[rank]['updates']} updates, its "
                                  f"heartbeat silent for {when[rank]['silent_seconds']:.0f} s"
                                  if rank in when else "")
                for rank in r["lost_workers"]]
        left = r["workers"] - len(r["lost_workers"])
        lines.append(f"ps: lost worker {'; '.join(said)}; trained on with {left} worker(s)")
    line = resumed_line(r)
    if line:
        lines.append(line)
    return lines


def resumed_line(r: dict[str, Any]) -> str | None:
    """Rank 0's line on a resume that took servers' snapshots or lost updates (None otherwise)."""
    froms, lost, names = r.get("resumed_from_update"), r.get("updates_lost"), r.get("resumed_snapshots")
    if froms is None or not (any(names) or any(n != 0 for n in lost)):
        return None
    each = []
    for s, (since, gone, name) in enumerate(zip(froms, lost, names, strict=True)):
        start = f"from update {since}" if name else "from the epoch's start (no snapshot)"
        each.append(f"server {s} {start}, "
                    + ("updates lost unknown (no intact record of its last one)" if gone is None
                       else f"{gone} update(s) after it lost"))
    return (f"ps: resumed epoch {r['resumed_epoch']} (--commit-every {r['commit_every']}): "
            f"{'; '.join(each)}; {r['batches_resumed']} batches every server held were not "
            f"trained again")

