"""GGUF files and weights kept in block formats, end to end on tiny random models of every family.

The files are written here with gguf's own writer (tests/gguf_files.py), with every tensor type minichat
reads spread over the tensors. Expanded to float32 (`dequantize`), a GGUF model is greedy token-exact
vs transformers loading the same file. Kept quantized, it runs minichat's kernels, whose only difference
is the activations' quantization to ~15 bits (tests/test_quant_kernels.py derives the bound), so the
model's top-1 token agrees with the dequantized model's nearly everywhere.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import QUANTIZATIONS
from engine.model.executor import OneCall
from engine.model.loader import resolve_checkpoint
from engine.model.quantized import weight_footprint
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"]
# hidden 256 and intermediate 512: rows long enough for the K formats' 256-value blocks
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
FAMILY_SHAPE = {"llama": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                "mistral": dict(num_key_value_heads=1), "qwen2": {},
                "qwen3": dict(head_dim=128),  # transformers' GGUF config for Qwen3 keeps Qwen3Config's default head_dim
                # Gemma: what transformers' GGUF config keeps of its own defaults (query scale, soft caps, layer
                # pattern: Gemma 3's five local layers to one global) is what the file cannot say
                "gemma2": dict(head_dim=64, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                               final_logit_softcapping=30.0),
                "gemma3": dict(head_dim=64, query_pre_attn_scalar=256, final_logit_softcapping=None,
                               num_hidden_layers=6, layer_types=None)}
EVERY_TYPE = {
    "layers.0.self_attn.q_proj": "Q8_0", "layers.0.self_attn.k_proj": "Q4_K", "layers.0.self_attn.v_proj": "Q6_K",
    "layers.0.self_attn.o_proj": "Q5_0", "layers.0.mlp.gate_proj": "Q4_1", "layers.0.mlp.up_proj": "Q5_1",
    "layers.0.mlp.down_proj": "Q5_K",
    "layers.1.self_attn.q_proj": "F16", "layers.1.self_attn.k_proj": "BF16", "layers.1.self_attn.v_proj": "Q4_0",
    "layers.1.self_attn.o_proj": "Q8_0", "layers.1.mlp.gate_proj": "Q6_K", "layers.1.mlp.up_proj": "Q4_K",
    "layers.1.mlp.down_proj": "Q5_0", "embed": "Q4_0", "lm_head": "Q6_K", "": "Q8_0"}
"""Every format minichat reads, over two layers (layer 1's q/k/v fuse two float parts with a block one), the
embedding and the head, as llama.cpp's mixed files (Q4_K_M) spread formats over tensors; Gemma 3's further layers
in Q8_0."""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-src")
    return {f: make_checkpoint(f, root / f, seed=3, **{**SHAPE, **FAMILY_SHAPE[f]}) for f in FAMILIES}


@pytest.fixture(scope="module")
def mixed_files(ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {f: write_gguf(ckpts[f], root / f"tiny-{f}.Q-mix.gguf", f, EVERY_TYPE) for f in FAMILIES}


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 384, (int(k),), generator=g).tolist() for k in torch.randint(3, 40, (n,), generator=g)]


@pytest.mark.parametrize("family", FAMILIES)
def test_dequantized_gguf_is_token_exact_vs_transformers_on_the_same_file(mixed_files, hf, family):
    path = mixed_files[family]
    llm = LLM(str(path), dequantize=True)
    assert llm.checkpoint.name == f"tiny-{family}.Q-mix"
    formats = llm.checkpoint.formats()
    assert {"Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q4_1", "Q5_1", "Q5_K", "Q4_0", "F32"} <= set(formats)
    assert "float32" in llm.execution["weights"] and "Q" not in llm.execution["gemm"]
    for prompt, out in zip(ps := prompts(6, seed=1), llm.generate(ps, SamplingParams(max_tokens=12)), strict=True):
        hf.check_greedy(out.token_ids, path, prompt, 12, eos=sorted(llm.eos_ids))
    llm.check_integrity()


@pytest.mark.parametrize("family", ["phi3", "qwen2_moe", "mixtral"])
def test_phi3_and_moe_files_are_token_exact_vs_the_checkpoint_they_were_written_from(tmp_path, hf, family):
    """Phi-3's fused qkv and gate_up rows, Qwen2-MoE's stacked experts with a shared expert and its gate, Mixtral
    as llama.cpp writes it (a llama file with experts), as llama.cpp writes them. transformers' GGUF loader keeps
    no expert sizes and reads Mixtral's file as a plain llama (minichat reads both from the file), so the oracle
    is the original checkpoint."""
    src = make_checkpoint(family, tmp_path / family, seed=5)
    path = write_gguf(src, tmp_path / f"tiny-{family}.F32.gguf", family, "F32")
    llm = LLM(str(path))
    for prompt, out in zip(ps := prompts(4, seed=3), llm.generate(ps, SamplingParams(max_tokens=12)), strict=True):
        hf.check_greedy(out.token_ids, src, prompt, 12, eos=sorted(llm.eos_ids))
    llm.check_integrity()


def top1_agreement(a: LLM, b_logprobs: torch.Tensor, ids: list[int]) -> tuple[float, float]:
    """Share of positions where `a`'s top token equals the reference's argmax, and the largest gap between
    their log-probabilities of the text's own next tokens."""
    out = a.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    scored = out.prompt_logprobs[1:]
    top = torch.tensor([p.top[0][0] for p in scored])
    agree = (top == b_logprobs[:-1].argmax(-1)).float().mean().item()
    ours = torch.tensor([p.logprob for p in scored])
    theirs = b_logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    return agree, (ours - theirs).abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_kernels_agree_with_the_dequantized_model(mixed_files, hf, family):
    path = mixed_files[family]
    llm = LLM(str(path), max_prefill_tokens=512)
    assert "blocks" in llm.execution["gemm"]
    ids = torch.randint(0, 384, (300,), generator=torch.Generator().manual_seed(7)).tolist()
    agree, gap = top1_agreement(llm, hf.log_softmax(path, ids), ids)
    assert agree >= 0.99 and gap < 0.05, (agree, gap)
    # decoding (one row at a time through the product) agrees too, and the engine ends clean
    outs = llm.generate(prompts(4, seed=2), SamplingParams(max_tokens=16))
    assert all(len(o.token_ids) == 16 or o.finish_reason == "stop" for o in outs)
    llm.check_integrity()


def test_the_weights_stay_the_files_size(mixed_files):
    """No float copy of a block weight: memory is the file's tensors, but for F16/BF16 ones (float32 in
    memory: twice their bytes) and the K formats' 6-bit scales (unpacked to bytes: +3%)."""
    path = mixed_files["qwen2"]
    tensors = resolve_checkpoint(str(path)).gguf.tensors.values()
    expected = sum(t.nbytes * (2 if t.qtype in ("F16", "BF16") else 1) for t in tensors)
    llm = LLM(str(path))
    size = weight_footprint(llm.model)[1]
    formats, _, mib = llm.execution["weights"].rpartition(", ")
    assert set(formats.split("+")) == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "float32"}
    assert mib == f"{size / 2**20:.1f} MiB"
    assert 0.99 * expected < size < 1.03 * expected


