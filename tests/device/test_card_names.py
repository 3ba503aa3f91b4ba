"""One card whatever its name's form (device.card_names): NVML, GFD labels, catalogue, MIG."""

from __future__ import annotations

import pytest

from autobatch.device import card_key, same_card
from autobatch.errors import ConfigError

H100_KEY = "h100-80gb-hbm3"
SLICE_KEY = "h100-80gb-hbm3-mig-1g.10gb"


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA H100 80GB HBM3",  # NVML
        "NVIDIA-H100-80GB-HBM3",  # nvidia.com/gpu.product
        "NVIDIA-H100-80GB-HBM3-SHARED",  # the device plugin shares it: same card
        "H100 80GB HBM3",  # a catalogue's, without the vendor
        "H100-80GB-HBM3",
        "  nvidia h100_80gb  HBM3 ",
    ],
)
def test_every_form_of_a_whole_cards_name_is_one_key(name: str) -> None:
    assert card_key(name) == H100_KEY


@pytest.mark.parametrize(
    ("name", "mig_profile"),
    [
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None),  # NVML's name of a MIG instance
        ("NVIDIA-H100-80GB-HBM3-MIG-1g.10gb", None),  # GFD, single strategy or read_node_labels
        ("H100-80GB-HBM3-MIG-1G.10GB", None),
        ("NVIDIA H100 80GB HBM3", "1g.10gb"),  # the whole card's name, the slice apart
        ("NVIDIA-H100-80GB-HBM3", "1G.10GB"),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "1g.10gb"),  # said twice, the same
    ],
)
def test_every_form_of_a_mig_slices_name_is_one_key(name: str, mig_profile: str | None) -> None:
    assert card_key(name, mig_profile) == SLICE_KEY


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3"),  # another H100
        ("NVIDIA H100 NVL", "NVIDIA-H100-80GB-HBM3"),
        ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB"),
        ("NVIDIA A100 80GB PCIe", "NVIDIA A100-SXM4-80GB"),
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3 MIG 1g.10gb"),  # a card and its slice
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA H100 80GB HBM3 MIG 2g.20gb"),
        ("NVIDIA L40S", "NVIDIA-H100-80GB-HBM3"),
        ("", "NVIDIA"),  # no card is no card's
    ],
)
def test_different_cards_are_not_the_same_card(first: str, second: str) -> None:
    assert not same_card(first, second)


def test_same_card_across_forms() -> None:
    assert same_card("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "A100-SXM4-40GB-MIG-1g.5gb")
    assert same_card("Tesla V100-SXM2-16GB", "Tesla-V100-SXM2-16GB")
    assert card_key("cpu") == "cpu"


def test_a_name_without_a_card_or_with_two_mig_profiles_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"card name 'NVIDIA' names no card.*H100"):
        card_key("NVIDIA")
    with pytest.raises(ConfigError, match="names no card"):
        card_key("  ")
    with pytest.raises(
        ConfigError, match=r"names MIG profile '1g\.10gb', but mig_profile is '2g\.20gb'"
    ):
        card_key("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "2g.20gb")
