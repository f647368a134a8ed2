"""A tiny, randomly initialised Llama that vLLM can serve offline: built here, never fetched from a hub.

The weights are random (seeded, so every build gives the same files), so replies are gibberish of the
requested length: what the tests and benchmarks need is a real vLLM doing real scheduling, batching,
KV-cache paging and streaming, not sensible text. The tokenizer is a byte-level BPE trained by the
`tokenizers` library on a generated corpus, saved with a Llama-3 style chat template so that
/v1/chat/completions and /v1/responses work.

Run it with the vLLM venv's Python (it needs torch, transformers and tokenizers, which that venv has):

    $(infra/vllm/install.sh)/bin/python infra/vllm/tiny_model.py        # prints the model folder

Idempotent: a stamp that records the build's parameters makes a second call return at once; a lock makes
parallel callers wait for one build; the folder is built beside it and renamed into place.

    ROLLFLOW_CACHE             the cache folder (default ~/.cache/rollflow)
    ROLLFLOW_VLLM_TINY_MODEL   where the model goes (default $ROLLFLOW_CACHE/vllm-tiny-llama)
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import shutil
import sys
from pathlib import Path

CACHE = Path(os.environ.get("ROLLFLOW_CACHE", Path.home() / ".cache/rollflow"))
DEFAULT_DIR = Path(os.environ.get("ROLLFLOW_VLLM_TINY_MODEL", CACHE / "vllm-tiny-llama"))
SEED = 0
# The build's parameters: a change here makes the next call rebuild.
SPEC = {
    "version": 1,
    "seed": SEED,
    "bpe_vocab": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # head_dim 64, which vLLM's CPU attention supports
    "max_position_embeddings": 2048,
    "dtype": "bfloat16",
}
STAMP_NAME = ".rollflow-tiny-model.json"
BOS, EOS, PAD = "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"
SPECIAL = [BOS, PAD, "<|start_header_id|>", "<|end_header_id|>", EOS]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% else %}{% set content = message['content'] | map(attribute='text') | join('') %}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + content | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
_WORDS = (
    "the of and to in is that for it as with was on be by at this are from or an have not which but "
    "all they one their there been has more will can if when what about would so up out them some "
    "time into only other new two could these may first any like then now than also after most over "
    "model token answer question solve compute number value step reason proof equal sum product "
    "rollout reward agent server request reply batch cache queue latency throughput prompt sample"
)
WORDS = _WORDS.split()


def corpus(lines: int = 20_000) -> list[str]:
    """Generated text to train the BPE on: words, numbers, punctuation and code-ish lines, seeded."""
    rng = random.Random(SEED)
    out = []
    for _ in range(lines):
        parts = []
        for _ in range(rng.randint(4, 24)):
            roll = rng.random()
            if roll < 0.75:
                word = rng.choice(WORDS)
                parts.append(word.capitalize() if rng.random() < 0.1 else word)
            elif roll < 0.9:
                parts.append(str(rng.randint(0, 10_000)))
            else:
                parts.append(rng.choice("+-*/=().,;:!?{}[]<>\"'#$%&"))
        out.append(" ".join(parts))
    return out


def build_tokenizer(vocab_size: int):
    """A byte-level BPE (every string encodes) with the chat special tokens, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=SPEC["max_position_embeddings"],
    )


def build(out: Path) -> None:
    """Write the tokenizer, config, generation config and seeded random weights into `out`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(SPEC["bpe_vocab"])
    tokenizer.save_pretrained(out)
    # Older transformers keep the template only in tokenizer_config.json; write the file newer ones read too.
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # exactly the tokenizer's: every id the model samples decodes
        hidden_size=SPEC["hidden_size"],
        intermediate_size=SPEC["intermediate_size"],
        num_hidden_layers=SPEC["num_hidden_layers"],
        num_attention_heads=SPEC["num_attention_heads"],
        num_key_value_heads=SPEC["num_key_value_heads"],
        max_position_embeddings=SPEC["max_position_embeddings"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype=SPEC["dtype"],
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(getattr(torch, SPEC["dtype"]))
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)


def ensure(model_dir: Path = DEFAULT_DIR) -> Path:
    """The tiny model's folder, built first if it is missing or was built from other parameters."""
    model_dir = Path(model_dir)
    stamp = model_dir / STAMP_NAME

    def ready() -> bool:
        try:
            return json.loads(stamp.read_text()) == SPEC
        except (OSError, ValueError):
            return False

    if ready():
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{model_dir}.build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready():  # another caller built it while this one waited
            return model_dir
        tmp = model_dir.with_name(model_dir.name + ".building")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        build(tmp)
        (tmp / STAMP_NAME).write_text(json.dumps(SPEC))
        shutil.rmtree(model_dir, ignore_errors=True)
        tmp.rename(model_dir)
    return model_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    print(ensure(args.dir), flush=True)


if __name__ == "__main__":
    sys.exit(main())
