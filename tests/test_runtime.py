"""Per-process settings made before ``hvd.init()``."""

from __future__ import annotations

from launch import runtime


def test_mpi_yields_when_ranks_fill_the_cores(monkeypatch):
    monkeypatch.setattr(runtime, "available_cores", lambda: 2)
    for local_size in ("2", "4"):
        env = {"OMPI_COMM_WORLD_LOCAL_SIZE": local_size}
        runtime.configure_mpi_progress(env)
        assert env["OMPI_MCA_mpi_yield_when_idle"] == "1"


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
