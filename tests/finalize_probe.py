"""Run by tests/test_faults.py under ``mpirun --enable-recovery -np 2``: rank 0 has "lost" rank 1
(:func:`ringtrain.strategies.ps.transport.bound_finalize_after_losing`, with a grace of argv[1] s) and
exits; rank 1 never calls MPI_Finalize and leaves only once rank 0's process is gone.  Rank 0's
MPI_Finalize would wait for rank 1 for ever (the fence at its end), so the job ends only if that
wait is bounded."""

import os
import sys
import time

from mpi4py import MPI

from ringtrain.strategies.ps import transport as ps_mpi

grace = float(sys.argv[1])
comm = MPI.COMM_WORLD
pids = comm.allgather(os.getpid())
if comm.Get_rank() == 0:
    ps_mpi.bound_finalize_after_losing(grace)
    print("rank 0 done", flush=True)
else:
    while True:  # rank 0's pid alive (a rank of the same host)
        try:
            os.kill(pids[0], 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    print("rank 1 saw rank 0 leave", flush=True)
    os._exit(0)
