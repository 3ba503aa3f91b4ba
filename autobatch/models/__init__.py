"""Models to probe by name (the CLI's ``autobatch tune gpt2`` and the service's registry): built-in
transformers architectures with random weights, or user code (``module:factory``); see ``zoo``."""

from __future__ import annotations

from autobatch.models._zoo import BUILTIN_MODELS, ModelSpec, load_model

__all__ = ["BUILTIN_MODELS", "ModelSpec", "load_model"]
