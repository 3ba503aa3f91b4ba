"""The one place the command line words a library message: every library argument a message
names in Python spelling is shown as the invoked command's flag.

The library's messages name arguments as Python does (``effective_batch_size 64 is less than
world_size 128``, ``use world_size=N``, ``plan without mixed_ranks``, ``give
device.capacity_bytes``); structured remedies are worded by
:func:`flag_wording`, and what is left in the text is translated here,
from the command's own flags (an argument whose flag is its name with dashes) and the table of
those that differ (:data:`FLAGS`, :data:`COMMAND_FLAGS`). A name the
command has no flag for is left as it is; a dotted Python path (``autobatch.training``) is never
touched, except a library call the command line has a command for (:data:`CALLS`:
``autobatch.autotune`` is ``autobatch tune``).

Example::

    flags = command_flags(build_parser(), "plan")
    cli_message("use effective_batch_size >= 128 or world_size <= 64", flags)
    # "use --effective-batch-size >= 128 or --world-size <= 64"
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping, Sequence

from autobatch.errors import AutobatchError, Remedy, ServiceError, with_remedies
from autobatch.planning import MAX_GRADIENT_ACCUMULATION_STEPS
from autobatch.units import format_bytes

__all__ = [
    "CALLS",
    "COMMAND_FLAGS",
    "FLAGS",
    "PYTHON_PHRASES",
    "TOKEN_ENV_VAR",
    "CommandFlags",
    "cli_message",
    "cli_remedies",
    "command_flags",
    "command_wording",
    "condition_words",
    "error_words",
    "flag_value",
    "flag_wording",
    "human_bytes",
    "json_advice",
    "python_words",
    "reason_words",
    "size_spelling",
    "warning_words",
]

TOKEN_ENV_VAR = "AUTOBATCH_API_TOKEN"
"""Where the command line reads the service's bearer token (the library takes ``token=``)."""

AMP_FLAG_VALUES = {"bfloat16": "bf16", "float16": "fp16"}


FLAGS = {
    "amp_dtype": "--amp",
    "capacity_bytes": "--capacity",
    "device": "--device",
    "gpu_fraction": "--gpu-fraction",
    "input_shape": "--input-shape",
    "image_size": "--image-size",
    "max_micro_batch_size": "--max-micro-batch-size",
    "seq_len": "--seq-len",
    "store": "--store",
    "world_size": "--world-size",
}
"""The library's parameter names whose flag is not the name with dashes (the one table); any
other ``name`` is ``--name`` with ``_`` as ``-`` (``allow_inexact``: ``--allow-inexact``)."""


def flag_value(value: object) -> str:
    """A library value as the flag takes it: ``bf16`` for bfloat16, ``3,224,224`` for a shape."""
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return AMP_FLAG_VALUES.get(str(value), str(value))


def flag_wording(remedy: Remedy) -> str:
    """A library error's remedy as this command line's flag: ``--allow-inexact``, ``--amp bf16``,
    ``a run without --eval``.

    The one place the CLI words remedies (the library names them by Python argument).
    """
    if not remedy.parameter:
        return remedy.purpose
    return _flag_phrase(remedy)


_PYTHON_CALL = re.compile(r"\b[A-Za-z_][\w.]*\([^)]*=[^)]*\)")
"""A call with keyword arguments a remedy's purpose spells (``from_pretrained(torch_dtype=...)``):
something only a Python caller can do."""


def cli_remedies(remedies: Sequence[Remedy]) -> list[Remedy]:
    """The remedies a command-line user can follow: those a flag or plain words give, not those
    whose only way is a Python call (``load them with from_pretrained(torch_dtype=...)``), which
    a user of a built-in model cannot make."""
    return [r for r in remedies if r.parameter or not _PYTHON_CALL.search(r.purpose)]


def command_wording(flags: Mapping[str, str]) -> Callable[[Remedy], str]:
    """:func:`flag_wording` for the invoked command (``flags``: :func:`command_flags`): a remedy
    naming an argument the command has no flag for (``autobatch devices`` has no ``--device``),
    or a value for a flag the command has as a switch (``launcher --world-size`` prints, it
    takes no N), is worded in plain words (``world size 16 (if mpirun started the ranks)``),
    never as a flag the command lacks."""

    def words(remedy: Remedy) -> str:
        if not remedy.parameter or _takes(flags, remedy):
            return flag_wording(remedy)
        name = remedy.parameter.replace("_", " ")
        if remedy.values in ((True,), (False,)):
            phrase = f"a run {'with' if remedy.values[0] else 'without'} {name}"
        else:
            phrase = f"{name} {' or '.join(map(flag_value, remedy.values))}"
        return f"{phrase} ({remedy.purpose})" if remedy.purpose else phrase

    return words


