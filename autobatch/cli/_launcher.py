"""``autobatch launcher``: the ranks the launcher's environment describes, printed; the Slurm
TaskProlog plans with its ``--world-size`` so that the prolog and the library read one rule.

Example::

    autobatch launcher                           # 16 ranks: Slurm job 908: 2 tasks x 8 GPUs ...
    autobatch launcher --slurm-task-ranks gpus --world-size     # 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import TextIO

from autobatch.launchers import LauncherLayout, launcher_layout
from autobatch.units import counted


def run_launcher(args: argparse.Namespace, out: TextIO) -> int:
    """Print this process's launcher layout (no launcher: one process).

    Raises:
        ConfigError: the launcher's variables disagree (named, with the fix).
    """
    layout = launcher_layout(os.environ, slurm_task_ranks=args.slurm_task_ranks) or ONE_PROCESS
    if args.world_size:
        print(layout.world_size, file=out)
    elif args.json:
        print(json.dumps(dataclasses.asdict(layout)), file=out)
    else:
        print(f"{counted(layout.world_size, 'rank')}: {layout.source}", file=out)
    return 0


ONE_PROCESS = LauncherLayout(
    world_size=1,
    nodes=1,
    ranks_per_node=1,
    rank=0,
    local_rank=0,
    source="one process (no launcher's variables)",
)
"""The layout outside any launcher: this process, rank 0 of 1 (text and --json alike)."""
