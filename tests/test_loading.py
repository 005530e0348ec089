"""Checkpoint loading: families, sharding, missing tokenizers, old-style configs, clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.loader import resolve_model_path
from tests.checkpoints import DROPS_SYSTEM_TEMPLATE, NO_SYSTEM_TEMPLATE, instruct_view, make_checkpoint


def test_sharded_checkpoint_without_tokenizer(tmp_path, hf):
    path = make_checkpoint("qwen3", tmp_path / "sharded", seed=7, tokenizer=False)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(path).save_pretrained(path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    llm = LLM(str(path))
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.add_request("hello")
    prompt = [5, 6, 7, 8]
    hf.check_greedy(llm.generate([prompt], SamplingParams(max_tokens=6))[0].token_ids, path, prompt, 6)


def test_old_style_rope_theta_config(tmp_path, hf):
    """Pre-transformers-5 checkpoints keep rope_theta at the top level of config.json."""
    path = make_checkpoint("llama", tmp_path / "old", seed=3, tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 500.0
    cfg["rope_scaling"] = None
    (path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(path))
    assert llm.model.spec.ropes[0].inv_freq[1].item() == pytest.approx(1 / 500.0 ** (2 / 16))
    prompt = list(range(10, 40))
    hf.check_greedy(llm.generate([prompt], SamplingParams(max_tokens=5))[0].token_ids, path, prompt, 5)


def test_missing_weights_are_named(tmp_path, llama_ckpt):
    path = tmp_path / "broken"
    shutil.copytree(llama_ckpt, path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights: model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM(str(path))


def test_unknown_model_errors_say_what_was_tried(tmp_path):
    with pytest.raises(ValueError, match="not in the local HF cache"):
        resolve_model_path("nobody/no-such-model")
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        resolve_model_path(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model_path(str(tmp_path))


def test_cuda_request_without_cuda_is_clear(llama_ckpt):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available on this machine")
    with pytest.raises(ValueError, match="CUDA is not available"):
        LLM(str(llama_ckpt), device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_greedy_matches_cpu(llama_ckpt):
    prompts = [[1, 2, 3, 4], list(range(50, 90))]
    cpu = LLM(str(llama_ckpt)).generate(prompts, SamplingParams(max_tokens=8))
    gpu = LLM(str(llama_ckpt), device="cuda").generate(prompts, SamplingParams(max_tokens=8))
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


def test_generation_config_defaults_and_the_templates_system_role(tmp_path, llama_ckpt):
    """The sampling settings a checkpoint recommends (generation_config.json), as vLLM takes them: top_k 0 is
    transformers' "off" (-1 here), a value SamplingParams refuses is left out, other keys are not sampling
    settings; and whether the chat template renders a system message (refused, dropped, or rendered)."""
    generation = {"temperature": 0.3, "top_p": 0.85, "top_k": 0, "min_p": 1.5, "repetition_penalty": 1.1,
                  "do_sample": True, "max_new_tokens": 77}
    refuses = LLM(str(instruct_view(llama_ckpt, tmp_path / "refuses", generation, NO_SYSTEM_TEMPLATE)))
    assert refuses.generation_defaults == {"temperature": 0.3, "top_p": 0.85, "top_k": -1, "repetition_penalty": 1.1}
    assert not refuses.system_role
    drops = LLM(str(instruct_view(llama_ckpt, tmp_path / "drops", {}, DROPS_SYSTEM_TEMPLATE)))
    assert drops.generation_defaults == {} and not drops.system_role
    plain = LLM(str(llama_ckpt))
    assert plain.generation_defaults == {} and plain.system_role
    # a template that adds no system message of its own, whether it takes one or not
    assert plain.default_system == refuses.default_system == drops.default_system == ""
