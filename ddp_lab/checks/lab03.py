"""Checks of lab 3 (DistributedDataParallel).

Visible checks (called by the notebook's test cells, in the student's kernel):

- :func:`shard_indices` and :func:`learning_rates` call the student's functions directly;
- :func:`ddp_train` runs the student's script ``ddp_train.py`` for real
  (``torchrun --nproc_per_node=2 ddp_train.py ...``) and compares the model rank 0 saved with
  one process trained on the global batch (2 x the per-process batch);
- :func:`evaluate` and :func:`my_ddp` run this module on 2 ranks
  (``python -m ddp_lab.checks.lab03 KIND FOLDER``): every rank calls the student's code
  exactly as the grader does and saves what it got; the kernel judges it with the grader's
  own judge.

Under ``nbgrader autograde`` these three only say so and return (the grader runs the same
code right after, outside the kernel, and its verdict decides), and :data:`GRADING` lets the
notebook skip its torchrun demonstrations: grading time is spent on what is graded.

``EXERCISES`` say how the grader judges the five test cells outside the kernel, on inputs
drawn at grading time: the training function on 3 ranks (weights, the samples each rank
read, logging, saving, set-up and teardown), the evaluation on 2 ranks with shards of
unequal size, the hand-written DDP on 3 ranks that start from different weights, and the
two pure functions (sharding, learning rates) in one process.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddp_lab.checks import CheckFailed, launch_problem, make_verdict, passed
from ddp_lab.grading.exercise import Exercise

LAB = "lab03_ddp"
verdict = make_verdict(LAB)

#: Seconds a visible check's torchrun job may take before it is killed (a hang).
CHECK_TIMEOUT_S = 60.0
#: The stub nbgrader puts into a released solution cell.
STUB = "raise NotImplementedError"
#: float64 exercises: DDP's averaged gradients equal the big batch's to rounding.
ATOL, RTOL = 1e-9, 1e-7


# --------------------------------------------------------------------------- references


class TinyNet(nn.Module):
    """Linear - tanh - (times a buffer) - linear: parameters *and* a buffer, in float64."""

    def __init__(self, d: int, h: int, c: int):
        super().__init__()
        self.hidden = nn.Linear(d, h)
        self.out = nn.Linear(h, c)
        self.register_buffer("scale", torch.ones(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)) * self.scale)


def tiny_net(dims: Sequence[int], state: dict | None = None) -> TinyNet:
    """A float64 :class:`TinyNet` of ``dims = (d, h, c)``, loaded with ``state`` if given."""
    model = TinyNet(*(int(v) for v in dims)).double()
    if state is not None:
        model.load_state_dict(state)
    return model


def _random_state(dims: Sequence[int], gen: torch.Generator) -> dict:
    d, h, c = (int(v) for v in dims)
    return {
        "hidden.weight": torch.randn(h, d, generator=gen, dtype=torch.float64) / math.sqrt(d),
        "hidden.bias": 0.1 * torch.randn(h, generator=gen, dtype=torch.float64),
        "out.weight": torch.randn(c, h, generator=gen, dtype=torch.float64) / math.sqrt(h),
        "out.bias": 0.1 * torch.randn(c, generator=gen, dtype=torch.float64),
        "scale": 0.5 + torch.rand(h, generator=gen, dtype=torch.float64),
    }


class RecordingDataset(Dataset):
    """``(x[i], y[i])`` pairs that remember which indices were read, in order.

    Example:
        >>> ds = RecordingDataset(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long))
        >>> _ = ds[2]; ds.reads
        [2]
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y, self.reads = x, y, []

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        self.reads.append(int(index))
        return self.x[index], self.y[index]


def shuffled_shards(n: int, world_size: int, epoch: int, seed: int) -> list[list[int]]:
    """What ``DistributedSampler(shuffle=True, seed=seed, drop_last=True)`` gives each rank.

    A permutation of ``range(n)`` from a generator seeded with ``seed + epoch``, cut to a
    multiple of ``world_size``, dealt out round-robin.

    Example:
        >>> [len(s) for s in shuffled_shards(7, 3, epoch=0, seed=0)]
        [2, 2, 2]
    """
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    order = order[: n - n % world_size].tolist()
    return [order[r::world_size] for r in range(world_size)]


