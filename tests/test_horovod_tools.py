"""Horovod's own tools behind ringtrain's flags: ``--timeline-out FILE`` and ``--autotune [LOG]``.

One job per framework at -np 2 with both flags: rank 0's timeline holds an allreduce of every
gradient in every step, and Horovod's autotuner, under the patched background loop, scores
samples of different settings, finishes (its search made short through Horovod's own variables)
and rank 0 prints and records what it chose.  The flags' bad inputs are one line each, and every
trainer flag reaches the trainer through horovodrun's parser (which stops at one it thinks
abbreviates two of its own: why the timeline's flag is not ``--timeline``).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import metrics, one_error_line, requires_horovod, run, train

from launch import cli
from ringtrain.errors import UserError
from ringtrain.horovod_tools import one_host, read_log

HEADER = "hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,cycle_time_ms," \
         "tensor_fusion_threshold,score\n"
# Horovod writes a space before cache_enabled (parameter_manager.cc): kept as it writes it.
SAMPLES = ["0,0,0, 0,5,4,1.5\n", "0,0,0, 0,50,32,3.25\n", "0,0,0, 1,25,16,2.0\n"]


# --- reading the autotune log --------------------------------------------------------------------

def test_a_finished_search_is_its_repeated_best_row():
    report = read_log(HEADER + "".join(SAMPLES) + SAMPLES[1])
    assert report["finished"] and report["samples"] == 3
    assert report["chosen"] == {"hierarchical_allreduce": False, "hierarchical_allgather": False,
                                "torus_allreduce": False, "cache_enabled": False,
                                "cycle_time_ms": 50.0, "tensor_fusion_threshold": 32.0, "score": 3.25}


def test_a_search_still_running_reports_the_best_so_far_and_the_last_tried():
    report = read_log(HEADER + "".join(SAMPLES))
    assert not report["finished"] and report["samples"] == 3 and report["chosen"] is None
    assert report["best_so_far"]["score"] == 3.25 and report["last_tried"]["cache_enabled"] is True


@pytest.mark.parametrize("text", ["", HEADER, HEADER + "0,0,0, 0,5,4\n", HEADER + "a,b,c,d,e,f,g\n",
                                  HEADER + "0,0,0, 0,5,4,nan\n", "\0\xff garbage"])
def test_an_empty_or_cut_log_has_no_samples(text):
    report = read_log(text)
    assert report["samples"] == 0 and not report["finished"]


def test_one_host_is_what_the_launcher_says():
    assert one_host({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert not one_host({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert one_host({"HOROVOD_SIZE": "3", "HOROVOD_LOCAL_SIZE": "3"})
    assert not one_host({})  # nobody says: hierarchical settings stay Horovod's to tune


# --- the flags ------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,needle", [
    (["--timeline-out", "."], "--timeline-out takes a file to write"),
    (["--autotune", "/"], "--autotune takes a file to write"),
    (["--timeline-out", "x.csv", "--autotune", "x.csv"], "name the same file"),
    (["--timeline-out", "t.json", "--elastic"], "--timeline-out is not supported with --elastic"),
    (["--autotune", "--elastic"], "--autotune is not supported with --elastic"),
])
def test_bad_tool_flags_are_refused_before_any_framework_loads(extra, needle):
    with pytest.raises(UserError, match=needle):
        cli.parse("torch", extra)


def test_a_bad_tool_flag_is_one_line():
    proc = run([sys.executable, "-m", "launch", "--framework", "torch", "--autotune", "--elastic"])
    one_error_line(proc, "--autotune is not supported with --elastic")


def test_autotune_takes_an_optional_log():
    assert cli.parse("torch", ["--autotune"]).autotune == "autotune.csv"
    assert cli.parse("torch", ["--autotune", "a.csv", "--epochs", "1"]).autotune == "a.csv"
    assert cli.parse("torch", []).autotune is None


def test_every_trainer_flag_passes_through_horovodrun():
    """horovodrun 0.28.1 reads every word of its command that abbreviates one of its own flags
    (argparse with abbreviations on): one that abbreviates two (``--timeline``: its
    ``--timeline-filename`` and ``--timeline-mark-cycles``) stops it with "ambiguous option"
    before any rank starts."""
    launcher = pytest.importorskip("horovod.runner.launch")
    flags = sorted(opt for action in cli.build_parser("torch")._actions for opt in action.option_strings
                   if opt.startswith("--") and opt != "--help")
    stopped = []
    saved = sys.argv
    try:
        for flag in flags:
            sys.argv = ["horovodrun", "-np", "2", "python", "-m", "launch", flag, "1"]
            try:
                command = launcher.parse_args().command
            except SystemExit:
                command = None
            if command != ["python", "-m", "launch", flag, "1"]:
                stopped.append(flag)
        sys.argv = ["horovodrun", "-np", "2", "python", "-m", "launch", "--timeline", "x"]
        with pytest.raises(SystemExit):  # the check can fail: the name it rules out
            launcher.parse_args()
    finally:
        sys.argv = saved
    assert not stopped, f"horovodrun does not pass these to the trainer: {stopped}"


# --- both tools in a real job -----------------------------------------------------------------------

# Horovod's autotuner, made short: no warm-up, a sample per allreduce of a tensor (5 make a
# score), 3 settings of (fusion threshold, cycle time) for each setting of the response cache
# (on one host ringtrain fixes hierarchical allgather off): 6 scores, 30 steps.
SHORT_SEARCH = {"HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "1",
                "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "2"}


def timeline_events(path: Path) -> list[dict]:
    """Horovod's timeline: a JSON array it closes after every event; a file cut short (a job
    killed while writing) is read up to its last whole event."""
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text[:text.rfind("}") + 1].rstrip().rstrip(",") + "]")


def allreduces_per_tensor(events: list[dict]) -> dict[str, int]:
    """Tensor name -> how many ALLREDUCE operations the timeline shows for it."""
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("name") == "process_name" and "name" in e.get("args", {})}
    counts: dict[str, int] = {}
    for e in events:
        if e.get("ph") == "B" and e.get("name") == "ALLREDUCE" and e.get("pid") in names:
            counts[names[e["pid"]]] = counts.get(names[e["pid"]], 0) + 1
    return counts


def gradient_allreduces(fw: str, counts: dict[str, int]) -> dict[str, int]:
    """The gradients' allreduces: PyTorch's ``allreduce.<parameter>``, Keras'
    ``.../HorovodAllreduce_grads[_k]_0`` (gradient k, in the model's order)."""
    if fw == "torch":
        return {name.removeprefix("allreduce."): n for name, n in counts.items()
                if name.startswith("allreduce.") and name not in ("allreduce.train_loss",
                                                                  "allreduce.eval_totals")}
    found = {}
    for name, n in counts.items():
        m = re.search(r"HorovodAllreduce_grads(?:_(\d+))?_0$", name)
        if m:
            found[m.group(1) or "0"] = n
    return found


def parameter_count() -> int:
    """The built-in CNN's trained tensors (two convolutions and two dense layers, a weight and a
    bias each), from the PyTorch model."""
    from ringtrain.data.dataset import mnist_info
    from torch_models.model import build

    return len(list(build("cnn", mnist_info(), 0.5).parameters()))


@requires_horovod
@pytest.mark.parametrize("fw", ["torch", "tf"])
def test_timeline_and_autotune_in_a_two_rank_job(fw, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    timeline = tmp_path / "out" / "timeline.json"
    timeline.parent.mkdir()
    timeline.symlink_to(victim)  # a link found at the path is replaced, never followed
    log, summary = tmp_path / "out" / "tune.csv", tmp_path / "m.json"
    epochs, steps = 2, 32
    proc = train("launch", ["--framework", fw, "--train-samples", "2048", "--test-samples", "100",
                            "--batch-size", "32", "--epochs", str(epochs), "--no-progress",
                            "--timeline-out", str(timeline), "--autotune", str(log),
                            "--metrics-out", str(summary)], np=2, timeout=900, env=SHORT_SEARCH)
    assert victim.read_text() == "the user's file" and not timeline.is_symlink()

    grads = gradient_allreduces(fw, allreduces_per_tensor(timeline_events(timeline)))
    assert len(grads) == parameter_count(), grads
    assert set(grads.values()) == {epochs * steps}, grads  # every gradient, every step

    m = metrics(summary)
    assert len(set(m["param_checksums"])) == 1  # the tuned settings reach every rank alike
    report = read_log(log.read_text())
    assert report["finished"] and m["autotune"]["finished"], log.read_text()
    assert m["autotune"]["chosen"] == report["chosen"] and m["autotune"]["log"] == str(log)
    rows = log.read_text().splitlines()[1:-1]  # the samples, without the closing best row
    settings = {tuple(r.replace(" ", "").split(",")[:6]) for r in rows}
    assert len(rows) == report["samples"] == 6 and len(settings) == len(rows)  # each one new
    tried = [read_log(HEADER + row + "\n")["last_tried"] for row in rows]
    assert {t["cache_enabled"] for t in tried} == {False, True}  # the response cache, both ways
    assert not any(t["hierarchical_allgather"] for t in tried)  # fixed off on one host
    said = [ln for ln in proc.stdout.splitlines() if "autotune: finished after" in ln]
    assert len(said) == 1 and f"log {log}" in said[0], proc.stdout[-2000:]


@requires_horovod
def test_a_timeline_folder_that_cannot_be_written_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = run([sys.executable, "-m", "launch", "--framework", "torch", "--train-samples", "64",
                "--epochs", "1", "--no-progress", "--timeline-out", str(blocker / "t.json")],
               timeout=300)
    one_error_line(proc, f"--timeline-out folder {blocker} is not writable")
