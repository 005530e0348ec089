"""GGUF checkpoints: a model's config, tokenizer, chat template and weights in one file, read with `gguf`
(ggml's own reader) and transformers' GGUF conversion.

The first open of a file turns its metadata into an ordinary checkpoint directory in the cache (config.json
with `architectures`, the tokenizer's files with its chat template, a generation_config.json from llama.cpp's
`general.sampling.*` keys when the file has them, and an index of the tensors: name, format, shape, offset),
keyed by the file's path, size and modification time. Reading that metadata takes seconds (the reader walks
every vocabulary entry, transformers reads the file once for the config and once more for the tokenizer), so
later opens, and tensor-parallel workers, read the cache and map the file's tensors directly.

Weights come out under their Hugging Face names, as the safetensors loader yields them: float tensors
(F32, F16, BF16) as torch tensors, block formats as `BlockSource` rows left as the file has them. llama.cpp
stores Llama's q and k rows permuted for its RoPE layout; they are put back in Hugging Face's order here
(a permutation of whole rows, so block data moves unchanged). A Llama 3 file's `rope_freqs` (llama.cpp's
form of the llama3 RoPE scaling) divides the inverse frequencies, as llama.cpp applies it. A mixture of experts
(Qwen3-MoE) stores each projection of all experts stacked ([experts, rows, columns]); each expert's rows are
read from its stretch of the stack, under the per-expert name the model asks for.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.config import model_id
from engine.generation_defaults import FILE as GENERATION_CONFIG
from engine.generation_defaults import GGUF_KEYS
from engine.model.quantized import BlockSource
from kernels.cpu.build import cache_dir
from kernels.quant import BLOCK_TYPES, QTYPES

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

SUFFIX = ".gguf"
GGUF_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM",
                    "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                    "mixtral": "MixtralForCausalLM"}
"""The families whose GGUF tensors the loader maps onto its own (model_type -> architecture); other GGUF files are
refused naming these."""
PERMUTED_ARCHS = ("llama",)
"""GGUF architectures whose q/k rows llama.cpp permuted (its converter's LlamaModel.permute)."""
SHIFTED_NORM_ARCHS = ("gemma2", "gemma3")
"""GGUF architectures whose RMSNorm weights llama.cpp stores as 1 + w (Gemma's norm scales by 1 + w; llama.cpp's
by its weight), as transformers' GGUF loader also undoes."""
INDEX_VERSION = 4  # 2: generation_config.json from the sampling metadata; 3: tensor ranges checked; 4: the added
# tokens in tokenizer_config.json
EXPERT = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+\.weight)")
"""A per-expert HF name (prefix, expert, projection), which GGUF stores in one stacked tensor per projection."""


def is_gguf(path: Path) -> bool:
    return path.suffix == SUFFIX and path.is_file()


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: format name, shape in Hugging Face's order ([out, in]), where its bytes lie."""

    name: str
    qtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF file and the directory its metadata was converted into (`meta`: config.json, tokenizer files)."""

    path: Path
    meta: Path
    architecture: str
    tensors: dict[str, TensorInfo]

    @property
    def formats(self) -> dict[str, int]:
        """How many tensors of each format the file has."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.qtype] = counts.get(t.qtype, 0) + 1
        return counts


