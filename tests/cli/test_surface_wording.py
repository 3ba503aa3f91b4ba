"""Each surface words an error in its own terms: the same bad input through Python names the
argument (``uneven='never'``), through the command line the flag (``--uneven never``); the
library's messages hard-code neither (the remedies carry the spelling, errors.Remedy)."""

from __future__ import annotations

import argparse
import pickle

import pytest
import torch

import autobatch
from autobatch.cli import build_parser, main
from autobatch.cli._output import FLAGS
from autobatch.device import resolve_device
from autobatch.device._budget import _UNSEEN
from autobatch.errors import ConfigError, DeviceUnavailableError, Remedy
from autobatch.integrations import deepspeed_config
from autobatch.models._zoo import load_model


def cli_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 1
    out, err = capsys.readouterr()
    prefix = f"autobatch {argv[0]}: error: "
    assert out == "" and err.startswith(prefix), err
    line, *hint = err.removeprefix(prefix).splitlines()
    assert hint in ([], [f"try 'autobatch {argv[0]} --help'"]), err
    return line


UNEQUAL = (
    "DeepSpeed takes one micro-batch size, but this plan has unequal micro-batches (20 and 19); "
    "use {uneven} (equal sizes, maybe more accumulation steps), or autobatch's Accumulator in "
    "the loop, which weights losses by micro-batch size"
)


def test_a_config_of_unequal_micro_batches(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as raised:
        deepspeed_config(autobatch.plan(24, effective_batch_size=97))
    assert str(raised.value) == UNEQUAL.format(uneven="uneven='never'")
    argv = ["plan", "--max-micro-batch-size", "24", "--effective-batch-size", "97"]
    err = cli_error(capsys, *argv, "--format", "deepspeed")
    assert err == UNEQUAL.format(uneven="--uneven never")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_unavailable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(DeviceUnavailableError) as raised:
        resolve_device("cuda:0")
    python = str(raised.value)
    assert python.endswith(
        "; use device='cpu' or 'sim:SIZE', or a CUDA build of torch on a machine with a GPU"
    )
    assert "--" not in python
    err = cli_error(
        capsys, "tune", "gpt2-tiny", "--device", "cuda:0", "--effective-batch-size", "8"
    )
    assert err == python.replace("device='cpu' or 'sim:SIZE'", "--device cpu or sim:SIZE")
    copy = pickle.loads(pickle.dumps(raised.value))  # a probe child's error keeps its remedies
    assert (str(copy), copy.reason, copy.remedies) == (
        python,
        raised.value.reason,
        raised.value.remedies,
    )


def test_a_factory_without_a_sample(capsys: pytest.CaptureFixture[str]) -> None:
    factory = "tests.service.models:tiny_mlp"
    with pytest.raises(ConfigError) as raised:
        load_model(factory)
    reason = f"factory {factory!r} returned a bare model and no sample; use "
    rest = ", or a factory that returns {'model': ..., 'sample': ...}"
    assert str(raised.value) == f"{reason}input_shape=(3, 224, 224) (one sample's){rest}"
    err = cli_error(capsys, "estimate", factory, "--capacity", "1GiB")
    assert err == f"{reason}--input-shape 3,224,224 (one sample's){rest}"


def test_built_in_model_sizes_name_the_keyword_each_surface_words() -> None:
    with pytest.raises(ConfigError, match="^seq_len 5000 must be in 1..1024"):
        load_model("gpt2-tiny", seq_len=5000)
    with pytest.raises(ConfigError, match="^image_size 100 must be a multiple of the patch"):
        load_model("vit-base", image_size=100)


def test_budget_warnings_name_no_surface_s_spelling() -> None:
    for text in _UNSEEN.values():
        assert "--" not in text and "capacity_bytes" not in text and "gpu_fraction" not in text


def test_the_flag_table_names_flags_the_parser_has() -> None:
    flags: set[str] = set()
    pending = [build_parser()]
    while pending:
        parser = pending.pop()
        for action in parser._actions:
            flags.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
    assert set(FLAGS.values()) <= flags
    from autobatch.cli._output import flag_wording as _flag_wording

    assert _flag_wording(Remedy(parameter="capacity_bytes", values=("80GiB",))) == (
        "--capacity 80GiB"
    )