def test_llama3_rope_from_rope_freqs(tmp_path, hf):
    """llama.cpp stores Llama 3's RoPE scaling as `rope_freqs` divisors, which transformers' GGUF loader
    ignores: the oracle is the original safetensors checkpoint (the llama family's llama3 scaling)."""
    src = make_checkpoint("llama", tmp_path / "llama3", seed=4)
    path = write_gguf(src, tmp_path / "llama3.F32.gguf", "llama", "F32")
    llm = LLM(str(path))
    for prompt, out in zip(ps := prompts(4, seed=3), llm.generate(ps, SamplingParams(max_tokens=12)), strict=True):
        hf.check_greedy(out.token_ids, src, prompt, 12, eos=sorted(llm.eos_ids))


def test_the_files_sampling_metadata_are_the_models_defaults(tmp_path):
    """A GGUF file carries no generation_config.json; llama.cpp's `general.sampling.*` keys, where a file has
    them, are the model's sampling defaults (engine/generation_defaults.py), read as the decimals written
    (float32 in the file); a file without them has none."""
    src = make_checkpoint("llama", tmp_path / "llama", seed=4)
    sampling = {"temp": 0.7, "top_p": 0.8, "top_k": 30, "min_p": 0.05, "penalty_repeat": 1.1}
    with_keys = LLM(str(write_gguf(src, tmp_path / "sampled.F32.gguf", "llama", "F32", sampling=sampling)))
    assert with_keys.generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 30, "min_p": 0.05,
                                             "repetition_penalty": 1.1}
    assert LLM(str(write_gguf(src, tmp_path / "plain.F32.gguf", "llama", "F32"))).generation_defaults == {}


