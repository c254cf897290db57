"""Lab 8's notebook, built from Python: ``python -m ddp_lab.answers.lab08.notebook`` writes
``solutions/lab08_profiling/lab08_profiling.ipynb`` (then ``make release``).

The sections of the four exercises are ``CELLS`` of ``exN_cells.py`` (prose, solution cell,
test cell, written answer, demos); this module adds the introduction, the set-up, "What goes
wrong", the seeds box and the recap. Edit these modules, not the notebook:
``tests/test_lab08_notebook.py`` fails when the committed notebook is not what they build.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ddp_lab.grading.authoring import code, md, write_notebook

PATH = Path(__file__).resolve().parents[3] / "solutions/lab08_profiling/lab08_profiling.ipynb"

INTRO = md(
    "intro",
    r"""
# Lab 8 - Profiling and performance

A DDP job that runs slower than it should raises no error. The loss falls, the GPUs are
busy, and a quarter of every step goes to waiting: for a gradient bucket that the backward
pass could not hide, for one rank whose data loading is slow, for arithmetic done in the
wrong precision. The only way to know is to measure where the time goes. This lab reads
`torch.profiler` traces of real DDP steps, on every rank, and turns them into decisions.

**What you will be able to do**

- record a trace of a few DDP steps on every rank (`torch.profiler`, as the course's
  trainer does with `--profile`) and read it as a timeline: compute, communication, and the
  communication the backward pass did not hide;
- find the straggler of a job from its ranks' traces: which rank, and which phase of its
  step, makes all the others wait;
- halve the bytes DDP sends with a communication hook that compresses gradients to fp16 or
  bf16, equal to PyTorch's own, and see what PowerSGD trades for far fewer bytes;
- count the FLOPs of a training step and compare the FLOP/s achieved with this machine's
  peak: a utilisation figure like the MFU of large-model reports.

| exercise | what you write | points |
| --- | --- | --- |
| 1 | `step_breakdown`: compute, communication, exposed communication per step, from a trace | 4 |
| 2 | `find_straggler`: the slow rank and its slow phase, from every rank's trace | 3 |
| 3 | `compress.py`: a gradient-compression communication hook, on every rank | 4 |
| 4 | `train_flops`: the FLOPs of a training step, forward and backward | 3 |
| written | exposed communication on a slower link and with bigger buckets | 2 |
| written | which rank's all-reduce is longest when one rank's forward is slow | 2 |
| written | PowerSGD's loss curve against plain all-reduce | 2 |""",
)

GRADING = md(
    "grading",
    """
**How this lab is graded.** Four exercises (14 points) and three written answers (6 points,
graded by your instructor from the rubric). Each test cell runs a quick check on small fixed
inputs and prints `OK: ...`, or says what it expected and what it got. Exercise 3 is a file
(`%%writefile`) that runs on every rank of a `torchrun` job of 3 processes (with a group of
2 of them inside); its test cell takes ten to twenty seconds.

The points come from the grader. It reruns your code in a fresh process on inputs it draws
when it grades: traces of real DDP jobs it records then (other bucket sizes, link delays,
slow ranks and phases, groups of 2 and 3 ranks), synthetic traces for the edge cases, other
models. Its oracles are independent of your code: its own reading of the same traces, the
slow rank it chose, PyTorch's own compression hooks, `FlopCounterMode` on the real model.
Each exercise is graded on its own.""",
)

SETUP = code(
    "setup",
    '''
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # several processes share a laptop's cores

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddp_lab.checks import lab08 as checks
from ddp_lab.launch import torchrun

torch.manual_seed(0)
torch.set_num_threads(1)  # as each of your DDP ranks runs
print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
      f"CUDA GPUs: {torch.cuda.device_count()}")


def finished(path):
    """True when a %%writefile exercise file exists and no longer holds the stub."""
    return Path(path).is_file() and "NotImplementedError" not in Path(path).read_text()''',
)

WRONG = [
    md(
        "wrong_md",
        """
## What goes wrong

### Measuring the measurement

A profiler records every operator it sees, and recording costs time: more with
`record_shapes=True`, `profile_memory=True` and `with_stack=True`, the settings a first
profile usually asks for, and more for a step of many small operators than for one of a
few large ones. And the first steps of any run pay for what later steps reuse: memory the
allocator has not cached yet, lazy initialisation, cold caches. That is why
`torch.profiler.schedule` skips a few steps (`wait`), records some and throws them away
(`warmup`), and only then keeps what it records (`active`). The cell below times the same
step of a deep, narrow MLP four ways. Before you run it, decide which of the four you would
report as "the step time".""",
    ),
    code(
        "wrong_demo",
        """
import time

from torch.profiler import ProfilerActivity, profile

torch.manual_seed(0)
# 40 small layers: many short operators, the case where recording costs most
model = nn.Sequential(*[m for _ in range(40) for m in (nn.Linear(64, 64), nn.ReLU())],
                      nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))


def timed_steps(n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return times


first = timed_steps(1)[0]
plain = sorted(timed_steps(15))[7]
with profile(activities=[ProfilerActivity.CPU]):
    timed_steps(3)  # the profiler's own start-up
    light = sorted(timed_steps(15))[7]
with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True,
             with_stack=True):
    timed_steps(3)
    heavy = sorted(timed_steps(15))[7]
for name, t in (("the very first step", first), ("median step, no profiler", plain),
                ("median step, profiler (CPU only)", light),
                ("median step, shapes + memory + stacks", heavy)):
    print(f"{name:>40}: {t * 1e3:6.2f} ms ({t / plain:.2f} x)")""",
    ),
    md(
        "wrong_after",
        """
Report the steady state without the profiler, and read the profile for *proportions*
(which phase, which rank, how much is hidden), not for absolute times. Where a number
matters, such as the step time of a bucket size you are choosing, time it without the
profiler, over many steps, and compare medians.

### Timing a GPU from the host

On a GPU, `time.perf_counter()` around a step measures how long the host took to *queue*
the kernels, not how long they ran: CUDA calls return before the work is done. Synchronise
first (`torch.cuda.synchronize()`) or time with CUDA events; the profiler's CUDA activity
(`ProfilerActivity.CUDA`, which the trainer's `--profile` adds on a GPU) records the
kernels themselves, on the device's own clock.""",
    ),
]