def train_on_batches(
    model: nn.Module, dataset: Dataset, batches: Sequence[Sequence[int]], lr: float
) -> nn.Module:
    """Plain SGD on mean cross-entropy, one step per list of sample indices (in place)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    device = next(model.parameters()).device
    for idx in batches:
        x, y = next(iter(DataLoader(dataset, batch_size=len(idx), sampler=list(idx))))
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def big_batch_steps(
    n: int, batch_size: int, epochs: int, seed: int, same_order: bool = False
) -> list[list[int]]:
    """The batches of one process that reads ``batch_size`` samples a step, shuffled per epoch.

    Exactly ``single.py``'s order: a permutation from ``seed + epoch`` (``seed`` alone when
    ``same_order``), in chunks of ``batch_size``, the incomplete last chunk dropped.
    """
    steps = []
    for epoch in range(epochs):
        gen = torch.Generator().manual_seed(seed + (0 if same_order else epoch))
        order = torch.randperm(n, generator=gen).tolist()
        steps += [order[k : k + batch_size] for k in range(0, n - batch_size + 1, batch_size)]
    return steps


def reference_train(
    model: nn.Module, dataset: Dataset, batch_size: int, lr: float, epochs: int, seed: int = 0
) -> nn.Module:
    """Train ``model`` in place as ``single.py`` does: the run DDP must reproduce.

    DDP on N ranks with ``batch_size`` samples each equals this with ``N * batch_size``.
    """
    return train_on_batches(
        model, dataset, big_batch_steps(len(dataset), batch_size, epochs, seed), lr
    )


def _rank_alone_steps(n: int, world: int, rank: int, b: int, epochs: int, seed: int):
    steps = []
    for epoch in range(epochs):
        shard = shuffled_shards(n, world, epoch, seed)[rank]
        steps += [shard[k : k + b] for k in range(0, len(shard) - b + 1, b)]
    return steps


def _max_diff(got: dict, expected: dict) -> float:
    worst = 0.0
    for name, value in expected.items():
        g = got.get(name)
        if not isinstance(g, torch.Tensor) or g.shape != value.shape:
            return math.inf
        d = (g.detach().double() - value.detach().double()).abs().max().item()
        worst = max(worst, d if math.isfinite(d) else math.inf)
    return worst


def _same_state(got, expected: dict, atol: float = ATOL, rtol: float = RTOL) -> bool:
    if not isinstance(got, dict) or set(got) != set(expected):
        return False
    for name, value in expected.items():
        g = got[name]
        if not isinstance(g, torch.Tensor) or g.shape != value.shape:
            return False
        g, e = g.detach().double(), value.detach().double()
        if not bool(torch.isfinite(g).all()) or bool(((g - e).abs() > atol + rtol * e.abs()).any()):
            return False
    return True


def _state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _first(items, k: int = 6) -> str:
    items = list(items)
    return ", ".join(str(i) for i in items[:k]) + (", ..." if len(items) > k else "")


def _is_stub(path: Path) -> bool:
    return STUB in path.read_text()


#: True while ``nbgrader autograde`` runs the notebook (the grader, not a student). The
#: notebook skips its torchrun demonstrations then: they teach, they are not graded, and each
#: would cost seconds of every student's grading time. (A constant, not a function: a cheat
#: that replaces every function of this module cannot turn the demonstrations back on.)
GRADING = os.environ.get("NBGRADER_EXECUTION") == "autograde"


def _deferred_to_grader(what: str) -> bool:
    """Under ``nbgrader autograde``, skip a visible check that launches torchrun.

    The grader runs the same code on the same number of processes right after the notebook,
    outside the kernel, and its verdict replaces this cell's outcome; launching the job here
    too would only double the grading time.
    """
    if os.environ.get("NBGRADER_EXECUTION") != "autograde":
        return False
    print(f"{what}: run by the grader outside this kernel (see its verdict below)")
    return True


# --------------------------------------------------------------------------- student code


@contextmanager
def recorded_process_group(calls: list) -> Iterator[None]:
    """Record the student's ``init_process_group`` / ``destroy_process_group`` calls.

    The grader's rank worker has joined the process group already; inside this block the two
    functions only note that they were called (and with which backend), so that ``setup()``
    and ``teardown()`` can be checked without tearing down the grader's group.
    ``dist.is_initialized()`` says what the student's own calls did (DDP's internals use
    ``distributed_c10d``'s, which still sees the real group).
    """
    import torch.distributed.distributed_c10d as c10d

    joined = [False]

    def init(*args, **kwargs):
        backend = args[0] if args else kwargs.get("backend")
        calls.append(("init", "" if backend is None else str(backend)))
        joined[0] = True

    def destroy(*args, **kwargs):
        calls.append(("destroy", ""))
        joined[0] = False

    fakes = {
        "init_process_group": init,
        "destroy_process_group": destroy,
        "is_initialized": lambda: joined[0],
    }
    saved = [(dist, n, getattr(dist, n)) for n in fakes]
    saved += [(c10d, n, getattr(c10d, n)) for n in fakes if n != "is_initialized"]
    for module, name, _ in saved:
        setattr(module, name, fakes[name])
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@contextmanager
def without_torch_ddp() -> Iterator[None]:
    """While the block runs, ``DistributedDataParallel(...)`` raises: write your own."""
    from torch.nn.parallel import DistributedDataParallel

    def refuse(self, *args, **kwargs):
        raise RuntimeError(
            "MyDDP must not use torch's DistributedDataParallel: broadcast the parameters "
            "and all-reduce the gradients yourself"
        )

    original = DistributedDataParallel.__init__
    DistributedDataParallel.__init__ = refuse
    try:
        yield
    finally:
        DistributedDataParallel.__init__ = original


def student_file(name: str, folder: str | Path = ".") -> dict:
    """Run the file a ``%%writefile`` cell wrote; return its namespace."""
    from ddp_lab.grading.student import load_module_file

    path = Path(folder) / name
    if not path.is_file():
        raise FileNotFoundError(f"{name} was not written: keep %%writefile {name} on top")
    return load_module_file(path)


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


# ========================================================================= ex1: sharding


def _as_indices(value) -> torch.Tensor:
    try:
        out = torch.as_tensor(list(value) if not isinstance(value, torch.Tensor) else value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"shard_indices must return a list of ints, got {type(value).__name__}"
        ) from None
    if out.dtype.is_floating_point or out.dim() != 1:
        raise TypeError("shard_indices must return a flat list of ints")
    return out.long()


def _shard_cases(gen: torch.Generator | None = None) -> list[dict]:
    if gen is None:
        return [
            {"n": 23, "world_size": 2, "seed": 0},
            {"n": 50, "world_size": 3, "seed": 7},
            {"n": 48, "world_size": 4, "seed": 11},
        ]
    cases = []
    for world in (2, 3, 4):
        n = int(torch.randint(25, 100, (1,), generator=gen))
        n += n % world == 0 and world < 4  # lengths not divisible by 2 and 3
        cases.append(
            {"n": n, "world_size": world, "seed": int(torch.randint(1, 10**6, (1,), generator=gen))}
        )
    return cases


def _shard_calls(fn: Callable, case: dict) -> dict:
    n, w, seed = case["n"], case["world_size"], case["seed"]

    def all_ranks(epoch: int, s: int) -> list[torch.Tensor]:
        return [_as_indices(fn(n, r, w, epoch, s)) for r in range(w)]

    return {
        "epoch0": all_ranks(0, seed),
        "again": all_ranks(0, seed),
        "epoch1": all_ranks(1, seed),
        "other_seed": all_ranks(0, seed + 1),
    }


def shard_problem(case: dict, got: dict) -> str | None:
    """What is wrong with one case of ``shard_indices`` on every rank, or None."""
    n, w = case["n"], case["world_size"]
    where = f"n = {n}, world_size = {w}"
    shards = [s.tolist() for s in got["epoch0"]]
    k = n // w
    for r, s in enumerate(shards):
        if any(not 0 <= i < n for i in s):
            return f"{where}: rank {r} got indices outside range({n}): {_first(s)}"
        if len(s) != k:
            more = " (padded? drop the last n % world_size samples instead)" if len(s) > k else ""
            return (
                f"{where}: rank {r} got {len(s)} indices; every rank must get exactly n // "
                f"world_size = {k}{more}"
            )
        if len(set(s)) != len(s):
            return f"{where}: rank {r} reads a sample twice: {_first(s)}"
    seen: dict[int, int] = {}
    for r, s in enumerate(shards):
        for i in s:
            if i in seen:
                return (
                    f"{where}: ranks {seen[i]} and {r} both read sample {i}. Every rank must cut "
                    "the *same* permutation: draw it from torch.Generator().manual_seed(seed + "
                    "epoch), not from the global random generator"
                )
            seen[i] = r
    if [s.tolist() for s in got["again"]] != shards:
        return (
            f"{where}: two calls with the same arguments gave different indices: ranks compute "
            "their shards on their own, so the permutation must come from a seeded generator"
        )
    everything = [i for s in zip(*shards, strict=True) for i in s]
    if everything == sorted(everything) or all(s == sorted(s) for s in shards):
        return f"{where}: the samples are not shuffled (rank 0 reads {_first(shards[0])})"
    if [s.tolist() for s in got["epoch1"]] == shards:
        return (
            f"{where}: epoch 1 reads exactly what epoch 0 read: seed the permutation with "
            "seed + epoch (that is what sampler.set_epoch(epoch) does)"
        )
    if [s.tolist() for s in got["other_seed"]] == shards:
        return f"{where}: another seed gave the same shards: seed the generator with seed + epoch"
    return None


def shard_indices(fn: Callable) -> None:
    """Check ``shard_indices(n, rank, world_size, epoch, seed)`` on three small cases.

    Raises:
        CheckFailed: naming the case and what is wrong (overlap, padding, no reshuffle ...).
    """
    from torch.utils.data import DistributedSampler

    same_as_sampler = True
    for case in _shard_cases():
        got = _shard_calls(fn, case)
        if problem := shard_problem(case, got):
            raise CheckFailed(problem)
        n, w, seed = case["n"], case["world_size"], case["seed"]
        for r in range(w):
            sampler = DistributedSampler(
                range(n), num_replicas=w, rank=r, shuffle=True, seed=seed, drop_last=True
            )
            same_as_sampler &= list(sampler) == got["epoch0"][r].tolist()
    extra = "; identical to DistributedSampler(drop_last=True)" if same_as_sampler else ""
    passed(
        "shards are disjoint, equal in size, shuffled, the same on every call, new every epoch"
        + extra
    )


def _shard_inputs(gen: torch.Generator) -> dict:
    return {"cases": _shard_cases(gen)}


def _shard_run(ns: dict, inputs: dict, workdir: Path) -> dict:
    return {"cases": [_shard_calls(ns["shard_indices"], case) for case in inputs["cases"]]}


def _shard_judge(inputs: dict, outputs: dict) -> str:
    for case, got in zip(inputs["cases"], outputs["cases"], strict=True):
        if problem := shard_problem(case, got):
            raise CheckFailed(problem)
    sizes = ", ".join(f"{c['n']} samples on {c['world_size']}" for c in inputs["cases"])
    return f"disjoint, equal, shuffled, reproducible shards, new every epoch ({sizes} ranks)"


# ========================================================================= ex2: DDP training


#: World sizes the grader runs the training function on (one torchrun job each).
TRAIN_WORLD_SIZES = (3,)


def _train_case(gen: torch.Generator, world: int) -> dict:
    d, h, c = (
        int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((3, 7), (4, 9), (2, 5))
    )
    b = int(torch.randint(2, 5, (1,), generator=gen))
    # n = world * k + t with 0 < t < world and k = q * b + (b - 1): DistributedSampler must
    # drop t samples (padding instead gives every rank k + 1 = (q + 1) * b, one batch more),
    # and each rank's shard of k ends with an incomplete batch of b - 1 for the DataLoader to
    # drop. Either mistake then changes what the ranks read, whatever the draw.
    steps = int(torch.randint(4, 8, (1,), generator=gen))
    k = steps * b + b - 1
    n = world * k + int(torch.randint(1, world, (1,), generator=gen))
    return {
        "world_size": world,
        "dims": [d, h, c],
        "init": _random_state((d, h, c), gen),
        "x": torch.randn(n, d, generator=gen, dtype=torch.float64),
        "y": torch.randint(0, c, (n,), generator=gen),
        "batch_size": b,
        "lr": float(0.1 + 0.4 * torch.rand(1, generator=gen).item()),
        "epochs": 2,
        "seed": int(torch.randint(1, 10**6, (1,), generator=gen)),
    }


def _train_inputs(gen: torch.Generator) -> dict:
    return {"cases": [_train_case(gen, world) for world in TRAIN_WORLD_SIZES]}


def _train_run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> dict:
    calls: list = []
    logged: list = []
    out = Path(f"saved-by-rank{rank}-of-{world}.pt").resolve()
    out.unlink(missing_ok=True)
    with recorded_process_group(calls):
        mod = student_file("ddp_train.py")
        got = mod["setup"]()
        calls.append(("setup", ""))
        model = tiny_net(case["dims"], case["init"])
        data = RecordingDataset(case["x"], case["y"])
        mod["train"](
            model,
            data,
            case["batch_size"],
            case["lr"],
            case["epochs"],
            seed=case["seed"],
            out=str(out),
            log=lambda *a, **k: logged.append(" ".join(str(v) for v in a)),
        )
        calls.append(("train", ""))
        saved = torch.load(out, weights_only=True) if out.is_file() else None
        mod["teardown"]()
    try:
        r, w, device = got
        setup = [int(r), int(w), str(device)]
    except (TypeError, ValueError):
        setup = [repr(got)[:200]]
    return {
        "setup": setup,
        "calls": [list(c) for c in calls],
        "reads": torch.tensor(data.reads, dtype=torch.long),
        "logged": logged,
        "saved": dict(saved) if isinstance(saved, dict) else None,
        "final": _state(model),
    }


def _read_problem(case: dict, reads: list[list[int]]) -> str | None:
    n, w, b = len(case["y"]), case["world_size"], case["batch_size"]
    epochs, seed = case["epochs"], case["seed"]
    steps = (n // w) // b

    def expected(seed_of_epoch, drop_batch=True, pad=False) -> list[list[int]]:
        out = [[] for _ in range(w)]
        for epoch in range(epochs):
            s = seed_of_epoch(epoch)
            if pad:
                order = torch.randperm(n, generator=torch.Generator().manual_seed(s)).tolist()
                total = math.ceil(n / w) * w
                order += order[: total - n]
                shards = [order[r::w] for r in range(w)]
            else:
                shards = shuffled_shards(n, w, 0, s)
            for r in range(w):
                keep = (len(shards[r]) // b) * b if drop_batch else len(shards[r])
                out[r] += shards[r][:keep]
        return out

    want = expected(lambda e: seed + e)
    if reads == want:
        return None
    where = f"{w} ranks, {n} samples, batch_size {b}"
    if any(len(r) == 0 for r in reads):
        r = next(i for i, x in enumerate(reads) if not x)
        return (
            f"{where}: rank {r} never read a sample of `dataset`: iterate a DataLoader over it "
            "in this process (num_workers=0)"
        )
    if w > 1 and all(r == reads[0] for r in reads):
        return (
            f"{where}: every rank read the same samples ({_first(reads[0])}): give the "
            "DataLoader a DistributedSampler so that each rank reads its own shard"
        )
    hints = [
        (
            expected(lambda e: seed),
            "every epoch read the samples in epoch 0's order: call "
            "sampler.set_epoch(epoch) at the start of every epoch",
        ),
        (
            expected(lambda e: e),
            "the samples follow seed 0, not `seed`: pass seed=seed to DistributedSampler",
        ),
        (
            expected(lambda e: 0),
            "the samples follow seed 0, not `seed`, and repeat every "
            "epoch: pass seed=seed to DistributedSampler and call sampler.set_epoch(epoch)",
        ),
        (
            expected(lambda e: seed + e, drop_batch=False),
            "each rank also read its incomplete last batch: pass drop_last=True to the DataLoader",
        ),
        (
            expected(lambda e: seed + e, pad=True),
            "the shards were padded with repeated "
            "samples: pass drop_last=True to DistributedSampler",
        ),
    ]
    for other, hint in hints:
        if reads == other:
            return f"{where}: {hint}"
    r = next(i for i in range(w) if reads[i] != want[i])
    return (
        f"{where}: rank {r} read {len(reads[r])} samples ({_first(reads[r])}); expected "
        f"{epochs} epochs x {steps} steps x {b} samples of its shard of DistributedSampler("
        f"dataset, shuffle=True, seed=seed, drop_last=True) with set_epoch(epoch): "
        f"{_first(want[r])}"
    )


def train_problem(case: dict, outs: list[dict]) -> str | None:
    """What is wrong with the student's ``setup`` / ``train`` / ``teardown`` on every rank."""
    w, n, b = case["world_size"], len(case["y"]), case["batch_size"]
    where = f"{w} ranks, {n} samples, batch_size {b}"
    if len(outs) != w:
        return f"expected the results of {w} ranks, got {len(outs)}"
    for r, o in enumerate(outs):
        inits = [c[1] for c in o["calls"] if c[0] == "init"]
        if len(inits) != 1:
            return (
                f"rank {r}: setup() called dist.init_process_group {len(inits)} times; call it "
                "exactly once"
            )
        if "nccl" in inits[0] and "gloo" not in inits[0]:
            return (
                f"rank {r}: setup() asked for the NCCL backend on a machine without GPUs: "
                "use gloo on the CPU (nccl only when torch.cuda.is_available())"
            )
        if len(o["setup"]) != 3:
            return f"rank {r}: setup() must return (rank, world_size, device), got {o['setup'][0]}"
        if o["setup"][:2] != [r, w]:
            return (
                f"rank {r}: setup() returned rank {o['setup'][0]} and world size "
                f"{o['setup'][1]}; expected {r} and {w}: read them from the process group "
                "(dist.get_rank(), dist.get_world_size())"
            )
        if not o["setup"][2].startswith("cpu"):
            return (
                f"rank {r}: setup() chose device {o['setup'][2]!r} on a machine without GPUs; "
                "expected the CPU (cuda:LOCAL_RANK only when CUDA is available)"
            )
    if problem := _read_problem(case, [o["reads"].tolist() for o in outs]):
        return problem

    model = tiny_net(case["dims"], case["init"])
    data = RecordingDataset(case["x"], case["y"])
    expected = _state(reference_train(model, data, w * b, case["lr"], case["epochs"], case["seed"]))
    finals = [o["final"] for o in outs]
    bad = [r for r in range(w) if not _same_state(finals[r], expected)]
    if bad:
        r = bad[0]
        diff = _max_diff(finals[r], expected)
        alone = _state(
            train_on_batches(
                tiny_net(case["dims"], case["init"]),
                data,
                _rank_alone_steps(n, w, r, b, case["epochs"], case["seed"]),
                case["lr"],
            )
        )
        if _same_state(finals[r], alone):
            hint = (
                "rank {r} trained alone on its shard: wrap the model in "
                "DistributedDataParallel so that the gradients are averaged"
            )
        elif not all(_same_state(f, finals[0]) for f in finals):
            hint = (
                "the ranks ended with different weights: wrap the model in "
                "DistributedDataParallel and give the optimizer the wrapped model's "
                "parameters"
            )
        else:
            summed = _state(
                reference_train(
                    tiny_net(case["dims"], case["init"]),
                    data,
                    w * b,
                    case["lr"] * w,
                    case["epochs"],
                    case["seed"],
                )
            )
            hint = (
                "the gradients were summed, not averaged, over the ranks"
                if _same_state(finals[r], summed)
                else "use SGD(lr=lr) and the mean cross-entropy loss of each rank's batch"
            )
        return (
            f"{where}: rank {r}'s final weights differ from one process trained on batches of "
            f"{w} x {b} = {w * b} samples (max abs difference {diff:.3g}): " + hint.format(r=r)
        )
    logs = [len(o["logged"]) for o in outs]
    if any(logs[1:]):
        return (
            f"{where}: ranks {[r for r in range(1, w) if logs[r]]} called log() too: only "
            "rank 0 logs (if rank == 0), or every line appears world_size times"
        )
    if logs[0] != case["epochs"]:
        return (
            f"{where}: rank 0 called log() {logs[0]} times in {case['epochs']} epochs; expected "
            "once per epoch"
        )
    saved = [o["saved"] for o in outs]
    if any(s is not None for s in saved[1:]):
        return (
            f"{where}: ranks {[r for r in range(1, w) if saved[r] is not None]} saved the model "
            "too: only rank 0 writes (the others would overwrite the same file)"
        )
    if saved[0] is None:
        return f"{where}: rank 0 saved nothing to `out`: torch.save(model.state_dict(), out)"
    if any(k.startswith("module.") for k in saved[0]):
        return (
            f"{where}: rank 0 saved the DDP wrapper's state_dict (keys start with 'module.'): "
            "save the plain model's, model.state_dict() (or ddp.module.state_dict())"
        )
    if not _same_state(saved[0], finals[0]):
        return f"{where}: the saved state_dict is not the final model's"
    for r, o in enumerate(outs):
        destroys = [c for c in o["calls"] if c[0] == "destroy"]
        if len(destroys) != 1:
            return (
                f"rank {r}: teardown() called dist.destroy_process_group {len(destroys)} times; "
                "call it once, at the end"
            )
    return None


