"""Section 9 of BENCHMARKS.md: parameter servers against the ring (``bench/parts/param_servers.py``)."""

from __future__ import annotations

from bench.common.tables import load_note, load_text, num, table


def _mb(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1e6:.3f}"


def accuracy(r: dict) -> str:
    """9.1's test accuracy of one cell."""
    return f"{100 * r['test_accuracy']:.2f}%"


def seconds(r: dict) -> str:
    """9.2's training seconds to the target."""
    return f"{r['seconds_to_target']:.1f}" if r["seconds_to_target"] is not None else "not reached"


def reached(r: dict) -> str:
    """9.2's training seconds to the target, and the epoch that reached it."""
    return f"{seconds(r)} (epoch {r['epoch_reached']})" if r["seconds_to_target"] is not None else seconds(r)


def link_measured(r: dict) -> tuple[float, float, str]:
    """9.3's comparison for one row: (bytes per step measured, the formula's, its name).  The
    server's link carries T_ps both ways together; a ring rank's, T_ring each way."""
    if r["strategy"] == "ps":
        return r["rx_per_step"] + r["tx_per_step"], r["formula_total"], "T_ps"
    return max(r["rx_per_step"], r["tx_per_step"]), r["formula_each_way"], "T_ring"


def staleness(ps: dict) -> list[str]:
    rows = ps.get("staleness") or []
    if not rows:
        return []
    cfg = ps["config"]
    lines = ["### 9.1 Accuracy after a fixed number of gradient applications", "",
             f"{cfg['workers']} workers and 1 server (`-np {cfg['workers'] + 1}`), "
             f"{cfg['train_samples']} training images x {cfg['epochs']} epoch(s), batch "
             f"{cfg['batch_size']} per worker: every cell applies the same gradients' count; test "
             f"accuracy on {cfg['test_samples']} images.  Default LR rule (0.01 x workers, 1 "
             "warm-up epoch, cosine decay).  Staleness = server updates between the weights a "
             "gradient was computed on and its application (server 0's histogram).", ""]
    body = []
    for r in rows:
        if not r.get("ok"):
            body.append([f"{r['momentum']:g}", r["staleness"], "failed (see JSON)", "", "", "", ""])
            continue
        body.append([f"{r['momentum']:g}", r["staleness"], accuracy(r),
                     f"{r['test_loss']:.4f}", str(r["applied"]), f"{r['staleness_mean']:.2f}",
                     str(r["staleness_max"])])
    lines += [table(["momentum", "--staleness", "test accuracy", "test loss", "gradients applied",
                     "staleness mean", "staleness max"], body), ""]
    return lines


def straggler(ps: dict) -> list[str]:
    rows = ps.get("straggler") or []
    if not rows:
        return []
    cfg = ps["config"]
    lines = ["### 9.2 One worker at half speed: time to a target accuracy", "",
             f"{cfg['straggler_workers']} workers (the ring: `-np {cfg['straggler_workers']}`; the "
             f"servers: one more rank), one of them computing at 1/{1 + cfg['straggler_factor']:g} "
             "speed (`bench/workers/straggler.py`: after each forward + backward it sleeps as long again, "
             f"its core free meanwhile); {cfg['straggler_samples']} training images per epoch, "
             f"{cfg['straggler_epochs']} epochs, batch {cfg['batch_size']}; training seconds (the "
             f"epochs' own) to the first epoch at >= {cfg['target']:.0%} test accuracy.", ""]
    body = []
    for r in rows:
        if not r.get("ok"):
            body.append([r["label"], "failed (see JSON)", "", "", "", ""])
            continue
        batches = ", ".join(f"{own}+{taken}" for own, taken in r.get("worker_batches", [])) or "-"
        stale = f"{r['staleness_mean']:.2f} / {r['staleness_max']}" if "staleness_mean" in r else "-"
        body.append([r["label"], reached(r), " ".join(f"{s:.1f}" for s in r["epoch_seconds"]),
                     " ".join(f"{100 * a:.1f}" for a in r["accuracies"]), batches, stale])
    lines += [table(["run", f"s to {cfg['target']:.0%}", "epoch seconds", "test accuracy % by epoch",
                     "batches per worker (own+taken)", "staleness mean / max"], body), ""]
    return lines


def link(ps: dict) -> list[str]:
    link_ = ps.get("link") or {}
    lines = ["### 9.3 The server's link against T_ps, the ring's against T_ring", ""]
    if "skipped" in link_:
        return lines + [f"Not measured: {link_['skipped']}.", ""]
    rows = link_.get("rows") or []
    if not rows:
        return []
    lines += ["Network-namespace hosts on one bridge (`bench/common/netns_hosts.py`), one rank per host: "
              "the ring on N hosts; the servers' job with rank 0 (the server) alone on host 1 and a "
              "worker on each other host, `--staleness inf`.  Bytes per step through host 1's link "
              "as the kernel counts them (frames, headers included), from the difference of a run "
              "of 2e and one of e epochs.  K = 4 x 184,586 bytes; each way the server takes "
              "(N-1) x K and sends (N-1) x K, T_ps = 2(N-1) x K; a ring rank sends and takes "
              "2(N-1)/N x K, T_ring = 2(N-1)/N x K.", ""]
    body = []
    for r in rows:
        if not r.get("ok"):
            body.append([r["name"], "failed (see JSON)", "", "", "", ""])
            continue
        measured, formula, name = link_measured(r)
        body.append([r["strategy"], str(r["hosts"]), _mb(r["rx_per_step"]), _mb(r["tx_per_step"]),
                     _mb(r["formula_each_way"]),
                     f"{name}: {_mb(measured)} / {_mb(formula)} = {num(measured / formula, '{:.2f}')}"])
    lines += [table(["strategy", "hosts", "in MB/step", "out MB/step", "formula each way MB",
                     "measured / formula"], body), ""]
    return lines


def section(res: dict) -> list[str]:
    ps = res.get("ps")
    if not ps or "config" not in ps:
        return []
    load0 = load_text(ps.get("load_average_at_start"))
    load1 = load_text(ps.get("load_average_at_end"))
    lines = ["## 9. Parameter servers (`--strategy ps`) against the ring", "",
             f"`bench/parts/param_servers.py` (`python -m bench --only ps`), {ps.get('model', 'the CNN')}, "
             "one run per "
             f"cell, started {ps.get('started', '?')}.  Load average at the part's start {load0}, "
             f"at its end {load1} "
             f"({load_note(ps.get('load_average_at_start'), (res.get('machine') or {}).get('cores'))}): "
             "every rank of a cell shares this machine's cores with the others, so compare cells of "
             "this run, not absolute times.  What the "
             "strategy is and when to use it: docs/parameter-servers.md.", ""]
    return lines + staleness(ps) + straggler(ps) + link(ps)
