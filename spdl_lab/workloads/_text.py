"""The text workload: generated documents, tokenized (Hugging Face ``tokenizers``, or the same
WordPiece in pure Python), padded, batched. Both hold the GIL per document; ``encode_batch``
releases it for a whole batch, hence ``"rust-batch"``."""

from __future__ import annotations

import functools
import itertools
import json
import os
import string
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np

from .._json import write_atomically
from .._pipeline import Pipeline, check_ints
from .._training import SimulatedDevice
from ..errors import PipelineSpecError
from ._steps import ModelStep, cache_dir, dataloader, seeded, step_for

TOKENIZERS = ("rust", "python", "rust-batch")
PAD, UNK = "[PAD]", "[UNK]"
SYLLABLES = ("ka", "lo", "mi", "ren", "sa", "tor", "vi", "ne", "dal", "qu", "is", "or", "an", "bel",
             "cu", "fen", "go", "har", "ju", "lem", "mar", "nos", "pi", "ras", "sul", "tem", "ux", "zo")


def _words(count: int = 20_000, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words: dict[str, None] = {}
    while len(words) < count:
        parts = rng.integers(0, len(SYLLABLES), size=int(rng.integers(1, 5)))
        words["".join(SYLLABLES[p] for p in parts)] = None
    return list(words)


def make_document(index: int, words: list[str]) -> str:
    """Document ``index``: 50-400 words in sentences, commas and full stops; Zipf-distributed."""
    rng = np.random.default_rng(1_000_003 + index)
    ranks = np.minimum(rng.zipf(1.2, size=int(rng.integers(50, 401))), len(words)) - 1
    out: list[str] = []
    for i, rank in enumerate(ranks):
        word = words[rank] + ("," if rng.random() < 0.08 else "")
        out.append(word + ("." if rng.random() < 0.07 or i == len(ranks) - 1 else ""))
    return " ".join(out)


def corpus(n: int, root: str | os.PathLike | None) -> Path:
    """A file of at least ``n`` documents, one per line (made, or made longer, now)."""
    path = cache_dir(root, "text-v1") / "documents.txt"
    if not path.exists() or path.read_text(encoding="utf-8").count("\n") < n:
        words = _words()
        write_atomically(path, "".join(make_document(i, words) + "\n" for i in range(max(n, 1024)))
                         .encode("utf-8"))
    return path


def tokenizer_file(root: str | os.PathLike | None, vocab_size: int) -> Path:
    """The trained WordPiece tokenizer (``tokenizers`` JSON), trained now if it is not cached."""
    path = cache_dir(root, "text-v1") / f"tokenizer-{vocab_size}.json"
    if path.exists():
        return path
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    except ImportError:
        raise PipelineSpecError("text(): the 'tokenizers' package is missing; pip install tokenizers "
                                "(it is in spdl_lab's dependencies)") from None
    docs = corpus(2_000, root)
    tokenizer = Tokenizer(models.WordPiece(unk_token=UNK, max_input_chars_per_word=100))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=[PAD, UNK],
                                        continuing_subword_prefix="##", show_progress=False)
    with open(docs, encoding="utf-8") as f:
        tokenizer.train_from_iterator((line for line in f), trainer)
    write_atomically(path, tokenizer.to_str().encode("utf-8"))
    return path


class Documents:
    """The source: the first ``n`` documents of the corpus file, read line by line each epoch."""

    def __init__(self, path: Path, n: int) -> None:
        self.path, self.n = Path(path), n

    def __iter__(self):
        with open(self.path, encoding="utf-8") as f:
            for line in itertools.islice(f, self.n):
                yield line.rstrip("\n")

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return f"Documents({str(self.path)!r}, n={self.n})"


