"""A small randomly initialised Llama-style chat model, built locally (no model hub) for bench/real_engine.py.

Runs in the engine's own environment (torch, transformers, tokenizers), not rollflow's:
    python bench/real_engine_model.py OUT_DIR [--layers N --hidden N --heads N --vocab N]
The tokenizer is a byte-level BPE trained in a second on generated arithmetic text, with a chat template;
the model's generation config has no end-of-sequence token, so every request generates exactly its
max_tokens (a rollout has a fixed cost). OUT_DIR then loads with `from_pretrained(OUT_DIR)`.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
WORDS = [
    "what", "is", "the", "sum", "of", "and", "plus", "minus", "times", "answer",
    "number", "so", "we", "get", "then", "it", "equals", "total",
]  # fmt: skip


def corpus(lines: int = 20_000, seed: int = 0) -> Iterator[str]:
    """Text like the bench's prompts and like arithmetic replies, to train the tokenizer on."""
    rnd = random.Random(seed)
    for i in range(lines):
        a, b = rnd.randint(1, 999), rnd.randint(1, 999)
        words = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(3, 12)))
        yield f"#{i}: what is {a} + {b}? {words} {a + b}. The answer is \\boxed{{{a + b}}}."


def build_tokenizer(vocab: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>", bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer, layers: int, hidden: int, heads: int, seed: int = 0):  # type: ignore[no-untyped-def]
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=None,  # no end of sequence: every request runs to its max_tokens
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=1.0, top_p=1.0, max_new_tokens=32, pad_token_id=tokenizer.pad_token_id
    )
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    args = ap.parse_args()
    tokenizer = build_tokenizer(args.vocab)
    model = build_model(tokenizer, args.layers, args.hidden, args.heads)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.out)
    model.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"params": params, "vocab": len(tokenizer), **vars(args), "out": str(args.out)}))


if __name__ == "__main__":
    main()