SEEDS = md(
    "seeds_checked",
    r"""
> **The seeds, checked.**
>
> - *"Enable `pin_memory=True` and `num_workers=4` in the DataLoader ... these settings
>   keep the synchronisation overhead within 10 % of the total time"* (000, performance).
>   The synchronisation overhead is set by the bytes a step all-reduces against the link,
>   and by how much of it the backward pass hides (section 1); `pin_memory` and
>   `num_workers` change the data phase only. Whether a job is within 10 % is read from its
>   trace, as you did in exercise 1, not promised by loader settings.
> - *"Modern DDP transfers the gradients in the background while computing them"* (004,
>   performance tips). Not all of them. A bucket's all-reduce starts only when every
>   gradient in it is ready, so the bucket that holds the first layers, whose gradients come
>   last, always waits for the end of the backward pass: exposed whatever the link. DDP
>   fills buckets in the reverse order of the parameters and caps the first one at 1 MiB
>   (`dist._DEFAULT_FIRST_BUCKET_BYTES`, 25 MiB after it) so that communication starts
>   early (`torch/nn/parallel/distributed.py`).
> - *"Combine `torch.cuda.amp` with distributed training: FP16 ... reduces memory"* (004).
>   `torch.cuda.amp` is deprecated for `torch.amp` (lab 5), and autocast does not shrink
>   what DDP sends: the parameters stay float32, so do their gradients and DDP's buckets
>   (measured: `tests/test_facts.py`). Halving the bytes is a communication hook's job:
>   exercise 3.""",
)

RECAP = md(
    "recap",
    r"""
## Recap

- A trace per rank (`torch.profiler`, a `schedule` that skips and warms up) shows where a
  step's time goes; read it for proportions, time without it.
- Communication is hidden only while the training thread computes; what runs after the
  backward pass, or while the thread waits, is exposed. Slower links and bigger buckets
  expose more; the last bucket is never hidden.
- In a synchronous job the slowest rank sets everyone's step; the others show it as waiting.
  Compare the same phase across ranks to find who is slow and where.
- A communication hook decides what DDP sends: fp16 or bf16 compression halves the bytes
  (divide first, or fp16 overflows); PowerSGD sends far fewer, with error feedback to keep
  the update right on average.
- FLOPs count what the step must do (`FlopCounterMode`: matrix products and convolutions);
  FLOP/s over the machine's peak says how well the time was spent.

## On real GPUs

- **`make lab8`** runs the lab's workload through the trainer with `--profile` on every GPU
  of the node (NCCL, `resnet18`), or on 2 CPU processes (gloo, `cnn`): every rank's trace in
  `results/lab8/trace/` (open one in ui.perfetto.dev or TensorBoard), each phase's time in
  `phases.json`, and the last profiled step of every rank in `timeline.png`. On a GPU the
  trace also holds the CUDA kernels (`ProfilerActivity.CUDA`): NCCL's all-reduce kernels
  run on their own stream, next to the backward's kernels, and the exposed part is what
  runs after the backward's last kernel.
- **Straggler hunting at scale**: NCCL's flight recorder (`TORCH_NCCL_TRACE_BUFFER_SIZE`,
  or `TORCH_FR_BUFFER_SIZE`, greater than 0: `torch/distributed/distributed_c10d.py`) keeps
  each rank's last collectives, with their state, so a slow or hung job can be asked which
  rank had not yet reached which collective.
- **Compression on GPUs**: `ddp_model.register_comm_hook(None, default_hooks.bf16_compress_hook)`
  is one line; PowerSGD (`powerSGD_hook.PowerSGDState(process_group=None,
  matrix_approximation_rank=1, start_powerSGD_iter=...)`) pays off where the link, not the
  GPU, is the bottleneck: across nodes.
- **MFU**: the peak is the GPU's datasheet number for the dtype (bf16 tensor cores); a
  large run reaches 40-50 % (PaLM 540B: 46 %, Chowdhery et al. 2022; Llama 3 405B: 38-43 %,
  The Llama 3 Herd of Models 2024, its table 4). Count FLOPs as you did, divide by step time
  and peak, and the profile tells you where the rest went.""",
)


def cells() -> list[dict]:
    """Every cell of the notebook, in order (cell ids unique)."""
    out = [INTRO, GRADING, SETUP]
    for n in (1, 2, 3, 4):
        out += importlib.import_module(f"ddp_lab.answers.lab08.ex{n}_cells").CELLS
    out += [*WRONG, SEEDS, RECAP]
    ids = [c["id"] for c in out]
    if len(ids) != len(set(ids)):
        raise ValueError(f"cell ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
    return out


if __name__ == "__main__":
    write_notebook(PATH, cells())
    print(f"wrote {PATH}")
