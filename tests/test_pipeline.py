"""A pipeline of S stages x R replicas (``--pipeline-stages``) computes what one process computes,
in both frameworks (docs/pipeline.md, docs/correctness.md rows 10-13).

The runs are float64 (``--model pipeline_models:{torch,tf}_cnn64``: the built-in CNN's layers in
float64), SGD with momentum 0.9, no dropout, file-order data, fixed LR, so that S stages x M
micro-batches x R replicas with per-replica batch B after k steps equal one process with batch
R x B to float64 rounding, not float32's.  Measured (2026-11-28): both frameworks differ by
3e-17 at S = 2, 8e-15 at S = 3 and 4 with BatchNorm (TF's differed by 2e-10 to 1e-7 while
model.fit's Keras loss cast float64 logits to float32).  A real bug moves weights by an update,
~1e-3.

As in tests/test_correctness.py the runs are grouped by launch (tests/correctness_probe.py):
per framework, the one-process references, S = 2 at -np 2 (R = 1) and S = 2 at -np 4 (R = 2),
both schedules, a resume at R = 2 of the R = 1 run's per-stage checkpoint, S = 3 at -np 3 and
S = 4 at -np 4 (R = 1) on a model with BatchNorm and Dropout: five launches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, launch_cmd, metrics, one_error_line, requires_horovod, run

pytestmark = [requires_horovod, pytest.mark.timeout(1800)]

FRAMEWORKS = ["torch", "tf"]
PROBE = str(REPO / "tests" / "correctness_probe.py")
ENV = {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}  # --model pipeline_models:...
B, SAMPLES = 16, 192  # per-replica batch; 12 steps at R = 1, 6 at R = 2
PLAIN = ["--momentum", "0.9", "--dropout", "0", "--no-shuffle", "--warmup-epochs", "0",
         "--lr-decay", "none", "--lr-scaling", "none", "--base-lr", "0.02", "--test-samples", "200",
         "--no-progress", "--train-samples", str(SAMPLES)]
RTOL, ATOL = 1e-6, 1e-8


def model(fw: str) -> list[str]:
    return ["--model", f"pipeline_models:{fw}_cnn64"]


def pipe(schedule: str, micro: int, epochs: int = 1, plain: list[str] = PLAIN) -> list[str]:
    return [*plain, "--batch-size", str(B), "--pipeline-stages", "2", "--schedule", schedule,
            "--microbatches", str(micro), "--epochs", str(epochs)]


# Each stage's own AdamW with decoupled weight decay, clipped by the whole model's gradient norm:
# at these steps the float64 CNN's norm measured 1.7 to 4.0 (one process, 2026-11-28), so 0.1
# clips every step, by a factor of 0.02 to 0.06.  AdamW has its betas, no --momentum.
NO_MOMENTUM = [a for a in PLAIN if a not in ("--momentum", "0.9")]
ADAMW = ["--optimizer", "adamw", "--base-lr", "0.001", "--weight-decay", "0.01"]
CLIP = ["--clip-grad-norm", "0.1"]
# --precision bf16 on the built-in float32 CNN, beside the same run in float32: two epochs, the
# loss of the second below the first's.
FLOAT32 = [*pipe("1f1b", 4, epochs=2), "--model", "cnn"]


M_DEEP = 4  # micro-batches of B / 4 = 4 rows (BatchNorm1d needs 2 or more)
DEEP_MODEL = ["--model", "pipeline_models:{fw}_bnd64"]  # a run's own --model wins over model(fw)


def deep(stages: int, schedule: str) -> list[str]:
    return [*PLAIN, "--batch-size", str(B), "--pipeline-stages", str(stages), "--schedule",
            schedule, "--microbatches", str(M_DEEP), "--epochs", "1", *DEEP_MODEL]


# group -> (world size, launcher, groups it resumes from, [(tag, args, seed run)])
GROUPS = {
    "single": (1, "single", (), [
        ("ref-b16", [*PLAIN, "--batch-size", str(B), "--epochs", "1"], None),
        ("ref-b32", [*PLAIN, "--batch-size", str(2 * B), "--epochs", "1"], None),
        ("ref-b64", [*PLAIN, "--batch-size", str(4 * B), "--epochs", "1"], None),
        ("ref-deep", [*PLAIN, "--batch-size", str(B // M_DEEP), "--backward-passes-per-step",
                      str(M_DEEP), "--epochs", "1", *DEEP_MODEL], None),
        # epoch 2 at batch 32 after epoch 1 at batch 16: what the R = 2 resume below must equal
        ("ref-resume", [*PLAIN, "--batch-size", str(2 * B), "--epochs", "2", "--resume"],
         "single/ref-b16"),
        ("ref-adamw", [*NO_MOMENTUM, "--batch-size", str(B), "--epochs", "1", *ADAMW, *CLIP], None),
        # the same without clipping: it must end elsewhere, or the clipping test proves nothing
        ("ref-adamw-free", [*NO_MOMENTUM, "--batch-size", str(B), "--epochs", "1", *ADAMW], None),
    ]),
    "np2": (2, "horovodrun", (), [
        ("gpipe", pipe("gpipe", 4), None),
        # the strategy spelt out: the same job as --pipeline-stages 2 alone, which implies it
        ("1f1b", ["--strategy", "pipeline", *pipe("1f1b", 4)], None),
        ("adamw", [*pipe("1f1b", 4, plain=NO_MOMENTUM), *ADAMW, *CLIP], None),
        ("fp32", FLOAT32, None),
        ("bf16", [*FLOAT32, "--precision", "bf16"], None),
    ]),
    "np4": (4, "horovodrun", ("np2",), [
        ("gpipe", pipe("gpipe", 2), None),
        ("1f1b", pipe("1f1b", 4), None),
        ("resume", [*pipe("1f1b", 2, epochs=2), "--resume"], "np2/1f1b"),
        ("k2", [*pipe("1f1b", 2), "--backward-passes-per-step", "2"], None),
    ]),
    # S = 3 and S = 4 at R = 1 on a model with BatchNorm and Dropout in its first, middle and last
    # stages (its own launches: a launch's process sets are fixed at its first hvd.init).  Each
    # stage computes BatchNorm over a micro-batch of B / M rows, so the math it claims is one
    # process accumulating M micro-batches of B / M rows (--backward-passes-per-step M).
    "np3": (3, "horovodrun", (), [
        ("gpipe", deep(3, "gpipe"), None),
        ("1f1b", deep(3, "1f1b"), None),
    ]),
    "np4s4": (4, "horovodrun", (), [
        ("gpipe", deep(4, "gpipe"), None),
        ("1f1b", deep(4, "1f1b"), None),
    ]),
}


class Runs:
    """Each (framework, group) launched once, on first use."""

    def __init__(self, root: Path) -> None:
        self.root, self.outcome = root, {}

    def out(self, fw: str, name: str) -> Path:
        return self.root / fw / name

    def ensure(self, fw: str, group: str) -> None:
        if (fw, group) not in self.outcome:
            np_, how, needs, runs = GROUPS[group]
            for dep in needs:
                self.ensure(fw, dep)
            if group.startswith("np"):
                self.ensure(fw, "single")
            plan = [{"args": [*model(fw), *(a.format(fw=fw) for a in args),
                              "--checkpoint-dir", str(self.out(fw, f"{group}/{tag}")),
                              "--metrics-out", str(self.out(fw, f"{group}/{tag}") / "m.json")],
                     "seed_from": str(self.out(fw, seed)) if seed else None}
                    for tag, args, seed in runs]
            path = self.root / fw / f"{group}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(plan))
            proc = run(launch_cmd(PROBE, [fw, str(path)], np=np_, how=how), timeout=900, env=ENV)
            self.outcome[(fw, group)] = None if proc.returncode == 0 else (
                f"{fw} {group} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        if self.outcome[(fw, group)]:
            pytest.fail(self.outcome[(fw, group)])

    def metrics(self, fw: str, name: str) -> dict:
        self.ensure(fw, name.split("/")[0])
        return metrics(self.out(fw, name) / "m.json")

    def params(self, fw: str, name: str) -> list[np.ndarray]:
        """The model's weights in model order: the one file, or the stages' files in stage order."""
        self.ensure(fw, name.split("/")[0])
        folder = self.out(fw, name)
        newest = sorted(folder.glob("ckpt-epoch*.*"))[-1].name[:len("ckpt-epoch0000")]
        files = sorted(folder.glob(f"{newest}*"))
        assert files and all(p.suffix in (".pt", ".npz") for p in files)
        return [a for p in files for a in load_params(p)]


def load_params(path: Path) -> list[np.ndarray]:
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            return [z[k] for k in json.loads(str(z["meta"]))["weight_keys"]]
    import torch  # the test process only

    state = torch.load(path, map_location="cpu", weights_only=True)["model"]
    return [t.numpy() for t in state.values()]


def assert_same(a: list[np.ndarray], b: list[np.ndarray], atol: float = ATOL) -> None:
    # float64 weights (and BatchNorm's statistics); BatchNorm's batch counters are integers
    assert len(a) == len(b) and all(x.dtype in (np.float64, np.int64) for x in a)
    assert any(x.dtype == np.float64 for x in a)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=RTOL, atol=atol)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("pipeline"))


def stage_checksums_agree(m: dict) -> None:
    """Every rank of a stage holds the same weights; the stages' differ."""
    stages = m["pipeline"]["stages"]
    sums = m["param_checksums"]
    by_stage = [{sums[r] for r in range(len(sums)) if r % stages == s} for s in range(stages)]
    assert all(len(s) == 1 for s in by_stage), sums
    assert len(set.union(*by_stage)) == stages


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("group,reference", [("np2", "single/ref-b16"), ("np4", "single/ref-b32")])
def test_s_stages_m_microbatches_r_replicas_equal_one_process_with_batch_r_x_b(fw, schedule, group,
                                                                              reference, runs):
    m = runs.metrics(fw, f"{group}/{schedule}")
    ref = runs.metrics(fw, reference)
    assert m["pipeline"]["replicas"] == (1 if group == "np2" else 2)
    assert m["global_batch_size"] == ref["global_batch_size"] == ref["batch_size_per_rank"]
    stage_checksums_agree(m)
    assert_same(runs.params(fw, f"{group}/{schedule}"), runs.params(fw, reference))
    # Exact metrics: the last stage's sums reach rank 0, each example counted once.
    assert m["final_test_accuracy"] == ref["final_test_accuracy"]
    assert m["epochs"][0]["train_loss"] == pytest.approx(ref["epochs"][0]["train_loss"], rel=1e-6)
    assert m["epochs"][0]["test_loss"] == pytest.approx(ref["epochs"][0]["test_loss"], rel=1e-6)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("group", ["np3", "np4s4"])
