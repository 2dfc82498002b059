# %% [markdown]
# # Two tokenizers and the GIL
#
# Text pipelines tokenize. `lab.workloads.text` makes a corpus on this machine (made-up
# words, Zipf-distributed), trains a WordPiece tokenizer on it with Hugging Face
# `tokenizers` (Rust), and offers the same algorithm in pure Python over the same
# vocabulary. The Python one holds the GIL for every character it looks at. The Rust one
# is often assumed not to; this notebook measures it, one document per call
# (`tokenizer="rust"`) and a batch per call (`"rust-batch"`, `encode_batch`).

# %%
import spdl_lab as lab

N = 1024
# The vocabulary is trained once, then cached beside the corpus; 200 documents to compare.
rust_pipeline, _ = lab.workloads.text(n=200, tokenizer="rust")
python_pipeline, _ = lab.workloads.text(n=200, tokenizer="python")
rust, python = rust_pipeline.stage("tokenize").fn, python_pipeline.stage("tokenize").fn
documents = list(rust_pipeline.source)
same = sum(rust(d) == python(d) for d in documents)
print(f"identical token ids on {same} of {len(documents)} documents; the first begins: {documents[0][:70]}...")

# %% [markdown]
# `lab.diagnose` runs each tokenizer alone in 1, 2 and 4 threads, with a probe that
# measures how long a thread waits for the GIL (`processes=False` leaves out the process
# sweep: whether processes help is notebook 06's question).

# %%
QUICK = lab.SweepSettings(warmup_s=0.1, window_s=0.2, min_windows=3, max_windows=4)
rows = {}
for name in ("python", "rust", "rust-batch"):
    pipeline, _ = lab.workloads.text(n=N, tokenizer=name)
    stage = lab.diagnose(pipeline, concurrency=(1, 2, 4), num_items=256, settings=QUICK,
                         processes=False, progress=False).stages["tokenize"]
    rows[name] = stage
    print(f"{name:10s} {stage.verdict or stage.status:10s} best concurrency {stage.best_concurrency}: {stage.evidence}")

# %%
held = [name for name, stage in rows.items() if stage.verdict == "gil-bound"]
free = [name for name in rows if name not in held]
print(f"hold the GIL (threads do not help): {', '.join(held) or 'none'}; "
      f"do not: {', '.join(free) or 'none'}")

# %% [markdown]
# Why can a Rust tokenizer hold the GIL? A call from Python converts its input and builds
# its result (`Encoding` objects, offsets, ids) as Python objects, under the GIL, and a
# per-document call is short enough that this is most of it. `encode_batch` converts a
# batch once and tokenizes it with the GIL released, spread over all the cores by its own
# Rust threads (`TOKENIZERS_PARALLELISM`), which is why one Python thread of it can fill
# the machine. Whether your tokenizer does one or the other is an implementation detail:
# measure it, as above.
#
# What it means for training: beside a GPU stream whose kernel launches need the GIL
# (`device="simulated"`), a GIL-holding tokenizer under the `thread` runner delays the
# launches. `train_gil_wait_frac` is the training thread's wait for the GIL.

# %%
import pandas as pd

tables = {}
for name in ("python", "rust-batch"):
    pipeline, device = lab.workloads.text(n=N, tokenizer=name, device="simulated")
    cmp = lab.compare(pipeline, step=device, runners=("thread", "subprocess-threads"), steps=24,
                      warmup=4, repeats=2, progress=False)
    tables[name] = cmp.table[["batches_per_s", "train_gil_wait_frac", "data_wait_frac", "cpu_percent"]]
pd.concat(tables, names=["tokenizer", "runner"]).round(3)

# %%
for name, table in tables.items():
    wait = table["train_gil_wait_frac"]
    print(f"{name}: the training thread waited for the GIL {wait['thread']:.0%} of its time under thread, "
          f"{wait['subprocess-threads']:.0%} under subprocess-threads")
