"""Worst-case probe samples, the profile's record of their load, the CLI's default sequence length,
and the store learning a size from a split in training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autobatch import autotune, probe
from autobatch.cli import build_parser
from autobatch.device._simulated import SimulatedDevice
from autobatch.errors import ConfigError
from autobatch.models._zoo import load_model
from autobatch.probing._worst_case import worst_case_sample
from autobatch.store._store import ProfileStore
from autobatch.training._oom_split import SplitEvent
from autobatch.tuning import split_recorder

Item = dict[str, torch.Tensor]


def items(lengths: list[int]) -> list[Item]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 50, (n,), generator=g)} for n in lengths]


def pad(batch: list[Item]) -> dict[str, torch.Tensor]:
    longest = max(len(item["input_ids"]) for item in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, item in enumerate(batch):
        ids[row, : len(item["input_ids"])] = item["input_ids"]
    return {"input_ids": ids}


def length(item: Item) -> int:
    return len(item["input_ids"])


LENGTHS = [5, 40, 7, 12, 40, 3, 33, 9, 18, 21]


def test_the_sample_is_made_of_the_heaviest_items_in_turn() -> None:
    dataset = items(LENGTHS)
    sample = worst_case_sample(dataset, key=length, collate_fn=pad, num_items=3)

    assert sample.load == 40 and sample.num_scanned == 10
    assert [length(i) for i in sample.items] == [40, 40, 33]
    assert sample.items[0] is dataset[1] and sample.items[1] is dataset[4]  # ties: first first
    batch = sample(5)
    assert batch["input_ids"].shape == (5, 40)
    # Rows cycle through the kept items: 40, 40, 33, 40, 40.
    torch.testing.assert_close(batch["input_ids"][3, :40], dataset[1]["input_ids"])
    torch.testing.assert_close(batch["input_ids"][2, :33], dataset[6]["input_ids"])
    assert "length = 40 (the largest of 10 items; 3 heaviest kept)" in sample.describe()


def test_a_percentile_leaves_out_the_longest_items() -> None:
    sample = worst_case_sample(items(LENGTHS), key=length, collate_fn=pad, percentile=80)
    # Nearest rank: the 8th of 10 sorted loads (3 5 7 9 12 18 21 33 40 40) is 33.
    assert sample.load == 33
    assert [length(i) for i in sample.items] == [33, 21, 18, 12, 9, 7, 5, 3]
    assert "percentile 80" in sample.describe()


def test_default_key_and_collate_on_plain_tensors() -> None:
    sample = worst_case_sample([torch.ones(n) for n in (2, 6, 4)], num_items=1)
    assert sample.key_name == "len" and sample.load == 6
    assert sample(3).shape == (3, 6)


@pytest.mark.parametrize(
    ("args", "kw", "match"),
    [
        ([], {}, "dataset is empty"),
        ([1, 2], {"percentile": 0}, r"percentile must be in \(0, 100\], got 0"),
        ([1, 2], {"percentile": 101}, r"percentile must be in \(0, 100\], got 101"),
        ([1, 2], {"percentile": True}, r"percentile must be in \(0, 100\], got True"),
        ([1, 2], {"num_items": 0}, "num_items must be an int >= 1, got 0"),
        ([1, 2], {"key": str}, "key str returned '1' for item 0"),
        ([1, 2], {"key": lambda x: float("nan")}, "returned nan for item 0"),
    ],
)
def test_bad_input_is_named(args: list[Any], kw: dict[str, Any], match: str) -> None:
    kw.setdefault("key", lambda x: x)
    with pytest.raises(ConfigError, match=match):
        worst_case_sample(args, **kw)


def test_len_of_a_dict_item_is_refused_not_taken_for_its_length() -> None:
    with pytest.raises(ConfigError, match=r"item 0 is a dict, whose len\(\) counts its fields"):
        worst_case_sample(items([3, 9]), collate_fn=pad)


def test_len_of_a_tuple_item_is_refused_not_taken_for_its_length() -> None:
    # A TensorDataset's item is (input, target): len() is 2 for every item, so the "heaviest"
    # would be the first ones whatever their length.
    x = torch.nn.utils.rnn.pad_sequence([torch.ones(n) for n in (2, 9, 4)], batch_first=True)
    dataset = torch.utils.data.TensorDataset(x, torch.zeros(3))
    with pytest.raises(
        ConfigError, match=r"item 0 is a tuple, whose len\(\) counts its fields .* key=lambda item"
    ):
        worst_case_sample(dataset)
    # A list of token ids is a sequence: its len is its length.
    assert worst_case_sample([[1, 2], [1, 2, 3, 4], [5]], key=len, num_items=1).load == 4


def test_an_iterable_dataset_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"not map-style .* list\(itertools.islice"):
        worst_case_sample(iter([1, 2]), key=lambda x: x)  # type: ignore[arg-type]


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 16)
        self.out = nn.Linear(16, 50)

    def forward(self, input_ids: torch.Tensor) -> Any:
        logits = self.out(torch.tanh(self.embed(input_ids)))
        return F.cross_entropy(logits.flatten(0, 1), input_ids.flatten())


def test_the_profile_records_the_load_it_was_measured_at() -> None:
    sample = worst_case_sample(items(LENGTHS), key=length, collate_fn=pad)
    profile = probe(
        TokenModel(),
        sample,
        loss_fn=lambda loss, batch: loss,
        device=SimulatedDevice(capacity_bytes=2**30),
        max_micro_batch_size=4,
    )
    assert profile.input_shape == {"input_ids": (40,)}  # probed at the longest sequence
    assert any("worst-case load: length = 40" in note for note in profile.notes)


def test_cli_seq_len_defaults_to_the_models_maximum() -> None:
    args = build_parser().parse_args(["tune", "gpt2-tiny", "--effective-batch-size", "8"])
    assert args.seq_len is None
    assert load_model("gpt2-tiny").sample["input_ids"].shape == (1, 1024)  # n_positions
    assert load_model("gpt2-tiny", seq_len=32).sample["input_ids"].shape == (1, 32)
    with pytest.raises(ConfigError, match="seq_len 2000 must be in 1..1024"):
        load_model("gpt2-tiny", seq_len=2000)


def test_split_recorder_makes_the_next_autotune_start_from_what_fitted(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
    sample = (torch.randn(2, 64), torch.randint(0, 10, (2,)))
    device = SimulatedDevice(capacity_bytes=6 * 2**20)
    store = tmp_path / "profiles.sqlite3"
    kw: dict[str, Any] = {"loss_fn": F.cross_entropy, "device": device, "store": store}
    first = autotune(model, sample, effective_batch_size=1000, **kw)
    assert first.source == "measured" and first.micro_batch_size > 5

    record = split_recorder(model, sample, **kw)
    record(
        SplitEvent(
            window_index=3,
            micro_step_index=1,
            old_micro_batch_size=first.micro_batch_size,
            new_micro_batch_size=5,
            phase="backward",
            reason="CUDA out of memory. Tried to allocate 20.00 MiB",
        )
    )
    record(  # a larger size than stored already: nothing to learn
        SplitEvent(window_index=4, micro_step_index=0, old_micro_batch_size=400,
                   new_micro_batch_size=200, phase="forward", reason="")
    )  # fmt: skip

    second = autotune(model, sample, effective_batch_size=1000, **kw)
    assert second.source == "cached" and second.micro_batch_size == 5
    with ProfileStore(store) as opened:
        profiles = opened.list_profiles()
    assert len(profiles) == 2  # the probe's, and the lowered copy (the split of 200 added none)
    lowered = profiles[0][1]
    assert lowered.max_micro_batch_size == lowered.recommended_micro_batch_size == 5
    assert "training ran out of memory at micro-batch size" in lowered.notes[-1]
    assert "window 3, micro-batch 1, backward" in lowered.notes[-1]


def test_a_collate_fn_that_cannot_batch_the_heaviest_items_is_named_at_once() -> None:
    # The default collate stacks: the heaviest items have different lengths, so it fails; that
    # must be said where the sample is made (naming the fix), not deep inside the probe.
    with pytest.raises(
        ConfigError,
        match=r"collate_fn default_collate cannot batch the 3 items kept .*RuntimeError: stack "
        r"expects .*pass a collate_fn that pads",
    ):
        worst_case_sample(items(LENGTHS), key=length, num_items=3)
    # Equal lengths stack fine with the default.
    assert worst_case_sample(items([4, 4]), key=length)(3)["input_ids"].shape == (3, 4)