def _takes(flags: Mapping[str, str], remedy: Remedy) -> bool:
    """Whether the command has ``remedy``'s argument as a flag taking its values."""
    if remedy.parameter not in flags:
        return False
    switch = flags[remedy.parameter] in getattr(flags, "switches", ())
    return not switch or all(isinstance(value, bool) for value in remedy.values)


def _flag_phrase(remedy: Remedy) -> str:
    flag = FLAGS.get(remedy.parameter, "--" + remedy.parameter.replace("_", "-"))
    # ``is``: 1 == True, and --multiple-of 1 is no switch.
    if len(remedy.values) == 1 and remedy.values[0] is True:
        phrase = flag  # a switch
    elif len(remedy.values) == 1 and remedy.values[0] is False:
        phrase = f"a run without {flag}"  # a switch left off
    else:
        phrase = f"{flag} {' or '.join(map(flag_value, remedy.values))}"
    return f"{phrase} ({remedy.purpose})" if remedy.purpose else phrase


COMMAND_FLAGS: dict[str, dict[str, str]] = {
    "plan": {"mixed_ranks": "--rank-max"},
}
"""Library arguments a command takes under another flag than :data:`FLAGS` gives: ``plan``'s
mixed plan is one ``--rank-max`` per rank (``tune`` takes ``--mixed-ranks``)."""

SERVICE_FIELDS = {"device.capacity_bytes": "capacity_bytes"}
"""Service fields a library message names for a plan's memory, as the library argument the
command line takes them by (``--capacity``)."""

CALLS = {
    "autobatch.autotune": "autobatch tune",
    "autobatch.estimate": "autobatch estimate",
    "autobatch.probe": "autobatch tune",
}
"""Library calls a message names (``autobatch.autotune there does``), as the command that does
the same (``autobatch tune``); a call with its arguments written out (``autobatch.autotune(...,
world_size=N)``) is code, and left as it is."""

_CALL = re.compile(
    r"(?<![\w.])(" + "|".join(map(re.escape, sorted(CALLS, key=len, reverse=True))) + r")(?![\w.(])"
)

_VALUE = r"(?:=('[^']*'|\"[^\"]*\"|[^\s,;)]+))?"

_CALL_ARGUMENT = re.compile(
    r"(?<![\w.])("
    + "|".join(map(re.escape, sorted(set(CALLS.values()), key=len, reverse=True)))
    + r")( there)?, ([a-z]+(?:_[a-z]+)*)=('[^']*'|[^\s,;)]+)"
)
"""A command a library call became, with an argument of that call after it (``autobatch tune
there, device='cuda:N'``): the argument is that command's flag, whatever command is running."""


def _call_argument(match: re.Match[str]) -> str:
    name = match[3]
    flag = FLAGS.get(name, "--" + name.replace("_", "-"))
    return f"{match[1]}{match[2] or ''}, {_with_value(flag, match[4])}"


class CommandFlags(dict[str, str]):
    """Library argument -> flag (a dict), knowing which flags are switches (take no value)."""

    switches: frozenset[str] = frozenset()


def command_flags(parser: argparse.ArgumentParser, command: str | None) -> CommandFlags:
    """Library argument -> flag, for ``command``'s flags and the top level's (``--store``);
    its ``switches`` are the flags that take no value (``launcher --world-size``).

    Args:
        parser: the ``autobatch`` parser (:func:`autobatch.cli._parser.build_parser`).
        command: the subcommand invoked (``"plan"``), or None for the top level alone.
    """
    parsers = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            parsers.append(action.choices[command])
    flags = CommandFlags()
    switches: set[str] = set()
    for each in parsers:
        for action in each._actions:
            long = [option for option in action.option_strings if option.startswith("--")]
            if long and action.dest != "help":
                flags[action.dest] = long[0]
                if action.nargs == 0:
                    switches.add(long[0])
    flags.switches = frozenset(switches)
    taken = set(flags.values())
    flags |= {name: flag for name, flag in FLAGS.items() if flag in taken}
    flags |= COMMAND_FLAGS.get(command or "", {})
    flags |= {field: flags[name] for field, name in SERVICE_FIELDS.items() if name in flags}
    return flags


