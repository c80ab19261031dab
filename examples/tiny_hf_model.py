"""A tiny Qwen3-MoE in the Hugging Face layout, with a BPE tokenizer trained on a directory of text: a stand-in
for your own checkpoint on a first day (README.md, "Your own checkpoint, start to finish").

    python examples/tiny_hf_model.py runs/first-day/base --corpus docs

Writes what transformers' ``save_pretrained`` writes for a model and its tokenizer: config.json,
model.safetensors, generation_config.json, tokenizer.json and tokenizer_config.json. The weights are random
(transformers' initialisation, seeded); the tokenizer is byte-level BPE with ``<|endoftext|>`` as its only
special token, the end of each document (``python -m moe.data prepare`` finds it by that name) and the model's
bos and eos. Needs the ``hf`` and ``data`` extras (transformers, safetensors, tokenizers).
"""

from __future__ import annotations

import argparse
from pathlib import Path

EOD = "<|endoftext|>"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python examples/tiny_hf_model.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("out", help="the directory to write (new, or empty)")
    p.add_argument("--corpus", default="docs", help="a directory of text files to train the tokenizer on")
    p.add_argument("--vocab-size", type=int, default=512, help="tokens in the BPE vocabulary (and the model's)")
    p.add_argument("--seed", type=int, default=0, help="of the random weights")
    return p


def train_tokenizer(corpus: Path, vocab_size: int):
    """A byte-level BPE tokenizer (transformers' fast tokenizer) trained on the text files under ``corpus``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from moe.data import TEXT_SUFFIXES

    files = sorted(str(p) for p in corpus.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise SystemExit(f"error: --corpus {corpus}: no text files ({', '.join(sorted(TEXT_SUFFIXES))})")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train(files, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOD, eos_token=EOD, pad_token=EOD)


def tiny_qwen3_moe(vocab_size: int, eod_id: int, seed: int):
    """Four layers of 8 experts (2 routed per token), hidden size 64: about 0.4 M parameters."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        bos_token_id=eod_id,
        eos_token_id=eod_id,
        pad_token_id=eod_id,
        tie_word_embeddings=False,
    )
    return transformers.Qwen3MoeForCausalLM(cfg)


def main(argv: list[str] | None = None) -> Path:
    args = _parser().parse_args(argv)
    out, corpus = Path(args.out), Path(args.corpus)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"error: {out} exists and is not an empty directory")
    if not corpus.is_dir():
        raise SystemExit(f"error: --corpus {corpus}: no such directory")
    tokenizer = train_tokenizer(corpus, args.vocab_size)
    model = tiny_qwen3_moe(len(tokenizer), tokenizer.convert_tokens_to_ids(EOD), args.seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: Qwen3-MoE of {params / 1e6:.2f} M parameters, a BPE tokenizer of {len(tokenizer)} tokens")
    return out


if __name__ == "__main__":
    main()
