"""Lab 8 exercise 3's notebook cells (instructor only): compressing the gradients DDP sends.

``CELLS`` is the section as the lead assembles it into the notebook: prose on DDP's
communication hooks and half-precision compression, the solution cell (``%%writefile
compress.py``), the test cell, prose on PowerSGD, its demo (2 gloo processes over a pretend
slow link: bytes per step, time per step and the loss, against all-reduce and float16), a
predict-then-explain question and the written answer (2 points).
"""

from __future__ import annotations

from ddp_lab.answers.lab08.ex3 import SOLUTION_CELL
from ddp_lab.grading.authoring import code, md, solution, test, written

_INTRO = r"""
## 3. Sending fewer bytes: a DDP communication hook

When the link is the bottleneck (the exposed communication of section 1), you can send fewer
bytes. DDP lets you replace *how* it combines the gradients, while it keeps the rest: the
buckets, the overlap with the backward pass, the copy into `.grad`.

**A communication hook.** `ddp_model.register_comm_hook(state, hook)` (once, before the
first backward pass) makes DDP call `hook(state, bucket)` for every bucket, as soon as all
of the bucket's gradients are ready on this rank, instead of its own all-reduce:

- `bucket.buffer()` is the bucket's gradients on this rank as **one flat tensor** (float32
  here; `bucket.index()` numbers the buckets, `bucket.parameters()` lists their
  parameters). DDP packs the gradients of several parameters into one bucket (up to
  `bucket_cap_mb`; by default all of them share one bucket at the first step, and after it
  DDP rebuilds the buckets in the order the gradients became ready);
- `state` is whatever you registered: here the process group the hook averages over
  (`None` meaning the default group, as everywhere in `torch.distributed`:
  `dist.get_world_size(None)` is the default group's size);
- the hook returns a `torch.futures.Future` whose value is the bucket's **new content**, a
  tensor of the buffer's shape; DDP copies it into the parameters' `.grad` once it is done
  (and waits for every bucket's Future at the end of `backward()`). DDP divides nothing
  itself when a hook is registered: the buffer holds this rank's own gradients, and the hook
  decides what comes back.

`dist.all_reduce(t, group=g, async_op=True)` returns a *work* handle; `work.get_future()` is a
Future whose value is a list holding `t`, and `fut.then(fn)` is a new Future whose value is
`fn(fut)`'s return value, computed when `fut` is done: that is how a hook does something
after the communication without waiting for it.

**Compression.** A float16 or bfloat16 number takes 2 bytes, a float32 one 4: an all-reduce
of the bucket in half precision moves half the bytes (a ring all-reduce sends each rank
`2 (n - 1) / n` times the tensor's bytes), so on a link that is the bottleneck it takes
about half the time. The price is rounding, and range:

| dtype | bytes | significant bits | largest finite | smallest normal |
| --- | --- | --- | --- | --- |
| float32 | 4 | 24 | 3.4e38 | 1.2e-38 |
| bfloat16 | 2 | 8 | 3.4e38 | 1.2e-38 |
| float16 | 2 | 11 | 65504 | 6.1e-5 |

bfloat16 keeps float32's range and drops precision; float16 keeps more precision in a small
range. Gradients can be large: a loss summed rather than averaged, or the loss scaling of
mixed precision (lab 5: `GradScaler` starts at a scale of 65536 and doubles it after every
2000 steps without an overflow). Then each rank's
gradient may fit float16 while a sum of them does not: on 3 ranks, three values of 40,000
add up to 120,000, which float16 rounds to `inf`. What you compute in which order decides
which intermediate values the compressed dtype must hold.

### Exercise 3 (4 points): `make_compress_hook`

Write `make_compress_hook(dtype)` in `compress.py`; the docstring is the contract. torch has
these hooks already (`fp16_compress_hook` and `bf16_compress_hook` in
`torch.distributed.algorithms.ddp_comm_hooks.default_hooks`); the check runs them on the
same DDP job as the oracle, and yours must give the same gradients bit for bit.

The grader runs your file on 3 ranks (torchrun): an MLP trained 4 DDP steps with your hook
(one bucket at the first step, three or more after), in float16 and in bfloat16, over all
3 ranks with `process_group` None and over a group of ranks 0 and 1, with gradients close to
float16's limit. It compares every rank's gradients and parameters with torch's hooks after
every step, and records what your hook sends for every bucket: one all-reduce of the
compressed dtype, nothing else.
"""

_TEST = """# Runs compress.py on 3 ranks (torchrun): DDP steps with your hook in float16 and
# bfloat16, over all 3 ranks and a group of 2, against torch's own hooks, bit for bit.
checks.compress_hook("compress.py")
### BEGIN HIDDEN TESTS
from ddp_lab.grading.verdict import hidden_test
hidden_test("test_ex3_compress_hook")
### END HIDDEN TESTS"""