class _FromFile:
    """Loaded on first use from ``path``, once per process (a pickled copy loads its own)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}


class RustTokenize(_FromFile):
    """``tokenizers.Tokenizer.encode(doc).ids``."""

    @functools.cached_property
    def tokenizer(self) -> Any:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(self.path)

    def __call__(self, document: str) -> list[int]:
        return self.tokenizer.encode(document, add_special_tokens=False).ids


class RustTokenizeBatch(RustTokenize):
    """``tokenizers.Tokenizer.encode_batch(documents)``: a batch in one call, the GIL released."""

    def __call__(self, documents: list[str]) -> list[list[int]]:  # type: ignore[override]
        return [e.ids for e in self.tokenizer.encode_batch(documents, add_special_tokens=False)]


class PythonTokenize(_FromFile):
    """The same WordPiece tokenizer in pure Python: BERT pre-tokenization (whitespace, then
    each punctuation character alone), then greedy longest-match-first sub-words."""

    @functools.cached_property
    def vocab(self) -> dict[str, int]:
        with open(self.path, encoding="utf-8") as f:
            return json.load(f)["model"]["vocab"]

    def __call__(self, document: str) -> list[int]:
        return [i for word in _pre_tokenize(document) for i in _wordpiece(word, self.vocab)]


def _is_punctuation(ch: str) -> bool:
    return ch in string.punctuation or unicodedata.category(ch).startswith("P")


def _pre_tokenize(document: str) -> list[str]:
    words: list[str] = []
    for chunk in document.split():
        for punctuation, run in itertools.groupby(chunk, _is_punctuation):
            part = "".join(run)
            words += list(part) if punctuation else [part]  # each punctuation mark alone
    return words


def _wordpiece(word: str, vocab: dict[str, int], max_chars: int = 100) -> list[int]:
    if len(word) > max_chars:
        return [vocab[UNK]]
    pieces, start = [], 0
    while start < len(word):
        prefix = "##" if start else ""
        end = next((e for e in range(len(word), start, -1) if prefix + word[start:e] in vocab), None)
        if end is None:
            return [vocab[UNK]]
        pieces.append(vocab[prefix + word[start:end]])
        start = end
    return pieces


class PadTruncate:
    """Token ids -> ``(ids, mask)``, int64 arrays of ``length`` (truncated, or padded with 0)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        kept = ids[: self.length]
        out = np.zeros(self.length, dtype=np.int64)
        out[: len(kept)] = kept
        return out, (np.arange(self.length) < len(kept)).astype(np.int64)


def stack_tokens(items: list[Any], pad: PadTruncate | None = None) -> dict[str, Any]:
    """``(ids, mask)`` pairs, or token id lists that ``pad`` pads first -> the collated batch."""
    import torch

    if pad is not None:
        items = [pad(ids) for ids in items]
    return {"input_ids": torch.from_numpy(np.stack([i for i, _ in items])),
            "attention_mask": torch.from_numpy(np.stack([m for _, m in items]))}