PYTHON_PHRASES = {
    f"{MAX_GRADIENT_ACCUMULATION_STEPS} accumulation steps (the planner's own bound, "
    "MAX_GRADIENT_ACCUMULATION_STEPS)": (
        f"{MAX_GRADIENT_ACCUMULATION_STEPS:,} accumulation steps (the planner's own bound)"
    ),
    "MAX_GRADIENT_ACCUMULATION_STEPS": (
        f"the planner's own bound, {MAX_GRADIENT_ACCUMULATION_STEPS:,} steps"
    ),
    "world_size x micro_batch_size / effective_batch_size": (
        "world size x micro-batch size / effective batch size"
    ),
    " x micro_batch_size / ": " x micro-batch size / ",
    "use_reentrant=False": "non-reentrant checkpointing",
    "use_reentrant=True": "reentrant checkpointing",
    "(fits_now is false)": "(fits now: no)",
}
"""Python spellings a library message or a recorded condition holds (a constant, a formula
over fields, a keyword argument), as the command line words them: ``1048576 accumulation steps
(the planner's own bound, MAX_GRADIENT_ACCUMULATION_STEPS)`` reads ``1,048,576 accumulation
steps (the planner's own bound)``, ``use_reentrant=False`` reads ``non-reentrant
checkpointing``."""

_PYTHON_PHRASE = re.compile("|".join(map(re.escape, sorted(PYTHON_PHRASES, key=len, reverse=True))))


def python_words(text: str) -> str:
    """``text`` with each Python spelling of :data:`PYTHON_PHRASES` in words."""
    return _PYTHON_PHRASE.sub(lambda match: PYTHON_PHRASES[match[0]], text)


def cli_message(text: str, flags: Mapping[str, str], *, bare: bool = True) -> str:
    """``text`` with every library argument of ``flags`` worded as its flag: ``world_size``
    as ``--world-size``, ``world_size=N`` as ``--world-size N``, ``allow_inexact=True`` as
    ``--allow-inexact``, ``amp_dtype=torch.bfloat16`` as ``--amp bf16``. A one-word argument
    (``device``) is a flag only with ``=`` (``device='cpu'``): as a bare word it is English. A
    quoted name (``'world_size'``) is a value the message quotes and is left as it is.
    ``bare=False`` leaves every bare name (a plan's note names the fields the text output
    prints, ``effective_batch_size 96 = ...``) and words only ``name=value``. A library call
    the message names is the command that does it (:data:`CALLS`); a constant, formula or
    keyword argument in Python spelling is in words (:func:`python_words`)."""
    text = python_words(text)
    text = _CALL_ARGUMENT.sub(_call_argument, _CALL.sub(lambda match: CALLS[match[1]], text))
    if not flags:
        return human_bytes(text)
    text = json_advice(text, flags)
    names = "|".join(re.escape(name) for name in sorted(flags, key=len, reverse=True))
    # A name in quotes is a value the message quotes ('world_size', a condition's name), not
    # an argument.
    # ``name=`` with no value (``with checkpoint_block_class=``) is the argument itself.
    pattern = re.compile(rf"(?<![\w.\-/:'\"])({names})(?:(=)(?=[\s,;)]|$)|{_VALUE})(?![\w(])")

    def flag(match: re.Match[str]) -> str:
        name, value = match[1], match[3]
        if match[2]:
            return flags[name]
        if name.endswith("_bytes") and value is None and _BYTES.match(text, match.end()):
            return flags[name]  # its number follows: see _spell_bytes
        if value is None:
            return flags[name] if bare and ("_" in name or "." in name) else name
        if flags[name] in getattr(flags, "switches", ()) and value not in ("True", "False"):
            return match[0]  # the command's switch of that name takes no value
        return _with_value(flags[name], value)

    return human_bytes(_spell_bytes(pattern.sub(flag, text), flags))


_NUMBER = r"(?<![\w.+\-*])(\d+)"
_LINE_BYTES = re.compile(rf"{_NUMBER} \+ (\d+) bytes per sample\b")
_PLAIN_BYTES = re.compile(rf"(?<!B \(){_NUMBER} bytes\b")