def test_text_chat_template_and_eos_come_from_the_file(mixed_files, checkpoints):
    """The tokenizer converted from the file's metadata tokenizes and renders chats as the original does."""
    from transformers import AutoTokenizer

    llm = LLM(str(mixed_files["llama"]), dequantize=True)
    original = AutoTokenizer.from_pretrained(checkpoints["llama"])
    text = "The quick brown fox jumps over the lazy dog; héllo wörld, 日本語のテキスト."
    assert llm.tokenizer.encode(text) == original.encode(text)
    # the converted directory names the added tokens (so a load need not parse tokenizer.json for them) as
    # transformers reads them from the file
    path = mixed_files["llama"]
    from_file = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    listed = json.loads((llm.checkpoint.meta / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert {int(i): t["content"] for i, t in listed.items()} == \
        {i: t.content for i, t in from_file.added_tokens_decoder.items()} != {}
    assert llm.tokenizer.added_tokens_decoder == from_file.added_tokens_decoder
    chat = [{"role": "user", "content": "To be, or not to be"}]
    expected = original.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert llm.encode_prompt(chat) == expected
    assert llm.eos_ids == {original.eos_token_id}


def test_other_tensor_types_are_refused_by_name(ckpts, tmp_path):
    import gguf

    path = write_gguf(ckpts["qwen2"], tmp_path / "odd.gguf", "qwen2", "F32")
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "q2k.gguf"), "qwen2")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name == "blk.0.ffn_down.weight":  # 256 columns: one Q2_K super-block (84 bytes) per row
            writer.add_tensor(t.name, np.zeros((t.shape[1], 84), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q2_K)
        else:
            writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down\.weight is Q2_K; minichat reads F32, F16, BF16, Q4_0"):
        LLM(str(tmp_path / "q2k.gguf"))


def round_tripped(src: Path, out: Path, qtype: str, keep_float: tuple[str, ...] = ()) -> Path:
    """`src` with every 2-D weight of whole 32-value blocks quantized to `qtype` and back by gguf: the model
    `--quantization` runs, in float32 for transformers (but for names ending in `keep_float`: routers stay float)."""
    from gguf import GGMLQuantizationType, dequantize, quantize
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(src / "model.safetensors")
    for name, t in tensors.items():
        if t.dim() == 2 and t.shape[1] % 32 == 0 and not name.endswith(keep_float):
            kind = GGMLQuantizationType[qtype]
            tensors[name] = torch.from_numpy(dequantize(quantize(t.float().numpy(), kind), kind))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantization_at_load_runs_the_quantized_model(ckpts, hf, tmp_path, family, quantization):
    """`--quantization` is the model with its weights quantized by gguf (Q8_0 / Q4_1), computed through the
    kernels: top-1 agreement with transformers on those weights, on every family (TP below)."""
    qtype = QUANTIZATIONS[quantization]
    llm = LLM(str(ckpts[family]), quantization=quantization, max_prefill_tokens=512)
    assert qtype in llm.execution["weights"]
    ids = torch.randint(0, 384, (300,), generator=torch.Generator().manual_seed(11)).tolist()
    oracle = round_tripped(ckpts[family], tmp_path / family, qtype)
    agree, gap = top1_agreement(llm, hf.log_softmax(oracle, ids), ids)
    assert agree >= 0.99 and gap < 0.05, (agree, gap)


@pytest.mark.parametrize("quantization,least", [("int8", 0.99), ("int4", 0.85)])
def test_quantization_accuracy_on_trained_weights(hf, quantization, least):
    """Against float32 on a trained model (the demo model; its 688-wide MLP rows stay float32): measured 100%
    (int8) and 88% (int4) top-1 agreement over 400 tokens of Shakespeare. Random tiny checkpoints are no
    measure of this: they amplify weight noise chaotically (transformers itself, on Q8_0-rounded weights of
    the tiny qwen2, agrees with its float32 self on 94% of tokens, on Q4_1-rounded ones on 35%)."""
    from engine.config import DEMO_MODEL_DIR

    llm = LLM(str(DEMO_MODEL_DIR), quantization=quantization, max_prefill_tokens=512)
    text = (Path(__file__).parent / "data" / "shakespeare_words.txt").read_text()[:20000]
    ids = llm.tokenizer.encode(text)[:400]
    agree, _ = top1_agreement(llm, hf.log_softmax(DEMO_MODEL_DIR, ids), ids)
    assert agree >= least, agree


def test_quantization_refuses_what_it_cannot_do(checkpoints):
    with pytest.raises(ValueError, match="quantization must be one of int8, int4"):
        LLM(str(checkpoints["llama"]), quantization="int3")
    with pytest.raises(ValueError, match="contradict"):
        LLM(str(checkpoints["llama"]), quantization="int8", dequantize=True)


def test_tensor_parallel_quantized_is_identical_to_one_rank(ckpts, tmp_path):
    """Shards cut on block boundaries: --tp 2 gives --tp 1's tokens, for int8 at load and a GGUF of 32-value
    blocks; a K-format row that two ranks would cut mid-block is refused, naming the cut."""
    ps = prompts(4, seed=5)
    params = SamplingParams(max_tokens=10)
    one = [o.token_ids for o in LLM(str(ckpts["llama"]), quantization="int8").generate(ps, params)]
    with LLM(str(ckpts["llama"]), quantization="int8", tensor_parallel_size=2) as two:
        assert [o.token_ids for o in two.generate(ps, params)] == one
    q4 = write_gguf(ckpts["qwen2"], tmp_path / "q40.gguf", "qwen2", "Q4_0")
    one = [o.token_ids for o in LLM(str(q4)).generate(ps, params)]
    with LLM(str(q4), tensor_parallel_size=2) as two:
        assert [o.token_ids for o in two.generate(ps, params)] == one
    k = write_gguf(ckpts["llama"], tmp_path / "q4k.gguf", "llama", "Q4_K")
    with pytest.raises(Exception, match="do not fall on its blocks of 256"):
        LLM(str(k), tensor_parallel_size=2)


def test_perplexity_of_quantized_equals_dequantized(mixed_files):
    """The same text scored through the kernels and through float32 weights: perplexities within 0.5%."""
    path = mixed_files["qwen3"]
    ids = torch.randint(0, 384, (200,), generator=torch.Generator().manual_seed(9)).tolist()
    nll = []
    for dequantize in (False, True):
        out = LLM(str(path), dequantize=dequantize).generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))
        nll.append(-sum(p.logprob for p in out[0].prompt_logprobs[1:]) / (len(ids) - 1))
    assert abs(math.exp(nll[0]) / math.exp(nll[1]) - 1) < 0.005