class TextModelStep(ModelStep):
    """A training step on CPU: token embeddings, masked mean pooling, a two-layer classifier."""

    def __init__(self, vocab_size: int, dim: int = 64, classes: int = 4, seed: int = 0) -> None:
        from torch import nn

        self.embed, self.head = seeded(seed, lambda: (
            nn.Embedding(vocab_size, dim), nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, classes))))
        super().__init__([*self.embed.parameters(), *self.head.parameters()], classes, lr=0.05)

    def forward(self, batch: dict[str, Any]) -> Any:
        ids, mask = batch["input_ids"], batch["attention_mask"].unsqueeze(-1).float()
        return self.head((self.embed(ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0))

    def __repr__(self) -> str:
        return f"TextModelStep(embedding {self.embed.num_embeddings} x {self.embed.embedding_dim})"


def text_step(vocab_size: int = 8_000, device: SimulatedDevice | str | None = None) -> Any:
    """The step for the text workload: the CPU model, or a SimulatedDevice."""
    return step_for(device, lambda: TextModelStep(vocab_size))


class DocumentTokens:
    """The text workload as a map-style torch Dataset: ``dataset[i]`` tokenizes document
    ``i`` and pads it, as a user's own Dataset would; the DataLoader's collate stacks them."""

    def __init__(self, n: int = 2_048, tokenizer: str = "rust", root: str | os.PathLike | None = None,
                 vocab_size: int = 8_000, max_length: int = 256) -> None:
        _check_text(n, tokenizer, vocab_size, max_length, 1, 1)
        if tokenizer == "rust-batch":
            raise PipelineSpecError("DocumentTokens tokenizes one document per item: use tokenizer='rust' "
                                    "or 'python' (a DataLoader's batches are collated after the items)")
        vocab = tokenizer_file(root, vocab_size)
        self.documents = list(Documents(corpus(n, root), n))
        self._tokenize = RustTokenize(vocab) if tokenizer == "rust" else PythonTokenize(vocab)
        self._pad = PadTruncate(max_length)

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, index: int) -> dict[str, Any]:
        ids, mask = self._pad(self._tokenize(self.documents[index]))
        return {"input_ids": ids, "attention_mask": mask}


def text_dataloader(n: int = 2_048, batch_size: int = 32, num_workers: int = 2, *, tokenizer: str = "rust",
                    root: str | os.PathLike | None = None, vocab_size: int = 8_000, max_length: int = 256,
                    **dataloader_options: Any) -> Any:
    """The text workload as a plain DataLoader over ``DocumentTokens`` (its default collate
    stacks the ids and masks into int64 tensors); other keyword arguments go to the DataLoader."""
    dataset = DocumentTokens(n, tokenizer, root, vocab_size, max_length)
    return dataloader(dataset, batch_size, num_workers, dataloader_options)


def _check_text(n: Any, tokenizer: Any, vocab_size: Any, max_length: Any, batch_size: Any,
                concurrency: Any) -> None:
    check_ints("text", n=(n, 1), vocab_size=(vocab_size, 100), max_length=(max_length, 1),
               batch_size=(batch_size, 1), concurrency=(concurrency, 1))
    if tokenizer not in TOKENIZERS:
        raise PipelineSpecError(f"text: tokenizer must be one of {TOKENIZERS}, got {tokenizer!r}")


def text(n: int = 2_048, tokenizer: str = "rust", root: str | os.PathLike | None = None, *,
         vocab_size: int = 8_000, max_length: int = 256, batch_size: int = 32, concurrency: int = 2,
         device: SimulatedDevice | str | None = None) -> tuple[Pipeline, Any]:
    """The text workload: ``(pipeline, step)``, tokenized by ``"rust"`` (one document per call),
    ``"python"`` or ``"rust-batch"`` (``encode_batch`` after batching), all giving the same ids;
    ``concurrency``: the tokenize stage's threads. Example::

        pipeline, step = lab.workloads.text(n=4096, tokenizer="python")
        lab.diagnose(pipeline)      # tokenize: gil-bound
    """
    _check_text(n, tokenizer, vocab_size, max_length, batch_size, concurrency)
    vocab = tokenizer_file(root, vocab_size)
    documents = Documents(corpus(n, root), n)
    if tokenizer == "rust-batch":
        pipeline = (Pipeline(documents).batch(batch_size, drop_last=True)
                    .map(RustTokenizeBatch(vocab), concurrency=concurrency, name="tokenize")
                    .map(functools.partial(stack_tokens, pad=PadTruncate(max_length)), name="collate"))
    else:
        tokenize = RustTokenize(vocab) if tokenizer == "rust" else PythonTokenize(vocab)
        pipeline = (Pipeline(documents).map(tokenize, concurrency=concurrency, name="tokenize")
                    .map(PadTruncate(max_length), name="pad")
                    .batch(batch_size, drop_last=True).map(stack_tokens, name="collate"))
    return pipeline, text_step(vocab_size, device)