def _train_judge(inputs: dict, outputs: dict) -> str:
    for case, outs in zip(inputs["cases"], outputs["cases"], strict=True):
        if problem := train_problem(case, outs):
            raise CheckFailed(problem)
    runs = " and ".join(f"{c['world_size']} ranks x {c['batch_size']}" for c in inputs["cases"])
    return (
        f"DDP on {runs} samples ends with the weights of one process on the global batch; "
        "each rank read its own shard, reshuffled every epoch; rank 0 alone logged and saved"
    )


def _torchrun_or_fail(target: str, args: Sequence[str], nproc: int, filename: str, **kw):
    from ddp_lab.launch import LaunchError, LaunchTimeout, torchrun

    try:
        return torchrun(target, args, nproc=nproc, timeout=CHECK_TIMEOUT_S, **kw)
    except LaunchTimeout:
        raise CheckFailed(
            f"{filename} did not finish within {CHECK_TIMEOUT_S:g} s on {nproc} ranks and was "
            "stopped: the ranks are waiting for each other (a collective that only some ranks "
            "call, or ranks that run different numbers of steps?)"
        ) from None
    except LaunchError as err:
        raise CheckFailed(launch_problem(err, filename)) from None


#: The run the visible check of ``ddp_train.py`` makes (the script's own flags).
TRAIN_CHECK = {"epochs": 2, "batch_size": 16, "lr": 0.05, "train_size": 200, "seed": 3}


