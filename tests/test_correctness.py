"""Proof that data-parallel training computes what one process would (docs/correctness.md).

Every test compares what the real trainers leave in their checkpoints and summaries after real
multi-process runs.  Plain SGD (no momentum unless stated), no dropout, file-order data, so that
the only difference between N ranks x batch B and one process x batch N*B is float32 summation
order.

Launching a job and importing a framework costs far more than the few steps an invariant needs,
so the runs are grouped by (framework, world size, launcher): each group is ONE launch of
``tests/correctness_probe.py``, which calls the trainer's ``train(args)`` once per configuration
in the same processes.  A group runs the first time a test needs it; the tests then only read
its outputs.  Ten launches instead of thirty-eight.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, launch_cmd, metrics, requires_horovod, run

pytestmark = [requires_horovod, pytest.mark.timeout(1800)]  # a test may launch two groups

FRAMEWORKS = ["torch", "tf"]
PROBE = str(REPO / "tests" / "correctness_probe.py")
# Deterministic SGD: what makes "N x B == 1 x N*B" an exact statement up to summation order.
PLAIN = ["--momentum", "0", "--dropout", "0", "--no-shuffle", "--warmup-epochs", "0",
         "--lr-decay", "none", "--lr-scaling", "none", "--base-lr", "0.05", "--test-samples", "200",
         "--no-progress", "--epochs", "1"]
# float32 summation order only: TF's conv kernels pick different reduction orders for batch 24 and
# 48, which after 6 steps moves a few weights by ~1e-5.  A real bug (a missed broadcast, a sum
# instead of an average, a skipped rank) moves them by the size of an update, ~1e-2.
RTOL, ATOL = 1e-3, 5e-5


def load_params(path: Path) -> list[np.ndarray]:
    """Model parameters, in model order, from either framework's checkpoint."""
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            return [z[name] for name in meta["weight_keys"]]
    import torch  # only the test process; the trainers run in their own processes

    state = torch.load(path, map_location="cpu", weights_only=True)["model"]
    return [t.numpy() for t in state.values()]


def read_meta(path: Path) -> dict:
    """A checkpoint's metadata, from either framework's file."""
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            return json.loads(str(z["meta"]))
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)["meta"]


def ckpt(folder: Path) -> Path:
    files = sorted(folder.glob("ckpt-epoch*.*"))
    assert files, f"no checkpoint in {folder}"
    return files[-1]


