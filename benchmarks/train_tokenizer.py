"""Train the byte-level BPE tokenizer (vocab 8192) of the embedded target model on the training corpus.

    python benchmarks/train_tokenizer.py --out checkpoints/specla-gdn-tiny

Saves a ``PreTrainedTokenizerFast`` whose only special token, ``<|endoftext|>``, is bos, eos and pad. Encoding with
special tokens prepends it, as every document is preceded by it in the packed training stream.
The whole corpus (132 MB) trains in about 20 s on 2 cores; ``--max-mb`` caps it.
"""
from __future__ import annotations

import argparse
import json
import lzma
import time
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOT = "<|endoftext|>"
DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus"


def iter_texts(path: Path) -> Iterator[str]:
    """The "text" field of each JSON line of an xz-compressed shard."""
    with lzma.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def read_texts(paths: list[Path], max_bytes: float) -> list[str]:
    """Documents in shard order (shards are shuffled across sources), up to ``max_bytes`` of UTF-8 in all."""
    texts, total = [], 0
    for path in paths:
        for text in iter_texts(path):
            texts.append(text)
            total += len(text.encode("utf-8"))
            if total >= max_bytes:
                return texts
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """Byte-level BPE as in GPT-2: no unknown tokens, whitespace runs kept (code indentation)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    eot_id = tok.token_to_id(EOT)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot_id)]),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT,
                                   unk_token=None, model_max_length=1 << 20)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    """``save_pretrained``, with ``tokenizer.json`` written as compact JSON: the embedded checkpoints travel with every
    GPU call, and indented it is 2.5x the size; it loads the same."""
    tokenizer.save_pretrained(folder)
    path = Path(folder) / "tokenizer.json"
    path.write_text(json.dumps(json.loads(path.read_text(encoding="utf-8")), ensure_ascii=False, separators=(",", ":")),
                    encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="folder with train-*.jsonl.xz")
    ap.add_argument("--out", type=Path, default=Path("checkpoints/specla-gdn-tiny"))
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--max-mb", type=float, default=float("inf"), help="train on at most this much text")
    args = ap.parse_args()

    t0 = time.time()
    paths = sorted(args.corpus.glob("train-*.jsonl.xz"))
    if not paths:
        raise SystemExit(f"no train-*.jsonl.xz under {args.corpus}")
    texts = read_texts(paths, args.max_mb * 2**20)
    print(f"{len(texts)} documents, {sum(map(len, texts)) / 2**20:.1f} M characters from {len(paths)} shards")
    tokenizer = train_tokenizer(texts, args.vocab_size)
    save_tokenizer(tokenizer, args.out)
    sample = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    ids = tokenizer(sample)["input_ids"]
    print(f"vocab {len(tokenizer)}, {len(sample)} chars -> {len(ids)} tokens, round trip "
          f"{tokenizer.decode(ids, skip_special_tokens=True) == sample}; {time.time() - t0:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