def human_bytes(text: str) -> str:
    """Byte counts a library message spells out, in the units the command line prints sizes
    in (:func:`autobatch.units.format_bytes`): ``peak 7535104 bytes`` as ``peak 7.19 MiB``,
    ``2208870 + 666215 bytes per sample`` as ``2.11 MiB + 650.60 KiB per sample``; the exact
    bytes beside a count already in units (``4.00 GiB (4294967296 bytes)``) and a count under
    1 KiB (``'80' is 80 bytes``: the same in units) are left."""
    text = _LINE_BYTES.sub(
        lambda m: f"{format_bytes(int(m[1]))} + {format_bytes(int(m[2]))} per sample", text
    )
    return _PLAIN_BYTES.sub(lambda m: format_bytes(int(m[1])) if int(m[1]) >= 1024 else m[0], text)


_JSON_VALUE = r'(?:"[^"]*"|-?\d+(?:\.\d+)?|true|false)'
_JSON_FIELD = re.compile(
    rf'"([a-z_]+)": (?:\{{"([a-z_]+)": ({_JSON_VALUE}(?: or {_JSON_VALUE})*)\}}'
    rf"|({_JSON_VALUE}(?: or {_JSON_VALUE})*))"
)
"""A service's advice in its body's fields: ``"card": "sim"``, ``"card": "A" or "B"``,
``"device": {"capacity_bytes": 1073741824}``, ``"conditions": {"amp_dtype": "bfloat16"}``."""

CONDITION_FIELDS = ("conditions", "condition")
"""The service's field of the conditions a plan must hold under (``--condition NAME=VALUE``)."""


def json_advice(text: str, flags: Mapping[str, str]) -> str:
    """``text`` with a service's advice in body fields worded as the command's flags:
    ``"card": "sim"`` as ``--card sim``, ``"device": {"capacity_bytes": N}`` as ``--capacity
    N``, ``"activation_checkpointing": "full"`` as ``--activation-checkpointing full`` where
    the command has that flag, else as ``--condition activation_checkpointing=full`` where it
    takes conditions. A field the command has no flag for is left as the service wrote it."""

    def spelled(match: re.Match[str]) -> str:
        field, inner = match[1], match[2]
        values = re.findall(_JSON_VALUE, match[3] or match[4])
        name = field if inner is None else inner
        flag = flags.get(field if inner is None else f"{field}.{inner}") or flags.get(name)
        recorded = name in CONDITION_WORDS or name == "amp_dtype"
        condition = field in CONDITION_FIELDS if inner is not None else recorded
        if inner is not None and field in CONDITION_FIELDS:
            flag = None
        if flag is None and condition and "condition" in flags:
            each = " or ".join(f"{name}={v.strip(chr(34))}" for v in values)
            return f"{flags['condition']} {each}"
        if flag is None:
            return match[0]
        if values == ["true"]:
            return flag
        if values == ["false"]:
            return f"no {flag}"
        return f"{flag} {' or '.join(_json_word(v) for v in values)}"

    return _JSON_FIELD.sub(spelled, text)


def _json_word(value: str) -> str:
    """One JSON value as a flag takes it: a string without its quotes (kept where it has a
    space, as a shell needs), ``bf16`` for bfloat16."""
    if value.startswith('"') and not any(c.isspace() for c in value):
        return flag_value(value.strip('"'))
    return value


_BYTES = re.compile(r" (\d+)\b")


def _spell_bytes(text: str, flags: Mapping[str, str]) -> str:
    """A byte count after a flag that takes a size, as the flag takes it: ``--capacity
    1073741824`` as ``--capacity 1GiB`` (a whole number of GiB or MiB; else the bytes)."""
    sized = {flags[name] for name in flags if name.endswith("_bytes")}
    if not sized:
        return text
    names = "|".join(re.escape(flag) for flag in sorted(sized, key=len, reverse=True))
    return re.sub(rf"({names}) (\d+)\b", lambda m: f"{m[1]} {size_spelling(int(m[2]))}", text)


