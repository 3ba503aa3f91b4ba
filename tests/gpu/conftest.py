"""Skips ``gpu``-marked tests when torch sees no CUDA device (CPU CI, this laptop)."""

from __future__ import annotations

import pytest
import torch


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    num_needed = int(marker.kwargs.get("num_devices", 1))
    num_devices = torch.cuda.device_count()
    if num_devices < num_needed:
        pytest.skip(
            f"needs {num_needed} CUDA device(s); torch.cuda.device_count() == {num_devices}"
        )
