"""Section 11 of BENCHMARKS.md: the seconds one killed rank costs, per strategy
(``bench/parts/fault_recovery.py``)."""

from __future__ import annotations

from bench.common.tables import load_note, load_text, num, table

NAMES = {"ring": "ring, fixed + `--resume`", "elastic": "ring, `--elastic`",
         "pipeline": "pipeline S=2 + `--resume`", "ps": "parameter servers"}


def _s(v: float | None) -> str:
    return num(v, "{:.1f}")


def redone(r: dict) -> str:
    """The steps redone and their seconds at the clean run's step rate."""
    if r["strategy"] == "ps":
        ok = r.get("no_update_lost")
        return ("0 (every gradient applied once: "
                f"{r.get('gradients_applied')}/{r.get('expected_applied')})" if ok
                else f"not verified ({r.get('gradients_applied')}/{r.get('expected_applied')})")
    if r["lost_steps"] is None:
        return "n/a"
    approx = "~" if r["strategy"] == "elastic" else ""
    return f"{approx}{r['lost_steps']:g} steps, {approx}{_s(r['lost_work_s'])} s"


def how(r: dict) -> str:
    if r["strategy"] in ("ring", "pipeline"):
        return (f"killed at epoch {r['kill_epoch']} step {r['kill_step']}; job ended "
                f"{_s(r['job_end_after_kill_s'])} s later, `--resume` from epoch "
                f"{r['resumed_from_epoch']}'s checkpoint trained {_s(r['resume_start_up_s'])} s after "
                "its launch")
    if r["strategy"] == "elastic":
        sizes = " -> ".join(str(x["world_size"]) for x in r.get("resizes", []))
        return (f"world {sizes}, rolled back to step {r['rollback_step']} of epoch 2 (a commit "
                f"every {r['lost_steps_bound']} steps)")
    lost = r.get("lost") or []
    return f"worker rank {r['victim']} dropped" + (f" in epoch {lost[0].get('epoch')}" if lost else "")


def section(res: dict) -> list[str]:
    part = res.get("fault_recovery")
    if not part or not part.get("rows"):
        return []
    cfg = part["config"]
    cores = (part.get("machine") or res.get("machine") or {}).get("cores")
    load = part.get("load_average_at_start")
    lines = ["## 11. Seconds lost to one killed rank mid-epoch, per strategy", "",
             f"The PyTorch trainer on MNIST ({cfg['train_samples']} training images, batch "
             f"{cfg['batch_size']} per rank, {cfg['epochs']} epochs, a checkpoint after each, "
             f"`--stall-timeout {cfg['stall_timeout']}`), each strategy run unfaulted and then with "
             "one rank SIGKILLed a few steps into epoch 2 (never rank 0; a worker of the servers), "
             "back to back (`bench/parts/fault_recovery.py`; docs/fault-tolerance.md says what each "
             "strategy does). *To training again*: from the kill to the first step after it. "
             "*Redone*: steps whose updates were lost, at the clean run's seconds per step "
             "(elastic: estimated from the time of the kill, at most one commit interval). "
             "*Lost in all*: the faulted job's wall time, both launches where it resumes, minus "
             f"the clean run's. Load average at the start {load_text(load)} "
             f"({load_note(load, cores)}). Measured with `python -m bench --only fault_recovery` "
             "(about 6 min); one run per cell, so on a loaded machine the clean and faulted walls "
             "differ by noise of several seconds (a negative loss: the faulted run was the luckier).",
             ""]
    rows = []
    for r in part["rows"]:
        if not r.get("ok"):
            rows.append([NAMES.get(r["strategy"], r["strategy"]), "failed", "", "", "", "", ""])
            continue
        rows.append([NAMES.get(r["strategy"], r["strategy"]), _s(r["to_training_again_s"]),
                     redone(r), _s(r["clean_wall_s"]), _s(r["fault_wall_s"]), _s(r["seconds_lost"]),
                     how(r)])
    lines += [table(["strategy", "to training again (s)", "redone", "clean wall (s)",
                     "faulted wall (s)", "lost in all (s)", "what happened"], rows), ""]
    return lines