ONE_CALL = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]
"""The families whose layers kernels/cpu/decode.c runs in one call (Llama-shaped, and Gemma 3 with its GELU, its norms
of each half's output and a RoPE table per layer; Gemma 2's capped attention scores run layer by layer)."""


@pytest.mark.parametrize("family", ONE_CALL)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_layers_in_one_call_compute_what_the_layer_by_layer_path_does(mixed_files, family, kv_cache_dtype):
    """kernels/cpu/decode.c runs every layer of a block-format model in one C call, from the same functions as
    the per-call path: the same log-probabilities bit for bit, prompt and decode alike (Qwen3's q/k norms
    are torch's F.rms_norm layer by layer and the C row function in one call: equal to float32 rounding), on float
    KV pages and on int8 ones (quantized by the same C function as they are stored)."""
    path = mixed_files[family]
    results = []
    for one_call in (True, False):
        llm = LLM(str(path), max_prefill_tokens=64, one_call=one_call, kv_cache_dtype=kv_cache_dtype)
        assert llm.kv.dtype_name == ("int8" if kv_cache_dtype == "int8" else "float32")
        assert llm.execution["layers"] == ("one C call a step" if one_call else "one call each")
        ids = torch.randint(0, 384, (40,), generator=torch.Generator().manual_seed(3)).tolist()
        out = llm.generate([ids, ids[:7]], SamplingParams(max_tokens=8, prompt_logprobs=0, logprobs=0))
        assert (isinstance(llm.model.executor, OneCall) and llm.model.executor.built is not None) == one_call
        results.append([(o.token_ids, [p.logprob for p in o.prompt_logprobs[1:]], [p.logprob for p in o.logprobs])
                        for o in out])
    assert results[0] == results[1]


