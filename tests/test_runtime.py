"""Per-process settings made before ``hvd.init()``."""

from __future__ import annotations

import pytest

from ringtrain import runtime
from ringtrain.errors import UserError


def test_mpi_yields_when_ranks_fill_the_cores(monkeypatch):
    monkeypatch.setattr(runtime, "available_cores", lambda: 2)
    for local_size in ("2", "4"):
        env = {"OMPI_COMM_WORLD_LOCAL_SIZE": local_size}
        runtime.configure_mpi_progress(env)
        assert env["OMPI_MCA_mpi_yield_when_idle"] == "1"


def test_mpi_yields_under_srun_which_sets_no_open_mpi_rank_variables(monkeypatch):
    """srun --mpi=pmix (docs/clusters.md's Slurm script) starts the ranks itself: the count
    comes from Slurm."""
    monkeypatch.setattr(runtime, "available_cores", lambda: 2)
    for per_node, node_id, yields in (("2", "0", True), ("1(x2)", "1", False), ("1,3(x2)", "2", True),
                                      ("4(x2)", "5", False), ("garbage", "0", False)):
        env = {"SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_NODEID": node_id}
        runtime.configure_mpi_progress(env)
        assert ("OMPI_MCA_mpi_yield_when_idle" in env) == yields, (per_node, node_id)


def test_mpi_keeps_polling_with_spare_cores_or_without_mpirun(monkeypatch):
    monkeypatch.setattr(runtime, "available_cores", lambda: 8)
    env = {"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    runtime.configure_mpi_progress(env)
    assert "OMPI_MCA_mpi_yield_when_idle" not in env
    env = {}  # plain python, or horovodrun --gloo: no Open MPI rank environment
    runtime.configure_mpi_progress(env)
    assert env == {}


def test_users_mpi_setting_wins(monkeypatch):
    monkeypatch.setattr(runtime, "available_cores", lambda: 2)
    env = {"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_mpi_yield_when_idle": "0"}
    runtime.configure_mpi_progress(env)
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "0"


def test_threads_split_the_hosts_cores_unless_omp_num_threads_says(monkeypatch):
    monkeypatch.setattr(runtime, "available_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [runtime.threads_per_rank(n) for n in (1, 2, 4, 16)] == [8, 4, 2, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert runtime.threads_per_rank(4) == 3
    for unusable in ("0", "two", ""):
        monkeypatch.setenv("OMP_NUM_THREADS", unusable)
        assert runtime.threads_per_rank(4) == 2


# --- Gloo's address, checked before hvd.init() (tests/test_unresolvable_host.py runs it for real) ---

UNRESOLVABLE = "rt-no-such-host.invalid"  # .invalid never resolves (RFC 2606)


@pytest.fixture
def unresolvable_hostname(monkeypatch):
    monkeypatch.setattr(runtime.socket, "gethostname", lambda: UNRESOLVABLE)


def test_gloo_job_on_a_host_whose_name_does_not_resolve_gets_the_fix(unresolvable_hostname):
    for env in ({"HOROVOD_CONTROLLER": "gloo"}, {"HOROVOD_CPU_OPERATIONS": "GLOO"}):
        with pytest.raises(UserError) as err:
            runtime.check_gloo_address(env)
        message = str(err.value)
        assert f"'{UNRESOLVABLE}' does not resolve" in message
        assert f"127.0.1.1 {UNRESOLVABLE}" in message and "HOROVOD_GLOO_IFACE" in message
        assert "\n" not in message


def test_mpi_jobs_and_named_interfaces_do_not_need_the_hostname(unresolvable_hostname):
    runtime.check_gloo_address({})  # MPI controller: Gloo never starts
    runtime.check_gloo_address({"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "mpi"})
    # horovodrun --gloo names the interface; Gloo then binds to it, not to the host's name
    runtime.check_gloo_address({"HOROVOD_CONTROLLER": "gloo", "HOROVOD_GLOO_IFACE": "lo"})


def test_gloo_interface_that_is_not_there_is_named_with_the_ones_that_are():
    with pytest.raises(UserError) as err:
        runtime.check_gloo_address({"HOROVOD_CONTROLLER": "gloo", "HOROVOD_GLOO_IFACE": "rtnosuch0"})
    assert "HOROVOD_GLOO_IFACE=rtnosuch0: there is no such network interface" in str(err.value)
    assert "lo" in str(err.value).split("it has: ")[1]


def test_loopback_has_an_address_and_a_missing_interface_has_none():
    assert runtime.interface_has_address("lo")
    assert not runtime.interface_has_address("rtnosuch0")


def test_resolvable_hostname_passes(monkeypatch):
    monkeypatch.setattr(runtime.socket, "gethostname", lambda: "localhost")
    runtime.check_gloo_address({"HOROVOD_CONTROLLER": "gloo"})
