"""HF checkpoint loading and the decoder families (engine/model/families.py lists them)."""

from engine.model.decoder import CausalLM, ModelSpec
from engine.model.families import SUPPORTED_ARCHITECTURES
from engine.model.loader import load_model, resolve_model_path

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "ModelSpec", "load_model", "resolve_model_path"]