def assert_same_params(a: list[np.ndarray], b: list[np.ndarray], rtol=RTOL, atol=ATOL) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def moved(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


# --- the runs, grouped by launch ----------------------------------------------------------------
GLOBAL_BATCH, STEPS = 48, 6
INV2 = [*PLAIN, "--train-samples", str(GLOBAL_BATCH * STEPS)]
INV3 = [*PLAIN, "--momentum", "0.9", "--train-samples", "128"]
INV5 = [*PLAIN, "--test-samples", "1000"]
INV6 = ["--train-samples", "256", "--test-samples", "100", "--batch-size", "32", "--epochs", "2",
        "--warmup-epochs", "2", "--lr-decay", "none", "--base-lr", "0.01", "--no-progress"]
INV7 = [*PLAIN, "--train-samples", str(2 * 4 * 64)]
INV8 = [*PLAIN, "--train-samples", "384", "--batch-size", "32"]
# AdamW with decoupled weight decay and gradients clipped to a global norm small enough to scale
# every step's (their norms are 0.9 to 3 in these 6 steps; docs/training.md, "Choosing an
# optimizer"): PLAIN without SGD's --momentum.  The
# clip must see the averaged gradients for N x B to equal 1 x N*B: a clip of each rank's own would
# average differently scaled gradients.
ADAMW = [*PLAIN[2:], "--optimizer", "adamw", "--weight-decay", "0.1", "--clip-grad-norm", "0.1",
         "--base-lr", "0.003", "--train-samples", str(GLOBAL_BATCH * STEPS)]
# --strategy ps (docs/parameter-servers.md): the ring's whole LR rule (warm-up, cosine decay),
# momentum and shuffled shards; only dropout off (its masks follow each rank's seed).
PS = ["--momentum", "0.9", "--dropout", "0", "--warmup-epochs", "1", "--base-lr", "0.05",
      "--test-samples", "200", "--no-progress", "--epochs", "2", "--train-samples", "192",
      "--batch-size", "16"]

# group -> (world size, launcher, groups whose outputs it resumes from, [(tag, args, seed run)])
GROUPS: dict[str, tuple[int, str, tuple[str, ...], list[tuple[str, list[str], str | None]]]] = {
    "single": (1, "single", (), [
        ("big", [*INV2, "--batch-size", str(GLOBAL_BATCH)], None),
        ("inv3-first", [*INV3, "--batch-size", "32"], None),
        ("inv3-resume", [*INV3, "--epochs", "2", "--batch-size", "32", "--resume"], "single/inv3-first"),
        ("inv5-src", [*INV5, "--train-samples", "256", "--batch-size", "32"], None),
        ("inv8-init", [*INV8, "--base-lr", "1e-12"], None),
        ("ps-single", PS, None),
        ("adamw-big", [*ADAMW, "--batch-size", str(GLOBAL_BATCH)], None),
    ]),
    "mpi2": (2, "horovodrun", ("single",), [
        ("inv2", [*INV2, "--batch-size", str(GLOBAL_BATCH // 2)], None),
        ("inv3-resume", [*INV3, "--epochs", "2", "--batch-size", "16", "--resume"], "single/inv3-first"),
        ("inv6-linear", [*INV6, "--lr-scaling", "linear"], None),
        ("inv6-sqrt", [*INV6, "--lr-scaling", "sqrt"], None),
        ("inv6-adasum", [*INV6, "--lr-scaling", "linear", "--adasum"], None),
        ("inv7-big", [*INV7, "--batch-size", "64"], None),
        ("inv7-acc", [*INV7, "--batch-size", "16", "--backward-passes-per-step", "4"], None),
        ("inv8-full", INV8, None),
        ("inv8-half", [*INV8, "--fp16-allreduce"], None),
        ("inv8-predivide", [*INV8, "--gradient-predivide-factor", "2"], None),
        ("ps-ring", PS, None),
        ("adamw", [*ADAMW, "--batch-size", str(GLOBAL_BATCH // 2)], None),
        ("adamw-acc", [*ADAMW, "--batch-size", str(GLOBAL_BATCH // 4), "--backward-passes-per-step",
                       "2"], None),
        ("adamw-shard", [*ADAMW, "--batch-size", str(GLOBAL_BATCH // 2), "--shard-optimizer"], None),
    ]),
    # 2 servers + 2 workers at K=0 (== mpi2/ps-ring), 3 servers + 1 worker at K=4 (==
    # single/ps-single), 1 server + 3 workers at K=inf (the counters), and a ring checkpoint with
    # momentum resumed on 2 servers (== single/inv3-resume), and AdamW with decay and clipping on
    # 2 servers + 2 workers at K=0 (== mpi2/adamw: the servers clip the step's mean gradient)
    "ps4": (4, "horovodrun", ("single",), [
        ("k0", [*PS, "--strategy", "ps", "--ps-servers", "2", "--staleness", "0"], None),
        ("one", [*PS, "--strategy", "ps", "--ps-servers", "3", "--staleness", "4"], None),
        ("inf", [*PS, "--strategy", "ps", "--staleness", "inf"], None),
        ("inv3-resume", [*INV3, "--epochs", "2", "--batch-size", "16", "--resume", "--strategy",
                         "ps", "--ps-servers", "2"], "single/inv3-first"),
        ("adamw", [*ADAMW, "--batch-size", str(GLOBAL_BATCH // 2), "--strategy", "ps",
                   "--ps-servers", "2", "--staleness", "0"], None),
    ]),
    "mpi3": (3, "horovodrun", ("single", "mpi2"), [
        ("inv2", [*INV2, "--batch-size", str(GLOBAL_BATCH // 3)], None),
        ("inv5-eval", [*INV5, "--resume"], "single/inv5-src"),
        # --shard-optimizer's checkpoints at another -np: the sharded one of mpi2 resumed
        # unsharded, the unsharded one resumed sharded (Keras; PyTorch's format: in process)
        ("adamw-unshard-resume", [*ADAMW, "--epochs", "2", "--batch-size", str(GLOBAL_BATCH // 3),
                                  "--resume"], "mpi2/adamw-shard"),
        ("adamw-shard-resume", [*ADAMW, "--epochs", "2", "--batch-size", str(GLOBAL_BATCH // 3),
                                "--resume", "--shard-optimizer"], "mpi2/adamw"),
    ]),
    "gloo2": (2, "gloo", (), [("inv2", [*INV2, "--batch-size", str(GLOBAL_BATCH // 2)], None)]),
    "gloo3": (3, "gloo", (), [("inv2", [*INV2, "--batch-size", str(GLOBAL_BATCH // 3)], None)]),
}


# Runs of one framework only (the suite's time: the resumes at another -np are Keras', whose
# sharded optimizer is not PyTorch's flat buffer).
ONLY = {"mpi3/adamw-unshard-resume": "tf", "mpi3/adamw-shard-resume": "tf"}


class Runs:
    """Launches each (framework, group) once, on first use, and serves its outputs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.outcome: dict[tuple[str, str], str | None] = {}  # None = ran fine, else the failure

    def out(self, fw: str, run: str) -> Path:
        return self.root / fw / run

    def ensure(self, fw: str, group: str) -> None:
        if (fw, group) not in self.outcome:
            np_, how, needs, runs = GROUPS[group]
            for dep in needs:
                self.ensure(fw, dep)
            plan = []
            for tag, args, seed in runs:
                if ONLY.get(f"{group}/{tag}", fw) != fw:
                    continue
                out = self.out(fw, f"{group}/{tag}")
                plan.append({"args": [*args, "--checkpoint-dir", str(out), "--metrics-out",
                                      str(out / "m.json")],
                             "seed_from": str(self.out(fw, seed)) if seed else None})
            plan_path = self.root / fw / f"{group}.json"
            plan_path.parent.mkdir(parents=True, exist_ok=True)
            plan_path.write_text(json.dumps(plan))
            proc = run(launch_cmd(PROBE, [fw, str(plan_path)], np=np_, how=how), timeout=840)
            self.outcome[(fw, group)] = None if proc.returncode == 0 else (
                f"{fw} group {group} (np={np_}, {how}) failed (rc={proc.returncode}):\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        if self.outcome[(fw, group)]:
            pytest.fail(self.outcome[(fw, group)])

    def params(self, fw: str, run: str) -> list[np.ndarray]:
        self.ensure(fw, run.split("/")[0])
        return load_params(ckpt(self.out(fw, run)))

    def metrics(self, fw: str, run: str) -> dict:
        self.ensure(fw, run.split("/")[0])
        return metrics(self.out(fw, run) / "m.json")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("correctness"))


# 1 + 2 + 3: identical ranks; N x B equals 1 x N*B; every rank starts from rank 0's weights
# (ranks are seeded differently, so without the broadcast neither equality could hold).
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("np_,how", [(2, "horovodrun"), (3, "horovodrun"), (2, "gloo"), (3, "gloo")])
def test_invariant_2_data_parallel_equals_big_batch(fw, np_, how, runs):
    group = f"{'gloo' if how == 'gloo' else 'mpi'}{np_}"
    m = runs.metrics(fw, f"{group}/inv2")
    assert m["world_size"] == np_ and m["controller"] == ("gloo" if how == "gloo" else "mpi")
    assert len(m["epochs"]) == 1 and len(set(m["param_checksums"])) == 1, "invariant 1: ranks differ"
    assert_same_params(runs.params(fw, f"{group}/inv2"), runs.params(fw, "single/big"))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_invariant_3_resume_broadcasts_rank0_optimizer_state(fw, runs):
    """Resume a momentum run at np=2 from a checkpoint only rank 0 reads: the continuation must
    equal the single-process continuation, which needs rank 0's momentum on every rank."""
    for run_ in ("single/inv3-resume", "mpi2/inv3-resume"):
        m = runs.metrics(fw, run_)
        assert m["resumed_from_epoch"] == 1 and len(set(m["param_checksums"])) == 1
    assert_same_params(runs.params(fw, "mpi2/inv3-resume"), runs.params(fw, "single/inv3-resume"))


# 5: exact metrics, with shards of unequal size (1000 test images over 3 ranks: 334/333/333).
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_invariant_5_exact_metrics(fw, runs):
    single, dist = runs.metrics(fw, "single/inv5-src"), runs.metrics(fw, "mpi3/inv5-eval")
    assert dist["world_size"] == 3 and dist["epochs"] == [], "the np=3 run must only evaluate"
    # Accuracy is a ratio of integer counts: exactly equal.  Loss: float sums in another order.
    assert dist["final_test_accuracy"] == single["final_test_accuracy"]
    assert dist["final_test_loss"] == pytest.approx(single["final_test_loss"], rel=1e-6)


# 6: effective LR and warm-up, as the trainers apply them.
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("rule", ["linear", "sqrt", "adasum"])
def test_invariant_6_lr_rule(fw, rule, runs):
    m = runs.metrics(fw, f"mpi2/inv6-{rule}")
    want = {"linear": 0.02, "sqrt": 0.01 * math.sqrt(2), "adasum": 0.01}[rule]
    assert m["effective_lr"] == pytest.approx(want)
    # Last step of epoch 1 is halfway through a 2-epoch warm-up (minus one step), epoch 2 ends at
    # the target: the LR ramps linearly from the base to the target.
    steps = 256 // 2 // 32
    lr1 = 0.01 + (want - 0.01) * ((steps - 1) / steps) / 2
    lr2 = 0.01 + (want - 0.01) * (1 + (steps - 1) / steps) / 2
    assert [e["lr"] for e in m["epochs"]] == pytest.approx([lr1, lr2])


# 7: --backward-passes-per-step K equals one step over K x the batch.
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_invariant_7_gradient_accumulation(fw, runs):
    assert runs.metrics(fw, "mpi2/inv7-acc")["global_batch_size"] == 128
    assert_same_params(runs.params(fw, "mpi2/inv7-acc"), runs.params(fw, "mpi2/inv7-big"))


# 8: fp16 compression perturbs results only at fp16 rounding level.
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_invariant_8_fp16_compression(fw, runs):
    init, full = runs.params(fw, "single/inv8-init"), runs.params(fw, "mpi2/inv8-full")
    half = runs.params(fw, "mpi2/inv8-half")
    assert len(set(runs.metrics(fw, "mpi2/inv8-half")["param_checksums"])) == 1
    update = moved(full, init)
    diff = moved(half, full)
    assert update > 1e-3, "training must have moved the weights for this test to mean anything"
    # fp16 has an 11-bit significand (relative rounding 2^-11 ~ 4.9e-4 per gradient element); over
    # 6 steps, through ReLU/max-pool switches, that compounds to a few ulps of the update (TF: ~9).
    # Bound: 16 fp16 ulps of the update, i.e. under 1% of how far training moved the weights.
    assert diff <= 2 ** -11 * update * 16, (diff, update)


# 8 (continued): --gradient-predivide-factor f splits the average into a sum of gradients / f,
# times f / N: a change of rounding only, within the tolerance of invariant 2.
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_invariant_8_gradient_predivide_factor(fw, runs):
    assert len(set(runs.metrics(fw, "mpi2/inv8-predivide")["param_checksums"])) == 1
    assert_same_params(runs.params(fw, "mpi2/inv8-predivide"), runs.params(fw, "mpi2/inv8-full"))


# 10: parameter servers (docs/parameter-servers.md): staleness 0 is the ring's math, one worker
# is single-process SGD, every pushed gradient is applied exactly once, and checkpoints resume
# across strategies.
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_invariant_10_parameter_servers(fw, runs):
    k0, one, inf = (runs.metrics(fw, f"ps4/{r}") for r in ("k0", "one", "inf"))
    assert [m["strategy"] for m in (k0, one, inf)] == ["ps"] * 3
    for m in (k0, one, inf):
        assert len(set(m["param_checksums"])) == 1, "every rank ends with the servers' weights"
        assert m["ps"]["exactly_once"]
    # K = 0 with 2 workers on 2 servers: the ring's weights at -np 2 after 12 steps (warm-up,
    # cosine decay, momentum 0.9, shuffled shards), and the same per-epoch losses
    assert k0["ps"]["staleness_histogram"] == {"0": 24}
    assert_same_params(runs.params(fw, "ps4/k0"), runs.params(fw, "mpi2/ps-ring"))
    ring = runs.metrics(fw, "mpi2/ps-ring")
    assert [e["train_loss"] for e in k0["epochs"]] == pytest.approx(
        [e["train_loss"] for e in ring["epochs"]], rel=1e-5)
    # One worker, staleness 4, its 24 gradients over 3 servers: single-process SGD
    assert one["ps"]["workers"] == 1 and one["ps"]["gradients_pushed"] == 24
    assert_same_params(runs.params(fw, "ps4/one"), runs.params(fw, "single/ps-single"))
    # Staleness inf, 3 workers: every one of the 2 x 3 x 4 gradients applied once, none lost
    ps_ = inf["ps"]
    assert ps_["gradients_pushed"] == 24 == sum(ps_["pushed"]) == ps_["gradients_applied"][0]
    assert ps_["applied"] == ps_["received"] == [ps_["pushed"]]
    assert sum(ps_["staleness_histogram"].values()) == 24
    # A ring checkpoint with momentum, resumed on 2 servers (its momentum split between them)
    resumed = runs.metrics(fw, "ps4/inv3-resume")
    assert resumed["resumed_from_epoch"] == 1
    assert_same_params(runs.params(fw, "ps4/inv3-resume"), runs.params(fw, "single/inv3-resume"))


# 2 (continued), with AdamW, its decoupled weight decay and the clip of the averaged gradients'
# global norm: N ranks x B, and N ranks x K micro-batches of B / K, equal one process x N*B; the
# checkpoint records the optimizer whose state it holds.
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_invariant_2_with_adamw_decay_and_clipping(fw, runs):
    single = runs.params(fw, "single/adamw-big")
    for run_ in ("mpi2/adamw", "mpi2/adamw-acc"):
        m = runs.metrics(fw, run_)
        assert m["world_size"] == 2 and m["global_batch_size"] == GLOBAL_BATCH
        assert len(set(m["param_checksums"])) == 1, "invariant 1: ranks differ"
        assert_same_params(runs.params(fw, run_), single)
    assert read_meta(ckpt(runs.out(fw, "mpi2/adamw")))["optimizer"] == "adamw"
    # parameter servers at staleness 0 (2 servers, 2 workers): each server's AdamW on its slice,
    # the step's mean gradient clipped by its norm over both slices: the ring's weights
    assert_same_params(runs.params(fw, "ps4/adamw"), runs.params(fw, "mpi2/adamw"))
    assert read_meta(ckpt(runs.out(fw, "ps4/adamw")))["optimizer"] == "adamw"
    init = runs.params(fw, "single/inv8-init")  # the same initial weights, not trained (LR 1e-12)
    assert moved(single, init) > 1e-2, "AdamW must have moved the weights for this to mean anything"


# 2 (continued), --shard-optimizer (ZeRO stage 1): the gradients reduce-scattered, each rank's
# AdamW over its half of the flat weights, global-norm clip from both halves, the halves
# allgathered: the same weights as the unsharded run of the same flags, and a checkpoint in the
# unsharded format (the whole state, gathered), so that either resumes the other.
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_invariant_2_sharded_optimizer_equals_unsharded(fw, runs):
    m = runs.metrics(fw, "mpi2/adamw-shard")
    assert m["world_size"] == 2 and len(set(m["param_checksums"])) == 1, "invariant 1: ranks differ"
    whole = runs.params(fw, "mpi2/adamw")
    # one process's float32 sums in another order (the clip's norm), not an update (~1e-3)
    assert_same_params(runs.params(fw, "mpi2/adamw-shard"), whole, rtol=1e-5, atol=1e-6)
    if fw == "tf":
        _keras_sharded_checkpoints(runs)
        return
    import torch

    def state(run_):
        return torch.load(ckpt(runs.out("torch", run_)), map_location="cpu", weights_only=True)["optimizer"]
    shard, plain = state("mpi2/adamw-shard"), state("mpi2/adamw")
    assert shard["param_groups"] == plain["param_groups"] and shard["state"].keys() == plain["state"].keys()
    for i, entry in plain["state"].items():
        assert entry.keys() == shard["state"][i].keys()
        for key, value in entry.items():
            torch.testing.assert_close(shard["state"][i][key], value, rtol=1e-4, atol=1e-8)


def _keras_sharded_checkpoints(runs) -> None:
    """Keras: the sharded checkpoint's optimizer arrays are the unsharded one's (names, shapes,
    values); at -np 3 each resumes the other's flags (sharded into unsharded and back), and both
    continue alike."""
    def arrays(run_):
        with np.load(ckpt(runs.out("tf", run_)), allow_pickle=False) as z:
            return {k: z[k] for k in z.files if k.startswith("optimizer_")}
    shard, plain = arrays("mpi2/adamw-shard"), arrays("mpi2/adamw")
    assert shard.keys() == plain.keys() and len(plain) > 2
    for key, value in plain.items():
        assert shard[key].shape == value.shape and shard[key].dtype == value.dtype, key
        np.testing.assert_allclose(shard[key], value, rtol=1e-4, atol=1e-8, err_msg=key)
    resumed = [f"mpi3/adamw-{how}-resume" for how in ("unshard", "shard")]
    for run_ in resumed:
        m = runs.metrics("tf", run_)
        assert m["world_size"] == 3 and m["resumed_from_epoch"] == 1, run_
        assert len(set(m["param_checksums"])) == 1, "invariant 1: ranks differ"
    a, b = (runs.params("tf", run_) for run_ in resumed)
    assert moved(a, runs.params("tf", "mpi2/adamw")) > 1e-3, "the resumed epoch trained"
    assert_same_params(a, b, rtol=1e-5, atol=1e-6)
