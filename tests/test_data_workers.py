"""PyTorch's DataLoader workers for streamed data are forks of a server that holds PyTorch.

Each worker that imports PyTorch itself costs seconds of CPU and hundreds of MiB of private memory
(bench/parts/owndata.py measures it); forked from a server that already imported it, the pages are
shared.  Checked through the trainers' own loader (``torch_models.data.Streamed``) in a separate
process: a worker reports its parent, and the parent must have PyTorch's library mapped.
"""

from __future__ import annotations

import sys

import pytest
from conftest import run

PROBE = r"""
import argparse, os
import numpy as np
import torch
from torch_models.data import Streamed


class Parent(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([float(os.getppid())]), 0, -1


def main():
    args = argparse.Namespace(batch_size=2, workers=1)
    data = Streamed(None, Parent(), Parent(), reload=None, args=args, device=torch.device("cpu"),
                    local_size=1)
    x, _ = next(data.epoch([np.array([0, 1])]))
    server = int(x[0, 0])
    assert server != os.getpid(), "the worker is not a fork server's child"
    maps = open(f"/proc/{server}/maps").read()
    print("server holds torch:", "libtorch_cpu" in maps, "; rank pid", os.getpid(), "server", server)


if __name__ == "__main__":
    main()
"""


@pytest.mark.timeout(180)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_are_forked_from_a_server_holding_torch(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc = run([sys.executable, str(script)], timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "server holds torch: True" in proc.stdout, proc.stdout + proc.stderr[-2000:]
