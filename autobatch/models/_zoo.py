"""Models to probe by name, for the CLI and the service's registry: built-in transformers
architectures with random weights, or user code.

Built-in names (weights are random: nothing is downloaded; ``transformers`` must be installed):

==============  =============================================  ==========================
name            architecture                                   sample
==============  =============================================  ==========================
``gpt2``        GPT-2 small, 124M (``GPT2LMHeadModel``)         tokens, ``--seq-len``
``bert-base``   BERT-base, 110M (``BertForSequenceClassif.``)  tokens, ``--seq-len``
``vit-base``    ViT-B/16, 86M (``ViTForImageClassification``)  images, ``--image-size``
``llama-small`` Llama-style, 8 layers x 512, 60M               tokens, ``--seq-len``
``gpt2-tiny``   GPT-2, 2 layers x 64 (tests and demos)          tokens, ``--seq-len``
==============  =============================================  ==========================

``--seq-len`` defaults to the model's maximum (1024 for GPT-2, 512 for BERT, 4096 for the
Llama): a probe must see the longest sequence training will, or its answer runs out of memory
the first time one comes by.

User code is named ``module:factory`` (the module must be importable, e.g. from the current
directory). The factory is called with no arguments and returns either a model, or a dict with
``model`` and ``sample`` (and optionally ``loss_fn`` and ``optimizer``). For a bare model the
sample is random normal of ``--input-shape`` and the loss is the output's mean (a stand-in whose
own memory is negligible).

Example::

    spec = load_model("gpt2", seq_len=128)
    spec.model, spec.sample["input_ids"].shape      # (1, 128)
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

from autobatch.errors import ConfigError, Remedy
from autobatch.extras import require

__all__ = ["BUILTIN_MODELS", "ModelSpec", "load_model"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A model ready to probe: the model, one sample (batch of 1) and how its loss is formed."""

    name: str
    model: torch.nn.Module
    sample: Any
    loss_fn: Callable[..., torch.Tensor] | None = None
    optimizer: torch.optim.Optimizer | None = None

    def to(self, device: torch.device) -> ModelSpec:
        """The model and sample on ``device``: the one place where the CLI and the service's
        probe jobs put what they built on the device they probe (the library never moves a
        user's model). The model moves in place (``module.to``); the sample's tensors are
        copied. A factory's optimizer stays valid where torch keeps the parameters' identity
        (CPU to CUDA does).

        Raises:
            ConfigError: the sample is a callable (it builds its batches where it likes), or the
                move replaced parameters the optimizer holds.
        """
        if callable(self.sample) and not isinstance(self.sample, torch.Tensor):
            raise ConfigError(
                f"model {self.name!r}: a callable sample cannot be moved to {device}; return "
                "a sample batch from the factory"
            )
        self.model.to(device)
        if self.optimizer is not None:
            held = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
            if not held <= {id(p) for p in self.model.parameters()}:
                raise ConfigError(
                    f"model {self.name!r}: moving it to {device} replaced the parameters its "
                    "optimizer holds; let the factory return no optimizer (AdamW is used) or "
                    "one the probe can rebuild"
                )
        sample = tree_map(
            lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, self.sample
        )
        return dataclasses.replace(self, sample=sample)


def _transformers() -> Any:
    transformers = require("transformers", extra="models", purpose="a built-in model")
    transformers.logging.set_verbosity_error()
    return transformers


def _tokens(vocab_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab_size, (1, seq_len))
    return {"input_ids": ids, "labels": ids.clone()}


def _gpt2(
    seq_len: int | None, image_size: int | None, tiny: bool = False
) -> tuple[torch.nn.Module, Any]:
    tf = _transformers()
    if tiny:
        config = tf.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=1024)
    else:
        config = tf.GPT2Config()
    seq_len = _seq_len(seq_len, config.n_positions)
    model = tf.GPT2LMHeadModel(config)
    # The loss by name: from the class name transformers finds none, and warns once.
    model.loss_type = "ForCausalLM"
    return model, _tokens(config.vocab_size, seq_len)


def _bert(seq_len: int | None, image_size: int | None) -> tuple[torch.nn.Module, Any]:
    tf = _transformers()
    config = tf.BertConfig(num_labels=2)
    seq_len = _seq_len(seq_len, config.max_position_embeddings)
    sample = {
        "input_ids": torch.randint(0, config.vocab_size, (1, seq_len)),
        "attention_mask": torch.ones(1, seq_len, dtype=torch.long),
        "labels": torch.zeros(1, dtype=torch.long),
    }
    return tf.BertForSequenceClassification(config), sample


def _vit(seq_len: int | None, image_size: int | None) -> tuple[torch.nn.Module, Any]:
    tf = _transformers()
    image_size = 224 if image_size is None else image_size
    if image_size % 16:
        raise ConfigError(f"image_size {image_size} must be a multiple of the patch size 16")
    config = tf.ViTConfig(image_size=image_size, num_labels=1000)
    sample = {
        "pixel_values": torch.randn(1, 3, image_size, image_size),
        "labels": torch.zeros(1, dtype=torch.long),
    }
    return tf.ViTForImageClassification(config), sample


def _llama(seq_len: int | None, image_size: int | None) -> tuple[torch.nn.Module, Any]:
    tf = _transformers()
    config = tf.LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=4096,
    )
    seq_len = _seq_len(seq_len, config.max_position_embeddings)
    return tf.LlamaForCausalLM(config), _tokens(config.vocab_size, seq_len)


