"""Architecture registry: the ``architectures[0]`` of a config.json -> our model class.

Every class is a LlamaForCausalLM flavour (models/llama.py), so that is the type the
runner relies on."""

from __future__ import annotations

from services.worker.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    cls = MODEL_REGISTRY.get(architecture)
    if cls is None:
        supported = supported_architectures()
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {supported}")
    return cls