def _meta_dir(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{INDEX_VERSION}".encode())
    return cache_dir() / "gguf" / f"{model_id(str(path))}-{key.hexdigest()[:16]}"


def open_gguf(path: Path) -> GGUFCheckpoint:
    """The checkpoint of a GGUF file, its metadata converted into the cache on the first open."""
    meta = _meta_dir(path)
    if not (meta / "tensors.json").is_file():
        log.info("reading %s's metadata into %s (once per file)", path, meta)
        _convert_metadata(path, meta)
    index = json.loads((meta / "tensors.json").read_text())
    tensors = {t["name"]: TensorInfo(t["name"], t["qtype"], tuple(t["shape"]), t["offset"], t["nbytes"])
               for t in index["tensors"]}
    return GGUFCheckpoint(path, meta, index["architecture"], tensors)


def _convert_metadata(path: Path, meta: Path) -> None:
    """Write `meta` (atomically: concurrent engines may open the same file at once)."""
    from transformers import AutoConfig, AutoTokenizer

    reader = _reader(path)
    arch_field = reader.fields.get("general.architecture")
    arch = str(arch_field.contents()) if arch_field is not None else "?"
    tensors = []
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype not in QTYPES:
            raise ValueError(f"{path}: tensor {t.name} is {qtype}; minichat reads {', '.join(QTYPES)}")
        tensors.append({"name": t.name, "qtype": qtype, "shape": [int(d) for d in reversed(t.shape.tolist())],
                        "offset": int(t.data_offset), "nbytes": int(t.n_bytes)})
    _check_ranges(path, tensors, path.stat().st_size)
    if any(t["name"] in ("rope_factors_long.weight", "rope_factors_short.weight") for t in tensors):
        raise ValueError(f"{path}: long-context RoPE factors (rope_factors_long/short, Phi-3's LongRoPE) are not read "
                         f"yet; the model's own checkpoint directory runs")
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{path}: transformers cannot read this GGUF file's metadata ({arch}): {e}") from e
    config = _completed(config, reader, arch)
    if config.model_type not in GGUF_MODEL_TYPES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} ({config.model_type}); minichat runs GGUF files of "
                         f"{', '.join(sorted(GGUF_MODEL_TYPES))}")
    config.architectures = [GGUF_MODEL_TYPES[config.model_type]]
    meta.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=meta.parent, prefix=".convert-"))
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _list_added_tokens(tmp, tokenizer)
        sampling = {key: _decimal(reader.fields[name].contents()) for name, key in GGUF_KEYS.items()
                    if name in reader.fields}
        if sampling:  # read back like any checkpoint's (engine/generation_defaults.py)
            (tmp / GENERATION_CONFIG).write_text(json.dumps(sampling))
        (tmp / "tensors.json").write_text(json.dumps({"architecture": arch, "file": str(path), "tensors": tensors}))
        try:
            os.rename(tmp, meta)
        except OSError:  # another engine converted it first
            if not (meta / "tensors.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _list_added_tokens(directory: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """Name the tokenizer's added tokens in its tokenizer_config.json, as checkpoints on the Hub do. Without them
    transformers parses the whole tokenizer.json in Python at every load to find them: 1.1 s of Gemma 3's 3 s
    (a 33 MB file, 6,384 added tokens; the same tokenizer either way)."""
    path = directory / "tokenizer_config.json"
    settings = json.loads(path.read_text())
    settings.setdefault("added_tokens_decoder", {str(i): token.__getstate__()
                                                 for i, token in tokenizer.added_tokens_decoder.items()})
    path.write_text(json.dumps(settings, ensure_ascii=False))


def _completed(config: PretrainedConfig, reader: GGUFReader, arch: str) -> PretrainedConfig:
    """What transformers' GGUF config leaves out and the file says: the head size (its Qwen3 mapping keeps a
    default), the experts' sizes (Qwen3-MoE's, Qwen2-MoE's and its shared expert's), and Mixtral's experts."""
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    if key_length is not None and hasattr(config, "head_dim"):
        config.head_dim = int(key_length.contents())
    for key, attribute in (("expert_feed_forward_length", "moe_intermediate_size"),
                           ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")):
        rows = reader.fields.get(f"{arch}.{key}")
        if rows is not None and hasattr(config, attribute):
            setattr(config, attribute, int(rows.contents()))
    experts = reader.fields.get(f"{arch}.expert_count")
    if config.model_type in ("llama", "mistral") and experts is not None and int(experts.contents()) > 0:
        return _as_mixtral(config, int(experts.contents()), int(reader.fields[f"{arch}.expert_used_count"].contents()))
    return config


def _as_mixtral(config: PretrainedConfig, experts: int, used: int) -> PretrainedConfig:
    """A llama file with experts, as llama.cpp writes Mixtral, as the Mixtral config transformers' GGUF loader does
    not make of it (the llama config it reads, with the experts; its feed-forward length is an expert's)."""
    from transformers import MixtralConfig

    fields = set(MixtralConfig().to_dict()) - {"model_type", "architectures", "transformers_version"}
    kept = {k: v for k, v in config.to_dict().items() if k in fields}
    return MixtralConfig(**{**kept, "num_local_experts": experts, "num_experts_per_tok": used})


def _reader(path: Path) -> GGUFReader:
    """gguf's reader of the file, or a ValueError naming the file and what is wrong with it."""
    from gguf import GGUFReader

    _check_header(path)
    try:
        return GGUFReader(path)
    except ValueError as e:  # gguf's own say what is wrong (bad magic, a version it cannot read); numpy's do not
        if "reshape" in str(e):  # the view of a tensor's data, cut short by the end of the file
            raise ValueError(f"{path}: a tensor's data runs past the end of the file ({path.stat().st_size} bytes): "
                             f"truncated, or its table of tensors is wrong ({e})") from None
        raise ValueError(f"{path}: {e}") from None
    except (IndexError, TypeError, OverflowError, MemoryError, KeyError, struct.error) as e:
        raise ValueError(f"{path}: malformed GGUF file: its metadata or tensor table runs past the end or holds "
                         f"impossible values ({type(e).__name__}: {e})") from None


MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, key-value count
MIN_KV_BYTES = 8 + 1 + 4 + 1  # a key's length, a one-byte key, a value type, a one-byte value: the least a key takes
MIN_TENSOR_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # a name's length and one byte, dims count, one dim, type, offset: the least


def _check_header(path: Path) -> None:
    """Refuse, naming what is wrong, a file too short for a GGUF header or whose counts of keys and tensors its size
    cannot hold (gguf's reader would index past the end, or try to allocate terabytes, and say neither)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        raise ValueError(f"{path}: {size} bytes, too short for a GGUF header ({HEADER.size} bytes)")
    magic, _, tensor_count, kv_count = HEADER.unpack(head)
    if magic != b"GGUF":
        return  # gguf's reader says "GGUF magic invalid"
    if kv_count * MIN_KV_BYTES > size:
        raise ValueError(f"{path}: the header counts {kv_count} metadata keys, more than a file of {size} bytes holds")
    if tensor_count * MIN_TENSOR_BYTES > size:
        raise ValueError(f"{path}: the header counts {tensor_count} tensors, more than a file of {size} bytes holds")


def _check_ranges(path: Path, tensors: list[dict], size: int) -> None:
    """Every tensor's data lies inside the file, has at most MAX_DIMS dimensions, and no two overlap (a tensor
    relabelled with a bigger format would otherwise read into its neighbours)."""
    for t in tensors:
        if len(t["shape"]) > MAX_DIMS:
            raise ValueError(f"{path}: tensor {t['name']} has {len(t['shape'])} dimensions (at most {MAX_DIMS})")
        if t["offset"] + t["nbytes"] > size:
            raise ValueError(f"{path}: tensor {t['name']}'s data, bytes [{t['offset']}, {t['offset'] + t['nbytes']}), "
                             f"runs past the end of the file ({size} bytes): truncated, or its format or shape is "
                             f"wrong")
    ordered = sorted(tensors, key=lambda t: t["offset"])
    for a, b in itertools.pairwise(ordered):
        if a["offset"] + a["nbytes"] > b["offset"]:
            raise ValueError(f"{path}: tensors {a['name']} ({a['qtype']}) and {b['name']} overlap: bytes "
                             f"[{a['offset']}, {a['offset'] + a['nbytes']}) and [{b['offset']}, "
                             f"{b['offset'] + b['nbytes']}); the file's table of tensors is inconsistent")


SCALES_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
             "Q6_K": (208,)}
"""Where each block format keeps its float16 scales (d, and m or dmin) in a block."""
NON_FINITE = {"F16": 0x7C00, "BF16": 0x7F80}
"""The exponent bits that, all set, make a 16-bit float an infinity or a NaN."""


def _check_finite(path: Path, info: TensorInfo, raw: np.ndarray) -> None:
    """Refuse a tensor with a non-finite value or block scale, naming where: one NaN scale makes every logit NaN
    (every request would then emit token 0 until its length ran out). A pass over the tensor's bytes, once at load."""
    if info.qtype == "F32":
        bad, where = ~np.isfinite(raw.view(np.float32)), "value"
    elif info.qtype in SCALES_AT:
        blocks = raw.reshape(-1, QTYPES[info.qtype].block_bytes)
        scales = np.stack([np.ascontiguousarray(blocks[:, at : at + 2]).view(np.uint16)[:, 0]
                           for at in SCALES_AT[info.qtype]], axis=1)
        bad, where = ((scales & NON_FINITE["F16"]) == NON_FINITE["F16"]).any(axis=1), "scale of block"
    else:
        mask = NON_FINITE[info.qtype]
        bad, where = (raw.view(np.uint16) & mask) == mask, "value"
    if bad.any():
        raise ValueError(f"{path}: tensor {info.name} ({info.qtype}) has a non-finite {where} {int(np.argmax(bad))} "
                         f"(NaN or infinity); the file is damaged")