def ddp_train(path: str = "ddp_train.py", out: str = "ddp_model.pt") -> None:
    """Run ``path`` with ``torchrun --nproc_per_node=2`` and compare with one process.

    The script trains the course MLP on the synthetic set (flags in :data:`TRAIN_CHECK`) and
    saves rank 0's model to ``out``; this check trains the same model in this kernel with
    ``single.py``'s rule on batches of 2 x 16 samples and compares the weights (float32,
    tolerance 1e-5). It also checks that rank 1 printed no log line.

    Raises:
        CheckFailed: with the failing rank's error, or what differs and the likely cause.
    """
    from ddp_lab.data import SyntheticCIFAR
    from ddp_lab.models import build_model

    if _deferred_to_grader(f"{path} on 2 processes"):
        return
    file = Path(path)
    if not file.is_file():
        raise CheckFailed(f"{path} not found in {Path.cwd()}: run the %%writefile cell first")
    if _is_stub(file):
        raise CheckFailed(f"{path} still holds the `{STUB}()` stub: write your solution first")
    t0 = time.monotonic()
    Path(out).unlink(missing_ok=True)
    cfg = TRAIN_CHECK
    args = [f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()] + [f"--out={out}"]
    res = _torchrun_or_fail(str(file), args, 2, file.name)
    rank1 = [line for line in res.logs.get(1, "").splitlines() if line.startswith("epoch")]
    if rank1:
        raise CheckFailed(
            f"rank 1 printed {rank1[0]!r} too: only rank 0 logs (if rank == 0), or every line "
            "appears once per process"
        )
    rank0 = [line for line in res.logs.get(0, "").splitlines() if line.startswith("epoch")]
    if len(rank0) != cfg["epochs"]:
        raise CheckFailed(
            f"rank 0 printed {len(rank0)} lines starting with 'epoch' in {cfg['epochs']} epochs;"
            " expected one per epoch (log(f'epoch {epoch}: ...'))"
        )
    if not Path(out).is_file():
        raise CheckFailed(f"{path} saved no model to {out}: rank 0 saves model.state_dict()")
    got = torch.load(out, weights_only=True)
    torch.manual_seed(cfg["seed"])
    init = build_model("mlp")
    data = SyntheticCIFAR(cfg["train_size"], seed=cfg["seed"])
    state0 = _state(init)
    if set(got) != set(state0):
        prefix = " (keys start with 'module.': save model.state_dict(), not the DDP wrapper's)"
        raise CheckFailed(
            f"{out} holds keys {_first(got, 3)}; expected {_first(state0, 3)}"
            + (prefix if any(k.startswith("module.") for k in got) else "")
        )

    def run(batches, lr=cfg["lr"]) -> dict:
        model = build_model("mlp")
        model.load_state_dict(state0)
        return _state(train_on_batches(model, data, batches, lr))

    n, b, e, s = cfg["train_size"], cfg["batch_size"], cfg["epochs"], cfg["seed"]
    expected = run(big_batch_steps(n, 2 * b, e, s))
    if not _same_state(got, expected, atol=1e-5, rtol=1e-4):
        diff = _max_diff(got, expected)
        hints = [
            (
                lambda: run(big_batch_steps(n, 2 * b, e, s, same_order=True)),
                "every epoch repeated epoch 0's order: call sampler.set_epoch(epoch)",
            ),
            (
                lambda: run(_rank_alone_steps(n, 2, 0, b, e, s)),
                "rank 0 trained alone on its shard: wrap the model in DistributedDataParallel",
            ),
            (
                lambda: run(big_batch_steps(n, 2 * b, e, s), lr=2 * cfg["lr"]),
                "the gradients were summed over the ranks, not averaged",
            ),
        ]
        hint = next(
            (h for make, h in hints if _same_state(got, make(), 1e-5, 1e-4)),
            "did every rank read its own shard (DistributedSampler(dataset, shuffle=True,"
            " seed=seed, drop_last=True)) in batches of batch_size (drop_last=True)?",
        )
        raise CheckFailed(
            f"the model rank 0 saved differs from one process trained on batches of 2 x {b} "
            f"samples (max abs difference {diff:.3g}): {hint}"
        )
    diff = _max_diff(got, expected)
    passed(
        f"{path} on 2 processes x {b} samples equals 1 process x {2 * b} after {e} epochs "
        f"(max abs difference {diff:.1e}); rank 0 alone logged and saved "
        f"({time.monotonic() - t0:.1f} s)"
    )