def test_three_and_four_stages_with_batchnorm_and_dropout_equal_one_process_accumulating_m(
        fw, schedule, group, runs):
    """S = 3 and 4 (middle stages included) x M = 4 at R = 1, BatchNorm and Dropout in the
    stages: the weights, BatchNorm's moving statistics (in the checkpoints) and the losses of one
    process that accumulates M micro-batches of B / M rows, with the same dropout masks."""
    m = runs.metrics(fw, f"{group}/{schedule}")
    ref = runs.metrics(fw, "single/ref-deep")
    stages = int(group[2])
    assert m["pipeline"]["stages"] == stages and m["pipeline"]["replicas"] == 1
    assert m["global_batch_size"] == ref["global_batch_size"] == B
    stage_checksums_agree(m)
    assert_same(runs.params(fw, f"{group}/{schedule}"), runs.params(fw, "single/ref-deep"))
    assert m["final_test_accuracy"] == ref["final_test_accuracy"]
    assert m["epochs"][0]["train_loss"] == pytest.approx(ref["epochs"][0]["train_loss"], rel=1e-6)
    assert m["epochs"][0]["test_loss"] == pytest.approx(ref["epochs"][0]["test_loss"], rel=1e-6)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_resume_with_the_same_stages_and_more_replicas_continues_exactly(fw, runs):
    """The R = 1 run's per-stage checkpoints (momentum included), resumed at R = 2: each stage's
    first replica reads its file and broadcasts it within its process set."""
    m = runs.metrics(fw, "np4/resume")
    assert m["resumed_from_epoch"] == 1 and len(m["epochs"]) == 1
    stage_checksums_agree(m)
    assert_same(runs.params(fw, "np4/resume"), runs.params(fw, "single/ref-resume"))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_gradient_accumulation_folds_into_the_micro_batches(fw, runs):
    """--backward-passes-per-step 2 at M = 2: one schedule of 4 micro-batches per optimizer step,
    equal to one process with batch 2 x 2 x B."""
    m = runs.metrics(fw, "np4/k2")
    assert m["global_batch_size"] == 4 * B
    stage_checksums_agree(m)
    assert_same(runs.params(fw, "np4/k2"), runs.params(fw, "single/ref-b64"))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_the_summary_names_each_stage(fw, runs):
    m = runs.metrics(fw, "np4/1f1b")
    split = m["pipeline"]["split"]
    assert [len(s["layers"]) for s in split] and sum(s["params"] for s in split) == m["param_count"]
    assert all(s["bytes"] == 8 * s["params"] for s in split)  # float64 weights
    by_rank = {r["rank"]: r for r in m["pipeline"]["ranks"]}
    assert [by_rank[r]["param_bytes"] for r in range(4)] == [split[r % 2]["bytes"] for r in range(4)]


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_adamw_with_decay_clipped_by_the_global_norm_over_the_stages_equals_one_process(fw, runs):
    """S = 2: each stage's AdamW (its moments and step count broadcast within its set), its
    gradients scaled by the norm over both stages, equals one process's AdamW clipped by the
    model's norm; the stages' checkpoints hold AdamW's state."""
    m = runs.metrics(fw, "np2/adamw")
    ref = runs.metrics(fw, "single/ref-adamw")
    stage_checksums_agree(m)
    mine, theirs = runs.params(fw, "np2/adamw"), runs.params(fw, "single/ref-adamw")
    # Adam divides each gradient by its own running magnitude: a weight whose gradients are near
    # zero (a unit ReLU keeps dead) moves by lr x g / (|g| + eps), which turns the rounding of g
    # into its update.  Keras' float64 gradients differ from one process's by up to 2e-10
    # (docs/pipeline.md), and measured one weight of 184,586 1.4e-8 apart after 12 steps; PyTorch's
    # (3e-17) stay within the other tests' 1e-8.  1e-6 is still a thousandth of one update (LR 1e-3).
    assert_same(mine, theirs, atol=ATOL if fw == "torch" else 1e-6)
    assert m["epochs"][0]["train_loss"] == pytest.approx(ref["epochs"][0]["train_loss"], rel=1e-6)
    assert m["final_test_accuracy"] == ref["final_test_accuracy"]
    # Clipping bites: without it one process ends more than an update away (a per-stage norm,
    # or none, would not match the reference above).
    free = runs.params(fw, "single/ref-adamw-free")
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(theirs, free, strict=True)) > 1e-4
    folder = runs.out(fw, "np2/adamw")
    for path in sorted(folder.glob("ckpt-epoch0001-stage*")):  # Adam's moments, per stage
        if path.suffix == ".pt":
            import torch

            state = torch.load(path, map_location="cpu", weights_only=True)["optimizer"]["state"]
            assert state and all({"exp_avg", "exp_avg_sq", "step"} <= set(s) for s in state.values())
            assert all(float(s["step"]) == 12 for s in state.values())
        else:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                slots = [k for k in z.files if k.startswith("optimizer_")]
                assert meta["optimizer"] == "adamw"
                assert len(slots) >= 2 * len(meta["weight_keys"])  # m and v per weight


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_bf16_stages_send_half_the_bytes_keep_float32_weights_and_learn(fw, runs):
    """--precision bf16 at S = 2: the activations and their gradients cross the cut in bfloat16,
    half the bytes of the same run in float32 (measured by the engine, per step and rank); the
    weights stay float32; the loss falls, near float32's."""
    bf, fp = runs.metrics(fw, "np2/bf16"), runs.metrics(fw, "np2/fp32")

    def per_rank(m, key):
        return [r[key] for r in sorted(m["pipeline"]["ranks"], key=lambda r: r["rank"])]

    assert all(per_rank(fp, "sent_bytes_per_step"))
    assert per_rank(bf, "sent_bytes_per_step") == [b / 2 for b in per_rank(fp, "sent_bytes_per_step")]
    assert per_rank(bf, "param_bytes") == per_rank(fp, "param_bytes")
    losses = [e["train_loss"] for e in bf["epochs"]]
    assert len(losses) == 2 and losses[1] < losses[0]
    for a, b in zip(losses, [e["train_loss"] for e in fp["epochs"]], strict=True):
        assert a == pytest.approx(b, abs=0.1)


