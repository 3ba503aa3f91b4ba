"""The name of the machine a probe runs on, as the cluster knows it.

A profile records it (``Profile.node_name``) so that a fleet's shared store can say where each
measurement was made, and a central service can answer for a node. Read from the environment,
first set and non-empty wins:

1. ``AUTOBATCH_NODE_NAME``: set by the user or a manifest;
2. ``NODE_NAME``: the conventional name for Kubernetes' downward API
   (``valueFrom.fieldRef.fieldPath: spec.nodeName``);
3. ``SLURMD_NODENAME``: set by Slurm in a job's environment;
4. else the host name (``socket.gethostname()``), which inside a pod is the pod's name.

Example::

    from autobatch.device._node import node_name

    node_name()   # "gpu-node-17"
"""

from __future__ import annotations

import os
import socket

__all__ = ["NODE_NAME_ENV_VARS", "node_name"]

NODE_NAME_ENV_VARS = ("AUTOBATCH_NODE_NAME", "NODE_NAME", "SLURMD_NODENAME")
"""Environment variables read, in order, before falling back to the host name."""


def node_name() -> str:
    """The node this process runs on: the first set variable of :data:`NODE_NAME_ENV_VARS`
    (stripped), else ``socket.gethostname()``."""
    for var in NODE_NAME_ENV_VARS:
        value = os.environ.get(var, "").strip()
        if value:
            return value
    return socket.gethostname()