def _decimal(value: object) -> object:
    """A float32 from the file as the decimal it was written from (0.7, not 0.699999988)."""
    return float(f"{value:.7g}") if isinstance(value, float) else value


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (within each head, interleaved pairs -> two halves)."""
    n = rows.shape[0]
    order = np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(1, 2).reshape(n)
    return rows[order]


def _hf_to_gguf_names(ckpt: GGUFCheckpoint, hf_names: list[str], num_layers: int) -> dict[str, tuple[str, int | None]]:
    """HF name -> the file's tensor holding it, and for an expert its index in that tensor's stack."""
    import gguf

    arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == ckpt.architecture), None)
    if arch is None:
        raise ValueError(f"{ckpt.path}: unknown GGUF architecture {ckpt.architecture!r}")
    names = gguf.get_tensor_name_map(arch, num_layers)
    mapping: dict[str, tuple[str, int | None]] = {}
    for hf in hf_names:
        expert = EXPERT.fullmatch(hf)
        stacked = f"{expert[1]}.{expert[3]}" if expert else hf
        g = names.get_name(stacked, try_suffixes=(".weight", ".bias"))
        if g is not None:
            mapping[hf] = (g, int(expert[2]) if expert else None)
    return mapping


def block_tensor_names(ckpt: GGUFCheckpoint, hf_names: list[str], num_layers: int) -> set[str]:
    """Those of `hf_names` whose tensor the file stores in a block format."""
    mapping = _hf_to_gguf_names(ckpt, hf_names, num_layers)
    return {hf for hf, (g, _) in mapping.items() if g in ckpt.tensors and ckpt.tensors[g].qtype in BLOCK_TYPES}


def read_tensors(ckpt: GGUFCheckpoint, hf_names: list[str], num_layers: int, num_heads: int,
                 num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor | BlockSource]]:
    """The file's tensors under the Hugging Face names in `hf_names` (those it has), block formats as
    `BlockSource` rows straight from the mapped file, float ones as float32/bf16 tensors."""
    data = np.memmap(ckpt.path, dtype=np.uint8, mode="r")
    permuted = ckpt.architecture in PERMUTED_ARCHS
    shifted = ckpt.architecture in SHIFTED_NORM_ARCHS
    for hf, (name, expert) in _hf_to_gguf_names(ckpt, hf_names, num_layers).items():
        info = ckpt.tensors.get(name)
        if info is None:
            continue
        raw, shape = data[info.offset : info.offset + info.nbytes], info.shape
        if expert is not None:  # one expert's stretch of the stacked [experts, rows, columns] tensor
            size = info.nbytes // shape[0]
            raw, shape = raw[expert * size : (expert + 1) * size], shape[1:]
        heads = num_heads if ".q_proj." in hf else (num_kv_heads if ".k_proj." in hf else 0)
        _check_finite(ckpt.path, info, raw)
        if info.qtype in BLOCK_TYPES:
            qtype = QTYPES[info.qtype]
            rows = raw.reshape(shape[0], -1)
            yield hf, BlockSource(qtype, _unpermute(rows, heads) if permuted and heads else rows, shape[1])
            continue
        dense = raw.view({"F32": np.float32, "F16": np.float16, "BF16": np.int16}[info.qtype]).reshape(shape)
        if permuted and heads:
            dense = _unpermute(dense, heads)
        tensor = torch.from_numpy(np.array(dense))
        tensor = tensor.view(torch.bfloat16) if info.qtype == "BF16" else tensor.float()
        yield hf, tensor - 1 if shifted and hf.endswith("norm.weight") else tensor


def rope_factors(ckpt: GGUFCheckpoint) -> torch.Tensor | None:
    """llama.cpp's per-frequency RoPE divisors (Llama 3's scaling as the converter wrote it), if the file has them."""
    info = ckpt.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    if info.qtype != "F32":
        raise ValueError(f"{ckpt.path}: rope_freqs.weight is {info.qtype}, expected F32")
    data = np.memmap(ckpt.path, dtype=np.uint8, mode="r")[info.offset : info.offset + info.nbytes]
    return torch.from_numpy(np.array(data.view(np.float32)))