# --- bad input: one line, exit 2 ---------------------------------------------------------------

@pytest.mark.parametrize("module", ["launch.torch_mnist", "launch.tf_mnist"])
@pytest.mark.parametrize("flags,needle", [
    (["--pipeline-stages", "2", "--microbatches", "3"], "--microbatches 3 must divide --batch-size 64"),
    (["--pipeline-stages", "2", "--elastic", "--schedule", "1f1b"],
     "--schedule 1f1b with --elastic --pipeline-stages"),
    (["--pipeline-stages", "2", "--adasum"], "--adasum with --pipeline-stages"),
    (["--pipeline-stages", "2", "--autotune"], "--autotune with --pipeline-stages"),
    (["--pipeline-stages", "2", "--timeline-out", "t.json"], "--timeline-out with --pipeline-stages"),
    (["--pipeline-stages", "0"], "--pipeline-stages must be a positive integer"),
    (["--schedule", "gpipe"], "--schedule works with --pipeline-stages 2 or more"),
    (["--checkpoint-activations"], "--checkpoint-activations works with --pipeline-stages 2 or more"),
    (["--partition", "time"], "--partition works with --pipeline-stages 2 or more"),
    (["--pipeline-stages", "2", "--schedule", "zigzag"], "invalid choice: 'zigzag'"),
    (["--strategy", "pipeline"], "--strategy pipeline needs --pipeline-stages S of 2 or more"),
    (["--strategy", "ring", "--pipeline-stages", "2"], "--strategy ring with --pipeline-stages 2"),
    (["--strategy", "pipeline", "--pipeline-stages", "2", "--staleness", "1"],
     "--ps-servers and --staleness set up parameter servers"),
])
def test_bad_pipeline_flags(module, flags, needle):
    one_error_line(run([sys.executable, "-m", module, *flags]), needle)