# ========================================================================= ex3: evaluation


def _eval_case(gen: torch.Generator, world: int) -> dict:
    d = int(torch.randint(3, 7, (1,), generator=gen))
    c = int(torch.randint(3, 6, (1,), generator=gen))
    k = int(torch.randint(12, 25, (1,), generator=gen))
    n = world * k + int(torch.randint(1, world, (1,), generator=gen))  # not divisible by world
    weight = torch.randn(c, d, generator=gen, dtype=torch.float64)
    bias = torch.randn(c, generator=gen, dtype=torch.float64)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    pred = (x @ weight.T + bias).argmax(1)
    right = torch.rand(n, generator=gen) < 0.5
    wrong = (pred + torch.randint(1, c, (n,), generator=gen)) % c
    return {
        "world_size": world,
        "weight": weight,
        "bias": bias,
        "x": x,
        "y": torch.where(right, pred, wrong),
        "batch_size": int(torch.randint(4, 10, (1,), generator=gen)),
    }


def _eval_inputs(gen: torch.Generator) -> dict:
    return {"cases": [_eval_case(gen, 2)]}


def _eval_run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> dict:
    mod = student_file("evaluate.py")
    model = nn.Linear(case["weight"].shape[1], case["weight"].shape[0]).double()
    model.load_state_dict({"weight": case["weight"], "bias": case["bias"]})
    data = RecordingDataset(case["x"], case["y"])
    got = mod["evaluate"](model, data, batch_size=case["batch_size"])
    if not isinstance(got, dict):
        raise TypeError(f"evaluate must return a dict, got {type(got).__name__}")
    return {
        "correct": _number(got.get("correct")),
        "total": _number(got.get("total")),
        "accuracy": _number(got.get("accuracy")),
        "reads": torch.tensor(data.reads, dtype=torch.long),
    }


