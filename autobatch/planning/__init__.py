"""Planning, PURE: numbers in, Plan out (no torch, no pynvml).

``planner`` splits an effective batch into micro-batches and accumulation steps; ``limits``
resolves what a plan's limit is (a number, a profile, a memory line and a capacity); ``splits`` is
the search over splits; ``prediction`` predicts the largest micro-batch past what was measured.
"""