def _seq_len(seq_len: int | None, limit: int) -> int:
    """The tokens per sample: by default the model's maximum, the worst case to probe with."""
    if seq_len is None:
        return limit
    if not 1 <= seq_len <= limit:
        raise ConfigError(f"seq_len {seq_len} must be in 1..{limit} for this model")
    return seq_len


BUILTIN_MODELS: dict[str, Callable[[int | None, int | None], tuple[torch.nn.Module, Any]]] = {
    "bert-base": _bert,
    "gpt2": _gpt2,
    "gpt2-tiny": lambda seq_len, image_size: _gpt2(seq_len, image_size, tiny=True),
    "llama-small": _llama,
    "vit-base": _vit,
}
"""Built-in model names -> builder(seq_len, image_size); seq_len None: the model's maximum,
image_size None: 224."""

IMAGE_MODELS = frozenset({"vit-base"})
"""The built-in models that take ``image_size`` (images); the others take ``seq_len`` (tokens)."""


def _refuse_sizes_not_taken(
    name: str, seq_len: int | None, image_size: int | None, input_shape: tuple[int, ...] | None
) -> None:
    """Refuse a size argument ``name``'s model would ignore, naming what it takes.

    Raises:
        ConfigError: ``seq_len`` for an image model, ``image_size`` for a text model,
            ``input_shape`` for a built-in model, ``seq_len``/``image_size`` for a factory.
    """
    ignored: dict[str, object]
    if name not in BUILTIN_MODELS:
        takes = "it is called with no arguments; input_shape for a bare model"
        ignored = {"seq_len": seq_len, "image_size": image_size}
    elif name in IMAGE_MODELS:
        takes = "image_size (pixels per side)"
        ignored = {"seq_len": seq_len, "input_shape": input_shape}
    else:
        takes = "seq_len (tokens per sample)"
        ignored = {"image_size": image_size, "input_shape": input_shape}
    given = [key for key, value in ignored.items() if value is not None]
    if given:
        raise ConfigError(
            f"model {name!r} takes no {' or '.join(given)}, which it would ignore: it takes "
            f"{takes}; leave {' and '.join(given)} out"
        )


def load_model(
    name: str,
    *,
    seq_len: int | None = None,
    image_size: int | None = None,
    input_shape: tuple[int, ...] | None = None,
    seed: int = 0,
) -> ModelSpec:
    """Build a built-in model or call a user factory ``module:factory``. ``seq_len``: tokens
    per sample of a text model (None: its maximum); ``image_size``: pixels per side of an image
    model (None: 224); ``input_shape``: one sample's shape for a factory's bare model.

    Raises:
        ConfigError: unknown name, unimportable module, missing factory, a factory returning
            something else than a model or a dict with ``model`` and ``sample``, a bare model
            without ``input_shape``; a size the model would ignore (``seq_len`` for
            ``vit-base``, ``image_size`` for a text model, ``input_shape`` for a built-in).
    """
    torch.manual_seed(seed)
    _refuse_sizes_not_taken(name, seq_len, image_size, input_shape)
    if name in BUILTIN_MODELS:
        model, sample = BUILTIN_MODELS[name](seq_len, image_size)
        return ModelSpec(name=name, model=model, sample=sample)
    if ":" not in name:
        raise ConfigError(
            f"model {name!r} is neither built in ({', '.join(sorted(BUILTIN_MODELS))}) nor "
            "'module:factory'"
        )
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"model {name!r}: write 'module:factory', e.g. 'mypkg.models:build'")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any error while importing it is theirs
        raise ConfigError(
            f"cannot import module {module_name!r} for model {name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ConfigError(f"{module_name!r} has no callable {attribute!r} (model {name!r})")
    try:
        built = factory()
    except Exception as exc:  # the user's factory
        raise ConfigError(
            f"factory {name!r} failed: {type(exc).__name__}: {exc}; it is called with no "
            "arguments and returns a model or {'model': ..., 'sample': ...}"
        ) from exc
    if isinstance(built, torch.nn.Module):
        if input_shape is None:
            raise ConfigError(
                f"factory {name!r} returned a bare model and no sample",
                remedies=[
                    Remedy(
                        parameter="input_shape", values=((3, 224, 224),), purpose="one sample's"
                    ),
                    Remedy(purpose="a factory that returns {'model': ..., 'sample': ...}"),
                ],
            )
        return ModelSpec(
            name=name,
            model=built,
            sample=torch.randn(1, *input_shape),
            loss_fn=lambda output: output.float().mean(),
        )
    if isinstance(built, dict) and "model" in built and "sample" in built:
        if not isinstance(built["model"], torch.nn.Module):
            raise ConfigError(
                f"factory {name!r} returned model={type(built['model']).__name__}, not a "
                "torch.nn.Module"
            )
        optimizer = built.get("optimizer")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"factory {name!r} returned optimizer={type(optimizer).__name__}, not a "
                "torch.optim.Optimizer"
            )
        return ModelSpec(
            name=name,
            model=built["model"],
            sample=built["sample"],
            loss_fn=built.get("loss_fn"),
            optimizer=built.get("optimizer"),
        )
    raise ConfigError(
        f"factory {name!r} returned {type(built).__name__}; return a torch.nn.Module or a dict "
        "with 'model' and 'sample'"
    )
