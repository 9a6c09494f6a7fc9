"""Part ``cluster``: Horovod where it lives, on an emulated cluster of this machine.

Four network-namespace "hosts" on one bridge (:mod:`bench.common.netns_hosts`: one address, one sshd,
one veth each; names ``rtc-*``), each host's link shaped by tc in both directions to a profile
(1 Gbit/s, 10 Gbit/s; or left unshaped as the baseline), one rank per host (two where the
hierarchical allreduce is tried).  On it:

* **collectives**: ``bench/workers/coll_worker.py`` (Horovod MPI and Gloo, mpi4py ``Allreduce``,
  ``torch.distributed`` gloo, the mpi4py parameter server; hierarchical variants at 2 ranks per
  host), 64 KiB to 64 MiB, on 2, 3 and 4 hosts; every rank reads its host interface's byte
  counters around each size's repetitions, so the bytes that crossed the busiest link are
  measured, not assumed;
* **training** in the bandwidth-bound regime: ``bench/workers/bigmodel_torch.py`` (torchvision ResNet-18,
  46.8 MB of gradients) under Horovod and DDP on 1-4 hosts, the same ranks computing alone (no
  exchange) and the knobs (fp16 compression, fusion threshold, cycle time, hierarchical
  allreduce); ``bench/workers/bigmodel_tf.py`` (Keras Applications ResNet50, 102 MB) under Horovod;
* **the link itself**: one TCP stream and its round trip between two hosts
  (``bench/workers/linkprobe.py``), per profile.

Every process of a run is a real launch: ``horovodrun -H rtc-h1:1,...`` (over ssh, as on a
cluster) started inside host 1, ``mpirun -H ...`` likewise, DDP/torch-gloo as one process per
host with env:// rendezvous.  This machine has 2 cores for all hosts, so ranks share cores; the
report separates that from the network's share (see ``bench/reports/report_cluster.py``).  MPI ranks are
told to yield while they wait (``OMPI_MCA_mpi_yield_when_idle=1``): a rank that busy-polls here
takes a core from another "host", which a real host's own cores would not.

Runs as root only (namespaces, tc, sshd); elsewhere the part records why it was skipped.
Namespaces, the bridge and every tc rule are removed on exit, errors, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import costmodel, util
from bench.common import netns_hosts as nh
from launch.horovodrun import with_controller

PREFIX = "rtc-"
IFACE = "rtceth0"
SUBNET = "10.252.0"
SIZES = [64 * 1024 * 4 ** k for k in range(6)]  # 64 KiB .. 64 MiB
CELLS = ("collectives", "torch", "tf")  # the kinds of cell; the link probes run in every part


@dataclass(frozen=True)
class Profile:
    label: str
    rate_bit: float | None  # None: no tc at all (the baseline)
    delay_s: float = 0.0    # one way, on each host's egress; needs sch_netem


PROFILES = {
    "unshaped": Profile("unshaped (veth + bridge, no tc)", None),
    "1g": Profile("1 Gbit/s + 0.2 ms", 1e9, 0.2e-3),
    "10g": Profile("10 Gbit/s + 0.05 ms", 10e9, 0.05e-3),
}

# Open MPI's ring allreduce instead of its default choice (coll/tuned's fixed decision rules pick
# recursive doubling or Rabenseifner at these sizes, both pairwise exchanges; on TCP they ran at
# 0.46 of the 1 Gbit/s link at 16 MiB on 2 and 4 hosts where the ring ran at 0.88 and 0.74)
RING = {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1", "OMPI_MCA_coll_tuned_allreduce_algorithm": "4"}


@dataclass(frozen=True)
class Coll:
    worker: str            # bench.workers.coll_worker --impl
    launcher: str          # horovodrun | horovodrun-gloo | mpirun | direct
    formula: str           # ring | ps | hier: what the busiest link is held against
    env: tuple[tuple[str, str], ...] = ()
    flags: tuple[str, ...] = ()  # horovodrun options


COLLECTIVES = {
    "horovod-mpi": Coll("hvd", "horovodrun", "ring"),
    "horovod-mpi-ring": Coll("hvd", "horovodrun", "ring", tuple(RING.items())),
    "horovod-gloo": Coll("hvd", "horovodrun-gloo", "ring"),
    "mpi4py-allreduce": Coll("mpi4py", "mpirun", "ring"),
    "mpi4py-ring": Coll("mpi4py", "mpirun", "ring", tuple(RING.items())),
    # mpi4py-ring after Horovod's per-cycle coordination round: its protocol's floor (coll_worker)
    "mpi4py-ring-negotiated": Coll("mpi4py-negotiated", "mpirun", "ring", tuple(RING.items())),
    "torch-gloo": Coll("torch", "direct", "ring"),
    "mpi4py-param-server": Coll("ps", "mpirun", "ps"),
    # the rank waits by poll + sleep instead of horovod.torch's spinning wait (bench/parts/cluster_cells.py)
    "horovod-gloo-sleepwait": Coll("hvd-sleep", "horovodrun-gloo", "ring"),
    "horovod-mpi-ring-sleepwait": Coll("hvd-sleep", "horovodrun", "ring", tuple(RING.items())),
}
# at 2 ranks per host: flat, Horovod's own switch (which its CPU build ignores: see the report),
# and a two-level allreduce made with mpi4py
HIERARCHICAL = {
    "horovod-mpi-ring": COLLECTIVES["horovod-mpi-ring"],
    "horovod-mpi-ring --hierarchical-allreduce": Coll("hvd", "horovodrun", "ring", tuple(RING.items()),
                                                      ("--hierarchical-allreduce",)),
    "mpi4py-ring": COLLECTIVES["mpi4py-ring"],
    "mpi4py-hierarchical": Coll("hier", "mpirun", "hier", tuple(RING.items())),
}


@dataclass
class ClusterConfig:
    quick: bool = False
    hosts: int = 4  # made once; each cell runs on the first N
    profiles: list[str] = field(default_factory=lambda: ["1g", "10g"])
    # how time grows with N is measured on 1 Gbit/s; 10 Gbit/s is more than this machine's TCP
    # stack moves between four namespaces, so one N there says what it does
    coll_hosts: dict[str, list[int]] = field(default_factory=lambda: {
        "unshaped": [4], "1g": [2, 3, 4], "10g": [4]})
    # mpi4py with Open MPI's default algorithm is left out: Horovod MPI runs the same MPI_Allreduce
    coll_impls: list[str] = field(default_factory=lambda: [
        "horovod-mpi", "horovod-mpi-ring", "horovod-gloo", "mpi4py-ring", "torch-gloo",
        "mpi4py-param-server"])
    coll_sizes: list[int] = field(default_factory=lambda: list(SIZES))
    coll_warmup: int = 2
    coll_reps: int = 5
    coll_budget_s: float = 3.0
    hier_hosts: list[int] = field(default_factory=lambda: [2])  # 2 ranks each, on the 1g profile
    train_hosts: dict[str, list[int]] = field(default_factory=lambda: {
        "unshaped": [1, 2, 3, 4], "1g": [2, 3, 4], "10g": [2, 3, 4]})
    train_warmup: int = 3
    train_steps: int = 8
    torch_model: str = "resnet18"
    image_size: int = 32
    batch_size: int = 32
    ddp: bool = True
    knob_profile: str | None = "1g"
    knob_hosts: int = 4
    tf_model: str | None = "resnet50"
    tf_hosts: dict[str, list[int]] = field(default_factory=lambda: {"unshaped": [1, 2], "1g": [2, 4]})
    tf_alone_hosts: list[int] = field(default_factory=lambda: [2, 4])
    tf_batch_size: int = 16
    timeout_s: float = 900
    cells: list[str] = field(default_factory=lambda: list(CELLS))

    def to_dict(self) -> dict:
        return asdict(self)

    def only(self, cells: list[str]) -> ClusterConfig:
        """This config with the cells of the other kinds (collectives, torch or tf training)
        taken out."""
        cfg = dataclasses.replace(self, cells=[c for c in CELLS if c in cells])
        if "collectives" not in cells:
            cfg = dataclasses.replace(cfg, coll_hosts={}, hier_hosts=[])
        if "torch" not in cells:
            cfg = dataclasses.replace(cfg, train_hosts={}, knob_profile=None)
        if "tf" not in cells:
            cfg = dataclasses.replace(cfg, tf_model=None)
        return cfg


def full() -> ClusterConfig:
    return ClusterConfig()


def quick() -> ClusterConfig:
    """A few minutes: the 1 Gbit/s profile, 2 and 4 hosts, messages to 16 MiB, ResNet-18 on
    1 and 2 hosts, no knobs, no Keras."""
    return ClusterConfig(quick=True, profiles=["1g"], coll_hosts={"1g": [2, 4]},
                         coll_sizes=SIZES[:5], coll_reps=3, coll_budget_s=1.5, hier_hosts=[],
                         train_hosts={"unshaped": [1, 2], "1g": [2]}, train_warmup=2, train_steps=4,
                         ddp=True, knob_profile=None, tf_model=None, timeout_s=400)


@dataclass
class TrainRun:
    framework: str  # torch | tf
    wrapper: str    # none | alone | horovod | ddp
    hosts: int
    profile: str
    slots: int = 1
    variant: str = "default"
    flags: tuple[str, ...] = ()  # horovodrun options
    args: tuple[str, ...] = ()   # worker options
    env: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return f"{self.framework}/{self.wrapper}/{self.variant}/{self.profile}/h{self.hosts}x{self.slots}"


class Cluster:
    """Launch lines and runs on the emulated hosts."""

    def __init__(self, hosts: nh.Hosts, out: Path, timeout: float) -> None:
        self.hosts, self.out, self.timeout = hosts, out, timeout
        self.profile = "unshaped"

    def env(self, **extra: str) -> dict[str, str]:
        return self.hosts.env(util.base_env(**{"OMPI_MCA_mpi_yield_when_idle": "1",
                                               "OMP_NUM_THREADS": "1", **extra}))

    def host_list(self, n: int, slots: int) -> str:
        return ",".join(f"{h.name}:{slots}" for h in self.hosts.hosts[:n])

    def horovodrun(self, n: int, slots: int, inner: list[str], gloo: bool, flags=()) -> list[str]:
        return [str(util.BIN / "horovodrun"), *(["--gloo"] if gloo else []), "-np", str(n * slots),
                "-H", self.host_list(n, slots), "--network-interfaces", self.hosts.iface,
                "--ssh-identity-file", str(self.hosts.identity_file), "--disable-cache",
                "--start-timeout", "120", *flags, *inner]

    def mpirun(self, n: int, slots: int, inner: list[str], env: dict[str, str]) -> list[str]:
        """Raw mpirun with the flags horovodrun passes Open MPI (ob1 over TCP on our interface)."""
        exported = ["PATH", "PYTHONPATH", "OMPI_MCA_mpi_yield_when_idle", "OMP_NUM_THREADS",
                    "TF_CPP_MIN_LOG_LEVEL", *env]
        return ["mpirun", "--allow-run-as-root", "-np", str(n * slots), "-H", self.host_list(n, slots),
                "-bind-to", "none", "-map-by", "slot", "-mca", "pml", "ob1", "-mca", "btl", "^openib",
                "-mca", "btl_tcp_if_include", self.hosts.iface,
                "-mca", "oob_tcp_if_include", self.hosts.iface,
                "-mca", "plm_rsh_args", f"-i {self.hosts.identity_file}",
                *[a for v in exported for a in ("-x", v)], *inner]

    def run(self, name: str, launcher: str, n: int, slots: int, inner: list[str],
            flags=(), env: dict[str, str] | None = None) -> util.Result:
        """One job: launcher ``horovodrun``/``horovodrun-gloo``/``mpirun`` started on host 1, or
        ``direct``: one process per rank in its host's namespace (env:// rendezvous at host 1).
        ``env``: extra variables for every rank (horovodrun forwards its whole environment)."""
        env = dict(env or {})
        log = self.work(name) / "output.log"
        head = self.hosts.hosts[0]
        nh.ensure_privsep_dir()  # another harness user may have removed it meanwhile
        try:
            if launcher == "direct":
                port = str(util.free_port())
                cmds, envs = [], []
                for rank in range(n * slots):
                    host = self.hosts.hosts[rank // slots]
                    cmds.append(self.hosts.cmd_in(host, inner))
                    envs.append(self.env(**env, RANK=str(rank), BENCH_RANK=str(rank),
                                         WORLD_SIZE=str(n * slots), LOCAL_RANK=str(rank % slots),
                                         LOCAL_WORLD_SIZE=str(slots),
                                         MASTER_ADDR=head.addr, MASTER_PORT=port,
                                         GLOO_SOCKET_IFNAME=self.hosts.iface))
                return util.run_parallel(cmds, envs, timeout=self.timeout, log=log)
            if launcher == "mpirun":
                cmd = self.mpirun(n, slots, inner, env)
            else:
                cmd = self.horovodrun(n, slots, inner, gloo=launcher == "horovodrun-gloo", flags=flags)
            return util.run(self.hosts.cmd_in(head, cmd), env=self.env(**env), timeout=self.timeout, log=log)
        finally:
            self.hosts.kill_strays()  # ranks on the other hosts are not in our process group

    def work(self, name: str) -> Path:
        path = self.out / "tmp" / "cluster" / name.replace("/", "_").replace(" ", "")
        path.mkdir(parents=True, exist_ok=True)
        return path

    # -- the link ------------------------------------------------------------------------------

    def probe(self) -> dict:
        """One TCP stream and its round trip, host 1 -> host 2."""
        a, b = self.hosts.hosts[:2]
        port = str(util.free_port())
        server = subprocess.Popen(self.hosts.cmd_in(b, [util.PY, "-m", "bench.workers.linkprobe", "server",
                                                        b.addr, port]), env=self.env(), cwd=util.REPO,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        try:
            res = util.run(self.hosts.cmd_in(a, [util.PY, "-m", "bench.workers.linkprobe", "client", b.addr,
                                                 port]),
                           env=self.env(), timeout=120)
            if not res.ok:
                return {"error": util.tail(res.output)}
            return json.loads(res.output.strip().splitlines()[-1])
        finally:
            util.kill_group(server)
            server.wait()
            self.hosts.kill_strays()

    # -- collectives ---------------------------------------------------------------------------

    def collective(self, cfg: ClusterConfig, impl_name: str, coll: Coll, n: int, slots: int = 1,
                   wrap: tuple[str, ...] = (), tag: str = "") -> dict:
        """One cell: ``coll`` on ``n`` hosts; ``wrap`` prefixes every rank's command (as ``nice``
        does), ``tag`` names that variant."""
        name = f"coll/{self.profile}/{impl_name}/h{n}x{slots}" + (f"/{tag}" if tag else "")
        work = self.work(name)
        res_path = work / "result.json"
        res_path.unlink(missing_ok=True)
        inner = [*wrap, util.PY, "-m", "bench.workers.coll_worker", "--impl", coll.worker,
                 "--sizes", ",".join(map(str, cfg.coll_sizes)), "--warmup", str(cfg.coll_warmup),
                 "--reps", str(cfg.coll_reps), "--budget", str(cfg.coll_budget_s),
                 "--out", str(res_path), "--count-iface", self.hosts.iface]
        util.say(f"{name} ...")
        res = self.run(name, coll.launcher, n, slots, inner, coll.flags, dict(coll.env))
        rec = {"profile": self.profile, "impl": impl_name, "hosts": n, "slots": slots, "ranks": n * slots,
               "launcher": coll.launcher, "formula": coll.formula, "flags": list(coll.flags),
               "env": dict(coll.env), "wrap": list(wrap), "ok": res.ok and res_path.exists(),
               "wall_seconds": round(res.seconds, 1)}
        if rec["ok"]:
            doc = util.read_json(res_path)
            rec["controller"] = doc["controller"]
            rec["rows"] = [enrich(row, coll.formula, n * slots, n, PROFILES[self.profile])
                           for row in doc["rows"]]
            big = rec["rows"][-1]
            util.say(f"{name}: {big['bytes'] >> 20} MiB in {big['seconds'] * 1e3:.0f} ms, busiest link "
                     f"{big['busiest_link_bytes'] / 2**20:.1f} MiB "
                     f"(formula {big['formula_link_bytes'] / 2**20:.1f})")
        else:
            rec["error"] = util.tail(res.output, 25)
            util.say(f"{name} FAILED; log: {work / 'output.log'}")
        return rec

    # -- training ------------------------------------------------------------------------------

    def train(self, cfg: ClusterConfig, run: TrainRun) -> dict:
        work = self.work(f"train/{run.name}")
        res_path = work / "result.json"
        res_path.unlink(missing_ok=True)
        module = "bench.workers.bigmodel_torch" if run.framework == "torch" else "bench.workers.bigmodel_tf"
        model = cfg.torch_model if run.framework == "torch" else cfg.tf_model
        batch = cfg.batch_size if run.framework == "torch" else cfg.tf_batch_size
        inner = [util.PY, "-m", module, "--wrapper", run.wrapper, "--model", model,
                 "--image-size", str(cfg.image_size), "--batch-size", str(batch),
                 "--warmup-steps", str(cfg.train_warmup), "--steps", str(cfg.train_steps),
                 "--out", str(res_path), *run.args]
        launcher = "horovodrun" if run.wrapper == "horovod" else "direct"
        util.say(f"{run.name} ...")
        res = self.run(f"train/{run.name}", launcher, run.hosts, run.slots, inner, run.flags, dict(run.env))
        rec = {"name": run.name, **asdict(run), "flags": list(run.flags), "args": list(run.args),
               "env": dict(run.env), "model": model,
               "ok": res.ok and res_path.exists(), "wall_seconds": round(res.seconds, 1)}
        if rec["ok"]:
            rec["result"] = util.read_json(res_path)
            util.say(f"{run.name}: {rec['result']['seconds_per_step']:.2f} s/step, "
                     f"{rec['result']['images_per_second']:.1f} img/s, {res.seconds:.0f}s wall")
        else:
            rec["error"] = util.tail(res.output, 25)
            util.say(f"{run.name} FAILED; log: {work / 'output.log'}")
        return rec


def enrich(row: dict, formula: str, ranks: int, hosts: int, profile: Profile) -> dict:
    """Add the link accounting to one size's row: busiest link (counted) against the formula,
    and the time against the formula at the profile's rate."""
    k, t = row["bytes"], row["seconds"]
    link = costmodel.busiest_link(row.pop("link_bytes_per_rank"))  # per rank; kept per host below
    row.update(hosts_seen=link["hosts_seen"], busiest_link_bytes=link["busiest_bytes"],
               per_host_link_bytes=link["per_host"],
               formula_link_bytes=costmodel.formula_link_bytes(formula, k, ranks, hosts),
               busbw=costmodel.ring_link_bytes(k, ranks) / t,
               busiest_link_bytes_per_s=link["busiest_bytes"] / t)
    if profile.rate_bit:
        rate = profile.rate_bit / 8
        row["formula_seconds"] = costmodel.formula_seconds(formula, k, ranks, hosts, rate)
        row["busbw_of_link"] = row["busbw"] / rate
    return row


