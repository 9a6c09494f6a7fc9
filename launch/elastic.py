"""What an elastic job needs beyond a fixed-size one, independent of the framework.

Horovod's elastic mode (``horovodrun --min-np/--max-np --host-discovery-script``) restarts the
training function whenever workers leave or join.  The trainer must then know three things that a
fixed job gets for free: that it really runs under an elastic launcher, where in the epoch the job
is (one integer, see :func:`launch.sharding.remaining_shard`), and the LR for the new world size.
"""

from __future__ import annotations

import os

from launch.errors import UserError

LAUNCH_HINT = ("horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script "
               "launch/discover_hosts.sh python -m launch.torch_mnist --elastic")


def launched_elastic() -> bool:
    """horovodrun's elastic driver marks every worker it starts (``HOROVOD_ELASTIC=1``)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def check_launcher(elastic_flag: bool) -> None:
    """Refuse a mismatch between the trainer's mode and the launcher's, before ``hvd.init()``.

    Without ``--elastic`` under an elastic launcher, a lost worker would kill the job instead of
    shrinking it; with ``--elastic`` under a fixed launcher there is no driver to rejoin.
    """
    if elastic_flag and not launched_elastic():
        raise UserError(f"--elastic needs horovodrun's elastic mode, e.g. {LAUNCH_HINT}")
    if launched_elastic() and not elastic_flag:
        raise UserError("horovodrun started this job in elastic mode (--min-np/--max-np/"
                        "--host-discovery-script); add --elastic to the trainer's flags")


def epoch_progress(epoch: int, consumed: int, num_samples: int) -> float:
    """Fractional epochs done, by samples consumed: the LR schedule's clock, which does not care
    how many workers consumed them."""
    return epoch - 1 + consumed / num_samples
