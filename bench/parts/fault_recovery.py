"""``python -m bench --only fault_recovery``: the seconds one killed rank costs, per strategy
(docs/fault-tolerance.md, "Seconds lost per strategy"; issue #56 item 5).

For each strategy, the real PyTorch trainer on MNIST runs twice, back to back: once unfaulted
(the clean run) and once with one rank SIGKILLed mid-epoch, a few steps into epoch 2 (read from
rank 0's progress bar, which mpirun gives a terminal; the elastic job, whose workers have none,
is struck a fixed share of a clean epoch after epoch 1's line).  Never rank 0: rank 1 of the ring
and of the pipeline, the last worker of the parameter servers.

* ``ring``: ``horovodrun -np 2``; the job ends, then the same command with ``--resume`` continues
  from the last epoch checkpoint.
* ``elastic``: ``horovodrun --min-np 1`` with a discovery script listing ``localhost:1`` and
  ``127.0.0.1:1`` (tests/test_elastic.py), ``--elastic --commit-every K``; the survivor rolls back
  to its last commit and trains on alone.
* ``pipeline``: ``horovodrun -np 2 --pipeline-stages 2``; ends, then ``--resume``.
* ``ps``: ``python -m launch.horovodrun -np 1+W --strategy ps --ps-servers 1 --staleness 4``
  (mpirun ``--enable-recovery``); server 0 drops the dead worker and the job trains on.

Measured per strategy (:func:`measure`, a pure function of the recorded events, so that the
arithmetic is tested without a process):

* **to training again**: from the kill to the first step after it: the elastic job's line
  ``elastic: 1 worker(s)`` (the re-formed world, printed before its first step); for ring and
  pipeline the job's end plus the ``--resume`` launch's start-up to its first progress step;
  for ps server 0's warning that it dropped the worker (the others never stopped).
* **work redone**: steps whose updates were lost and trained again: ring/pipeline the steps since
  the last epoch checkpoint (the step at the kill, from the bar, plus whole epochs if the resumed
  run restarted earlier); elastic the steps between the rollback's commit (``elastic_resizes``)
  and the kill (estimated from the time since epoch 1's line at the clean run's step rate, at
  most K); ps 0, checked: every gradient applied exactly once (``gradients_applied``).  In
  seconds: steps x the clean run's seconds per step.
* **seconds lost**: the faulted job's wall time (both launches for ring/pipeline) minus the
  clean run's.

Every job runs in its own process group; at its end the group and any rank still carrying the
job's folder in its command line are SIGKILLed.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import util

MODULE = "launch.torch_mnist"
STRATEGIES = ("ring", "elastic", "pipeline", "ps")
BAR = re.compile(r"epoch (\d+)/(\d+) \[[#.]*\] (\d+)/(\d+)")
EPOCH_LINE = re.compile(r"epoch (\d+)/(\d+): train loss")


@dataclass
class FaultConfig:
    quick: bool = False
    strategies: list[str] = field(default_factory=lambda: list(STRATEGIES))
    train_samples: int = 3072
    test_samples: int = 200
    batch_size: int = 32
    epochs: int = 4
    commit_every: int = 4          # elastic: steps between commits
    ps_workers: int = 3
    staleness: str = "4"
    stall_timeout: int = 10
    elastic_strike: float = 0.4    # elastic: share of a clean epoch after epoch 1's line
    timeout_s: float = 600

    def to_dict(self) -> dict:
        return asdict(self)


def full() -> FaultConfig:
    return FaultConfig()


def quick() -> FaultConfig:
    return FaultConfig(quick=True, train_samples=2048, epochs=3)


def smoke() -> FaultConfig:
    """One strategy (the ring: kill, end, resume), a few steps an epoch."""
    return FaultConfig(quick=True, strategies=["ring"], train_samples=512, test_samples=100,
                       epochs=3, timeout_s=300)


# --- the measurement: pure arithmetic on recorded events ----------------------------------------

def measure(strategy: str, *, kill_t: float, clean_wall: float, clean_step_s: float,
            fault_wall: float, recovered_t: float | None, lost_steps: float | None,
            applied: int | None = None, expected_applied: int | None = None,
            exactly_once: bool | None = None) -> dict:
    """One row of the table.  Times are seconds from the faulted job's start (``kill_t``,
    ``recovered_t``: when it trained again) or lengths (``*_wall``: the whole faulted job, both
    launches where there is a ``--resume``; the clean run's); ``clean_step_s`` the clean run's
    seconds per optimizer step; ``lost_steps`` the steps redone."""
    row = {"strategy": strategy, "kill_s": round(kill_t, 2),
           "to_training_again_s": None if recovered_t is None else round(recovered_t - kill_t, 2),
           "lost_steps": lost_steps, "clean_step_s": round(clean_step_s, 4),
           "lost_work_s": None if lost_steps is None else round(lost_steps * clean_step_s, 2),
           "clean_wall_s": round(clean_wall, 2), "fault_wall_s": round(fault_wall, 2),
           "seconds_lost": round(fault_wall - clean_wall, 2)}
    if applied is not None:
        row.update(gradients_applied=applied, expected_applied=expected_applied,
                   exactly_once=exactly_once,
                   no_update_lost=bool(exactly_once) and applied == expected_applied)
    return row


def fixed_lost_steps(kill_epoch: int, kill_step: int, steps_per_epoch: int,
                     resumed_from_epoch: int | None) -> int:
    """Steps since the last epoch checkpoint: the resumed run restarts after epoch
    ``resumed_from_epoch`` (None: from scratch), the kill came at ``kill_step`` of ``kill_epoch``."""
    done = resumed_from_epoch or 0
    return (kill_epoch - 1 - done) * steps_per_epoch + kill_step


def elastic_lost_steps(kill_step_estimate: float, rollback_step: int, commit_every: int) -> float:
    """Steps between the commit the survivor rolled back to and the kill, at most K."""
    return round(min(max(kill_step_estimate - rollback_step, 0.0), float(commit_every)), 1)


# --- running and striking -----------------------------------------------------------------------

class Job:
    """A job whose output lines are collected with their arrival times (seconds from ``t0``)."""

    def __init__(self, cmd: list[str], env: dict, marker: str, log: Path, t0: float | None = None):
        self.cmd, self.marker, self.log = cmd, marker, log
        self.t0 = time.perf_counter() if t0 is None else t0
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, cwd=util.REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     stdin=subprocess.DEVNULL)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # universal newlines: the bar's \r splits lines too
            self.lines.append((time.perf_counter() - self.t0, line.rstrip("\n")))

    def output(self) -> str:
        return "\n".join(ln for _, ln in list(self.lines))

    def first(self, pattern: re.Pattern | str, after: float = 0.0) -> tuple[float, re.Match] | None:
        for t, ln in list(self.lines):
            m = re.search(pattern, ln)
            if m and t >= after:
                return t, m
        return None

    def wait_for(self, test, timeout: float) -> object:
        deadline = time.perf_counter() + timeout
        while True:
            got = test()
            if got:
                return got
            if self.proc.poll() is not None or time.perf_counter() > deadline:
                return None
            time.sleep(0.05)

    def rank(self, r: int, timeout: float = 30):
        import psutil

        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            for proc in self.ranks():
                with contextlib.suppress(psutil.Error):
                    env = proc.environ()
                    if str(r) in (env.get("OMPI_COMM_WORLD_RANK"), env.get("HOROVOD_RANK")):
                        return proc
            time.sleep(0.3)
        return None

    def ranks(self) -> list:
        import psutil

        found = []
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            if MODULE in cmd and any(self.marker in part for part in cmd):
                found.append(proc)
        return found

    def finish(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
        self.reader.join(timeout=10)
        util.write_text(self.log, " ".join(self.cmd) + "\n\n" + self.output() + "\n")
        return self.proc.returncode

    def kill(self) -> None:
        import psutil

        util.kill_group(self.proc)
        for proc in self.ranks():
            with contextlib.suppress(psutil.Error):
                proc.kill()


def trainer_args(cfg: FaultConfig, ckpt: Path, metrics: Path) -> list[str]:
    return ["--train-samples", str(cfg.train_samples), "--test-samples", str(cfg.test_samples),
            "--batch-size", str(cfg.batch_size), "--epochs", str(cfg.epochs), "--stall-timeout",
            str(cfg.stall_timeout), "--checkpoint-dir", str(ckpt), "--metrics-out", str(metrics),
            "--seed", "3"]


def command(cfg: FaultConfig, strategy: str, work: Path) -> tuple[list[str], dict, int]:
    """(command, environment, victim rank) of one strategy's job in ``work``."""
    inner = [util.PY, "-m", MODULE, *trainer_args(cfg, work / "ckpt", work / "metrics.json")]
    env = util.base_env(OMP_NUM_THREADS="1")
    if strategy == "ring":
        return util.horovodrun(2, inner), env, 1
    if strategy == "pipeline":
        return util.horovodrun(2, [*inner, "--pipeline-stages", "2"]), env, 1
    if strategy == "ps":
        np_ = 1 + cfg.ps_workers
        cmd = [util.PY, "-m", "launch.horovodrun", "-np", str(np_), "-H", f"localhost:{np_}", *inner,
               "--strategy", "ps", "--ps-servers", "1", "--staleness", cfg.staleness]
        return cmd, env, np_ - 1
    hosts = work / "hosts.txt"
    util.write_text(hosts, "localhost:1\n127.0.0.1:1\n")
    env["RINGTRAIN_HOSTS"] = str(hosts)
    cmd = [str(util.BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", str(util.REPO / "launch" / "discover_hosts.sh"),
           "--network-interface", "lo", "--gloo-timeout-seconds", "180", *inner,
           "--elastic", "--commit-every", str(cfg.commit_every), "--no-progress"]
    return cmd, env, 1


def steps_per_epoch(cfg: FaultConfig, strategy: str) -> int:
    from ringtrain.data.sharding import optimizer_steps

    width = {"ring": 2, "elastic": 2, "pipeline": 1, "ps": cfg.ps_workers}[strategy]
    return optimizer_steps(cfg.train_samples, width, cfg.batch_size, 1)


def fresh(work: Path) -> Path:
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    return work


def clean_run(cfg: FaultConfig, strategy: str, work: Path) -> dict:
    cmd, env, _ = command(cfg, strategy, fresh(work))
    job = Job(cmd, env, str(work), work / "output.log")
    try:
        rc = job.finish(cfg.timeout_s)
    finally:
        job.kill()
    wall = time.perf_counter() - job.t0
    metrics = work / "metrics.json"
    if rc != 0 or not metrics.exists():
        return {"ok": False, "error": util.tail(job.output(), 25)}
    s = util.read_json(metrics)
    steps = steps_per_epoch(cfg, strategy) * len(s["epochs"])
    return {"ok": True, "wall_s": wall, "train_seconds": s["total_seconds"],
            "step_s": sum(e["seconds"] for e in s["epochs"]) / steps,
            "epoch_s": [e["seconds"] for e in s["epochs"]],
            "first_step_s": _first_step(job)}


def _first_step(job: Job) -> float | None:
    hit = job.first(BAR)
    return None if hit is None else hit[0]


def strike(cfg: FaultConfig, strategy: str, job: Job, clean: dict) -> tuple[int, int] | None:
    """Wait for the moment to strike: (epoch, step) from the bar, a few steps into epoch 2
    (elastic: (2, estimated step) a share of a clean epoch after epoch 1's line)."""
    if strategy == "elastic":
        hit = job.wait_for(lambda: job.first(r"epoch 1/\d+: train loss"), cfg.timeout_s)
        if not hit:
            return None
        wait = cfg.elastic_strike * clean["epoch_s"][1 if len(clean["epoch_s"]) > 1 else 0]
        time.sleep(wait)
        return 2, 0
    seen = 0

    def ready():
        nonlocal seen
        for _, ln in job.lines[seen:]:
            seen += 1
            m = BAR.search(ln)
            if m:
                step, steps = int(m.group(3)), int(m.group(4))
                low = min(3, max(1, steps // 4))  # a few steps in, well before the epoch's end
                if int(m.group(1)) == 2 and low <= step <= max(low, steps // 2):
                    return 2, step
        return None
    return job.wait_for(ready, cfg.timeout_s)


def last_bar(job: Job, before: float) -> tuple[int, int] | None:
    """The last (epoch, step) the bar showed before ``before``."""
    found = None
    for t, ln in list(job.lines):
        m = BAR.search(ln)
        if m and t <= before:
            found = int(m.group(1)), int(m.group(3))
    return found


def faulted_run(cfg: FaultConfig, strategy: str, work: Path, clean: dict) -> dict:
    cmd, env, victim = command(cfg, strategy, fresh(work))
    job = Job(cmd, env, str(work), work / "output.log")
    resumed = None
    try:
        at = strike(cfg, strategy, job, clean)
        proc = job.rank(victim) if at else None
        if proc is None:
            job.kill()
            job.finish(30)
            return {"ok": False, "error": "never reached the strike point or found the victim\n"
                                          + util.tail(job.output(), 25)}
        proc.send_signal(signal.SIGKILL)
        kill_t = time.perf_counter() - job.t0
        rc = job.finish(cfg.timeout_s)
        end_t = time.perf_counter() - job.t0
        rec = {"ok": True, "victim": victim, "kill_s": kill_t, "exit": rc, "end_s": end_t}
        if strategy in ("ring", "pipeline"):
            at_kill = last_bar(job, kill_t) or at
            rec.update(kill_epoch=at_kill[0], kill_step=at_kill[1])
            resumed = Job([*cmd, "--resume"], env, str(work), work / "resumed.log", t0=job.t0)
            rc2 = resumed.finish(cfg.timeout_s)
            first = _first_step(resumed)
            rec.update(resume_exit=rc2, resume_start_s=end_t,
                       resume_first_step_s=first,
                       recovered_s=first, wall_s=time.perf_counter() - job.t0)
            if rc2 != 0 or first is None:
                rec.update(ok=False, error=util.tail(resumed.output(), 25))
        else:
            rec["wall_s"] = end_t
            if strategy == "elastic":
                hit = job.first(r"elastic: 1 worker", after=kill_t)
            else:
                hit = job.first(rf"warning: worker rank {victim} \(", after=kill_t)
            rec["recovered_s"] = None if hit is None else hit[0]
            epoch1 = job.first(r"epoch 1/\d+: train loss")
            rec["epoch1_line_s"] = None if epoch1 is None else epoch1[0]
            if rc != 0:
                rec.update(ok=False, error=util.tail(job.output(), 25))
        metrics = work / "metrics.json"
        rec["summary"] = util.read_json(metrics) if metrics.exists() else None
        if rec["summary"] is None:
            rec.update(ok=False, error=rec.get("error") or util.tail(job.output(), 25))
        return rec
    finally:
        job.kill()
        if resumed is not None:
            resumed.kill()


def row(cfg: FaultConfig, strategy: str, clean: dict, fault: dict) -> dict:
    s, spe = fault["summary"], steps_per_epoch(cfg, strategy)
    extra: dict = {}
    if strategy in ("ring", "pipeline"):
        lost = fixed_lost_steps(fault["kill_epoch"], fault["kill_step"], spe,
                                s.get("resumed_from_epoch"))
        extra = {"kill_epoch": fault["kill_epoch"], "kill_step": fault["kill_step"],
                 "resumed_from_epoch": s.get("resumed_from_epoch"),
                 "job_end_after_kill_s": round(fault["end_s"] - fault["kill_s"], 2),
                 "resume_start_up_s": None if fault["resume_first_step_s"] is None else
                 round(fault["resume_first_step_s"] - fault["resume_start_s"], 2)}
    elif strategy == "elastic":
        resizes = s.get("elastic_resizes") or []
        back = resizes[1] if len(resizes) > 1 else None
        global_batch = 2 * cfg.batch_size
        rollback_step = back["consumed"] // global_batch if back else 0
        # steps of epoch 2 done at the kill: the time since epoch 1's line (its evaluation and the
        # next epoch's start included, so an overestimate by a little) at the clean step rate
        since = fault["kill_s"] - (fault["epoch1_line_s"] or fault["kill_s"])
        estimate = since / clean["step_s"]
        lost = elastic_lost_steps(estimate, rollback_step, cfg.commit_every) if back else None
        extra = {"resizes": resizes, "rollback_step": rollback_step,
                 "kill_step_estimate": round(estimate, 1), "lost_steps_bound": cfg.commit_every}
    else:
        lost = 0
        ps = s.get("ps") or {}
        extra = {"lost_workers": ps.get("lost_workers"), "lost": ps.get("lost")}
    kw = {}
    if strategy == "ps":
        ps = s.get("ps") or {}
        kw = {"applied": (ps.get("gradients_applied") or [None])[0],
              "expected_applied": cfg.epochs * spe * cfg.ps_workers,
              "exactly_once": ps.get("exactly_once")}
    out = measure(strategy, kill_t=fault["kill_s"], clean_wall=clean["wall_s"],
                  clean_step_s=clean["step_s"], fault_wall=fault["wall_s"],
                  recovered_t=fault.get("recovered_s"), lost_steps=lost, **kw)
    out.update(extra, victim=fault["victim"], exit=fault["exit"], ok=True,
               clean_first_step_s=None if clean.get("first_step_s") is None else
               round(clean["first_step_s"], 2),
               final_test_accuracy=s.get("final_test_accuracy"))
    return out


def run_part(cfg: FaultConfig, out: Path) -> dict:
    data = {"config": cfg.to_dict(), "model": "mnist-cnn-v1 (184,586 parameters, PyTorch)",
            "load_average_at_start": list(os.getloadavg()), "rows": []}
    for strategy in cfg.strategies:
        base = out / "tmp" / "fault_recovery" / strategy
        util.say(f"fault_recovery/{strategy}: clean run ...")
        clean = clean_run(cfg, strategy, base / "clean")
        if not clean["ok"]:
            util.say(f"fault_recovery/{strategy}: clean run FAILED; log: {base / 'clean'}")
            data["rows"].append({"strategy": strategy, "ok": False, "error": clean["error"]})
            continue
        util.say(f"fault_recovery/{strategy}: {clean['wall_s']:.1f} s; the faulted run ...")
        fault = faulted_run(cfg, strategy, base / "fault", clean)
        if not fault["ok"]:
            util.say(f"fault_recovery/{strategy}: faulted run FAILED; log: {base / 'fault'}")
            data["rows"].append({"strategy": strategy, "ok": False, "error": fault["error"]})
            continue
        r = row(cfg, strategy, clean, fault)
        util.say(f"fault_recovery/{strategy}: training again {r['to_training_again_s']} s after "
                 f"the kill, {r['lost_steps']} steps redone ({r['lost_work_s']} s), "
                 f"{r['seconds_lost']} s lost in all")
        data["rows"].append(r)
        util.write_json(out / "fault_recovery.partial.json", data)
    data["load_average_at_end"] = list(os.getloadavg())
    (out / "fault_recovery.partial.json").unlink(missing_ok=True)
    return data


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.parts.fault_recovery", allow_abbrev=False)
    p.add_argument("--scale", choices=("smoke", "quick", "full"), default="smoke")
    p.add_argument("--strategies", default=None, help=f"comma-separated: {', '.join(STRATEGIES)}")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    cfg = {"smoke": smoke, "quick": quick, "full": full}[args.scale]()
    if args.strategies:
        cfg.strategies = [s for s in args.strategies.split(",") if s in STRATEGIES]
    why = util.private_dir(args.out)
    if why:
        raise SystemExit(f"error: --out: {why}")
    data = run_part(cfg, Path(args.out).resolve())
    util.write_json(Path(args.out) / "fault_recovery.json", data)
    from bench.reports.report_fault_recovery import section

    print("\n".join(section({"fault_recovery": data})))
    return 0 if all(r.get("ok") for r in data["rows"]) else 1


if __name__ == "__main__":
    import sys

    with util.terminate_as_exit():
        sys.exit(main())
