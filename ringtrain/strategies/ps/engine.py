"""Parameter servers with bounded staleness: the engine, framework-free and transport-free.

Ranks ``0 .. P-1`` serve, the others work.  The model's trainable parameters are one flat
float32 vector of D values; server ``s`` holds the contiguous range ``bounds[s]:bounds[s+1]``
of it (:func:`split`) and the optimizer state of that range only.  Contiguous ranges of one float32
vector balance the servers' bytes exactly (their sizes differ by at most one value, 4 bytes),
whatever the tensors' sizes; giving each server whole tensors could not (the CNN's first dense
layer holds 87% of its 184,586 parameters) and buys nothing, since workers send and receive
flat slices anyway.

A worker pulls the weights (one slice from every server), computes the gradient of one batch,
pushes it (one slice to every server) and gets the next weights in reply.  Its batches are its
shard of the epoch, exactly the ring's (``FixedLoop.index_batches``: shard rank = worker index,
shard size = number of workers); server 0 hands them out one at a time in its replies, own
batches in order, and a worker whose own batches are all handed out takes the last unassigned
batch of the worker with the most left (the epoch's tail goes to whoever is free).  Every batch
of the epoch is trained on once, and a slow worker no longer holds the epoch's end back by its
whole shard, only by the batch it is computing.  (With staleness 0 every worker is at the same
step, so no batch changes hands: the ring's assignment.)

The update rule is ``--optimizer`` (:class:`SliceOptimizer`: SGD with momentum, Adam, AdamW,
RMSprop, with ``--weight-decay`` decoupled for AdamW and an L2 term for the others), element-wise
on the slice in the framework's own arithmetic (``rule``: ``torch`` as ``torch.optim``, e.g. SGD's
``v = mu v + g; w -= lr v`` and Adam's ``sqrt(v) / sqrt(1 - b2^t) + eps``; ``keras`` as Keras,
e.g. ``v = mu v - lr g; w += v`` and ``lr sqrt(1 - b2^t) / (1 - b1^t)`` with epsilon outside the
correction: what its checkpoints hold).  Adam's step count counts the server's updates: one per
step at staleness 0, one per gradient above (its bias correction fades N times sooner there).

* **staleness 0** (synchronous through the servers): a server waits for the N gradients of step
  t, averages them in worker order and applies one update at the ring's LR for that step (the
  LR rule scaled by N, ``FixedLoop.lr``), then answers the N pulls.  That is the ring's math: the
  same average, the same update, so N workers after k steps hold the ring's weights up to float
  summation order.
* **staleness K > 0 or inf**: each gradient is applied once, as it arrives, at LR / N (N
  applications at LR / N move the weights about as far as one averaged step at LR).  Momentum is
  per application: every applied gradient decays the velocity by mu, so a constant gradient gives
  the ring's step per round of N gradients (lr g / (1 - mu)), but the velocity remembers
  1 / (1 - mu) applications, i.e. 1 / (N (1 - mu)) rounds, not steps; staleness itself acts as
  extra momentum (Mitliagkas et al. 2016), which is why momentum suffers most from it (Dai et
  al. 2019).

Staleness control (stale-synchronous parallel): a worker's clock is the number of gradients it
has pushed this epoch.  A server answers a pull from a worker at clock c once it has applied that
worker's own c gradients and the slowest worker still training this epoch has clock >= c - K.
K = inf never waits for anyone.  Each applied gradient records how many updates the server
applied between the weights it was computed on and its own application (the staleness
histogram; 0 throughout at K = 0).

A dead or frozen worker (:meth:`Server.drop`, at any K) leaves the bound: nobody waits for it.
A gradient of it that reached the server is applied (at K = 0 it stays in its step); the batch
it was computing, handed out with no gradient back, goes back to server 0's book
(:meth:`Assigner.give_back`) and is the next batch handed to anyone, and its batches not yet
handed out are the epoch's tail that the others take: every batch of the epoch is trained once.
The LR follows the workers still training (:meth:`Config.lr_for`).  A dropped worker that comes
back (it was frozen, not dead) gets a :data:`DROPPED` notice in answer to anything it sends, or
at once where it waits for a reply, and leaves (:class:`Dropped`); nothing it sends is used.

``--clip-grad-norm`` clips by the global norm over all parameters, every server's slice.  At
staleness 0 it clips what the ring clips, the step's mean gradient: each server sums the squares
of its slice of the mean (float64), sends that one number to every other server (a NORM message
on the servers' tag, :data:`TAG_PEER`, naming the epoch and the step), sums all of them in server
order (the same float on every server) and scales its slice by the framework's factor
(:func:`clip_factor`: PyTorch's ``clip_grad_norm_``, Keras' ``global_clipnorm``) before the
update; one server needs no message.  Above staleness 0 each gradient is applied alone as it
arrives, so each is clipped by its own global norm, by the worker that computed it (it holds all
of it) before it pushes: no server-to-server message, nothing in the header.

A server with a snapshot store (``ringtrain.strategies.ps.snapshot``) writes its slice, its
optimizer state (:meth:`SliceOptimizer.state`, and its step count) and the batches of the epoch
they hold every ``--commit-every`` updates. An epoch resumed from snapshots
(:meth:`Server.resume`) goes on with the batches not every server holds: server 0 hands out only
those (:meth:`Assigner.resume`), and a server whose snapshot holds one receives its gradient
without applying it again, so each server applies every batch of the epoch once over both runs.

Every message is one float32 array: an 8-value header (:data:`HEADER`, read as int32 through a
view, the step's loss as float32) and, for pushes and replies, the slice.  Nothing is pickled.
The transport (:class:`Link`) is MPI point to point in a job (``ringtrain.strategies.ps.transport``) and
threads of one process in the tests.

No message is taken at its word: before anything of it is used, its length (the values the
transport received) must be what its kind holds, its kind and epoch what this rank waits for,
and every index in its header in range (a worker, a batch of the epoch, a clock that follows the
worker's last one, a version the server has reached).  Anything else is :class:`BadMessage`:
the job ends in one line naming the peer, the message and what was expected, and nothing of
the message is applied.  A few integer comparisons per message; the slices are never scanned.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import numpy as np

# --- the wire format ------------------------------------------------------------------------------

HEADER = 8  # float32 values in front of every message
KIND, EPOCH, OWNER, T, CLOCK, VERSION, FLAGS, LOSS = range(HEADER)
# worker -> server
PULL, PUSH, FINAL = 1, 2, 3
# server -> worker, server -> server
WEIGHTS, EXCHANGE, DEAD, NORM = 4, 5, 6, 7
# FLAGS of a reply: STOP (the weights stopped being finite: train no further).  DROPPED, in a
# header-only WEIGHTS notice: the servers went on without this worker (it was silent), so it leaves.
STOP, DROPPED = 1, 2
# One tag per direction: MPI delivers messages from one sender with one tag in the order sent,
# so a server sees a worker's pushes before its FINAL, and each reply before the next.
TAG_UP, TAG_DOWN, TAG_PEER, TAG_CTRL, TAG_VERDICT = 11, 12, 13, 14, 15
NONE = -1  # no batch assigned: the epoch's batches are all handed out
KIND_NAMES = {PULL: "PULL", PUSH: "PUSH", FINAL: "FINAL", WEIGHTS: "WEIGHTS reply",
              EXCHANGE: "EXCHANGE", DEAD: "DEAD notice", NORM: "NORM"}


def header(buf: np.ndarray) -> np.ndarray:
    """The int32 view of a message's header (its loss slot read through :func:`loss_of`)."""
    return buf[:HEADER].view(np.int32)


def loss_of(buf: np.ndarray) -> float:
    return float(buf[LOSS])


