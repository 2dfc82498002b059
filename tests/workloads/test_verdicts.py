"""Diagnose on the real stages, checked against what their code does (real timing: `measurement`).

* the pure-Python tokenizer is a Python loop over the document: it holds the GIL;
* the Rust tokenizer's per-document ``Tokenizer.encode`` was measured to hold the GIL as
  well (flat QPS from 1 to 4 threads, the probe waiting about half the time, while two
  processes doubled it): the call converts its input and builds its ``Encoding`` under the
  GIL. Tutorial 09 shows it and says so; ``encode_batch`` releases it for the whole batch;
* reading a file and Pillow's JPEG decode release the GIL (``read()`` in the OS, Pillow's
  decoder inside ``ImagingSectionEnter``), so neither may be judged gil-bound; what limits
  them on a 2-core machine is the cores or nothing.
"""

from __future__ import annotations

import pytest

import spdl_lab as lab
from spdl_lab.workloads._images import ListFiles, decode_pil, image_files, read_bytes
from spdl_lab.workloads._text import Documents, PythonTokenize, RustTokenize, corpus, tokenizer_file

pytestmark = [pytest.mark.measurement, pytest.mark.timeout(300)]


def _diagnose(pipeline: lab.Pipeline) -> lab.Diagnosis:
    # The verdicts come from the thread sweep alone; processes only add advice (not checked here).
    return lab.diagnose(pipeline, concurrency=(1, 2, 4), num_items=400, processes=False, progress=False)


@pytest.mark.parametrize("tokenizer", [PythonTokenize, RustTokenize])
def test_both_tokenizers_hold_the_gil(tokenizer):
    documents = Documents(corpus(400, None), 400)
    pipeline = lab.Pipeline(documents).map(tokenizer(tokenizer_file(None, 8_000)), name="tokenize")
    stage = _diagnose(pipeline).stages["tokenize"]
    assert stage.verdict == "gil-bound", (stage.verdict, stage.evidence)


def test_file_reads_and_pil_decode_are_not_gil_bound():
    files = ListFiles(image_files(400, (256, 512), None), 400)
    pipeline = lab.Pipeline(files).map(read_bytes, name="read").map(decode_pil, name="decode")
    diagnosis = _diagnose(pipeline)
    for name in ("read", "decode"):
        stage = diagnosis.stages[name]
        assert stage.verdict != "gil-bound", (name, stage.evidence)
        assert stage.verdict in ("scales", "cpu-bound", "contended"), (name, stage.verdict)
    decode = diagnosis.stages["decode"]
    # Pillow decodes with the GIL released: two threads decode more than one, up to the cores.
    assert decode.verdict in ("scales", "cpu-bound"), decode.evidence


def test_the_rust_tokenizers_batch_call_releases_the_gil():
    from spdl_lab.workloads._text import RustTokenizeBatch

    documents = Documents(corpus(1_600, None), 1_600)
    pipeline = (lab.Pipeline(documents).batch(16)
                .map(RustTokenizeBatch(tokenizer_file(None, 8_000)), name="tokenize"))
    stage = _diagnose(pipeline).stages["tokenize"]
    assert stage.verdict != "gil-bound", stage.evidence
