"""Part 5: time to 99% test accuracy, per framework and -np, with the trainers' default flags.

The trainer prints one line per epoch (test accuracy, epoch seconds); the driver reads them as
they come and stops the job at the first epoch that reaches the target: later epochs cannot change
when the target was first reached (the LR schedule is fixed in advance by ``--epochs``), so
running them would only cost time.  Time to target = the epochs' training seconds added up (what
the trainer times: no start-up, no evaluation); the wall time from launch is reported beside it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from bench.common import metrics, util
from bench.parts.config import Config
from bench.parts.training_runs import TRAINER_MODULES

EPOCH_LINE = re.compile(r"epoch (?P<epoch>\d+)/(?P<epochs>\d+):.*?test acc (?P<acc>[\d.]+)%"
                        r".*?(?P<seconds>[\d.]+)s\s+(?P<ips>[\d.]+) img/s")


def parse_epoch_line(line: str) -> dict | None:
    m = EPOCH_LINE.search(line)
    if not m:
        return None
    return {"epoch": int(m["epoch"]), "epochs": int(m["epochs"]),
            "test_accuracy": float(m["acc"]) / 100, "seconds": float(m["seconds"]),
            "images_per_second": float(m["ips"])}


def run_one(framework: str, np: int, cfg: Config, out: Path) -> dict:
    work = out / "tmp" / f"acc_{framework}_np{np}"
    work.mkdir(parents=True, exist_ok=True)
    metrics_path = work / "metrics.json"
    metrics_path.unlink(missing_ok=True)
    cmd = util.horovodrun(np, [util.PY, "-m", TRAINER_MODULES[framework], "--no-progress",
                               "--metrics-out", str(metrics_path), *cfg.acc_args])
    util.say(f"time to {cfg.acc_target:.0%}: {framework} np{np} ...")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=util.base_env(), cwd=util.REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    epochs, lines, reached_wall, stopped = [], [], None, False
    try:
        for line in proc.stdout:
            lines.append(line)
            rec = parse_epoch_line(line)
            if rec is None:
                continue
            epochs.append(rec)
            if rec["test_accuracy"] >= cfg.acc_target and reached_wall is None:
                reached_wall = time.perf_counter() - t0
                if rec["epoch"] < rec["epochs"]:
                    stopped = True
                    os.killpg(proc.pid, signal.SIGTERM)
                    break
            if time.perf_counter() - t0 > cfg.timeout_s * 3:
                os.killpg(proc.pid, signal.SIGTERM)
                break
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    except BaseException:  # the driver ends: the job is in its own session (util.run)
        util.kill_group(proc)
        raise
    util.write_text(work / "output.log", " ".join(cmd) + "\n\n" + "".join(lines))
    if metrics_path.exists():  # ran to the end: the JSON is the authority
        epochs = [{k: e[k] for k in ("epoch", "test_accuracy", "seconds", "images_per_second")}
                  for e in util.read_json(metrics_path)["epochs"]]
    seconds, epoch = metrics.time_to_target(epochs, cfg.acc_target)
    rec = {"framework": framework, "np": np, "target": cfg.acc_target, "epochs": epochs,
           "seconds_to_target": seconds, "epoch_reached": epoch,
           "wall_seconds_to_target": round(reached_wall, 1) if reached_wall else None,
           "stopped_at_target": stopped, "ok": bool(epochs) and (code == 0 or stopped)}
    if not rec["ok"]:
        rec["error"] = util.tail("".join(lines), 25)
        util.say(f"time to target {framework} np{np} FAILED; log: {work / 'output.log'}")
    elif seconds is None:
        util.say(f"{framework} np{np}: {cfg.acc_target:.0%} not reached in {len(epochs)} epochs")
    else:
        util.say(f"{framework} np{np}: {cfg.acc_target:.0%} after epoch {epoch}, {seconds:.0f}s of "
                 f"training ({reached_wall:.0f}s wall)")
    return rec


def run_part(cfg: Config, out: Path, frameworks: list[str]) -> dict:
    runs = [run_one(fw, np, cfg, out) for fw in frameworks for np in cfg.acc_nps]
    return {"target": cfg.acc_target, "trainer_args": cfg.acc_args, "proxy": cfg.acc_proxy,
            "runs": runs}
