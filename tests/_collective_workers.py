"""Worker processes for ``test_collectives.py``: one gloo process group runs every case.

The test starts ``world_size`` processes with ``_harness.spawn_gloo`` (``multiprocessing``
spawn context, the group joined through a ``file://`` store: no port), each calling
:func:`worker_main`. Spawn pickles the target by module and name, so this module must be
importable in the child: the parent puts ``tests/`` on ``sys.path`` and spawn copies the
parent's ``sys.path`` into the child. This module adds the repository root itself, so
``ddp_lab`` imports whatever the working directory.

The collectives under test are lab 2's reference answers (``ddp_lab.answers.lab02``: the
ring, the average through one rank, the parameter server with staleness 0, 1 and 2, the last
against the kit's trajectory oracle) and the runtime's bandwidth tool (``ddp_lab.bandwidth``).

Each rank writes ``rank<r>.pt`` (a dict of results) into the output folder, or ``rank<r>.err``
(the traceback) and exits non-zero; the parent asserts on the files.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ddp_lab.answers.lab02.references import (  # noqa: E402
    ring_all_gather,
    ring_all_reduce,
    ring_chunks,
)
from ddp_lab.answers.lab02.servers import (  # noqa: E402
    parameter_server,
    reduce_broadcast_average,
)
from ddp_lab.bandwidth import measure_all_reduce  # noqa: E402
from ddp_lab.checks.lab02 import server as oracle  # noqa: E402


def broken_ring_skip_step(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """A ring all-reduce with the classic bug: the last reduce-scatter step is skipped.

    Each rank then passes on a chunk that is missing one rank's contribution, so the result
    differs from ``dist.all_reduce``; the tests use it to prove they can tell.
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    flat = tensor.view(-1)
    chunks = ring_chunks(flat, n)
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 2):  # BUG: should be range(n - 1)
        send, recv = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        request = dist.isend(send, right) if send.numel() else None
        received = torch.empty_like(recv)
        if received.numel():
            dist.recv(received, left)
        if request is not None:
            request.wait()
        recv.add_(received)
    ring_all_gather(chunks, group)
    return tensor


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def run_cases(rank: int, world_size: int, cases: list[tuple]) -> dict:
    """Run every ``(shape, dtype_name)`` case; return the max abs differences per case."""
    out: dict = {"ring": {}, "ps": {}, "broken": {}, "in_place": {}}
    for i, (shape, dtype_name) in enumerate(cases):
        key = (tuple(shape), dtype_name)
        gen = torch.Generator().manual_seed(1000 * rank + i)
        x = torch.randn(shape, generator=gen, dtype=getattr(torch, dtype_name))
        reference = x.clone()
        dist.all_reduce(reference, op=dist.ReduceOp.SUM)

        ring_in = x.clone()
        ring_out = ring_all_reduce(ring_in)
        out["in_place"][key] = ring_out is ring_in and ring_out.shape == x.shape
        out["ring"][key] = _max_diff(ring_out, reference)

        ps_in = x.clone()
        ps_out = reduce_broadcast_average(ps_in, server_rank=world_size - 1)
        out["in_place"][key] = out["in_place"][key] and ps_out is ps_in
        out["ps"][key] = _max_diff(ps_out, reference / world_size)

        out["broken"][key] = _max_diff(broken_ring_skip_step(x.clone()), reference)

    # a non-contiguous input (a transpose) is reduced in place all the same
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64).t()
    reference = x.clone()
    dist.all_reduce(reference)
    ring_out, ps_out = ring_all_reduce(x.clone()), reduce_broadcast_average(x.clone())
    out["noncontig"] = max(
        _max_diff(ring_out, reference), _max_diff(ps_out, reference / world_size)
    )

    # a sub-group: group ranks differ from global ranks, peers must be translated
    members = list(range(world_size - 1, -1, -2))  # e.g. [2, 0] for 3 ranks
    sub = dist.new_group(members)
    if rank in members:
        x = torch.randn(11, generator=gen, dtype=torch.float64)
        reference = x.clone()
        dist.all_reduce(reference, group=sub)
        ring_out = ring_all_reduce(x.clone(), group=sub)
        ps_out = reduce_broadcast_average(x.clone(), server_rank=len(members) - 1, group=sub)
        out["subgroup"] = max(
            _max_diff(ring_out, reference), _max_diff(ps_out, reference / len(members))
        )

    # the parameter server, synchronous and stale, against the checks' one-process trajectory
    out["server"] = {}
    for staleness in (0, 1, 2):
        run = oracle.make_run(
            torch.Generator().manual_seed(staleness),
            world_size,
            5,
            torch.float64,
            staleness=staleness,
        )
        params = run["init"].clone()
        optimizer = oracle.optimizer(run, params) if rank == 0 else None
        x, y = (run["xs"][rank - 1], run["ys"][rank - 1]) if rank else (None, None)
        grad_fn = (lambda p, x=x, y=y: oracle.gradient(x, y, p)) if rank else None
        parameter_server(params, optimizer, grad_fn, run["steps"], staleness)
        out["server"][staleness] = _max_diff(params, oracle.trajectory(run)[-1])

    out["measured"] = measure_all_reduce([64, 4096], repeats=3, warmup=1)
    out["measured_ring"] = measure_all_reduce([64, 4096], repeats=3, warmup=1, fn=ring_all_reduce)
    return out


def worker_main(rank: int, world_size: int, out_dir: str, cases: list[tuple]) -> None:
    """In a joined gloo group (``_harness.spawn_gloo``): run :func:`run_cases`, save the
    results; on any error write ``rank<r>.err`` and exit at once with status 1."""
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        results = run_cases(rank, world_size, cases)
        dist.barrier()
        torch.save(results, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