def split(size: int, parts: int) -> list[int]:
    """Bounds of ``parts`` contiguous ranges of ``range(size)`` whose lengths differ by <= 1."""
    return [size * p // parts for p in range(parts + 1)]


@dataclass(frozen=True)
class Roles:
    """Who serves and who works in a world of ``world`` ranks with ``servers`` servers."""

    servers: int
    world: int

    @property
    def workers(self) -> int:
        return self.world - self.servers

    def serves(self, rank: int) -> bool:
        return rank < self.servers

    def worker_rank(self, index: int) -> int:
        return self.servers + index

    def worker_index(self, rank: int) -> int:
        return rank - self.servers


# --- the transport --------------------------------------------------------------------------------

class Link(Protocol):
    """Non-blocking point-to-point transfers of float32 arrays between ranks.  A buffer handed to
    :meth:`isend` or :meth:`irecv` belongs to the transfer until its request has completed."""

    def isend(self, dest: int, tag: int, buf: np.ndarray) -> Any: ...

    def irecv(self, source: int, tag: int, buf: np.ndarray) -> Any: ...

    def wait_any(self, requests: Sequence[Any], timeout: float) -> tuple[int, int] | None:
        """(index, float32 values received) of one completed request among ``requests`` (None
        entries are skipped), or None if none completed within ``timeout`` seconds."""

    def wait(self, request: Any, timeout: float) -> int | None:
        """Values received (or 0 for a send) once ``request`` completes; None on timeout."""


class PeerSilent(Exception):
    """A peer this rank waits for has been silent past the engine's deadline."""


class Dropped(Exception):
    """This worker was dropped by the servers while it was silent (frozen, or cut off) and has come
    back: the job trains on without it, and it must leave without touching anyone's state."""


class BadMessage(PeerSilent):
    """A peer's message that breaks the protocol (its length, kind, epoch or an index out of
    range), refused before anything of it is used.  Its text is the job's whole last line; it is
    caught where a silent peer is (the peer failed this rank either way) and ends the job."""


def values(count: int) -> str:
    """``count`` values as a message's length (the transport's -1: not whole float32 values)."""
    return f"{count} values" if count >= 0 else "a length that is no whole number of float32 values"


def refuse(me: str, peer: str, what: str, expected: str) -> NoReturn:
    raise BadMessage(f"{me} refused a message from {peer}: {what}, expected {expected}; nothing "
                     f"of it was used, so the job ends")


def check_batch(me: str, peer: str, h: np.ndarray, workers: int, steps: int, what: str,
                none: bool = False) -> None:
    """The (OWNER, T) of a header name a batch of the epoch: a worker's shard ``0 .. workers-1``
    and a step ``0 .. steps-1`` (or, where ``none``, no batch: both :data:`NONE`)."""
    owner, t = int(h[OWNER]), int(h[T])
    if none and owner == NONE and t == NONE:
        return
    if not (0 <= owner < workers and 0 <= t < steps):
        refuse(me, peer, f"a {what} naming batch {t} of worker {owner}",
               f"a batch 0..{steps - 1} of a worker 0..{workers - 1}"
               + (f" (or {NONE}, {NONE}: none)" if none else ""))


# --- the servers' optimizer -----------------------------------------------------------------------

BETAS, EPS, RMSPROP_ALPHA = (0.9, 0.999), 1e-8, 0.99  # ringtrain.optimizer_spec's (both frameworks)
OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop")


class SliceOptimizer:
    """A built-in optimizer on one server's slice, element-wise, in place, float32, in the
    framework's own arithmetic (``rule``: ``torch`` as ``torch.optim``, ``keras`` as
    ``keras.optimizers`` with ``tf_models.optimizers.RingUpdate``'s L2 term).  :meth:`apply`
    updates the weights ``w`` by a gradient (clipped by the caller) at ``lr``; :meth:`state` names
    its float32 arrays (a snapshot's members, the checkpoint's state); :attr:`steps` counts the
    updates applied (Adam's bias correction reads it; saved and restored with the state)."""

    names: tuple[str, ...] = ()

    def __init__(self, weights: np.ndarray, rule: str, weight_decay: float = 0.0) -> None:
        if rule not in ("torch", "keras"):
            raise ValueError(f"unknown momentum rule {rule!r}")
        self.w, self.rule = weights, rule
        self.wd = np.float32(weight_decay)
        self.steps = 0
        self.tmp = np.empty_like(weights)

    def apply(self, grad: np.ndarray, lr: float) -> None:
        self.steps += 1
        self.lr = float(lr)  # PyTorch's scalar arithmetic takes it as a Python float
        self._apply(grad, np.float32(lr))

    def _apply(self, grad: np.ndarray, lr32: np.float32) -> None:
        raise NotImplementedError

    def _l2(self, grad: np.ndarray) -> np.ndarray:
        """PyTorch's L2 weight decay (``g + W w``, after clipping, before the update), in a buffer
        of its own: ``grad`` is a received message, never written."""
        if not self.wd:
            return grad
        out = np.multiply(self.w, self.wd)
        out += grad
        return out

    def state(self) -> dict[str, np.ndarray]:
        """The optimizer's state for the slice, as named float32 arrays of its length (what a
        snapshot holds, besides :attr:`steps`)."""
        return {name: getattr(self, "_" + name) for name in self.names}

    def load_state(self, arrays: dict[str, np.ndarray], steps: int | None = None) -> None:
        """Copy ``arrays`` (:meth:`state`'s names and lengths, checked by the caller) in, and
        the step count where given."""
        mine = self.state()
        if set(arrays) != set(mine):
            raise ValueError(f"optimizer state {sorted(arrays)}, expected {sorted(mine)}")
        for name, array in arrays.items():
            mine[name][:] = array
        if steps is not None:
            self.steps = int(steps)


class SliceSGD(SliceOptimizer):
    """SGD with momentum on one server's slice, in place, float32, in the framework's form
    (``--weight-decay``: the L2 term, PyTorch's ``weight_decay``, as both trainers add it)."""

    def __init__(self, weights: np.ndarray, momentum: float, rule: str,
                 velocity: np.ndarray | None = None, weight_decay: float = 0.0) -> None:
        super().__init__(weights, rule, weight_decay)
        self.mu = np.float32(momentum)
        self.v = None
        if momentum:
            self.v = np.zeros_like(weights) if velocity is None else velocity
            self.names = ("velocity",)

    @property
    def _velocity(self) -> np.ndarray | None:
        return self.v

    def _apply(self, grad: np.ndarray, lr32: np.float32) -> None:
        grad = self._l2(grad)
        if self.v is None:
            np.multiply(grad, lr32, out=self.tmp)
            self.w -= self.tmp
        elif self.rule == "torch":  # torch.optim.SGD: buf.mul_(mu).add_(g); p.add_(buf, alpha=-lr)
            self.v *= self.mu
            self.v += grad
            np.multiply(self.v, lr32, out=self.tmp)
            self.w -= self.tmp
        else:  # keras.optimizers.SGD: m = -g * lr + m * mu; w += m
            self.v *= self.mu
            np.multiply(grad, lr32, out=self.tmp)
            self.v -= self.tmp
            self.w += self.v


class SliceAdam(SliceOptimizer):
    """Adam, or AdamW (``decoupled``: ``w -= lr W w`` before the update, both frameworks' AdamW);
    Adam's ``--weight-decay`` is the L2 term.  ``torch``: ``torch.optim.Adam``'s bias correction
    (``lr / (1 - b1^t)``, ``sqrt(v) / sqrt(1 - b2^t) + eps``); ``keras``: Keras' (``alpha = lr
    sqrt(1 - b2^t) / (1 - b1^t)``, ``m alpha / (sqrt(v) + eps)``: epsilon outside the correction)."""

    names = ("exp_avg", "exp_avg_sq")

    def __init__(self, weights: np.ndarray, rule: str, weight_decay: float = 0.0,
                 decoupled: bool = False) -> None:
        super().__init__(weights, rule, 0.0 if decoupled else weight_decay)
        self.decay_value = float(weight_decay if decoupled else 0.0)
        self.decay = np.float32(self.decay_value)
        self._exp_avg, self._exp_avg_sq = np.zeros_like(weights), np.zeros_like(weights)
        self.b1, self.b2 = (np.float32(b) for b in BETAS)
        self.eps = np.float32(EPS)

    def _apply(self, grad: np.ndarray, lr32: np.float32) -> None:
        m, v, tmp, t = self._exp_avg, self._exp_avg_sq, self.tmp, self.steps
        if self.decay:  # decoupled, first: torch's p.mul_(1 - lr W); Keras' w -= w W lr
            if self.rule == "torch":
                self.w *= np.float32(1 - self.lr * self.decay_value)
            else:
                np.multiply(self.w, self.decay, out=tmp)
                tmp *= lr32
                self.w -= tmp
        grad = self._l2(grad)
        if self.rule == "torch":
            # exp_avg.lerp_(g, 1 - b1); exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
            np.subtract(grad, m, out=tmp)
            tmp *= np.float32(1 - BETAS[0])
            m += tmp
            v *= self.b2
            np.multiply(grad, grad, out=tmp)
            tmp *= np.float32(1 - BETAS[1])
            v += tmp
            step_size = self.lr / (1 - BETAS[0] ** t)
            bc2_sqrt = (1 - BETAS[1] ** t) ** 0.5
            np.sqrt(v, out=tmp)
            tmp /= np.float32(bc2_sqrt)
            tmp += self.eps
            np.divide(m, tmp, out=tmp)
            tmp *= np.float32(-step_size)
            self.w += tmp
        else:
            # keras.optimizers.Adam: m += (g - m)(1 - b1); v += (g^2 - v)(1 - b2);
            # w -= m alpha / (sqrt(v) + eps), alpha = lr sqrt(1 - b2^t) / (1 - b1^t) in float32
            b1_power = np.float32(self.b1 ** np.float32(t))
            b2_power = np.float32(self.b2 ** np.float32(t))
            alpha = lr32 * np.sqrt(np.float32(1) - b2_power) / (np.float32(1) - b1_power)
            # (1 - beta) in Python's float, then float32, as Keras and PyTorch both take it:
            # 0.001, where float32's 1 - 0.999f is 0.00099998713)
            np.subtract(grad, m, out=tmp)
            tmp *= np.float32(1 - BETAS[0])
            m += tmp
            np.multiply(grad, grad, out=tmp)
            tmp -= v
            tmp *= np.float32(1 - BETAS[1])
            v += tmp
            np.sqrt(v, out=tmp)
            tmp += self.eps
            np.divide(np.multiply(m, np.float32(alpha)), tmp, out=tmp)
            self.w -= tmp


class SliceRMSprop(SliceOptimizer):
    """RMSprop (alpha 0.99, PyTorch's), with momentum where given; ``--weight-decay``: the L2
    term.  ``torch``: ``g / (sqrt(s) + eps)``, the momentum buffer without the LR; ``keras``:
    ``lr g / sqrt(s + eps)``, the momentum buffer with it."""

    def __init__(self, weights: np.ndarray, rule: str, weight_decay: float = 0.0,
                 momentum: float = 0.0) -> None:
        super().__init__(weights, rule, weight_decay)
        self.mu = np.float32(momentum)
        self._square_avg = np.zeros_like(weights)
        self._velocity = np.zeros_like(weights) if momentum else None
        self.names = ("square_avg", "velocity") if momentum else ("square_avg",)
        self.rho, self.eps = np.float32(RMSPROP_ALPHA), np.float32(EPS)

    def _apply(self, grad: np.ndarray, lr32: np.float32) -> None:
        s, buf, tmp = self._square_avg, self._velocity, self.tmp
        grad = self._l2(grad)
        s *= self.rho  # square_avg.mul_(alpha).addcmul_(g, g, value=1 - alpha); Keras' the same
        np.multiply(grad, grad, out=tmp)
        tmp *= np.float32(1 - RMSPROP_ALPHA)
        s += tmp
        if self.rule == "torch":
            np.sqrt(s, out=tmp)
            tmp += self.eps
            np.divide(grad, tmp, out=tmp)
            if buf is not None:  # buf.mul_(mu).addcdiv_(g, avg); p.add_(buf, alpha=-lr)
                buf *= self.mu
                buf += tmp
                np.multiply(buf, lr32, out=tmp)
            else:  # p.addcdiv_(g, avg, value=-lr)
                tmp *= lr32
            self.w -= tmp
        else:  # increment = lr g rsqrt(s + eps); m = mu m + increment; w -= m (or the increment)
            np.add(s, self.eps, out=tmp)
            np.sqrt(tmp, out=tmp)
            np.divide(np.multiply(grad, lr32), tmp, out=tmp)
            if buf is not None:
                buf *= self.mu
                buf += tmp
                self.w -= buf
            else:
                self.w -= tmp


def slice_optimizer(optimizer: str, weights: np.ndarray, rule: str, momentum: float = 0.0,
                    weight_decay: float = 0.0) -> SliceOptimizer:
    """``--optimizer`` (a built-in) on a slice: the servers' update."""
    if optimizer == "sgd":
        return SliceSGD(weights, momentum, rule, weight_decay=weight_decay)
    if optimizer in ("adam", "adamw"):
        return SliceAdam(weights, rule, weight_decay, decoupled=optimizer == "adamw")
    if optimizer == "rmsprop":
        return SliceRMSprop(weights, rule, weight_decay, momentum)
    raise ValueError(f"the servers apply the built-in optimizers {OPTIMIZERS}, not {optimizer!r}")


def state_names(momentum: float, optimizer: str = "sgd") -> tuple[str, ...]:
    """The names of :meth:`SliceOptimizer.state`'s arrays for ``optimizer`` with ``momentum``
    (SGD: ``velocity``, none without momentum; Adam(W): ``exp_avg``, ``exp_avg_sq``; RMSprop:
    ``square_avg`` and, with momentum, ``velocity``)."""
    return slice_optimizer(optimizer, np.zeros(0, np.float32), "torch", momentum).names


def clip_factor(norm: float, clip: float, rule: str) -> float:
    """The factor that clips gradients of global norm ``norm`` to ``clip``: PyTorch's
    ``clip_grad_norm_`` (``min(1, clip / (norm + 1e-6))``), Keras' ``global_clipnorm``
    (``clip min(1 / norm, 1 / clip)``)."""
    if rule == "torch":
        return min(1.0, clip / (norm + 1e-6))
    return clip * min(1.0 / norm if norm else float("inf"), 1.0 / clip)


def squares(x: np.ndarray) -> float:
    """The sum of squares of ``x``, in float64."""
    x64 = x.astype(np.float64)
    return float(np.dot(x64, x64))


# --- who trains which batch (server 0) -----------------------------------------------------------

class Assigner:
    """Server 0's book of an epoch's batches: worker w's own batch t is ``(w, t)``, t < steps."""

    def __init__(self, workers: int, steps: int) -> None:
        self.workers, self.steps = workers, steps
        self.new_epoch()

    def new_epoch(self) -> None:
        self.next = [0] * self.workers  # the next own batch not yet handed out
        self.end = [self.steps] * self.workers  # batches from here on were taken by other workers
        self.handed: dict[int, tuple[int, int]] = {}  # worker -> the batch it trains (no gradient yet)
        self.returned: list[tuple[int, int]] = []  # handed to a worker that died before its gradient
        self.stolen = 0
        self.already: np.ndarray | None = None  # a resumed epoch: batches never to hand out again

    def resume(self, done: np.ndarray) -> None:
        """The epoch resumes from the servers' snapshots: ``done`` (bool, workers x steps) holds
        the batches every server has applied already, which are skipped wherever they are met
        (every worker's range is trimmed to start and end on a batch still to train)."""
        self.already = np.asarray(done, bool)
        for w in range(self.workers):
            self._trim(w)

    def _trim(self, w: int) -> None:
        if self.already is None:
            return
        while self.next[w] < self.end[w] and self.already[w, self.next[w]]:
            self.next[w] += 1
        while self.end[w] > self.next[w] and self.already[w, self.end[w] - 1]:
            self.end[w] -= 1

    def left(self, w: int) -> int:
        n = self.end[w] - self.next[w]
        if self.already is not None and n > 0:  # a resumed epoch: done batches inside the range
            n -= int(self.already[w, self.next[w]:self.end[w]].sum())
        return n

    def take(self, w: int) -> tuple[int, int] | None:
        """The batch worker ``w`` trains next: one a dead worker was computing (the first given
        back), else its own next one, else the last unassigned batch of the worker with the most
        left (the lowest index among equals), else None."""
        batch = self._pick(w)
        if batch is not None:
            self.handed[w] = batch
        return batch

    def _pick(self, w: int) -> tuple[int, int] | None:
        if self.returned:  # first: the epoch cannot end before someone has trained it
            self.stolen += 1
            return self.returned.pop(0)
        if self.next[w] < self.end[w]:
            t = self.next[w]
            self.next[w] += 1
            self._trim(w)
            return w, t
        victim = max(range(self.workers), key=lambda v: (self.left(v), -v))
        if self.left(victim) <= 0:
            return None
        self.end[victim] -= 1
        t = self.end[victim]
        self._trim(victim)
        self.stolen += 1
        return victim, t

    def busy(self, w: int) -> bool:
        """Whether a worker other than ``w`` trains a batch it was handed: if it dies, that batch
        comes back, and ``w`` must be there to take it."""
        return any(v != w for v in self.handed)

    def done(self, w: int) -> None:
        """Worker ``w``'s gradient of the batch it was handed has arrived."""
        self.handed.pop(w, None)

    def give_back(self, w: int) -> None:
        """Worker ``w`` is dead: the batch it was computing (handed out, no gradient back) is
        handed to the next worker that asks."""
        batch = self.handed.pop(w, None)
        if batch is not None:
            self.returned.append(batch)


# --- the books --------------------------------------------------------------------------------

@dataclass
class ServerBooks:
    """One server's counters over the run (``applied`` per worker, run-wide) and this epoch's."""

    applied: list[int]
    received: list[int]
    staleness: Counter = field(default_factory=Counter)
    updates: int = 0  # updates applied (aggregated steps at K = 0): the weights' version
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    epoch_updates: list[int] = field(default_factory=list)
    epoch_bytes: list[tuple[int, int]] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    stolen: int = 0
    # server 0: each worker it went on without: rank, epoch, updates applied by then, seconds
    # into training, seconds of silence
    lost: list[dict[str, Any]] = field(default_factory=list)
    # per worker: gradients received of batches this server's snapshot held already (a resumed
    # epoch), not applied again
    skipped: list[int] = field(default_factory=list)
    snapshots: int = 0  # snapshots written, their seconds in all and the longest
    snapshot_seconds: float = 0.0
    snapshot_max_seconds: float = 0.0
    snapshot_every: int | None = None  # --commit-every, where this server writes snapshots
    # a resumed epoch: epoch, from_update (its snapshot's updates of the epoch; 0: the epoch's
    # start), updates_lost (None: unknown), snapshot (its name), batches_done (server 0: those
    # every server held)
    resumed: dict[str, Any] | None = None

    def record(self) -> dict[str, Any]:
        return {"applied": list(self.applied), "received": list(self.received),
                "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
                "updates": self.updates, "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "seconds": self.seconds, "epoch_updates": list(self.epoch_updates),
                "epoch_bytes": [list(b) for b in self.epoch_bytes],
                "epoch_seconds": list(self.epoch_seconds), "stolen": self.stolen,
                "lost": [dict(x) for x in self.lost],
                "skipped": list(self.skipped) or [0] * len(self.applied),
                "snapshots": self.snapshots, "snapshot_seconds": self.snapshot_seconds,
                "snapshot_max_seconds": self.snapshot_max_seconds,
                "snapshot_every": self.snapshot_every,
                "resumed": dict(self.resumed) if self.resumed is not None else None}


@dataclass
class WorkerBooks:
    pushed: int = 0
    own: int = 0
    taken: int = 0  # batches of other workers' shards
    wait_seconds: float = 0.0
    seconds: float = 0.0
    last_loss: float = 0.0

    def record(self) -> dict[str, Any]:
        return {"pushed": self.pushed, "own": self.own, "taken": self.taken,
                "wait_seconds": self.wait_seconds, "seconds": self.seconds}


@dataclass(frozen=True)
class Config:
    """What every rank of a parameter-server job agrees on."""

    roles: Roles
    size: int                     # D, the flat parameter vector's length
    staleness: int | None         # K; None = inf
    momentum: float
    rule: str                     # "torch" | "keras"
    steps: int                    # batches per worker per epoch (the ring's optimizer steps)
    lr: Callable[[int, int], float]  # (epoch, step) -> the ring's LR (scaled by the workers)
    deadline: float | None = None  # s a rank waits for a silent peer before PeerSilent (None: never)
    tick: float = 0.5             # s between a waiting rank's checks
    # (epoch, step, n) -> the LR rule scaled for n workers (the run's: warm-up and scaling rule
    # with n); None: lr x n / workers, linear scaling
    live_lr: Callable[[int, int, int], float] | None = None
    optimizer: str = "sgd"        # --optimizer, a built-in (SliceOptimizer)
    weight_decay: float = 0.0     # --weight-decay (decoupled for adamw, an L2 term otherwise)
    clip: float | None = None     # --clip-grad-norm: the global norm over all servers' slices

    def make_optimizer(self, weights: np.ndarray) -> SliceOptimizer:
        return slice_optimizer(self.optimizer, weights, self.rule, self.momentum, self.weight_decay)

    def lr_for(self, epoch: int, step: int, n: int) -> float:
        """The LR of ``step`` for ``n`` workers training: with a worker lost, the rule as the ring
        of the survivors would scale it, not as for the workers the job started with."""
        if n == self.roles.workers:
            return self.lr(epoch, step)
        if self.live_lr is not None:
            return self.live_lr(epoch, step, n)
        return self.lr(epoch, step) * n / self.roles.workers

    @property
    def bounds(self) -> list[int]:
        return split(self.size, self.roles.servers)

    def slice(self, server: int) -> slice:
        b = self.bounds
        return slice(b[server], b[server + 1])

    def length(self, server: int) -> int:
        b = self.bounds
        return b[server + 1] - b[server]


# --- a server ---------------------------------------------------------------------------------

def forever(deadline: float | None) -> float:
    return deadline if deadline is not None else 1e9


class Server:
    """Server ``index`` of the job: its slice, its optimizer, its books, its epoch loop.

    ``silent()`` (server 0) names the ranks whose heartbeats stopped (the watchdog's), with
    seconds of silence; a silent worker is ``on_dead(rank, seconds)``'s to judge: True goes on
    without it (:meth:`drop`, at any K, under an MPI that survives a rank's death), False ends
    the job (:class:`PeerSilent`).  A silent server always ends it: its slice is gone.  ``progress()``
    marks the rank alive for its watchdog after each update; ``on_step(epoch, updates, loss)``
    (server 0) reports each update to the progress bar.

    ``store`` (a :class:`ringtrain.strategies.ps.snapshot.Store`, or None) takes a snapshot of the
    slice and the optimizer state every ``store.every`` updates of an epoch, and the count of the
    epoch's updates after each one.  :meth:`resume` starts an epoch from a snapshot: the batches
    it holds are not applied again (:meth:`_already`), and server 0 hands out only those that some
    server still lacks.
    """

    def __init__(self, cfg: Config, link: Link, index: int, weights: np.ndarray,
                 velocity: np.ndarray | None = None, *, state: dict[str, np.ndarray] | None = None,
                 steps: int = 0,
                 silent: Callable[[], dict[int, float]] = dict,
                 on_dead: Callable[[int, float], bool] = lambda rank, quiet: False,
                 progress: Callable[[], None] = lambda: None,
                 on_step: Callable[[int, int, float], None] = lambda epoch, step, loss: None,
                 store: Any = None) -> None:
        self.cfg, self.link, self.index = cfg, link, index
        n, roles = cfg.length(index), cfg.roles
        self.opt = cfg.make_optimizer(np.array(weights, dtype=np.float32))
        if velocity is not None and state is None and "velocity" in self.opt.names:  # SGD's
            state = {"velocity": velocity}
        if state is not None:
            self.opt.load_state(state, steps)
        self.opt.steps = steps
        self.step_index = 0  # K = 0: the epoch's steps taken (the servers' NORM messages name it)
        self.silent, self.on_dead, self.progress, self.on_step = silent, on_dead, progress, on_step
        w = roles.workers
        self.books = ServerBooks(applied=[0] * w, received=[0] * w, skipped=[0] * w,
                                 snapshot_every=store.every if store is not None else None)
        self.store = store
        self.done = np.zeros((w, cfg.steps), bool)  # the epoch's batches this slice holds
        self.restored: np.ndarray | None = None  # a resumed epoch: those its snapshot held
        self.resume_at: tuple[int, int, np.ndarray, np.ndarray] | None = None
        self.epoch_updates = 0  # updates of this epoch (a resumed one: its snapshot's included)
        self.since_snapshot = 0
        self.snapshot_due = False
        self.inbox = [np.zeros(HEADER + n, np.float32) for _ in range(w)]
        self.outbox = [np.zeros(HEADER + n, np.float32) for _ in range(w)]
        self.sending: list[Any] = [None] * w  # a reply's send, waited for before its buffer is reused
        self.recvs: list[Any] = [None] * w
        self.ctrl_buf = np.zeros(HEADER, np.float32)
        self.ctrl: Any = None
        self.dead: set[int] = set()  # worker indices, run-wide
        # A dead worker's receive stays posted (its tomb): if it was only frozen and comes back,
        # what it sends lands there and is answered with a DROPPED notice, never used.
        self.tombs: list[Any] = [None] * w
        self.notices: list[tuple[np.ndarray, Any]] = []  # never waited for: the peer may be dead
        self.started: float | None = None  # the first epoch's start (server 0's lost records)
        self.assigner = Assigner(w, cfg.steps) if index == 0 else None
        self.diverged: tuple[int, int, float] | None = None  # (epoch, step, loss) of the first
        self.sum = np.zeros(n, np.float32)
        self.epoch = 0

    @property
    def weights(self) -> np.ndarray:
        return self.opt.w

    @property
    def velocity(self) -> np.ndarray | None:
        return self.opt.state().get("velocity")

    def resume(self, epoch: int, updates: int, mine: np.ndarray, everyone: np.ndarray,
               weights: np.ndarray | None = None, state: dict[str, np.ndarray] | None = None,
               steps: int | None = None) -> None:
        """Before ``epoch`` begins: the slice and the optimizer state of this server's snapshot
        (``weights``, ``state``; None: no snapshot, the slice stays the checkpoint's), taken after
        ``updates`` updates of the epoch holding the batches ``mine`` (bool, workers x steps);
        ``everyone``: the batches every server holds, which server 0 does not hand out again."""
        if weights is not None:
            self.opt.w[:] = weights
            self.opt.load_state(state or {}, steps)
        self.resume_at = (epoch, updates, np.array(mine, bool), np.array(everyone, bool))

    def _post(self, w: int) -> None:
        self.recvs[w] = self.link.irecv(self.cfg.roles.worker_rank(w), TAG_UP, self.inbox[w])

    def _live(self) -> list[int]:
        return [w for w in range(self.cfg.roles.workers) if w not in self.dead]

    # --- the epoch ------------------------------------------------------------------------

    def serve_epoch(self, epoch: int) -> None:
        """Until every live worker has sent its FINAL: apply their gradients and answer their
        pulls; then answer every FINAL with this epoch's last weights."""
        cfg, books = self.cfg, self.books
        t0, b0, u0 = time.monotonic(), (books.bytes_in, books.bytes_out), books.updates
        self.started = t0 if self.started is None else self.started
        self.begin_epoch(epoch)
        last_message = last_check = time.monotonic()
        while not self.epoch_done():
            got = self.link.wait_any([*self.recvs, self.ctrl, *self.tombs], cfg.tick)
            now = time.monotonic()
            if got is None or now - last_check >= cfg.tick:
                last_check = now
                self._check_silent(now - last_message)
            if got is not None:
                last_message = now
                self.handle(*got)
            self.commit_if_due()  # a drop (K = 0) may have completed the step
        for w in sorted(self.finals - self.dead):  # not waited for: a worker may die after its FINAL
            self._reply(w, None)
        books.epoch_seconds.append(time.monotonic() - t0)
        books.seconds += books.epoch_seconds[-1]
        books.epoch_updates.append(books.updates - u0)
        books.epoch_bytes.append((books.bytes_in - b0[0], books.bytes_out - b0[1]))
        if self.assigner is not None:
            books.stolen += self.assigner.stolen

    def begin_epoch(self, epoch: int) -> None:
        """Receives posted for every live worker (and server 0's word, on the others), the
        epoch's clocks at 0, server 0's batches all unassigned."""
        live = self._live()
        for w in live:
            if self.recvs[w] is None:
                self._post(w)
        if self.index != 0 and self.ctrl is None:
            self.ctrl = self.link.irecv(0, TAG_CTRL, self.ctrl_buf)
        if self.assigner is not None:
            self.assigner.new_epoch()
        self.epoch = epoch
        self.done[:] = False
        self.restored, self.epoch_updates, self.since_snapshot = None, 0, 0
        self.snapshot_due = False
        if self.resume_at is not None and self.resume_at[0] == epoch:
            _, self.epoch_updates, mine, everyone = self.resume_at
            self.done[:] = mine
            self.restored = mine
            if self.assigner is not None:
                self.assigner.resume(everyone)
        self.resume_at = None
        if self.store is not None:
            self.store.mark(epoch, self.epoch_updates)
        self.clock = dict.fromkeys(live, 0)  # gradients applied this epoch, per worker still at it
        self.pending: dict[int, int] = {}  # worker -> the clock its reply waits for
        self.finals: set[int] = set()
        self.held: dict[int, tuple[int, int, int]] = {}  # K = 0: worker -> (owner, t, version)
        self.step_index = 0
        self.pushes = [0] * self.cfg.roles.workers  # PUSHes accepted this epoch, per worker

    def epoch_done(self) -> bool:
        return set(self._live()) <= self.finals

    def handle(self, i: int, count: int) -> None:
        """The message that completed receive ``i`` (a worker's; at ``workers`` server 0's word
        that a worker is dead; above, what a dropped worker sent after all), then every reply
        that may now go."""
        workers = self.cfg.roles.workers
        if i == workers:
            self.drop(self._check_dead(count))
            self.ctrl = self.link.irecv(0, TAG_CTRL, self.ctrl_buf)
        elif i > workers:
            # A dropped worker came back: nothing of its message is used (it may be of an epoch
            # long gone); the notice tells it to leave.
            self.tombs[i - workers - 1] = None
            self._notify_dropped(i - workers - 1)
        else:
            self._receive(i, count)
        self._answer()
        self.commit_if_due()  # after the replies: the workers compute while it writes

    def _check_dead(self, count: int) -> int:
        """Server 0's word that a worker is dead: its worker index, once checked."""
        me, h, workers = f"server rank {self.index}", header(self.ctrl_buf), self.cfg.roles.workers
        if count != HEADER or int(h[KIND]) != DEAD:
            refuse(me, "server rank 0", f"a control message of {values(count)} and kind "
                   f"{int(h[KIND]) if count >= HEADER else '?'}",
                   f"a DEAD notice ({HEADER} values, kind {DEAD})")
        w = int(h[OWNER])
        if not 0 <= w < workers:
            refuse(me, "server rank 0", f"a DEAD notice naming worker {w}",
                   f"a worker 0..{workers - 1} of the {workers}")
        return w

    def _check_up(self, w: int, count: int, h: np.ndarray) -> int:
        """A worker's message, checked against its length and what this server knows of the
        worker; its kind."""
        cfg = self.cfg
        me, peer = f"server rank {self.index}", f"worker rank {cfg.roles.worker_rank(w)}"
        if count < HEADER:
            refuse(me, peer, f"a message of {values(count)}", f"at least its {HEADER}-value header")
        kind = int(h[KIND])
        if kind not in (PULL, PUSH, FINAL):
            refuse(me, peer, f"a message of kind {kind}",
                   f"a PULL ({PULL}), PUSH ({PUSH}) or FINAL ({FINAL})")
        want = HEADER + cfg.length(self.index) if kind == PUSH else HEADER
        if count != want:
            holds = (f"its {HEADER}-value header and this server's {want - HEADER} values of the "
                     f"gradient" if kind == PUSH else "its header alone")
            refuse(me, peer, f"a {KIND_NAMES[kind]} of {values(count)}", f"{want} ({holds})")
        name = KIND_NAMES[kind]
        epoch, clock = int(h[EPOCH]), int(h[CLOCK])
        if epoch != self.epoch:
            refuse(me, peer, f"a {name} of epoch {epoch}", f"epoch {self.epoch}, this server's")
        if w in self.finals:
            refuse(me, peer, f"a {name} after its FINAL of epoch {epoch}", "nothing more this epoch")
        pushed = self.pushes[w]
        if kind == PULL and (clock != 0 or pushed):
            refuse(me, peer, f"a PULL at clock {clock} after {pushed} PUSHes this epoch",
                   "a PULL only before its first PUSH of the epoch, at clock 0")
        if kind == FINAL and clock != pushed:
            refuse(me, peer, f"a FINAL at clock {clock}", f"clock {pushed}, the PUSHes it sent")
        if kind == PUSH:
            if clock != pushed + 1:
                refuse(me, peer, f"a PUSH at clock {clock}",
                       f"clock {pushed + 1}, the one after its last PUSH")
            check_batch(me, peer, h, cfg.roles.workers, cfg.steps, "PUSH")
            version = int(h[VERSION])
            if not 0 <= version <= self.books.updates:
                refuse(me, peer, f"a PUSH computed on version {version} of the weights",
                       f"a version 0..{self.books.updates} this server has sent")
        return kind

    def _receive(self, w: int, count: int) -> None:
        buf = self.inbox[w]
        h = header(buf)
        kind = self._check_up(w, count, h)
        self.books.bytes_in += 4 * count
        self.recvs[w] = None
        if kind == PULL:
            self.pending[w] = 0
            self._post(w)
        elif kind == FINAL:
            self.finals.add(w)
            self.clock.pop(w, None)  # done with this epoch: nobody waits for it
            self._post(w)
            self._step_if_complete()  # K = 0: the others' step no longer waits for it
        else:  # PUSH
            self.pushes[w] += 1
            self.books.received[w] += 1
            clock = int(h[CLOCK])
            self.pending[w] = clock
            if self.assigner is not None:
                self.assigner.done(w)
            if self.diverged is not None:  # stopping: gradients of non-finite weights are dropped
                self._post(w)
            elif self.cfg.staleness == 0:  # its buffer is held (not reposted) until the step's update
                self.held[w] = (int(h[OWNER]), int(h[T]), int(h[VERSION]))
                self._step_if_complete()
            else:
                if self._already(int(h[OWNER]), int(h[T])):
                    self.books.skipped[w] += 1  # its snapshot holds it: applied before the loss
                    self.clock[w] = clock
                else:
                    self._apply_one(w, clock)
                self._post(w)

    def _already(self, owner: int, t: int) -> bool:
        """Whether batch ``(owner, t)`` of a resumed epoch is in this server's snapshot: another
        server lacked it, so it was trained again, and here it is received, not applied."""
        return self.restored is not None and bool(self.restored[owner, t])

    def _apply_one(self, w: int, clock: int) -> None:
        """K > 0: this gradient alone, at LR / N, N the workers still training (the LR too is
        the rule's for N: :meth:`Config.lr_for`)."""
        buf, cfg = self.inbox[w], self.cfg
        h = header(buf)
        t = int(h[T])
        self.books.staleness[self.books.updates - int(h[VERSION])] += 1
        n = len(self._live())
        self.opt.apply(buf[HEADER:], cfg.lr_for(self.epoch, t, n) / n)
        self.books.updates += 1
        self.books.applied[w] += 1
        self.done[int(h[OWNER]), t] = True
        self.clock[w] = clock
        self._after_update(t, loss_of(buf))

    def _step_if_complete(self) -> None:
        """K = 0: the step's update once every worker still at the epoch has pushed."""
        if self.cfg.staleness == 0 and self.held and set(self.clock) <= set(self.held):
            self._apply_step()

    def _apply_step(self) -> None:
        """K = 0: the mean of the step's gradients, summed in worker order, one update at the LR
        for that many workers (all of them, but in the step that lost one: its gradient, if it
        arrived, is still averaged in).  In a resumed epoch, gradients of batches this server's
        snapshot holds are left out; a step of only those is no update here."""
        held = sorted(self.held)
        workers = [w for w in held if not self._already(*self.held[w][:2])]
        for w in held:
            if w in workers:
                self.books.applied[w] += 1
            else:
                self.books.skipped[w] += 1
            if w not in self.dead:  # a dead one's receive is its tomb, already posted
                self.clock[w] += 1
        self.step_index += 1
        clip = self.cfg.clip
        if clip is not None:
            # The norm of the step's mean gradient, all of it (a resumed epoch's skipped ones
            # too: the step's gradient is theirs), over every server's slice.
            self._mean(held)
            norm = self._global_norm(squares(self.sum))
        if not workers:
            self.held = {}
            self._repost(held)
            self.progress()
            return
        t = self.held[workers[0]][1]
        if clip is None or workers != held:
            self._mean(workers)
        if clip is not None:
            self.sum *= np.float32(clip_factor(norm, clip, self.cfg.rule))
        for w in workers:
            self.books.staleness[self.books.updates - self.held[w][2]] += 1
            self.done[self.held[w][0], self.held[w][1]] = True
        self.opt.apply(self.sum, self.cfg.lr_for(self.epoch, t, len(workers)))
        self.books.updates += 1
        loss = float(np.mean([loss_of(self.inbox[w]) for w in workers]))
        self.held = {}
        self._repost(held)  # after the sum: a receive posted writes into its inbox buffer
        self._after_update(t, loss)

    def _mean(self, workers: list[int]) -> None:
        """``self.sum``: the mean of ``workers``' gradients, summed in worker order."""
        self.sum[:] = self.inbox[workers[0]][HEADER:]
        for w in workers[1:]:
            self.sum += self.inbox[w][HEADER:]
        self.sum /= np.float32(len(workers))

    def _global_norm(self, mine: float) -> float:
        """K = 0 with --clip-grad-norm: the global norm of the step's mean gradient from this
        server's sum of squares ``mine`` and every other server's (one NORM message of a float64
        to each, per step), summed in server order: the same float on every server."""
        servers = self.cfg.roles.servers
        if servers == 1:
            return mine ** 0.5
        msg = np.zeros(HEADER + 2, np.float32)
        h = header(msg)
        h[KIND], h[EPOCH], h[T] = NORM, self.epoch, self.step_index
        msg[HEADER:].view(np.float64)[0] = mine
        sends = [(s, self.link.isend(s, TAG_PEER, msg)) for s in range(servers) if s != self.index]
        parts = {self.index: mine}
        for s in range(servers):
            if s == self.index:
                continue
            buf = np.zeros(HEADER + 2, np.float32)
            got = self._wait(self.link.irecv(s, TAG_PEER, buf), f"server rank {s}")
            hb = header(buf)
            kind = int(hb[KIND]) if got >= HEADER else None
            value = float(buf[HEADER:].view(np.float64)[0])
            if (got != len(buf) or kind != NORM or int(hb[EPOCH]) != self.epoch
                    or int(hb[T]) != self.step_index or value < 0):
                refuse(f"server rank {self.index}", f"server rank {s}",
                       f"a message of {values(got)}, kind {kind if kind is not None else '?'}, "
                       f"epoch {int(hb[EPOCH])}, step {int(hb[T])}, squares {value!r}",
                       f"its NORM of step {self.step_index} of epoch {self.epoch} ({len(buf)} "
                       f"values, kind {NORM}, a sum of squares not below 0)")
            parts[s] = value
        for s, req in sends:
            self._wait(req, f"server rank {s}")
        return sum(parts[s] for s in range(servers)) ** 0.5

    def _repost(self, workers: list[int]) -> None:
        for w in workers:
            if w not in self.dead:
                self._post(w)

    def _after_update(self, t: int, loss: float) -> None:
        self.epoch_updates += 1
        if self.store is not None:
            self.store.mark(self.epoch, self.epoch_updates)
            self.since_snapshot += 1
            self.snapshot_due = self.since_snapshot >= self.store.every
        self.progress()
        # 25 us per update for half the CNN's parameters here (a float64 sum took 92 us)
        if self.diverged is None and not np.isfinite(self.opt.w).all():
            self.diverged = (self.epoch, t + 1, loss)
        if self.index == 0:
            self.on_step(self.epoch, self.books.updates, loss)

    def commit_if_due(self) -> None:
        """The snapshot, once ``store.every`` updates of the epoch have been applied since the
        last (never of weights that stopped being finite: the run stops at that step)."""
        if not self.snapshot_due:
            return
        self.snapshot_due, self.since_snapshot = False, 0
        if self.diverged is not None:
            return
        seconds = self.store.write(self.epoch, self.epoch_updates, self.opt.w, self.opt.state(),
                                   self.done, self.opt.steps)
        if seconds is not None:
            books = self.books
            books.snapshots += 1
            books.snapshot_seconds += seconds
            books.snapshot_max_seconds = max(books.snapshot_max_seconds, seconds)

    def _ready(self, w: int, clock: int) -> bool:
        if self.diverged is not None:
            return True
        if self.clock.get(w, clock) < clock:  # its own gradients first (K = 0: the step's update)
            return False
        k = self.cfg.staleness
        return k is None or not self.clock or min(self.clock.values()) >= clock - k

    def _answer(self) -> None:
        for w, clock in list(self.pending.items()):
            if self._ready(w, clock):
                take = self.assigner is not None and self.diverged is None
                batch = self.assigner.take(w) if take else None
                if batch is None and take and self.assigner.busy(w):
                    # Nothing left to hand out, but another worker's batch is still out: its
                    # reply waits until that one is pushed (then: no batch, FINAL) or given back
                    # by a worker that died (then: this one trains it).  A worker sent on to its
                    # FINAL could not take it (the other servers end the epoch on the FINALs),
                    # and its FINAL would wait for the epoch's end anyway.
                    continue
                del self.pending[w]
                self._reply(w, batch)

    def _reply(self, w: int, batch: tuple[int, int] | None) -> None:
        out = self.outbox[w]
        if self.sending[w] is not None:  # the previous reply's buffer is free once it has left
            self._wait(self.sending[w], f"worker rank {self.cfg.roles.worker_rank(w)}")
        h = header(out)
        h[KIND], h[EPOCH], h[VERSION] = WEIGHTS, self.epoch, self.books.updates
        h[OWNER], h[T] = batch if batch is not None else (NONE, NONE)
        h[FLAGS] = STOP if self.diverged is not None else 0
        out[HEADER:] = self.opt.w
        self.sending[w] = self.link.isend(self.cfg.roles.worker_rank(w), TAG_DOWN, out)
        self.books.bytes_out += out.nbytes

    # --- silent peers -----------------------------------------------------------------------

    def _check_silent(self, quiet_for: float) -> None:
        """Server 0: a rank whose heartbeat stopped is dead or frozen: a server ends the job, a
        worker is ``on_dead``'s to judge.  Every server: no message at all past the deadline while
        it waits for workers ends the job (a backstop: the watchdog normally has by then)."""
        roles = self.cfg.roles
        if self.index == 0:
            for rank, quiet in sorted(self.silent().items()):
                if rank < roles.servers:
                    raise PeerSilent(f"server rank {rank}")
                w = roles.worker_index(rank)
                if w in self.dead or w in self.finals:
                    continue
                if not self.on_dead(rank, quiet):
                    raise PeerSilent(f"worker rank {rank}")
                started = self.started if self.started is not None else time.monotonic()
                self.books.lost.append({"rank": rank, "epoch": self.epoch,
                                        "updates": self.books.updates,
                                        "seconds": round(time.monotonic() - started, 1),
                                        "silent_seconds": round(quiet, 1)})
                self.drop(w)
                for s in range(1, roles.servers):  # so that they stop waiting for it too
                    msg = np.zeros(HEADER, np.float32)
                    h = header(msg)
                    h[KIND], h[EPOCH], h[OWNER] = DEAD, self.epoch, w
                    self._wait(self.link.isend(s, TAG_CTRL, msg), f"server rank {s}")
                # the pulls that waited for it (the bound, K = 0's step) may go now
                self._answer()
        deadline = self.cfg.deadline
        if deadline is not None and quiet_for > deadline:
            waited = [w for w in self._live()
                      if w not in self.finals and w not in self.pending and w not in self.held]
            if waited:
                raise PeerSilent(", ".join(f"worker rank {roles.worker_rank(w)}" for w in waited))

    def drop(self, w: int) -> None:
        """Go on without worker ``w``, at any staleness: nobody waits for it (it leaves the
        clocks), the LR follows the workers left, the batch it was computing and those not yet
        handed out go to the others (:class:`Assigner`); a gradient of it that arrived is
        applied (at K = 0, in its step).  Its receive stays posted as its tomb, and if it waits
        for a reply, it gets the DROPPED notice instead (frozen, it reads it when it wakes up)."""
        if w in self.dead:
            return
        self.dead.add(w)
        self.clock.pop(w, None)
        owed = self.pending.pop(w, None) is not None or w in self.finals  # it waits for a reply
        tomb = self.recvs[w]
        self.recvs[w] = None
        if tomb is None:  # K = 0, its gradient held in inbox[w]: the tomb gets a buffer of its own
            buf = np.zeros_like(self.inbox[w])
            tomb = self.link.irecv(self.cfg.roles.worker_rank(w), TAG_UP, buf)
            self.notices.append((buf, None))  # the buffer lives as long as its receive
        self.tombs[w] = tomb
        if self.assigner is not None:
            self.assigner.give_back(w)
        if owed:
            self._notify_dropped(w)
        self._step_if_complete()

    def _notify_dropped(self, w: int) -> None:
        """A header-only reply with the DROPPED flag: a send of 32 bytes, which MPI completes
        without the peer (eager), never waited for: the peer may be dead."""
        msg = np.zeros(HEADER, np.float32)
        h = header(msg)
        h[KIND], h[EPOCH], h[FLAGS] = WEIGHTS, self.epoch, DROPPED
        self.notices.append((msg, self.link.isend(self.cfg.roles.worker_rank(w), TAG_DOWN, msg)))

    def _wait(self, request: Any, what: str) -> int:
        got = self.link.wait(request, forever(self.cfg.deadline))
        if got is None:
            raise PeerSilent(what)
        return got

    # --- the epoch's end ----------------------------------------------------------------------

    def verdict(self) -> list[int]:
        """Server 0 tells every other live rank which workers are dead (run-wide), so that all of
        them agree before the epoch's collectives; the others read it.  Returns the list."""
        return share_verdict(self.link, 0 if self.index == 0 else self.index, self.cfg,
                             sorted(self.dead), self._wait)

    def exchange(self, full: np.ndarray, state: dict[str, np.ndarray] | np.ndarray | None = None
                 ) -> None:
        """Fill ``full`` (D values) with every server's weights, and on server 0 ``state`` (when
        given: the optimizer's state arrays by name, D values each; an array: SGD's velocity)
        with every server's optimizer state: each server sends its slice to the others, and its
        state arrays with it to server 0."""
        cfg, roles = self.cfg, self.cfg.roles
        if isinstance(state, np.ndarray):
            state = {"velocity": state}
        full[cfg.slice(self.index)] = self.opt.w
        mine_state = self.opt.state()
        names = list(mine_state)
        if state is not None and self.index == 0:
            for name in names:
                state[name][cfg.slice(0)] = mine_state[name]
        mine = np.concatenate([np.zeros(HEADER, np.float32), self.opt.w])
        header(mine)[KIND] = EXCHANGE
        sends, recvs = [], []
        for s in range(roles.servers):
            if s == self.index:
                continue
            out = np.concatenate([mine, *mine_state.values()]) if s == 0 and names else mine
            sends.append((s, self.link.isend(s, TAG_PEER, out)))
            both = bool(names) and self.index == 0
            buf = np.zeros(HEADER + cfg.length(s) * (1 + len(names) if both else 1), np.float32)
            recvs.append((s, buf, self.link.irecv(s, TAG_PEER, buf)))
        what = ("momentum" if names == ["velocity"] else "optimizer state")
        for s, buf, req in recvs:
            got = self._wait(req, f"server rank {s}")
            if got != len(buf) or int(header(buf)[KIND]) != EXCHANGE:
                refuse(f"server rank {self.index}", f"server rank {s}",
                       f"an exchange message of {values(got)} and kind "
                       f"{int(header(buf)[KIND]) if got >= HEADER else '?'}",
                       f"{len(buf)} values of kind {EXCHANGE} (its header, slice"
                       f"{f' and {what}' if len(buf) > HEADER + cfg.length(s) else ''})")
            n = cfg.length(s)
            full[cfg.slice(s)] = buf[HEADER:HEADER + n]
            if state is not None and len(buf) > HEADER + n:
                for i, name in enumerate(names):
                    state[name][cfg.slice(s)] = buf[HEADER + n * (1 + i):HEADER + n * (2 + i)]
        for s, req in sends:
            self._wait(req, f"server rank {s}")


def share_verdict(link: Link, rank: int, cfg: Config, dead: list[int],
                  wait: Callable[[Any, str], int]) -> list[int]:
    """Rank 0 sends ``dead`` (worker indices) to every other live rank; the others receive it.
    One message of W + 8 values per rank and epoch."""
    roles = cfg.roles
    msg = np.zeros(HEADER + roles.workers, np.float32)
    if rank == 0:
        header(msg)[CLOCK] = len(dead)
        msg[HEADER:HEADER + len(dead)] = dead
        targets = [*range(1, roles.servers), *(roles.worker_rank(w) for w in range(roles.workers)
                                             if w not in dead)]
        for req, r in [(link.isend(r, TAG_VERDICT, msg), r) for r in targets]:
            wait(req, f"{'server' if roles.serves(r) else 'worker'} rank {r}")
        return list(dead)
    got = wait(link.irecv(0, TAG_VERDICT, msg), "server rank 0")
    me = f"{'server' if roles.serves(rank) else 'worker'} rank {rank}"
    if got != len(msg):
        refuse(me, "server rank 0", f"a verdict of {values(got)}",
               f"{len(msg)} (its header and one value per worker)")
    n = int(header(msg)[CLOCK])
    if not 0 <= n <= roles.workers:
        refuse(me, "server rank 0", f"a verdict of {n} dead workers", f"0..{roles.workers}")
    dead = msg[HEADER:HEADER + n]
    if not ((dead >= 0) & (dead < roles.workers) & (dead == np.floor(dead))).all():
        refuse(me, "server rank 0", f"a verdict naming workers {dead.tolist()}",
               f"worker indices 0..{roles.workers - 1}")
    return [int(x) for x in dead]


# --- a worker ---------------------------------------------------------------------------------

class Worker:
    """Worker ``index``: pulls, computes, pushes; ``weights`` is the flat vector it computes on.

    In :meth:`work_epoch`, ``use(weights)`` hands the pulled weights to the model before each
    gradient and ``gradient(batch) -> (flat gradient, mean loss)`` computes one (the framework's
    part); ``own`` yields this worker's own batches of the epoch in order, ``fetch(owner, t)``
    another worker's batch t (the epoch's tail).
    """

    def __init__(self, cfg: Config, link: Link, index: int, *,
                 progress: Callable[[], None] = lambda: None) -> None:
        self.cfg, self.link, self.index = cfg, link, index
        self.rank = cfg.roles.worker_rank(index)
        self.progress = progress
        p = cfg.roles.servers
        self.weights = np.zeros(cfg.size, np.float32)
        self.outbox = [np.zeros(HEADER + cfg.length(s), np.float32) for s in range(p)]
        self.inbox = [np.zeros(HEADER + cfg.length(s), np.float32) for s in range(p)]
        self.versions = [0] * p
        self.books = WorkerBooks()

    def _wait(self, request: Any, what: str) -> int:
        got = self.link.wait(request, forever(self.cfg.deadline))
        if got is None:
            raise PeerSilent(what)
        return got

    def _exchange(self, kind: int, epoch: int, clock: int = 0,
                  batch: tuple[int, int] = (NONE, NONE), grad: np.ndarray | None = None,
                  loss: float = 0.0) -> tuple[tuple[int, int] | None, int]:
        """One message to every server (the receives for their replies posted first), then every
        reply: the weights into ``self.weights``; server 0's next batch for this worker (None:
        none left) and the replies' flags are returned."""
        cfg = self.cfg
        recvs = [self.link.irecv(s, TAG_DOWN, self.inbox[s]) for s in range(cfg.roles.servers)]
        sends = []
        for s, out in enumerate(self.outbox):
            h = header(out)
            h[KIND], h[EPOCH], h[CLOCK], h[VERSION], h[FLAGS] = kind, epoch, clock, self.versions[s], 0
            h[OWNER], h[T] = batch
            out[LOSS] = loss
            if grad is not None:
                out[HEADER:] = grad[cfg.slice(s)]
            sends.append(self.link.isend(s, TAG_UP, out if grad is not None else out[:HEADER]))
        t0 = time.monotonic()
        flags = 0
        for s, req in enumerate(recvs):  # every reply checked before any is used
            self.check_reply(s, self._wait(req, f"server rank {s}"), epoch)
        for s in range(cfg.roles.servers):
            h = header(self.inbox[s])
            self.versions[s] = int(h[VERSION])
            flags |= int(h[FLAGS])
            self.weights[cfg.slice(s)] = self.inbox[s][HEADER:]
        for s, req in enumerate(sends):
            self._wait(req, f"server rank {s}")
        self.books.wait_seconds += time.monotonic() - t0
        h0 = header(self.inbox[0])
        return (None if int(h0[OWNER]) == NONE else (int(h0[OWNER]), int(h0[T]))), flags

    def check_reply(self, s: int, count: int, epoch: int) -> None:
        """Server ``s``'s reply in ``self.inbox[s]``, ``count`` values long, checked before
        anything of it is used (server 0's batch: any batch of the epoch, or none).  A DROPPED
        notice (the header alone, of any epoch: this worker may be epochs behind) raises
        :class:`Dropped`."""
        cfg, h = self.cfg, header(self.inbox[s])
        me, peer = f"worker rank {self.rank}", f"server rank {s}"
        if count == HEADER and int(h[KIND]) == WEIGHTS and int(h[FLAGS]) == DROPPED:
            raise Dropped(f"{me} was dropped by the servers (told by {peer}) while it was silent")
        want = HEADER + cfg.length(s)
        if count != want:
            refuse(me, peer, f"a reply of {values(count)}",
                   f"{want} (its {HEADER}-value header and the server's {want - HEADER} weights)")
        kind, got_epoch = int(h[KIND]), int(h[EPOCH])
        if kind != WEIGHTS or got_epoch != epoch:
            refuse(me, peer, f"a reply of kind {kind}, epoch {got_epoch}",
                   f"kind {WEIGHTS} (WEIGHTS) of epoch {epoch}")
        version, flags = int(h[VERSION]), int(h[FLAGS])
        if version < self.versions[s] or flags & ~STOP:
            refuse(me, peer, f"a reply of version {version}, flags {flags}",
                   f"a version >= {self.versions[s]}, its last, and flags 0 or {STOP} (STOP)")
        if s == 0:
            check_batch(me, peer, h, cfg.roles.workers, cfg.steps, "reply", none=True)

    def work_epoch(self, epoch: int, own: Iterator[Any], fetch: Callable[[int, int], Any],
                   use: Callable[[np.ndarray], None],
                   gradient: Callable[[Any], tuple[np.ndarray, float]]) -> int:
        """Train this worker's share of ``epoch``; returns the replies' flags (STOP: the weights
        stopped being finite).  ``self.weights`` ends as the epoch's final weights."""
        t0 = time.monotonic()
        batch, flags = self._exchange(PULL, epoch)
        clock, expect = 0, 0
        late: set[int] = set()  # own batches handed back out of order (see below)
        while batch is not None and not flags & STOP:
            owner, t = batch
            if owner == self.index and t == expect and t not in late:
                data, expect = next(own), expect + 1
                self.books.own += 1
            elif owner == self.index:
                # Out of order: a batch of its shard's tail that a worker which then died had
                # taken, handed back (Assigner.give_back); never one it has trained already.
                if t < expect or t in late:
                    refuse(f"worker rank {self.rank}", "server rank 0",
                           f"a reply handing it its own batch {t} again",
                           f"its own batch {expect}, the next in order, or a later one it has "
                           f"not trained")
                late.add(t)
                data = fetch(owner, t)
                self.books.own += 1
            else:
                data = fetch(owner, t)
                self.books.taken += 1
            use(self.weights)
            grad, loss = gradient(data)
            if self.cfg.clip is not None and self.cfg.staleness != 0:
                # K > 0: each gradient is applied alone, clipped by its own global norm (here,
                # where the whole of it is); K = 0: the servers clip the step's mean.
                factor = clip_factor(squares(grad) ** 0.5, self.cfg.clip, self.cfg.rule)
                grad = grad * np.float32(factor)
            clock += 1
            self.books.last_loss = loss
            batch, flags = self._exchange(PUSH, epoch, clock, (owner, t), grad, loss)
            self.books.pushed += 1
            self.progress()
        _, final = self._exchange(FINAL, epoch, clock)
        self.books.seconds += time.monotonic() - t0
        return flags | final

    def verdict(self) -> list[int]:
        return share_verdict(self.link, self.rank, self.cfg, [], self._wait)


def histogram_line(staleness: dict[str, int], buckets: Sequence[int] = (0, 1, 2, 4, 8, 16)) -> str:
    """``0: 812, 1: 640, 2-3: 301, 4-7: 12`` from a {updates behind: count} record."""
    counts = Counter({int(k): v for k, v in staleness.items()})
    parts, edges = [], [*buckets, None]
    for lo, hi in zip(edges, edges[1:], strict=False):
        n = sum(v for k, v in counts.items() if k >= lo and (hi is None or k < hi))
        if n:
            label = f"{lo}" if hi == lo + 1 else f"{lo}+" if hi is None else f"{lo}-{hi - 1}"
            parts.append(f"{label}: {n}")
    return ", ".join(parts) or "none"