_POWERSGD = r"""
### Fewer numbers: PowerSGD

Half precision halves the bytes. PowerSGD (Vogels et al., 2019; `powerSGD_hook` in
`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`) sends far fewer *numbers*: it
replaces each weight's gradient matrix `M` (`n x m`) by a rank-`r` approximation `P Q^T` and
sends only the factors. Per bucket and step, with `Q` (`m x r`) kept from the previous step
(*warm start*; random at the first): `P = M Q`, all-reduce `P`, orthogonalize its columns,
`Q = M^T P`, all-reduce `Q`, and the new gradient is `P Q^T`, the same on every rank. That
is `r (n + m)` numbers instead of `n m`: for a 384 x 384 weight at rank 1, 768 instead of
147,456. Vectors (biases), and matrices that would not shrink at least `min_compression_rate`
(2) times, are all-reduced as they are.

`PowerSGDState(process_group, matrix_approximation_rank=r, start_powerSGD_iter=k, ...)` holds
what the hook remembers between steps. It all-reduces plainly for the first `k` steps (at
least 2 when error feedback or warm start is on). With `use_error_feedback=True` (the
default), every rank keeps, per bucket, the difference between what it put in (its gradient)
and what came back (the approximation, the same on every rank), and adds it to its next
step's gradient before compressing.

The next cell writes a script that trains the same MLP (176,650 parameters, one bucket) on 2
gloo processes with four hooks: `allreduce_hook` (what DDP does without a hook),
`fp16_compress_hook`, and PowerSGD at rank 1 with and without error feedback. The link is
pretend-slow: every `dist.all_reduce` these hooks call waits `bytes / 20 MB/s` first (and runs
at once on the calling thread). The script counts the bytes each rank all-reduces, times the
steps (from the third on, when PowerSGD compresses) and measures the loss on a fixed
evaluation set after 10, 20 and 40 steps.
"""

_SCRIPT = r'''
%%writefile powersgd_demo.py
"""Four DDP communication hooks on 2 gloo processes over a pretend slow link: the bytes
each rank all-reduces per step, the time per step, the loss on a fixed evaluation set."""
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.launch import write_result

LINK = 20e6  # bytes per second: every all-reduce first waits its bytes / LINK
STEPS, CHECKS = 40, (10, 20, 40)
dist.init_process_group("gloo")
rank = dist.get_rank()
sent, real_all_reduce = [0], dist.all_reduce


class Done:
    """What an async all_reduce returns, for one that has finished already."""

    def __init__(self, tensor):
        self.fut = torch.futures.Future()
        self.fut.set_result([tensor])

    def get_future(self):
        return self.fut

    def wait(self):
        return True


def slow_all_reduce(tensor, group=None, async_op=False, **kwargs):
    """dist.all_reduce over the slow link, at once on this thread: count, wait, reduce."""
    sent[0] += tensor.numel() * tensor.element_size()
    time.sleep(tensor.numel() * tensor.element_size() / LINK)
    real_all_reduce(tensor, group=group, **kwargs)
    return Done(tensor) if async_op else None


dist.all_reduce = slow_all_reduce  # every hook below calls dist.all_reduce
torch.manual_seed(0)  # the same task on both ranks: labels from a random "teacher"
teacher = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 10))
x_eval = torch.randn(1024, 64)
y_eval = teacher(x_eval).argmax(1)


def batch(step):
    g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch
    x = torch.randn(64, 64, generator=g)
    return x, teacher(x).argmax(1)


def train(name, state, hook):
    torch.manual_seed(1)  # the same initial model for every hook
    model = DDP(nn.Sequential(nn.Linear(64, 384), nn.ReLU(), nn.Linear(384, 384), nn.ReLU(),
                              nn.Linear(384, 10)))
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, t0, b0 = {}, 0.0, 0
    for step in range(1, STEPS + 1):
        if step == 3:  # PowerSGD compresses from its third step on: measure from there
            t0, b0 = time.perf_counter(), sent[0]
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step in CHECKS:
            with torch.no_grad():
                losses[step] = F.cross_entropy(model.module(x_eval), y_eval).item()
    n = STEPS - 2
    return {"hook": name, "bytes": (sent[0] - b0) / n,
            "ms": 1e3 * (time.perf_counter() - t0) / n, "loss": losses}


def powersgd_state(**kw):
    return powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                  start_powerSGD_iter=2, **kw)


rows = [
    train("all-reduce (float32)", None, default_hooks.allreduce_hook),
    train("fp16_compress_hook", None, default_hooks.fp16_compress_hook),
    train("PowerSGD rank 1", powersgd_state(), powersgd.powerSGD_hook),
    train("PowerSGD rank 1, no error feedback",
          powersgd_state(use_error_feedback=False, warm_start=False), powersgd.powerSGD_hook),
]
write_result({"rows": rows})
dist.destroy_process_group()
'''