def eval_problem(case: dict, outs: list[dict]) -> str | None:
    """What is wrong with ``evaluate`` on every rank, or None."""
    w, n = case["world_size"], len(case["y"])
    where = f"{n} samples on {w} ranks"
    pred = (case["x"] @ case["weight"].T + case["bias"]).argmax(1)
    correct = int((pred == case["y"]).sum())
    reads = [o["reads"].tolist() for o in outs]
    owner: dict[int, int] = {}
    for r, rr in enumerate(reads):
        for i in rr:
            if i in owner:
                who = "rank " + str(r) + (" twice" if owner[i] == r else f" and rank {owner[i]}")
                pad = (
                    " DistributedSampler pads the shards with repeated samples: split the indices"
                    " yourself (range(rank, n, world_size))"
                    if all(len(x) == math.ceil(n / w) for x in reads)
                    else ""
                )
                return f"{where}: sample {i} was scored by {who}.{pad}"
            owner[i] = r
    missing = sorted(set(range(n)) - set(owner))
    if missing:
        return f"{where}: samples {_first(missing)} were never scored"
    sizes = [len(x) for x in reads]
    if max(sizes) - min(sizes) > 1:
        return (
            f"{where}: the ranks scored {sizes} samples: split the data set evenly, every rank "
            "scores its own part"
        )
    results = [(o["correct"], o["total"], o["accuracy"]) for o in outs]
    for r in range(1, w):
        if results[r] != results[0]:
            return (
                f"{where}: rank {r} returned {_fmt(results[r])} but rank 0 {_fmt(results[0])}: "
                "sum the counts over the ranks (dist.all_reduce) so that every rank knows the "
                "result"
            )
    got_correct, got_total, got_acc = results[0]
    if got_total != n:
        shard = " (one rank's shard: all_reduce the counts)" if got_total in sizes else ""
        return f"{where}: total = {got_total:g}, expected {n}{shard}"
    if got_correct != correct:
        return f"{where}: correct = {got_correct:g}, expected {correct}"
    if not math.isclose(got_acc, correct / n, rel_tol=1e-12, abs_tol=1e-12):
        return (
            f"{where}: accuracy = {got_acc:.6f}, expected correct / total = {correct / n:.6f}. "
            "The mean of the ranks' accuracies weighs every shard the same, but the shards "
            "differ in size: divide the summed counts"
        )
    return None


def _fmt(result) -> str:
    c, t, a = result
    return f"(correct {c:g}, total {t:g}, accuracy {a:.4f})"


def _eval_judge(inputs: dict, outputs: dict) -> str:
    for case, outs in zip(inputs["cases"], outputs["cases"], strict=True):
        if problem := eval_problem(case, outs):
            raise CheckFailed(problem)
    c = inputs["cases"][0]
    return (
        f"every one of {len(c['y'])} samples scored exactly once on {c['world_size']} ranks; "
        "the exact accuracy on every rank"
    )


# ========================================================================= ex4: your own DDP


def _myddp_case(gen: torch.Generator, world: int, steps: int = 3) -> dict:
    d, h, c = (
        int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((3, 7), (4, 9), (2, 5))
    )
    b = int(torch.randint(3, 7, (1,), generator=gen))
    return {
        "world_size": world,
        "dims": [d, h, c],
        "inits": [_random_state((d, h, c), gen) for _ in range(world)],
        "xs": [torch.randn(steps, b, d, generator=gen, dtype=torch.float64) for _ in range(world)],
        "ys": [torch.randint(0, c, (steps, b), generator=gen) for _ in range(world)],
        "lr": float(0.1 + 0.4 * torch.rand(1, generator=gen).item()),
    }


def _myddp_inputs(gen: torch.Generator) -> dict:
    return {"cases": [_myddp_case(gen, 3)]}


def _myddp_train(wrapped: nn.Module, model: nn.Module, case: dict, rank: int):
    opt = torch.optim.SGD(wrapped.parameters(), lr=case["lr"])
    grads0 = None
    for step, (x, y) in enumerate(zip(case["xs"][rank], case["ys"][rank], strict=True)):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(wrapped(x), y)
        loss.backward()
        if step == 0:
            grads0 = {
                k: (p.grad.detach().clone() if p.grad is not None else torch.full_like(p, math.nan))
                for k, p in model.named_parameters()
            }
        opt.step()
    return grads0


def _myddp_run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> dict:
    with without_torch_ddp():
        mod = student_file("my_ddp.py")
        model = tiny_net(case["dims"], case["inits"][rank])
        wrapped = mod["MyDDP"](model)
        after_wrap = _state(model)
        grads0 = _myddp_train(wrapped, model, case, rank)
    return {"after_wrap": after_wrap, "grads0": grads0, "final": _state(model)}


def _average_grads(case: dict, state: dict) -> tuple[dict, list[dict]]:
    per_rank = []
    for r in range(case["world_size"]):
        model = tiny_net(case["dims"], state)
        loss = nn.functional.cross_entropy(model(case["xs"][r][0]), case["ys"][r][0])
        loss.backward()
        per_rank.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
    mean = {k: torch.stack([g[k] for g in per_rank]).mean(0) for k in per_rank[0]}
    return mean, per_rank


def reference_myddp(case: dict) -> dict:
    """Rank 0's weights after the case's steps, gradients averaged over the ranks' batches."""
    model = tiny_net(case["dims"], case["inits"][0])
    opt = torch.optim.SGD(model.parameters(), lr=case["lr"])
    for step in range(case["xs"][0].shape[0]):
        opt.zero_grad()
        loss = (
            sum(
                nn.functional.cross_entropy(model(case["xs"][r][step]), case["ys"][r][step])
                for r in range(case["world_size"])
            )
            / case["world_size"]
        )
        loss.backward()
        opt.step()
    return _state(model)


