"""Architecture registry: config.json's ``architectures[0]`` -> a LlamaForCausalLM flavour."""

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