_QUESTION = r"""
**Predict, then explain (written answer, 2 points).** Before you run the next cell, predict:
(a) how many bytes per step each of the four hooks all-reduces, roughly, relative to plain
all-reduce; (b) whether PowerSGD at rank 1 gives the same loss curve as plain all-reduce, and
whether it still converges, with and without error feedback, and why. Then run the cell and
explain what you see, numbers included: the bytes, the time per step (what else costs time
besides the link?), and the losses.
"""

_RUN = r"""
if not checks.GRADING:  # (the grader skips the demonstrations: it judges the exercises)
    res = torchrun("powersgd_demo.py", nproc=2, timeout=120)
    print(f"{'hook':36} {'bytes/step':>11} {'ms/step':>8}   loss after 10, 20, 40 steps")
    for row in res.result["rows"]:
        losses = ", ".join(f"{row['loss'][str(s)]:.3f}" for s in (10, 20, 40))
        print(f"{row['hook']:36} {row['bytes']:>11,.0f} {row['ms']:>8.1f}   {losses}")
"""

_ANSWER = r"""### BEGIN SOLUTION
**Model answer.** (a) Plain all-reduce sends the 176,650 float32 gradients, 706,600 bytes per
step; `fp16_compress_hook` exactly half, 353,300. PowerSGD at rank 1 sends, per weight of
`n x m`, `n + m` numbers (P, then Q) and the biases as they are: 778 + 832 numbers of the
factors and 778 of the biases, 9,552 bytes, 74 times fewer than all-reduce, with or without
error feedback (it changes what is compressed, not how much is sent).

(b) No, not the same curve: the rank-1 `P Q^T` is only an approximation of the averaged
gradient (a 384 x 384 gradient has far more than one direction), so each step moves the
weights differently, and the loss falls more slowly: on this machine about 2.08 / 1.64 / 0.87
after 10 / 20 / 40 steps for all-reduce (float16 gives the same to 3 digits), 2.14 / 1.94 /
1.55 for PowerSGD with error feedback, and 2.18 / 2.12 / 2.02 without it, which barely
learns. It still converges with error feedback because nothing of a gradient is lost for
good: what a rank put in and did not get back is kept and added to that rank's next
gradient, so over a few steps every direction of the gradients is applied (late, not
never), and training keeps making progress, more slowly than with all-reduce. Without error
feedback each step keeps only its rank-1 part and throws the rest away for good; SGD then
follows a biased direction and stalls. (Warm start helps too: reusing Q from the last step
lets one power iteration per step track the leading directions.)

Time (it varies with the machine's load): about 42 to 47 ms per step for all-reduce, of
which 35 ms are the link's (706,600 bytes at 20 MB/s), 25 to 30 for float16 (half the
waiting), 11 to 20 for PowerSGD: its link time is about 0.5 ms, what is left is computation,
the step's own (the forward and backward passes, the optimizer: the 7 to 12 ms all-reduce
spends besides waiting) plus PowerSGD's (two matrix products per weight, the
orthogonalization, the error bookkeeping). Compression trades bytes for computation and for
a noisier gradient; it pays when the link is slow compared with the computation, and error
feedback is what makes a very low rank usable.

**Rubric (2 points).**
- 1 point: the bytes (half for float16; `r (n + m)` per weight and the biases for PowerSGD,
  orders of magnitude fewer) and the time read from the run, naming PowerSGD's computation
  as what is left (a prediction that was wrong is fine if the explanation of the run is
  right).
- 1 point: PowerSGD's loss curve differs (slower, because the low-rank gradient is an
  approximation) yet converges because error feedback carries the left-out part into the
  next steps, so no direction is lost; the run without error feedback shows the
  difference. "It is the same because the error is small" or no mechanism: 0.
### END SOLUTION"""

CELLS = [
    md("ex3_md", _INTRO),
    solution("ex3_compress_hook", SOLUTION_CELL),
    test("test_ex3_compress_hook", _TEST, points=4),
    md("ex3_powersgd_md", _POWERSGD),
    code("ex3_powersgd_script", _SCRIPT),
    md("ex3_q_powersgd", _QUESTION),
    code("ex3_powersgd_run", _RUN),
    written("ex3_a_powersgd", "ex3_q_powersgd", _ANSWER, 2),
]
