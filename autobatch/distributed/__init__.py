"""Distributed: the model's parallel layout (``layout``), the probe's consensus across ranks
(``consensus``), and the fake backend a probe's steps run their collectives on (``fake_backend``).
"""
