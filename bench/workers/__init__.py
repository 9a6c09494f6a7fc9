"""The programs the parts launch, each ``python -m bench.workers.NAME``: one rank under
``horovodrun``, ``mpirun`` or ``torchrun`` (the loops, ``coll_worker``, ``fusion_worker``,
``wait_worker``, ``bigmodel_torch``/``bigmodel_tf``), a wrapper around one rank (``rankexec``,
``memlimit``, ``straggler``) or one process (``decodecost``, ``linkprobe``), and the helpers only
they import (``loopcommon``, ``bigmodel``, ``loopcounters``, ``procs``)."""
