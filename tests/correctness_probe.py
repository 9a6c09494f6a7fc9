"""Run several trainer configurations inside ONE launched job (used by test_correctness.py).

Starting ``horovodrun`` and importing TensorFlow or PyTorch costs far more than the few training
steps each invariant needs, so the correctness suite groups its runs by (framework, world size,
launcher) and this script runs a group's runs one after another in the same processes.  Each run
is the real trainer's way in, ``registry.train(framework, args)``, parsed from the same flags
users type, with its own checkpoint folder and metrics file.

    horovodrun -np 2 python tests/correctness_probe.py torch plan.json

``plan.json`` holds ``[{"args": [...], "seed_from": "folder or null"}, ...]``; a run with a
``seed_from`` first gets the newest checkpoint of that folder copied into its ``--checkpoint-dir``
(by rank 0, before any rank reads it: the copy comes before the run's first collective; a
pipeline's checkpoint is one file per stage, all copied), so a resumed run can start from an
earlier run's output, in this group or another.  Runs of one launch share one pipeline layout
(Horovod's process sets are fixed when it is first initialised in the process).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch import cli  # noqa: E402
from ringtrain.errors import launcher_rank  # noqa: E402
from ringtrain.strategies import registry  # noqa: E402


def main(framework: str, plan_path: str) -> int:
    for run in json.loads(Path(plan_path).read_text()):
        args = cli.parse(framework, run["args"])
        if run.get("seed_from") and launcher_rank() == 0:
            newest = sorted(Path(run["seed_from"]).glob("ckpt-epoch*.*"))[-1].name[:len("ckpt-epoch0000")]
            dest = Path(args.checkpoint_dir)
            dest.mkdir(parents=True, exist_ok=True)
            for path in Path(run["seed_from"]).glob(f"{newest}*"):
                shutil.copy(path, dest / path.name)
        registry.train(framework, args, own_signals=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
