"""A size flag the model would ignore is refused, naming the flag and what the model takes;
a size out of range names its flag (issue 46)."""

from __future__ import annotations

import pytest

from autobatch.errors import ConfigError
from autobatch.models._zoo import load_model
from tests.cli.test_cli import run

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (
            ["vit-base", "--seq-len", "32"],
            "model 'vit-base' takes no --seq-len, which it would ignore: it takes --image-size "
            "(pixels per side); leave --seq-len out",
        ),
        (
            ["gpt2-tiny", "--image-size", "32"],
            "model 'gpt2-tiny' takes no --image-size, which it would ignore: it takes --seq-len "
            "(tokens per sample); leave --image-size out",
        ),
        (
            ["gpt2-tiny", "--input-shape", "3,4"],
            "model 'gpt2-tiny' takes no --input-shape, which it would ignore: it takes --seq-len "
            "(tokens per sample); leave --input-shape out",
        ),
        (["gpt2-tiny", "--seq-len", "100000"], "argument --seq-len: 100000 must be in 1..1024"),
        (["vit-base", "--image-size", "100"], "argument --image-size: 100 must be a multiple"),
    ],
)
def test_estimate_refuses_a_size_the_model_does_not_take(
    capsys: pytest.CaptureFixture[str], argv: list[str], error: str
) -> None:
    code, _, err = run(capsys, "estimate", *argv, "--capacity", "1GiB")
    assert code != 0
    assert err.splitlines()[0].startswith(f"autobatch estimate: error: {error}")


def test_the_library_names_its_keywords() -> None:
    with pytest.raises(ConfigError, match="^model 'vit-base' takes no seq_len, .* image_size"):
        load_model("vit-base", seq_len=32)
    with pytest.raises(ConfigError, match="^model 'mod:f' takes no image_size, .* no arguments"):
        load_model("mod:f", image_size=32)
