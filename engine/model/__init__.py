"""HF checkpoint loading and the decoder-only model family (Llama, Qwen2, Qwen3, Mistral)."""

from engine.model.llama import SUPPORTED_ARCHITECTURES, CausalLM, ModelSpec
from engine.model.loader import load_model, resolve_model_path

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "ModelSpec", "load_model", "resolve_model_path"]