def myddp_problem(case: dict, outs: list[dict]) -> str | None:
    """What is wrong with ``MyDDP`` on every rank, or None."""
    w = case["world_size"]
    where = f"{w} ranks that start from different weights"
    start = case["inits"][0]
    for r, o in enumerate(outs):
        after = o["after_wrap"]
        if not _same_state(after, start, 0, 0):
            params = {k: v for k, v in start.items() if k != "scale"}
            if _same_state({k: after[k] for k in params if k in after}, params, 0, 0):
                return (
                    f"{where}: after MyDDP(model), rank {r}'s buffers differ from rank 0's: "
                    "broadcast the buffers too (module.buffers())"
                )
            return (
                f"{where}: after MyDDP(model), rank {r}'s parameters differ from rank 0's: "
                "broadcast every parameter from rank 0 in __init__ (dist.broadcast(p, src=0))"
            )
    mean, per_rank = _average_grads(case, start)
    for r, o in enumerate(outs):
        g = o["grads0"]
        if _same_state(g, mean):
            continue
        if any(bool(torch.isnan(v).all()) for v in g.values()):
            return f"{where}: after loss.backward() rank {r} has parameters without .grad"
        total = {k: v * w for k, v in mean.items()}
        if _same_state(g, total):
            return (
                f"{where}: after backward, rank {r} holds the SUM of the ranks' gradients: "
                "divide by the world size"
            )
        if _same_state(g, per_rank[r]):
            return (
                f"{where}: after backward, rank {r} holds its own gradient: all-reduce every "
                "gradient in a hook (param.register_post_accumulate_grad_hook) and divide by the "
                "world size"
            )
        return (
            f"{where}: after the first backward, rank {r}'s gradient is not the average over "
            f"the ranks (max abs difference {_max_diff(g, mean):.3g})"
        )
    expected = reference_myddp(case)
    for r, o in enumerate(outs):
        if not _same_state(o["final"], expected):
            return (
                f"{where}: after {case['xs'][0].shape[0]} steps rank {r}'s weights differ from "
                f"DDP's (max abs difference {_max_diff(o['final'], expected):.3g}): every step "
                "must average the gradients, not only the first"
            )
    return None


def _myddp_judge(inputs: dict, outputs: dict) -> str:
    for case, outs in zip(inputs["cases"], outputs["cases"], strict=True):
        if problem := myddp_problem(case, outs):
            raise CheckFailed(problem)
    c = inputs["cases"][0]
    return (
        f"MyDDP on {c['world_size']} ranks that start from different weights: rank 0's weights "
        f"everywhere, averaged gradients, the weights of DDP after {c['xs'][0].shape[0]} steps"
    )


# ========================================================================= ex5: learning rates