def test_stages_that_do_not_divide_the_world_end_every_rank_in_one_line():
    proc = run(launch_cmd("launch.torch_mnist", ["--pipeline-stages", "2"], np=3), timeout=120)
    one_error_line(proc, "--pipeline-stages 2 must divide the number of processes, not 3")


def test_gloo_is_refused_with_why():
    proc = run(launch_cmd("launch.torch_mnist", ["--pipeline-stages", "2"], np=2, how="gloo"),
               timeout=120)
    # Every rank exits 2 with no traceback; rank 0 says why in one line (horovodrun --gloo itself
    # then exits 1, with a traceback of its own naming the first rank's exit code).
    assert proc.returncode == 1 and "Exit code: 2" in proc.stderr, proc.stderr[-2000:]
    ranks = [line for line in proc.stderr.splitlines() if "]<stderr>:" in line]
    assert not [line for line in ranks if "Traceback" in line], ranks
    errors = [line for line in ranks if "error:" in line]
    assert len(errors) == 1 and "--pipeline-stages needs Horovod's MPI controller" in errors[0]
    assert "Gloo has no such messages" in errors[0]


@pytest.mark.parametrize("fw,spec,needle", [
    ("torch", "pipeline_models:torch_unsplittable", "cannot split"),
    ("tf", "pipeline_models:tf_residual", "is not a chain of layers"),
])
def test_a_model_that_cannot_be_split_ends_every_rank_in_one_line(fw, spec, needle):
    proc = run(launch_cmd(f"launch.{fw}_mnist", ["--pipeline-stages", "2", "--model", spec,
                                                 "--train-samples", "64", "--epochs", "1"], np=2),
               timeout=300, env=ENV)
    one_error_line(proc, f"--model {spec}", needle)