def shipped_flags(hosts: int) -> tuple[str, ...]:
    """The controller flag ``python -m launch.horovodrun`` adds for a job on ``hosts`` hosts
    (``--gloo`` across hosts): the "default" Horovod cells run as users' jobs do; the "mpi" cells
    keep horovodrun's own default."""
    argv, _ = with_controller(["-H", ",".join(f"h{i}:1" for i in range(hosts)), "python"])
    return tuple(argv[:argv.index("-H")])


def plan_training(cfg: ClusterConfig, profile: str) -> list[TrainRun]:
    runs: list[TrainRun] = []
    hosts = cfg.train_hosts.get(profile, [])
    multi = [n for n in hosts if n > 1]
    if profile == "unshaped":  # nothing here crosses a link: measured once
        if 1 in hosts:
            runs.append(TrainRun("torch", "none", 1, profile))
        runs += [TrainRun("torch", "alone", n, profile) for n in multi]
    for n in multi:
        flags = shipped_flags(n)
        runs.append(TrainRun("torch", "horovod", n, profile, flags=flags))
        if flags and not cfg.quick:
            runs.append(TrainRun("torch", "horovod", n, profile, variant="mpi"))
        if cfg.ddp:
            runs.append(TrainRun("torch", "ddp", n, profile))
    if profile == cfg.knob_profile:
        n, ring = cfg.knob_hosts, tuple(RING.items())
        runs += [TrainRun("torch", "horovod", n, profile, variant="mpi-ring", env=ring),
                 TrainRun("torch", "horovod", n, profile, variant="mpi-ring+fp16", env=ring,
                          args=("--fp16",)),
                 TrainRun("torch", "horovod", n, profile, variant="mpi-ring+fusion-0", env=ring,
                          flags=("--fusion-threshold-mb", "0")),
                 TrainRun("torch", "horovod", n, profile, variant="mpi-ring+cycle-10ms", env=ring,
                          flags=("--cycle-time-ms", "10")),
                 TrainRun("torch", "horovod", n, profile, variant="mpi-ring+cycle-0.3ms", env=ring,
                          flags=("--cycle-time-ms", "0.3")),
                 TrainRun("torch", "horovod", n // 2, profile, slots=2, variant="mpi-ring", env=ring),
                 TrainRun("torch", "horovod", n // 2, profile, slots=2, variant="mpi-ring+hierarchical",
                          env=ring, flags=("--hierarchical-allreduce",))]
        if cfg.ddp:
            runs.append(TrainRun("torch", "ddp", n, profile, variant="fp16", args=("--fp16",)))
    if cfg.tf_model:
        tf_multi = [n for n in cfg.tf_hosts.get(profile, []) if n > 1]
        if profile == "unshaped":
            if 1 in cfg.tf_hosts.get(profile, []):
                runs.append(TrainRun("tf", "none", 1, profile))
            runs += [TrainRun("tf", "alone", n, profile) for n in cfg.tf_alone_hosts]
        runs += [TrainRun("tf", "horovod", n, profile, flags=shipped_flags(n)) for n in tf_multi]
        if profile == cfg.knob_profile:  # horovodrun's own default (MPI), where it differs
            runs += [TrainRun("tf", "horovod", n, profile, variant="mpi")
                     for n in tf_multi[:1] if shipped_flags(n)]
    return runs


def count_parameters(models: tuple[str, ...] = ("resnet18", "resnet50", "resnet101", "vgg16")) -> dict:
    """Trainable parameters of torchvision's ImageNet models (in a child process: the bench
    driver does not import the frameworks; on the meta device: shapes only, no memory, no init)."""
    code = ("import json, torch, torchvision\n"
            "with torch.device('meta'):\n"
            "    print(json.dumps({m: sum(p.numel() for p in getattr(torchvision.models, m)().parameters())\n"
            f"                      for m in {list(models)!r}}}))")
    res = util.run([util.PY, "-c", code], timeout=300)
    return json.loads(res.output.strip().splitlines()[-1]) if res.ok else {"error": util.tail(res.output)}


def hosts_needed(cfg: ClusterConfig) -> int:
    """The most hosts any cell of ``cfg`` runs on."""
    counts = [*cfg.hier_hosts, *(n for ns in cfg.coll_hosts.values() for n in ns),
              *(n for ns in cfg.train_hosts.values() for n in ns), cfg.knob_hosts if cfg.knob_profile else 1]
    if cfg.tf_model:
        counts += [*cfg.tf_alone_hosts, *(n for ns in cfg.tf_hosts.values() for n in ns)]
    return max(counts, default=1)


def merge_rerun(part: dict, rerun: dict, command: str) -> dict:
    """``part`` (a whole cluster part) with the records of the cells ``rerun`` measured again
    (``--cells``) in place of its own; everything else stays as measured, and when and how the
    rerun ran (its time, machine, load, link probes, config) is kept in ``reruns``."""
    cells = rerun["config"]["cells"]
    merged = dict(part)
    if "collectives" in cells:
        merged["collectives"] = rerun["collectives"]
    merged["training"] = [r for r in part["training"] if r["framework"] not in cells] + rerun["training"]
    merged["quick"] = bool(part.get("quick") or rerun.get("quick"))
    merged["reruns"] = [*part.get("reruns", []), {
        "cells": cells, "command": command, **{k: rerun.get(k) for k in (
            "started", "duration_s", "machine", "profiles", "config", "netem_missing")}}]
    return merged


def run_part(cfg: ClusterConfig, out: Path) -> dict:
    if hosts_needed(cfg) > cfg.hosts:
        raise ValueError(f"cluster config: a cell needs {hosts_needed(cfg)} hosts, {cfg.hosts} are made")
    reason = nh.why_unavailable()
    if reason:
        util.say(f"cluster: skipped: {reason}")
        return {"skipped": reason, "config": cfg.to_dict()}
    netem = nh.netem_missing()
    data: dict = {"config": cfg.to_dict(), "hosts": cfg.hosts, "iface": IFACE, "netem_missing": netem,
                  "profiles": {}, "collectives": [], "training": [],
                  "models": count_parameters(), "tcp_payload_fraction": costmodel.TCP_PAYLOAD_FRACTION}
    names = [f"{PREFIX}h{i}" for i in range(1, cfg.hosts + 1)]
    t0 = time.perf_counter()
    with util.terminate_as_exit(), nh.make_hosts(names, prefix=PREFIX, subnet=SUBNET, iface=IFACE,
                                                    hostnames=True) as hosts:
        util.say(f"cluster: {cfg.hosts} hosts up ({', '.join(h.netns for h in hosts.hosts)}, "
                 f"bridge in {hosts.switch})")
        cl = Cluster(hosts, out, cfg.timeout_s)
        for profile in ["unshaped", *cfg.profiles]:
            prof = PROFILES[profile]
            applied = None
            if prof.rate_bit:
                delay = 0.0 if netem else prof.delay_s
                applied = nh.LinkShape(prof.rate_bit, delay)
                hosts.shape(applied)
            else:
                hosts.unshape()
            cl.profile = profile
            probe = cl.probe()
            data["profiles"][profile] = {
                "label": applied.describe() if applied else prof.label, "requested": prof.label,
                "rate_bit": prof.rate_bit, "delay_s_requested": prof.delay_s,
                "delay_s_applied": applied.delay_s if applied else 0.0,
                "burst_bytes": applied.burst_bytes if applied else None, "probe": probe}
            util.say(f"cluster: profile {profile}: one TCP stream "
                     f"{probe.get('stream_bytes_per_s', 0) / 1e6:.0f} MB/s, round trip "
                     f"{probe.get('rtt_s', 0) * 1e6:.0f} us")
            for n in cfg.coll_hosts.get(profile, []):
                for impl in cfg.coll_impls:
                    data["collectives"].append(cl.collective(cfg, impl, COLLECTIVES[impl], n))
            if profile == "1g":
                for n in cfg.hier_hosts:
                    for impl, coll in HIERARCHICAL.items():
                        data["collectives"].append(cl.collective(cfg, impl, coll, n, slots=2))
            for run in plan_training(cfg, profile):
                data["training"].append(cl.train(cfg, run))
    data["duration_s"] = time.perf_counter() - t0
    return data
