"""Training: the Accumulator (gradient accumulation with an exact gradient), run-time OOM
splitting (``oom_split``), and the window agreement that carries one rank's error to the others.
"""
