"""The store's decoded profiles (store._decoded): decoded once per stored text, the text
compared on every hit, and bounded by the bytes of text kept."""

from __future__ import annotations

import json

from autobatch.store._decoded import DecodedProfiles
from tests.store.test_store import make_profile


def test_a_profile_is_decoded_once_while_its_text_is_the_same() -> None:
    decoded = DecodedProfiles()
    text = json.dumps(make_profile().to_dict())

    first = decoded.get("a", text)

    assert decoded.get("a", text) is first
    changed = json.dumps(
        make_profile(max_micro_batch_size=9, recommended_micro_batch_size=9).to_dict()
    )
    other = decoded.get("a", changed)  # another text under the id: decoded again
    assert other.max_micro_batch_size == 9 and other is not first


def test_the_text_kept_is_bounded_and_the_least_recently_read_goes_first() -> None:
    text = json.dumps(make_profile().to_dict())
    decoded = DecodedProfiles(max_bytes=16 * len(text))  # 16 such texts at most
    names = [f"p{i}" for i in range(16)]

    kept = {name: decoded.get(name, text) for name in names}
    assert decoded.get("p0", text) is kept["p0"]  # read again: "p1" is now the oldest
    decoded.get("new", text)

    assert decoded.get("p0", text) is kept["p0"]
    assert decoded.get("p15", text) is kept["p15"]
    assert decoded.get("p1", text) is not kept["p1"]  # dropped, decoded again
    small = DecodedProfiles(max_bytes=16 * len(text) - 1)  # a text over a sixteenth of it
    assert small.get("a", text) is not small.get("a", text)