def test_resuming_checkpoints_of_another_stage_count_is_one_line(tmp_path):
    # The names say what a folder holds; the refusal comes before any file is read.
    (tmp_path / "ckpt-epoch0001-stage0of2.pt").write_bytes(b"")
    (tmp_path / "ckpt-epoch0001-stage1of2.pt").write_bytes(b"")
    proc = run(launch_cmd("launch.torch_mnist", ["--resume", "--checkpoint-dir", str(tmp_path),
                                                 "--train-samples", "64", "--epochs", "1"],
                          how="single"), timeout=120)
    one_error_line(proc, "holds checkpoints of 2 pipeline stages", "--pipeline-stages 1",
                   "resume with --pipeline-stages 2")


def test_resuming_a_stage_with_another_optimizer_is_one_line():
    """A stage's file records its optimizer; another --optimizer is refused before any state is
    read into the stage (in process: the check every stage's first replica makes on its file)."""
    from types import SimpleNamespace

    from ringtrain.errors import UserError
    from ringtrain.strategies.pipeline.run import PipelineRun

    me = SimpleNamespace(args=SimpleNamespace(optimizer="sgd"))
    with pytest.raises(UserError) as err:
        PipelineRun.check_loaded(me, {"optimizer": "adamw", "pipeline": {}}, "ckpt-epoch0001-stage0of2.pt")
    assert str(err.value) == ("ckpt-epoch0001-stage0of2.pt holds the state of --optimizer adamw, "
                              "this run has --optimizer sgd; resume with --optimizer adamw, or use "
                              "another --checkpoint-dir to start sgd afresh")
    # a file written before --optimizer existed holds SGD's state: it passes on to the layers' check
    me.stages, me.place = [SimpleNamespace(params=3, layers=["a"])], SimpleNamespace(stage=0)
    PipelineRun.check_loaded(me, {"pipeline": {"params": 3, "layers": ["a"]}}, "old.pt")
