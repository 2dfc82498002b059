"""The text workload: generated documents, two tokenizers with one vocabulary and one output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spdl_lab as lab
from spdl_lab.workloads._text import (
    Documents,
    PadTruncate,
    PythonTokenize,
    RustTokenize,
    corpus,
    tokenizer_file,
)

pytestmark = pytest.mark.usefixtures("no_thread_leak")


def test_the_rust_and_the_python_tokenizer_give_the_same_ids():
    path = tokenizer_file(None, 2_000)
    rust, python = RustTokenize(path), PythonTokenize(path)
    documents = list(Documents(corpus(300, None), 300))
    assert len(documents) == 300 and all(d.endswith(".") for d in documents)
    for document in documents:
        assert rust(document) == python(document)
    assert max(len(rust(d)) for d in documents) > 50
    stamp = path.stat().st_mtime_ns
    assert tokenizer_file(None, 2_000).stat().st_mtime_ns == stamp  # trained once, then cached


def test_punctuation_and_unknown_words_split_as_bert_does():
    path = tokenizer_file(None, 2_000)
    rust, python = RustTokenize(path), PythonTokenize(path)
    for odd in ["ka,lo.mi", "ÿ€ q!!", "x" * 150, "  ", "karen-sator's (vi)"]:
        assert rust(odd) == python(odd), odd


@pytest.mark.parametrize("tokenizer", ["rust", "python"])
def test_the_pipeline_yields_padded_batches_and_the_step_trains(tokenizer):
    pipeline, step = lab.workloads.text(n=64, tokenizer=tokenizer, vocab_size=2_000, max_length=32,
                                        batch_size=16)
    with lab.Loader(pipeline, runner="thread") as loader:
        batches = list(loader)
    assert len(batches) == 4
    ids, mask = batches[0]["input_ids"], batches[0]["attention_mask"]
    assert ids.shape == mask.shape == (16, 32) and ids.dtype == torch.int64
    assert bool(((ids == 0) | (mask == 1)).all()) and int(ids.max()) < 2_000
    assert np.isfinite(step(batches[0]))


def test_pad_truncate():
    ids, mask = PadTruncate(4)([5, 6])
    assert list(ids) == [5, 6, 0, 0] and list(mask) == [1, 1, 0, 0]
    ids, mask = PadTruncate(2)([5, 6, 7])
    assert list(ids) == [5, 6] and list(mask) == [1, 1]


@pytest.mark.parametrize("kwargs, words", [
    ({"tokenizer": "spacy"}, "tokenizer must be one of"),
    ({"n": 0}, "n must be an int >= 1"),
    ({"vocab_size": 10}, "vocab_size must be an int >= 100"),
])
def test_bad_arguments_say_what_to_do(kwargs, words):
    with pytest.raises(lab.PipelineSpecError, match=words):
        lab.workloads.text(**kwargs)


def test_the_text_dataloader_gives_what_the_pipeline_gives():
    dl = lab.workloads.text_dataloader(n=32, batch_size=8, num_workers=0, tokenizer="python",
                                       vocab_size=2_000, max_length=16)
    pipeline, _ = lab.workloads.text(n=32, tokenizer="rust", vocab_size=2_000, max_length=16, batch_size=8)
    with lab.Loader(pipeline, runner="thread") as loader:  # stages keep input order by default
        from_pipeline = list(loader)
    from_dl = list(dl)
    assert len(from_dl) == len(from_pipeline) == 4
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(from_dl, from_pipeline))


def test_rust_batch_tokenizes_after_batching_and_gives_the_same_batches():
    kwargs = dict(n=64, vocab_size=2_000, max_length=24, batch_size=16)
    per_item, _ = lab.workloads.text(tokenizer="rust", **kwargs)
    batched, _ = lab.workloads.text(tokenizer="rust-batch", **kwargs)
    assert [s.name for s in batched.stages] == ["batch", "tokenize", "collate"]
    with lab.Loader(per_item) as a, lab.Loader(batched) as b:
        pairs = list(zip(a, b, strict=True))
    assert len(pairs) == 4
    for x, y in pairs:
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["attention_mask"], y["attention_mask"])
    with pytest.raises(lab.PipelineSpecError, match="tokenizer='rust'"):
        lab.workloads.text_dataloader(n=8, tokenizer="rust-batch")