def _lr_cases(gen: torch.Generator | None = None) -> dict:
    if gen is None:
        scaled = [(0.1, 256, 32, 8, 1), (0.05, 64, 16, 2, 4), (0.4, 1024, 128, 4, 1)]
        warm = [(s, 0.1, 0.8, 5) for s in (0, 1, 2, 5, 9)] + [(3, 0.02, 0.02, 0), (3, 0.1, 0.4, 6)]
        return {"scaled": scaled, "warmup": warm}

    def u(lo, hi):
        return lo + (hi - lo) * torch.rand(1, generator=gen).item()

    def i(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    scaled = []
    for _ in range(6):
        accum = i(2, 5) if len(scaled) % 2 else 1  # > 1: forgetting it must show
        scaled.append((u(0.01, 0.5), 2 ** i(4, 11), i(4, 257), i(2, 65), accum))
    warm = []
    for _ in range(8):
        steps = i(2, 500)
        warm.append((i(0, 2 * steps), u(0.001, 0.1), u(0.1, 2.0), steps))
    warm.append((0, 0.05, 0.4, i(2, 50)))
    warm.append((i(0, 10), 0.05, 0.4, 0))
    return {"scaled": scaled, "warmup": warm}


def expected_scaled_lr(base_lr, base_batch, batch_size, world_size, accum_steps=1) -> float:
    """The linear scaling rule: the learning rate grows with the global batch."""
    return base_lr * batch_size * world_size * accum_steps / base_batch


def expected_warmup_lr(step, base_lr, peak_lr, warmup_steps) -> float:
    """Gradual warm-up: linear from ``base_lr`` (step 0) to ``peak_lr`` (step ``warmup_steps``)."""
    if step >= warmup_steps:
        return peak_lr
    return base_lr + (peak_lr - base_lr) * step / warmup_steps


def _lr_calls(scaled_lr: Callable, warmup_lr: Callable, cases: dict) -> dict:
    return {
        "scaled": [_number(scaled_lr(*c)) for c in cases["scaled"]],
        "warmup": [_number(warmup_lr(*c)) for c in cases["warmup"]],
    }


def lr_problem(cases: dict, got: dict) -> str | None:
    """What is wrong with ``scaled_lr`` / ``warmup_lr``, or None."""
    for c, g in zip(cases["scaled"], got["scaled"], strict=True):
        want = expected_scaled_lr(*c)
        if math.isclose(g, want, rel_tol=1e-9):
            continue
        base_lr, base_batch, b, w, k = c
        said = (
            f"scaled_lr(base_lr={base_lr:.4g}, base_batch={base_batch}, batch_size={b}, "
            f"world_size={w}, accum_steps={k}) = {g:.6g}, expected {want:.6g}"
        )
        ratio = b * w * k / base_batch
        hints = [
            (
                base_lr * math.sqrt(ratio),
                "that is the square-root rule; the linear rule "
                "multiplies by the ratio of global batches itself",
            ),
            (base_lr, "the learning rate must grow with the global batch"),
            (
                base_lr * b / base_batch * k,
                "the global batch counts every process: times world_size",
            ),
            (
                base_lr * b * w / base_batch,
                "the global batch also counts the accumulated micro-batches: times accum_steps",
            ),
            (base_lr / ratio, "the ratio is upside down: a larger batch gets a larger rate"),
            (base_lr * w, "scale by the global batch over base_batch, not by world_size alone"),
        ]
        hint = next(
            (h for v, h in hints if math.isclose(g, v, rel_tol=1e-9)),
            "lr = base_lr * (batch_size * world_size * accum_steps) / base_batch",
        )
        return f"{said}: {hint}"
    for c, g in zip(cases["warmup"], got["warmup"], strict=True):
        want = expected_warmup_lr(*c)
        if math.isclose(g, want, rel_tol=1e-9, abs_tol=1e-12):
            continue
        step, base_lr, peak_lr, n = c
        return (
            f"warmup_lr(step={step}, base_lr={base_lr:.4g}, peak_lr={peak_lr:.4g}, "
            f"warmup_steps={n}) = {g:.6g}, expected {want:.6g}: base_lr at step 0, a straight "
            "line up to peak_lr at step warmup_steps, peak_lr from then on"
        )
    return None


def learning_rates(scaled_lr: Callable, warmup_lr: Callable) -> None:
    """Check ``scaled_lr`` and ``warmup_lr`` on a few hand-picked cases.

    Raises:
        CheckFailed: with the call, the expected and received value, and a hint.
    """
    cases = _lr_cases()
    if problem := lr_problem(cases, _lr_calls(scaled_lr, warmup_lr, cases)):
        raise CheckFailed(problem)
    passed("scaled_lr follows the linear scaling rule; warmup_lr ramps linearly to the peak")


def _lr_inputs(gen: torch.Generator) -> dict:
    return _lr_cases(gen)


def _lr_run(ns: dict, inputs: dict, workdir: Path) -> dict:
    return _lr_calls(ns["scaled_lr"], ns["warmup_lr"], inputs)


def _lr_judge(inputs: dict, outputs: dict) -> str:
    if problem := lr_problem(inputs, outputs):
        raise CheckFailed(problem)
    return (
        f"linear scaling rule on {len(inputs['scaled'])} random set-ups (with accumulation) and "
        f"the warm-up ramp at {len(inputs['warmup'])} steps"
    )


# --------------------------------------------------------------------------- visible checks


#: kind -> (the file the notebook writes, run_rank, the judge's problem finder)
_DISTRIBUTED = {
    "evaluate": ("evaluate.py", _eval_run_rank, eval_problem),
    "my_ddp": ("my_ddp.py", _myddp_run_rank, myddp_problem),
}


def _run_visible(kind: str, case: dict, folder: str | Path = ".") -> list[dict]:
    filename = _DISTRIBUTED[kind][0]
    file = Path(folder) / filename
    if not file.is_file():
        raise CheckFailed(f"{filename} not found in {Path.cwd()}: run the %%writefile cell first")
    if _is_stub(file):
        raise CheckFailed(f"{filename} still holds the `{STUB}()` stub: write your solution first")
    with tempfile.TemporaryDirectory(prefix="lab03-check-") as tmp:
        torch.save({"cases": [case]}, Path(tmp) / "inputs.pt")
        _torchrun_or_fail(
            "ddp_lab.checks.lab03",
            [kind, tmp],
            case["world_size"],
            filename,
            module=True,
            cwd=str(Path(folder).resolve()),
            stream=False,
        )
        return [
            torch.load(Path(tmp) / f"rank{r}.pt", weights_only=True)
            for r in range(case["world_size"])
        ]


def evaluate(path: str = "evaluate.py") -> None:
    """Run ``evaluate`` from ``path`` on 2 ranks and 35 samples; compare with the exact count.

    Raises:
        CheckFailed: duplicates or missing samples, ranks that disagree, a wrong accuracy.
    """
    if _deferred_to_grader(f"evaluate from {path} on 2 processes"):
        return
    t0 = time.monotonic()
    case = _eval_case(torch.Generator().manual_seed(3), 2)
    outs = _run_visible("evaluate", case, Path(path).parent)
    if problem := eval_problem(case, outs):
        raise CheckFailed(problem)
    n = len(case["y"])
    passed(
        f"evaluate counts each of {n} samples once on 2 ranks (shards of {n // 2 + 1} and "
        f"{n // 2}) and every rank gets accuracy {outs[0]['accuracy']:.4f} "
        f"({time.monotonic() - t0:.1f} s)"
    )


def my_ddp(path: str = "my_ddp.py") -> None:
    """Run ``MyDDP`` from ``path`` on 2 ranks next to torch's DDP; compare every rank.

    Each rank starts from its own random weights; after 3 SGD steps every rank must hold
    what ``DistributedDataParallel`` holds.

    Raises:
        CheckFailed: no broadcast, gradients summed or not reduced, weights that differ.
    """
    if _deferred_to_grader(f"MyDDP from {path} on 2 processes"):
        return
    t0 = time.monotonic()
    case = _myddp_case(torch.Generator().manual_seed(4), 2)
    outs = _run_visible("my_ddp", case, Path(path).parent)
    if problem := myddp_problem(case, outs):
        raise CheckFailed(problem)
    diff = max(_max_diff(o["final"], o["ddp_final"]) for o in outs)
    if not diff < 1e-9:
        raise CheckFailed(f"MyDDP and DistributedDataParallel differ by {diff:.3g}")
    passed(
        f"MyDDP equals DistributedDataParallel on 2 ranks after 3 steps (max abs difference "
        f"{diff:.1e}) ({time.monotonic() - t0:.1f} s)"
    )


def _worker(kind: str, folder: str) -> None:
    """One rank of a visible check: run the student's code as the grader does, save it."""
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = torch.load(Path(folder) / "inputs.pt", weights_only=True)
    case = inputs["cases"][0]
    out = _DISTRIBUTED[kind][1]({}, inputs, case, rank, world)
    if kind == "my_ddp":  # torch's DDP from rank 0's weights, for comparison
        model = tiny_net(case["dims"], case["inits"][rank])
        _myddp_train(DistributedDataParallel(model), model, case, rank)
        out["ddp_final"] = _state(model)
    torch.save(out, Path(folder) / f"rank{rank}.pt")
    dist.barrier()
    gc.collect()  # see ddp_lab.dist.teardown
    dist.destroy_process_group()


EXERCISES = [
    Exercise(
        "test_ex1_shard_indices",
        ("ex1_shard_indices",),
        "shards: disjoint, equal, reshuffled every epoch",
        _shard_inputs,
        _shard_judge,
        run=_shard_run,
        timeout=30,
    ),
    Exercise(
        "test_ex2_ddp_train",
        ("ex2_ddp_train",),
        "DDP training equals one process on the global batch",
        _train_inputs,
        _train_judge,
        run_rank=_train_run_rank,
        forbid_modules=("ddp_lab.dist", "ddp_lab.train"),
        timeout=90,
    ),
    Exercise(
        "test_ex3_evaluate",
        ("ex3_evaluate",),
        "exact distributed evaluation",
        _eval_inputs,
        _eval_judge,
        run_rank=_eval_run_rank,
        forbid_modules=("ddp_lab.data", "ddp_lab.dist"),
        timeout=60,
    ),
    Exercise(
        "test_ex4_my_ddp",
        ("ex4_my_ddp",),
        "your own DDP: broadcast and gradient hooks",
        _myddp_inputs,
        _myddp_judge,
        run_rank=_myddp_run_rank,
        timeout=60,
    ),
    Exercise(
        "test_ex5_scaled_lr",
        ("ex5_scaled_lr",),
        "linear learning-rate scaling and warm-up",
        _lr_inputs,
        _lr_judge,
        run=_lr_run,
        timeout=30,
    ),
]


if __name__ == "__main__":
    _worker(*sys.argv[1:3])
