"""Section 12 of BENCHMARKS.md: the optimizers' state, sharded or not, and bf16 against fp32
(``bench/parts/update_cost.py``)."""

from __future__ import annotations

from bench.common.tables import load_note, load_text, num, table

FW = {"torch": "PyTorch", "tf": "TensorFlow/Keras"}
MB = 2**20


def _mb(v: float | None) -> str:
    return num(None if v is None else v / MB, "{:.0f}")


def _update(part: dict, cores: int | None) -> list[str]:
    up = part.get("update")
    if not up or not up.get("cells"):
        return []
    rows = []
    runs = max((c.get("runs") or 1) for c in up["cells"])
    for c in up["cells"]:
        head = [FW.get(c["framework"], c["framework"]), c["optimizer"], str(c["np"]),
                "yes" if c["sharded"] else "no"]
        if not c.get("ok"):
            rows.append([*head, "failed", "", "", _mb(c["state_bytes_formula"]), "", ""])
            continue
        peaks = c["peak_rss_mib"]
        saved = c.get("saved_bytes")
        spread = c.get("largest_peaks_mib") or []
        largest = f"{max(peaks):.0f}" + (f" ({min(spread):.0f}-{max(spread):.0f})"
                                          if len(spread) > 1 else "")
        rows.append([*head, f"{c['images_per_second']:.0f}", largest,
                     " / ".join(f"{v:.0f}" for v in peaks), _mb(c["state_bytes_formula"]),
                     f"{_mb(saved)} / {_mb(c.get('saved_bytes_formula'))}" if saved is not None
                     else "",
                     num(c.get("saved_vs_weights"), "{:.2f}")])
    return ["### 12.1 The optimizer's state per rank, sharded or not", "",
            f"An MLP of {up['depth']} hidden layers of {up['width']} ({up['params']:,} parameters, "
            f"W = {up['weight_bytes'] / MB:.0f} MiB of float32 weights; `bench.parts.model_parallel:mlp`"
            " and its Keras twin `bench.parts.update_cost:mlp_keras`), batch "
            f"{up['batch']} per rank, two epochs of {up['steps']} steps (images/s: the second). "
            + (f"Each cell is the median of {runs} launches, the unsharded and sharded ones "
               "interleaved (the run whose largest rank's peak is the median; in brackets the "
               "range of the launches' largest peaks). " if runs > 1 else "") +
            "SGD is the default (momentum 0.9, one tensor of state per weight); AdamW "
            "(`--optimizer adamw --base-lr 0.001 --weight-decay 0.01`) keeps two. *State per "
            "rank (formula)*: slots x W, divided by R with `--shard-optimizer`. *Saved*: the "
            "largest rank's peak resident memory unsharded minus sharded, measured back to back, "
            "against the formula's slots x W x (1 - 1/R); *saved / W*: the issue's target is "
            "0.7 or more for AdamW at R = 2. Peak resident memory: each rank's `ru_maxrss` "
            "(`bench/workers/rankexec.py`), framework included. A saving above the formula is the "
            "unsharded step's other transients (its allreduce buffers) and a peak's run-to-run "
            "variation.", "",
            table(["framework", "optimizer", "-np", "sharded", "images/s",
                   "peak RSS, largest rank (MiB)", "each rank (MiB)",
                   "state per rank, formula (MiB)", "saved: measured / formula (MiB)", "saved / W"],
                  rows), ""]


def _precision(part: dict) -> list[str]:
    pr = part.get("precision")
    if not pr or not pr.get("cells"):
        return []
    by = {(c["framework"], c["precision"]): c for c in pr["cells"]}
    rows = []
    for fw in dict.fromkeys(c["framework"] for c in pr["cells"]):
        fp32, bf16 = by.get((fw, "fp32")), by.get((fw, "bf16"))
        a = fp32.get("images_per_second") if fp32 and fp32.get("ok") else None
        b = bf16.get("images_per_second") if bf16 and bf16.get("ok") else None
        rows.append([FW.get(fw, fw), num(a), num(b), num(b / a if a and b else None, "{:.2f}x")])
    has = pr.get("cpu_bf16_instructions")
    cpu = ("has bfloat16 instructions" if has else "has no bfloat16 instructions (avx512_bf16, "
           "amx_bf16): bf16 is emulated" if has is False else "was not inspected")
    return ["### 12.2 `--precision bf16` against fp32 on this CPU", "",
            f"The built-in CNN on MNIST, -np {pr['np']}, batch {pr['batch']} per rank, two epochs "
            f"of {pr['steps']} steps (images/s: the second), fp32 then bf16 back to back. This "
            f"CPU {cpu}.", "",
            table(["framework", "fp32 images/s", "bf16 images/s", "bf16 / fp32"], rows), ""]


def section(res: dict) -> list[str]:
    part = res.get("optimizers")
    if not part:
        return []
    cores = (part.get("machine") or res.get("machine") or {}).get("cores")
    load = part.get("load_before")
    body = _update(part, cores) + _precision(part)
    if not body:
        return []
    repeats = (part.get("config") or {}).get("repeats", 1)
    cpu = (part.get("machine") or {}).get("cpu_model")
    on = f", on {cpu} ({cores} cores)" if cpu else ""  # (its own: parts ran on other VMs)
    runs = ("one run per cell" if repeats == 1 else
            f"12.1's cells the median of {repeats} launches each, 12.2's one run per cell")
    return ["## 12. Optimizers: the state's memory, sharded or not, and bf16", "",
            "`python -m bench --only optimizers` (`bench/parts/update_cost.py`; docs/training.md, "
            f"'Choosing an optimizer'){on}. Load average at the start {load_text(load)} "
            f"({load_note(load, cores)}); {runs}, images/s to be compared within a "
            "table, not across sections.", "", *body]
