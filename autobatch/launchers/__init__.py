"""How many ranks train, read from what the launcher set in the environment, before any process
group exists: torchrun (and ``accelerate launch``, which runs it), Kubeflow's PyTorchJob and
TrainJob, Slurm's ``srun``/``sbatch``, the DeepSpeed launcher, and ``mpirun`` (Open MPI, MPICH,
Intel MPI, MVAPICH). docs/launchers.md lists, per launcher, which variables are read.

The innermost launcher decides: a process torchrun started inside a Slurm task or a Kubeflow pod
reads torchrun's variables, which count the processes it really started. A Slurm step's own
variables (``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_STEP_NUM_NODES``) come
before the allocation's (``SLURM_NTASKS``, ``SLURM_NTASKS_PER_NODE``...): ``srun --ntasks=1``
inside ``sbatch --ntasks-per-node=8`` starts one task per node, whatever the allocation asked.
Where two launchers' variables disagree (an MPI launcher's ``PMI_*``/``OMPI_*``/``MV2_*``/``PMIX_*``
or torchrun's or a Kubeflow pod's against the Slurm step they run in, torchrun's against an
MPI launcher's, a rank beyond the ranks its own reading counts),
:class:`~autobatch.errors.ConfigError` names the variables, their values and the fix (a
:class:`~autobatch.errors.Remedy` for ``world_size``, which each surface words: ``world_size=N``
in Python, ``--world-size N`` on the command line), never a silent guess; where a launcher's
documented semantics settle it (Kubeflow's ``WORLD_SIZE`` counts pods), the reading says why it
chose.

Pure: a mapping of variables in, a :class:`LauncherLayout` out; imports neither torch nor pynvml.
The readings live in ``_layout`` (each launcher, and the rule that picks one), ``_slurm`` (a
Slurm step's tasks and GPUs) and ``_common`` (the layout and what every reading shares).

Example::

    layout = launcher_layout(os.environ)
    if layout is not None:
        layout.world_size, layout.source   # (16, "Slurm job 908: 2 tasks x 8 GPUs per task ...")
"""

from __future__ import annotations

from autobatch.launchers._common import LauncherLayout, SlurmTaskRanks
from autobatch.launchers._layout import launcher_layout

__all__ = ["LauncherLayout", "SlurmTaskRanks", "launcher_layout"]
