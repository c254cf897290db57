"""Lab 8, exercise 4's notebook section: FLOPs of a training step and a utilisation figure."""

from __future__ import annotations

from ddp_lab.answers.lab08.ex4 import SOLUTION_CELL
from ddp_lab.grading.authoring import code, md, solution, test

CELLS = [
    md(
        "ex4_md",
        r"""
## 4. Throughput accounting: FLOPs against the machine's peak

A trace says where the milliseconds went. It does not say whether they were well spent. For
that, count the work a step *must* do and divide by what the machine *can* do: large-model
reports give it as MFU (model FLOPs utilisation, PaLM 2022: achieved FLOP/s over the peak).

Almost all the arithmetic of a training step is matrix products and convolutions.
`torch.utils.flop_counter.FlopCounterMode` counts exactly those, from the shapes of the
operators a step really dispatches: an `(m x k) @ (k x n)` product is `m k n`
multiply-adds, `2 m k n` FLOPs; activations, bias additions, the loss and the optimizer
count nothing.

```python
from torch.utils.flop_counter import FlopCounterMode
with FlopCounterMode(display=False) as counter:
    loss = model(x).sum()
print(counter.get_total_flops())
```

Backward is where the rule of thumb (`6 x parameters x tokens`: 2 forward, 4 backward)
comes from, and where it breaks. For each layer, autograd computes what something needs:
the gradient of the layer's *weight*, if that weight trains, and the gradient of the layer's
*input*, if anything before the layer needs a gradient. Each is a product of the forward's
size. The data a model is fed needs no gradient; a frozen layer (`requires_grad=False`, as
in fine-tuning) needs none for its weight. A convolution applies each weight at every output
position, and a linear layer applied to `(batch, tokens, features)` at every token: count by
shapes, not by parameters.""",
    ),
    md(
        "ex4_ex_md",
        """
### Exercise 4 (3 points): the FLOPs of a training step

Write `train_flops`: the FLOPs of one forward and one backward pass of a model given as a
list of layer specs, as `FlopCounterMode` counts them. The grader builds each model from its
specs and counts with `FlopCounterMode` around the forward pass and around `backward()`:
MLPs on one sample and on `(batch, tokens, features)`, convolutions with stride, padding and
odd or non-square inputs, frozen first, middle and last layers.""",
    ),
    solution("ex4_flops", SOLUTION_CELL),
    test(
        "test_ex4_flops",
        """
# Checks train_flops against FlopCounterMode on three real models: an MLP on one sample,
# a CNN and an MLP with a frozen middle layer.
checks.train_flops(train_flops)
### BEGIN HIDDEN TESTS
from ddp_lab.grading.verdict import hidden_test
hidden_test("test_ex4_flops")
### END HIDDEN TESTS""",
        points=3,
    ),
    md(
        "ex4_mfu_md",
        """
Now the utilisation of this machine on the course's MLP (batch 256, SGD with momentum, one
thread, as each of your DDP ranks runs). The peak is measured too: the best FLOP/s of a
`1024 x 1024` float32 matrix product on the same thread. The profiler's table then says
where the rest of the step goes.""",
    ),
    code(
        "ex4_mfu",
        """
from torch.profiler import ProfilerActivity, profile

from ddp_lab.figures import lab08 as figures8
from ddp_lab.models import build_model

torch.manual_seed(0)
model = build_model("mlp")
specs = [{"kind": "flatten"}] + [
    {"kind": "linear", "in": m.in_features, "out": m.out_features, "bias": True, "frozen": False}
    if isinstance(m, nn.Linear) else {"kind": "relu"}
    for m in model.net[1:]
]
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,))


def step():
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


for _ in range(3):
    step()  # warm-up
steps = 20
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(steps):
        step()
groups = figures8.op_groups(prof.key_averages())
seconds = sum(groups.values()) / steps
peak = figures8.matmul_peak()
print(f"matmul peak here: {peak / 1e9:.1f} GFLOP/s; one step: {seconds * 1e3:.2f} ms of "
      "operator time")
try:
    flops = sum(train_flops(specs, [256, 3, 32, 32]).values())
    print(f"{flops / 1e9:.2f} GFLOP per step -> {flops / seconds / 1e9:.1f} GFLOP/s achieved, "
          f"{flops / seconds / peak:.0%} of the peak")
    matmul = groups["matmul"] / steps
    print(f"the matrix products alone: {matmul * 1e3:.2f} ms, {flops / matmul / peak:.0%} of "
          f"the peak; everything else: {(seconds - matmul) * 1e3:.2f} ms")
    display(figures8.utilisation(groups, flops, peak, steps))
except NotImplementedError:
    print("finish exercise 4 first")""",
    ),
    md(
        "ex4_after",
        """
Two things keep a step below the peak, and the two printed lines separate them. The matrix
products themselves run below the peak's `1024 x 1024` square: their shapes are other
(`256 x 3072` by `3072 x 256` here) and the backward's products read transposed operands.
Everything else (the activations and their gradients, the loss, the optimizer's update of
every parameter) is a pass over memory with almost no arithmetic: time without FLOPs. On a
GPU the same accounting adds what this CPU run hides: kernel launches, the wait for data,
and the exposed communication of section 1. MFU is the one number that includes them all,
which is why large-model reports give it.""",
    ),
]
