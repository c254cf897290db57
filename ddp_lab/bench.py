"""``make bench``: the trainer next to plain PyTorch, measured side by side (instructor-only).

Three measurements, written to ``results/bench/bench.json`` and ``bench.png``:

1. **Throughput pairs.** For 1 and for 2 processes (``--nprocs``), interleaved launches:
   reference, plain, trainer, reference, plain, trainer, ... (``--pairs`` rounds). Two
   plain PyTorch DDP scripts in the style of the official pytorch/examples DDP tutorial
   (:func:`reference`: ``init_process_group``, ``DistributedSampler``, ``DDP``, SGD,
   cross-entropy, nothing else): the *reference* reads the trainer's synthetic set
   (``ddp_lab.data``, as the trainer reads it); the *plain* one shares nothing with the
   trainer but the model: an in-memory ``TensorDataset`` of random CIFAR-shaped tensors, as
   a student's script would hold them. The *trainer* is ``torchrun -m ddp_lab.train`` with
   its defaults (``--log-every 10``; more flags with ``--trainer-args``). Same launcher,
   model, per-process batch, steps, optimizer settings, threads and loader workers; all
   count samples/s and the page faults of the slowest rank (:mod:`ddp_lab.hostmem`) from
   the end of the first step to the end of the last one. Each round gives the ratios
   trainer / reference and trainer / plain; the report is their median, min and max, so
   that the machine's drift over minutes cancels within a round instead of deciding which
   side wins. Also the trainer's 2 / 1-process speed-up (median of its runs).
2. **Communication share of a step** (2 processes): blocks of DDP steps with the gradient
   all-reduce, alternating with blocks under ``no_sync`` (no all-reduce); share = 1 -
   no_sync / synced step time, next to the trainer's own ``comm_share`` (its comm hook).
3. **Bus bandwidth**: ``dist.all_reduce`` against the course's ring all-reduce (lab 2's
   reference, on send/recv) over message sizes, interleaved per size; bus bandwidth =
   2(n-1)/n x size / time (the nccl-tests convention, comparable across world sizes), and
   the alpha-beta model ``T = 2(n-1) alpha + 2(n-1)/n S / B`` fitted to each.

``make bench BENCH_ARGS="--pairs 3 --steps 40"``; ``python -m ddp_lab.bench --help``.
Instructor-only (it imports the answers); not in the student kit.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

import torch

from ddp_lab.dist import teardown
from ddp_lab.launch import torchrun, write_result

PROG = "ddp_lab.bench"
#: Message sizes of the bandwidth sweep: 4 KiB to 64 MiB.
SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


# --------------------------------------------------------------------------- pure parts


#: The three launches of a round, in order.
KINDS = ("reference", "plain", "trainer")


def interleaved(
    pairs: int, nprocs: Sequence[int] = (1,), kinds: Sequence[str] = ("reference", "trainer")
) -> list[tuple[int, int, str]]:
    """The launch order ``(pair, processes, kind)``: round after round, each process count
    in turn, each a (reference, trainer) pair; so every ratio, and the speed-up between
    process counts, compares launches minutes apart at most. Round ``i`` starts with kind
    ``i mod len(kinds)``: no kind always runs first or last, so that a drift within a
    round does not always fall on the same kind.

    Example:
        >>> interleaved(2, [1, 2])[4:]
        [(1, 1, 'trainer'), (1, 1, 'reference'), (1, 2, 'trainer'), (1, 2, 'reference')]
    """
    turns = [tuple(kinds[i % len(kinds) :]) + tuple(kinds[: i % len(kinds)]) for i in range(pairs)]
    return [(i, n, kind) for i in range(pairs) for n in nprocs for kind in turns[i]]


def ratio_stats(numerator: Sequence[float], denominator: Sequence[float]) -> dict:
    """Pairwise ratios ``numerator[i] / denominator[i]`` and their median, min and max.

    Example:
        >>> ratio_stats([99.0, 102.0, 98.0], [100.0, 100.0, 100.0])["median"]
        0.99
    """
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"need pairs: {len(numerator)} vs {len(denominator)} values")
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "ratios": ratios,
    }


def bus_bandwidth(size_bytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth of an all-reduce in bytes/s: ``2(n-1)/n * size / time``.

    Example:
        >>> bus_bandwidth(1e6, 1e-3, 2)
        1000000000.0
    """
    return 2 * (world_size - 1) / world_size * size_bytes / seconds


