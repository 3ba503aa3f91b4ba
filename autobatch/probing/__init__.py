"""Probing: the largest micro-batch whose whole training step fits, in few real trials.

``probe`` runs the search over real trials (``trials``, steered by the pure ``search``), after an
estimate on fake tensors (``estimate``); ``step`` and ``batch`` say how a sample becomes a step;
``snapshot`` leaves no trace; ``identity`` is what a profile is stored under.
"""
