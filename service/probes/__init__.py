"""Probe runs of registered models: the model registry (``registry``), the runs, one at a time
per GPU in a child process (``runs``, ``children``), and ``/v1/probes`` (``routes``)."""