def size_spelling(num_bytes: int) -> str:
    """``num_bytes`` as a size flag takes it and a reader reads it: ``1GiB``, ``512MiB``, or the
    bytes themselves when neither divides them."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if num_bytes and num_bytes % size == 0:
            return f"{num_bytes // size}{unit}"
    return str(num_bytes)


CONDITION_WORDS = {
    "torch_version": "torch",
    "driver_version": "driver",
    "device_type": "device",
    "optimizer": "optimizer",
    "activation_checkpointing": "activation checkpointing",
    "allocator_settings": "allocator",
    "allocator_backend": "allocator backend",
    "cudnn": "cuDNN",
    "world_size": "world size",
    "node_name": "node",
    "device_name": "card",
}
"""A recorded condition's name as the command line words it (``torch 2.13.0``, ``device sim``)."""


def condition_words(name: str, value: str) -> str:
    """One recorded condition in words: ``torch 2.13.0+cpu``, ``no AMP``, ``AMP bf16``,
    ``world size 1``; a name this table lacks reads with spaces for underscores."""
    if name == "amp_dtype":
        return "no AMP" if value in ("", "off", "none", "None") else f"AMP {flag_value(value)}"
    return f"{CONDITION_WORDS.get(name, name.replace('_', ' '))} {python_words(value)}"


_MISMATCH = re.compile(r"\b([a-z_]+): (recorded '([^']*)'|not recorded), asked '([^']*)'")
"""A condition mismatch as :func:`autobatch.planning.condition_mismatches` phrases it
(``amp_dtype: recorded 'float16', asked 'bfloat16'``)."""


def reason_words(reason: str) -> str:
    """A plan's reason (why it is predicted, not measured) with each condition mismatch in
    words: ``amp_dtype: recorded 'float16', asked 'bfloat16'`` reads ``AMP: recorded fp16,
    asked bf16``; ``torch_version: not recorded, asked '2.13.0'`` reads ``torch: not recorded,
    asked 2.13.0``."""

    def words(match: re.Match[str]) -> str:
        name, recorded, asked = match[1], match[3], match[4]
        label = "AMP" if name == "amp_dtype" else condition_words(name, "").strip()
        if name == "amp_dtype":
            asked = flag_value(asked)
        have = "not recorded" if recorded is None else f"recorded {flag_value(recorded)}"
        return f"{label}: {have}, asked {asked}"

    return python_words(_MISMATCH.sub(words, reason))


def _with_value(flag: str, value: str) -> str:
    value = value.strip("'\"").removeprefix("torch.")
    if value == "True":
        return flag
    if value == "False":
        return f"no {flag}"
    return f"{flag} {flag_value(value)}"


def error_words(
    exc: AutobatchError, parser: argparse.ArgumentParser, command: str | None, argv: Sequence[str]
) -> str:
    """The command line's words for a library error: its remedies as flags
    (:func:`flag_wording`), the arguments its text names as flags
    (:func:`cli_message`), led by the flag the user gave when the message refuses its value,
    and for a service's refusal of the token the variable the command line reads it from."""
    flags = command_flags(parser, command)
    text = with_remedies(exc.message, cli_remedies(exc.remedies), command_wording(flags))
    words = _led_by_flag(text, flags, argv)
    if isinstance(exc, ServiceError) and exc.status in (401, 403):
        words += f"; set {TOKEN_ENV_VAR} to a token the service accepts"
    return words


def warning_words(
    parser: argparse.ArgumentParser, command: str | None
) -> Callable[[Warning | str], str]:
    """How a warning raised (or logged) during ``command`` reads on the command line: its
    remedies as flags (a warning that carries them, :class:`~autobatch.errors.ReportWarning`),
    and the arguments its text names as ``command``'s flags (:func:`cli_message`)."""
    flags = command_flags(parser, command)

    def words(warning: Warning | str) -> str:
        describe = getattr(warning, "describe", None)
        text = describe(command_wording(flags)) if describe is not None else str(warning)
        return cli_message(text, flags)

    return words


def _led_by_flag(text: str, flags: Mapping[str, str], argv: Sequence[str]) -> str:
    """A library refusal of a value the user gave as a flag, led by that flag as argparse leads
    its own (``argument --safety-margin: 1.5 must be in [0, 0.9]``), the rest worded by
    :func:`cli_message`. The parser only parses; the range is the library's one check."""
    name, _, rest = text.partition(" ")
    flag = flags.get(name)
    if flag is not None and any(a == flag or a.startswith(f"{flag}=") for a in argv):
        return f"argument {flag}: {cli_message(rest, flags)}"
    return cli_message(text, flags)