def damaged(src: Path, out: Path, damage: str) -> Path:
    """A copy of the Q4_1 file `src` damaged one way, at the byte positions gguf's reader gives for the valid file."""
    import gguf

    data = bytearray(src.read_bytes())
    reader = gguf.GGUFReader(src)
    tensors = {t.name: t for t in reader.tensors}
    q = tensors["blk.0.attn_q.weight"]
    info = q.field.offset + 8 + len(q.name.encode())  # past the name: its dimension count, dims, type, offset
    dims_at, type_at = info, info + 4 + 8 * len(q.shape)
    if damage == "nan scale":
        data[q.data_offset : q.data_offset + 2] = b"\x00\x7e"  # block 0's d, a float16 NaN
    elif damage == "relabelled":
        data[type_at : type_at + 4] = (1).to_bytes(4, "little")  # F16: read as 3.2 times its bytes
    elif damage == "overlap":
        k = tensors["blk.0.attn_k.weight"]
        data[type_at + 4 : type_at + 12] = (k.data_offset - reader.data_offset).to_bytes(8, "little")
    elif damage == "tensor count":
        data[8:16] = (2**40).to_bytes(8, "little")
    elif damage == "24 bytes":
        data = data[:24]
    elif damage == "truncated":
        data = data[: len(data) * 2 // 3]
    else:  # 99 dimensions
        data[dims_at : dims_at + 4] = (99).to_bytes(4, "little")
    out.write_bytes(data)
    return out


DAMAGED = {"nan scale": r"tensor blk\.0\.attn_q\.weight \(Q4_1\) has a non-finite scale of block 0",
           "relabelled": r"blk\.0\.attn_q\.weight.*(runs past the end|overlap)",
           "overlap": r"tensors blk\.0\.attn_\w\.weight \(Q4_1\) and blk\.0\.attn_\w\.weight overlap",
           "tensor count": r"the header counts 1099511627776 tensors, more than a file of \d+ bytes holds",
           "24 bytes": r"the header counts \d+ metadata keys, more than a file of 24 bytes holds",
           "truncated": r"data runs past the end of the file \(\d+ bytes\): truncated",
           "99 dimensions": r"(malformed GGUF file|has 99 dimensions)"}
"""Each damage, and what the refusal must say (besides the file's path, on one line)."""


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_an_inconsistent_or_malformed_file_is_refused_in_one_line_naming_what(ckpts, tmp_path, damage):
    """A GGUF file whose tensor table or data cannot be right is refused when it is opened (or its tensors read), in
    one line naming the file and what is wrong: never loaded into wrong text (a NaN scale made every request emit
    token 0), never a reader's IndexError from deep inside."""
    good = write_gguf(ckpts["llama"], tmp_path / "good.gguf", "llama", "Q4_1")
    path = damaged(good, tmp_path / "bad.gguf", damage)
    with pytest.raises(ValueError) as refused:
        LLM(str(path), kv_disk_gib=0)
    message = str(refused.value)
    assert str(path) in message and "\n" not in message, message
    assert re.search(DAMAGED[damage], message), message