def device_and_backend() -> tuple[torch.device, str]:
    """This worker's device (``cuda:LOCAL_RANK`` with GPUs) and backend."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device, "nccl"
    return torch.device("cpu"), "gloo"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- the reference


def reference(
    model_name: str, steps: int, batch: int, workers: int, lr: float = 0.05, data: str = "trainer"
) -> None:
    """The plain PyTorch DDP script the trainer is measured against (run under torchrun).

    The shape of pytorch/examples' ``multigpu_torchrun.py``: a process group, the model on
    this rank's device wrapped in DDP, a ``DataLoader`` with a ``DistributedSampler``, and a
    loop of zero_grad / forward / cross-entropy / backward / step. Same model, synthetic
    data, batch, optimizer settings (SGD, lr 0.05, momentum 0.9: the trainer's defaults) and
    loader workers as the trainer. Rank 0 writes samples/s from the end of the first step.
    ``data="trainer"`` reads the trainer's synthetic set; ``data="memory"`` an in-memory
    ``TensorDataset`` of random tensors (nothing of the trainer's but the model).
    """
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from ddp_lab.hostmem import minor_faults  # a measurement only: the loop is plain
    from ddp_lab.models import build_model

    device, backend = device_and_backend()
    dist.init_process_group(backend)
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = build_model(model_name).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    n = steps * batch * world
    if data == "memory":
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
        dataset = torch.utils.data.TensorDataset(x, y)
    else:
        from ddp_lab.data import make_datasets

        dataset, _ = make_datasets("synthetic", train_size=n, test_size=1)
    loader = DataLoader(
        dataset,
        batch_size=batch,
        shuffle=False,
        sampler=DistributedSampler(dataset),
        pin_memory=device.type == "cuda",
        num_workers=workers,
    )
    loader.sampler.set_epoch(0)
    t0 = None
    for source, targets in loader:
        source, targets = source.to(device), targets.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(source), targets)
        loss.backward()
        optimizer.step()
        if t0 is None:  # the first step is warm-up, as in the trainer
            _sync(device)
            t0, faults0 = time.perf_counter(), minor_faults()
    _sync(device)
    seconds = time.perf_counter() - t0
    # the most page faults per step of any rank, as the trainer's summary counts them
    faults = torch.tensor([(minor_faults() - faults0) / (steps - 1)], dtype=torch.float64)
    faults = faults.to(device)
    dist.all_reduce(faults, op=dist.ReduceOp.MAX)
    speed = (steps - 1) * batch * world / seconds
    write_result(
        {"samples_per_s": speed, "seconds": seconds, "page_faults_per_step": faults.item()}
    )
    # DDP's reducer freed after the group is gone can abort a rank ("terminate called
    # without an active exception"): drop it, wait for every rank, then leave the group.
    del model, optimizer, loader
    dist.barrier()
    teardown()


def collectives_worker(args: argparse.Namespace) -> None:
    """Both measurements on collectives in one job (run under torchrun): the synced and
    ``no_sync`` step times, then ``dist.all_reduce`` against the ring over sizes."""
    import torch.distributed as dist

    device, backend = device_and_backend()
    dist.init_process_group(backend)
    comm = step_times(args.model, args.batch_size, args.blocks, max(5, args.steps // 4), device)
    bw = all_reduce_times(args.sizes, args.rounds, args.repeats, device)
    write_result({"comm": comm, "bandwidth": {**bw, "backend": backend}})
    dist.barrier()
    teardown()


def step_times(model_name: str, batch: int, blocks: int, steps: int, device) -> dict:
    """Seconds per DDP step, in blocks alternating synced and ``no_sync`` (every rank)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_lab.models import build_model

    torch.manual_seed(dist.get_rank())
    model = DDP(build_model(model_name).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def block(sync: bool) -> float:
        dist.barrier()
        t = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad()
            if sync:
                F.cross_entropy(model(x), y).backward()
            else:
                with model.no_sync():
                    F.cross_entropy(model(x), y).backward()
            optimizer.step()
        _sync(device)
        return (time.perf_counter() - t) / steps

    block(True)  # warm-up: buckets, allocations
    synced, alone = [], []
    for _ in range(blocks):
        synced.append(block(True))
        alone.append(block(False))
    return {"synced_s": synced, "no_sync_s": alone, "steps_per_block": steps}


def all_reduce_times(sizes: Sequence[int], rounds: int, repeats: int, device) -> dict:
    """Median seconds per size of ``dist.all_reduce`` and of the course's ring all-reduce,
    the two interleaved per size and round (every rank)."""
    import torch.distributed as dist

    from ddp_lab.answers.lab02.references import ring_all_reduce
    from ddp_lab.bandwidth import measure_all_reduce

    fns = {"all_reduce": dist.all_reduce, "ring": ring_all_reduce}
    times = {name: [] for name in fns}
    for size in sizes:
        per = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                per[name] += measure_all_reduce([size], repeats, fn, device=device)
        for name in fns:
            times[name].append(statistics.median(per[name]))
    return {"sizes": list(sizes), "seconds": times}


# --------------------------------------------------------------------------- launches


def run_reference(
    args: argparse.Namespace, nproc: int, data: str = "trainer"
) -> tuple[float, float]:
    """Samples/s of the reference (``data="memory"``: the plain one) on ``nproc``
    processes (one launch), and the most page faults per step of any rank."""
    flags = ["--worker", "reference", "--model", args.model, "--steps", str(args.steps)]
    flags += ["--batch-size", str(args.batch_size), "--workers", str(args.workers), "--data", data]
    res = torchrun(PROG, flags, nproc=nproc, module=True, timeout=args.timeout, stream=False)
    return res.result["samples_per_s"], res.result["page_faults_per_step"]


def run_trainer(args: argparse.Namespace, nproc: int) -> tuple[float, float | None, float]:
    """Samples/s of ``torchrun -m ddp_lab.train`` with its defaults on ``nproc`` processes,
    the mean ``comm_share`` of its records (None on one process) and the most page faults
    per step of any rank."""
    with tempfile.TemporaryDirectory() as out:
        flags = ["--model", args.model, "--batch-size", str(args.batch_size)]
        flags += ["--max-steps", str(args.steps), "--num-workers", str(args.workers)]
        flags += ["--train-size", str(args.steps * args.batch_size * nproc)]
        flags += ["--test-size", "64", "--out", out, "--no-progress"]
        flags += shlex.split(args.trainer_args)
        torchrun(
            "ddp_lab.train", flags, nproc=nproc, module=True, timeout=args.timeout, stream=False
        )
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            shares = [json.loads(line).get("comm_share") for line in f]
    shares = [s for s in shares if s is not None and nproc > 1]
    share = statistics.mean(shares) if shares else None
    return summary["samples_per_s"], share, summary["page_faults_per_step"]


def load_1min() -> float:
    """The machine's 1-minute load average (what else runs shows up here)."""
    return os.getloadavg()[0]


def throughput(args: argparse.Namespace) -> dict:
    """Interleaved pairs for each process count; ratios, speed-up and the load seen."""
    order = interleaved(args.pairs, args.nprocs, KINDS)
    out: dict = {"pairs": args.pairs, "order": [list(o) for o in order]}
    for n in args.nprocs:
        faults = [f"{kind}_page_faults" for kind in KINDS]
        out[f"np{n}"] = {k: [] for k in (*KINDS, *faults, "trainer_comm_share", "load")}
    for i, n, kind in order:
        runs = out[f"np{n}"]
        runs["load"].append(load_1min())
        if kind != "trainer":
            speed, faults = run_reference(args, n, "memory" if kind == "plain" else "trainer")
        else:
            speed, share, faults = run_trainer(args, n)
            runs["trainer_comm_share"].append(share)
        runs[kind].append(speed)
        runs[f"{kind}_page_faults"].append(faults)
        say(
            f"pair {i + 1}/{args.pairs}, {n} process(es), {kind:<9} {speed:7.1f} samples/s, "
            f"{faults:6.0f} page faults per step (the most of any rank; load "
            f"{runs['load'][-1]:.2f})"
        )
    for n in args.nprocs:
        runs = out[f"np{n}"]
        runs["trainer_over_reference"] = ratio_stats(runs["trainer"], runs["reference"])
        runs["trainer_over_plain"] = ratio_stats(runs["trainer"], runs["plain"])
    top = max(args.nprocs)
    if 1 in args.nprocs and top > 1:  # the trainer's scaling: medians, and pair by pair
        one, many = out["np1"]["trainer"], out[f"np{top}"]["trainer"]
        out["trainer_speedup"] = {
            "processes": top,
            "median": statistics.median(many) / statistics.median(one),
            "pairs": ratio_stats(many, one),
        }
    return out


def collectives(args: argparse.Namespace, nproc: int = 2) -> dict:
    """The communication share of a step and the bandwidth sweep (one launch)."""
    import numpy as np

    from ddp_lab.answers.lab02.references import fit_alpha_beta, ring_allreduce_time

    flags = ["--worker", "collectives", "--model", args.model, "--batch-size"]
    flags += [str(args.batch_size), "--blocks", str(args.blocks), "--steps", str(args.steps)]
    flags += ["--rounds", str(args.rounds), "--repeats", str(args.repeats), "--sizes"]
    flags += [str(s) for s in args.sizes]
    r = torchrun(PROG, flags, nproc=nproc, module=True, timeout=args.timeout, stream=False).result
    c = r["comm"]
    synced, alone = statistics.median(c["synced_s"]), statistics.median(c["no_sync_s"])
    c.update(synced_median_s=synced, no_sync_median_s=alone, share=1 - alone / synced)
    b = {**r["bandwidth"], "world_size": nproc, "bus_bandwidth": {}, "fit": {}}
    for name, secs in b["seconds"].items():
        b["bus_bandwidth"][name] = [
            bus_bandwidth(s, t, nproc) for s, t in zip(b["sizes"], secs, strict=True)
        ]
        alpha, bw = fit_alpha_beta(b["sizes"], secs, nproc, relative=True)
        grid = np.geomspace(min(b["sizes"]), max(b["sizes"]), 60)
        model = ring_allreduce_time(grid, nproc, alpha, bw)
        pts = zip(grid.tolist(), model.tolist(), strict=True)
        curve = [[s, bus_bandwidth(s, t, nproc)] for s, t in pts if t > 0]
        b["fit"][name] = {"alpha_s": alpha, "bandwidth_bytes_per_s": bw, "curve": curve}
    b["ring_over_all_reduce_at_16MiB_plus"] = [
        ring / ref
        for size, ring, ref in zip(
            b["sizes"], b["bus_bandwidth"]["ring"], b["bus_bandwidth"]["all_reduce"], strict=True
        )
        if size >= 16 << 20
    ]
    return {"comm_share": c, "bandwidth": b}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="cnn")
    p.add_argument("--steps", type=int, default=80, help="training steps per launch")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--pairs", type=int, default=5, help="(reference, trainer) pairs per count")
    p.add_argument("--nprocs", type=int, nargs="+", default=[1, 2], help="process counts")
    p.add_argument("--workers", type=int, default=None, help="loader workers (trainer's rule)")
    p.add_argument("--blocks", type=int, default=6, help="synced / no_sync blocks")
    p.add_argument("--rounds", type=int, default=3, help="bandwidth rounds per size")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per size and round")
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="message sizes, bytes")
    p.add_argument("--only", choices=["throughput", "collectives"], nargs="+", default=None)
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    p.add_argument(
        "--trainer-args",
        default="",
        help='more trainer flags, e.g. "--host-memory release" (glibc\'s defaults, as in the '
        'plain loops) or "--amp bf16"',
    )
    p.add_argument("--out", default="results/bench")
    p.add_argument("--worker", choices=["reference", "collectives"], help=argparse.SUPPRESS)
    p.add_argument(
        "--data", choices=["trainer", "memory"], default="trainer", help=argparse.SUPPRESS
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers is None:  # the trainer's default: 4 on CUDA, 0 on the CPU
        args.workers = 4 if torch.cuda.is_available() else 0
    if args.worker == "reference":
        reference(args.model, args.steps, args.batch_size, args.workers, data=args.data)
        return 0
    if args.worker == "collectives":
        collectives_worker(args)
        return 0
    parts = args.only or ["throughput", "collectives"]
    result = {
        "model": args.model,
        "steps": args.steps,
        "batch_per_process": args.batch_size,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "threads": int(os.environ.get("OMP_NUM_THREADS", "1")),
        "trainer_args": args.trainer_args,
        "cpus": os.cpu_count(),
        "load_start": load_1min(),
    }
    t0 = time.monotonic()
    if "throughput" in parts:
        result["throughput"] = throughput(args)
    if "collectives" in parts:
        result.update(collectives(args))
    result.update(load_end=load_1min(), seconds=time.monotonic() - t0)
    report(result)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(result, f, indent=2)
    from ddp_lab.figures.bench import plot_bench

    plot_bench(result, os.path.join(args.out, "bench.png"))
    say(f"wrote {args.out}/bench.json and bench.png")
    return 0


def say(line: str) -> None:
    """One line of the bench's report, prefixed with its name."""
    print(f"{PROG}: {line}", flush=True)


def report(result: dict) -> None:
    """Print the ratios that matter, one line each."""
    tp = result.get("throughput", {})
    flags = f" (trainer flags {result['trainer_args']})" if result.get("trainer_args") else ""
    for key in sorted(k for k in tp if k.startswith("np")):
        for other in ("reference", "plain"):
            if (r := tp[key].get(f"trainer_over_{other}")) is not None:
                say(
                    f"trainer / {other}, {key[2:]} process(es): median {r['median']:.3f} "
                    f"(min {r['min']:.3f}, max {r['max']:.3f}, {len(r['ratios'])} pairs)"
                )
        faults = {k: tp[key].get(f"{k}_page_faults") for k in KINDS}
        if all(faults.values()):
            medians = ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in faults.items())
            say(f"page faults per step, {key[2:]} process(es), median: {medians}{flags}")
    if "trainer_speedup" in tp:
        s = tp["trainer_speedup"]
        say(
            f"trainer {s['processes']} / 1 processes: {s['median']:.2f}x (pairwise "
            f"min {s['pairs']['min']:.2f}, max {s['pairs']['max']:.2f})"
        )
    if "comm_share" in result:
        c = result["comm_share"]
        trainer = [s for s in tp.get("np2", {}).get("trainer_comm_share", []) if s is not None]
        mine = f"; the trainer's comm_share {statistics.mean(trainer):.1%}" if trainer else ""
        say(
            f"communication share of a step: {c['share']:.1%} (synced "
            f"{c['synced_median_s'] * 1e3:.1f} ms, no_sync {c['no_sync_median_s'] * 1e3:.1f} ms)"
            + mine
        )
    if "bandwidth" in result:
        b = result["bandwidth"]
        for i, size in enumerate(b["sizes"]):
            g, r = b["bus_bandwidth"]["all_reduce"][i], b["bus_bandwidth"]["ring"][i]
            say(
                f"{size / 2**20:8.3f} MiB: all_reduce {g / 1e9:6.3f} GB/s, ring "
                f"{r / 1e9:6.3f} GB/s ({r / g:.2f}x)"
            )
        for name, fit in b["fit"].items():
            say(
                f"fit {name}: alpha {fit['alpha_s'] * 1e6:.1f} us, B "
                f"{fit['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s"
            )


if __name__ == "__main__":
    sys.exit(main())
