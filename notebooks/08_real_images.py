# %% [markdown]
# # A real image pipeline: from a plain DataLoader to the fastest configuration
#
# JPEG files (made on this machine by `lab.workloads`, photo-like, 20-80 KB each),
# read, decoded with PIL, randomly cropped and flipped, normalized, stacked: the
# input pipeline of an image classifier. The training step is a small real model
# (three convolutions and a linear layer, forward, backward, SGD) on the CPU. The
# journey: measure the loader as it is, find the stage that limits it, compare the
# runners, and take the fastest configuration away as code. Every number below is
# measured by the notebook as it runs; on another machine they will differ.

# %%
import spdl_lab as lab

N, BATCH, CROP = 384, 16, 112   # small for CI; raise N and CROP=224 on a real machine

dl = lab.workloads.image_dataloader(n=N, batch_size=BATCH, num_workers=2, crop=CROP)
pipeline, step = lab.workloads.images(n=N, crop=CROP, batch_size=BATCH, epochs=6)
print(step)


# %% [markdown]
# First the loader as a user has it: a map-style Dataset in a torch DataLoader with two
# workers. `lab.run` times the training loop: how long each step waits for its batch.

# %%
def steady_rate(session, skip=4):
    # batches/s after the first steps, so the workers' start-up is not counted
    done = session.clock.records()[skip:]
    return (len(done) - 1) / (done[-1].end_s - done[0].end_s)

session = lab.run(dl, step=step, steps=20)
assert session.wait(timeout=180)
plain = session.stats().step
plain_rate = steady_rate(session)
print(f"plain DataLoader, num_workers=2: {plain_rate:.1f} batches/s after start-up, "
      f"the step waited for data {plain.data_wait_frac:.0%} of the loop "
      f"(step p50 {plain.step_p50_ms:.0f} ms, wait p50 {plain.data_wait_p50_ms:.1f} ms)")

# %% [markdown]
# `lab.workloads.images` is the same work split into stages (read, decode, augment,
# normalize, collate), so `lab.diagnose` can measure each alone in threads and say what
# limits it. PIL releases the GIL while it decodes, so decode should not read gil-bound;
# what it reads on this machine is printed below. `processes=False` leaves out the sweep
# in worker processes (notebook 06 shows it): a stage that holds no GIL has nothing to
# gain there, and starting the workers would more than double this cell's time on two cores.

# %%
QUICK = lab.SweepSettings(warmup_s=0.1, window_s=0.2, min_windows=3, max_windows=4)
diag = lab.diagnose(pipeline, concurrency=(1, 2, 4), num_items=64, settings=QUICK, processes=False,
                    progress=False)
print(diag.headline())
diag.verdicts()

# %% [markdown]
# Now the same pipeline and step under every runner, in interleaved rounds
# (`thread`; `subprocess-threads`, the thread engine in a child process; `process`, a
# torch DataLoader with worker processes; `cache`, the headspace where loading is free).

# %%
cmp = lab.compare(pipeline, step=step, steps=36, warmup=4, repeats=3, progress=False)
cmp.table[["batches_per_s", "batches_per_s_lo", "batches_per_s_hi", "vs_cache", "data_wait_frac",
           "step_p50_ms", "cpu_percent"]].round(3)

# %%
for warning in cmp.warnings:
    print("-", warning)

# %% [markdown]
# The fastest runner that really loads (not `cache`), with each stage at the smallest
# concurrency diagnose found within 5% of its best, as code to paste into a training
# script. When the comparison could not tell runners apart (see the warnings), the
# choice among them is a coin toss, and the printout says so.

# %%
table = cmp.table.drop(index="cache")
best = table["batches_per_s"].idxmax()
concurrency = {name: s.best_concurrency for name, s in diag.stages.items() if s.best_concurrency}
chain = "".join(f'.with_concurrency("{name}", {n})' for name, n in concurrency.items())
print(f"loader = lab.Loader(pipeline{chain}, runner={best!r})")
tied = [r for r in table.index if r != best and table.loc[r, "batches_per_s_hi"] >= table.loc[best, "batches_per_s_lo"]]
ratio = table.loc[best, "batches_per_s"] / table.loc["process", "batches_per_s"]
print(f"{best}: {table.loc[best, 'batches_per_s']:.1f} batches/s, {ratio:.2f}x the process runner "
      f"(torch DataLoader workers running the same chain) in the same rounds; {table.loc[best, 'vs_cache']:.2f}x the headspace")
print("within noise of it: " + (", ".join(tied) if tied else "none"))

# %% [markdown]
# Last, that configuration as a training loop, beside the plain DataLoader the notebook
# started with (two runs one after the other, so the machine's noise applies).

# %%
tuned_pipeline = pipeline
for name, n in concurrency.items():
    tuned_pipeline = tuned_pipeline.with_concurrency(name, n)
tuned = lab.run(tuned_pipeline, step=step, runner=best, steps=20)
assert tuned.wait(timeout=180)
fast, fast_rate = tuned.stats().step, steady_rate(tuned)
print(f"{best} with {concurrency}: {fast_rate:.1f} batches/s, data wait {fast.data_wait_frac:.0%}; "
      f"the plain DataLoader: {plain_rate:.1f} batches/s, data wait {plain.data_wait_frac:.0%} "
      f"({fast_rate / plain_rate:.2f}x)")
