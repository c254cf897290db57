"""Run a script under torchrun from a notebook, a Makefile target or a test.

:func:`torchrun` starts ``python -m torch.distributed.run --standalone`` (a free port every
time, so two launches never collide), shows a compact live view of the ranks' output, enforces
a timeout, and on timeout or Ctrl-C (Jupyter's stop button) kills the whole process tree:
torchrun *and* its workers, which torchrun starts in sessions of their own.

How the per-rank logs are captured: torchrun runs with ``--redirects 3 --log-dir DIR``, so
each worker writes its stdout and stderr to ``DIR/<run>/attempt_<k>/<local_rank>/std*.log``,
and torchrun's own (agent) output goes to a separate file. The launcher follows those files
as they grow (``PYTHONUNBUFFERED=1`` makes the workers write line by line), so it knows which
rank wrote each line without parsing prefixes, and it still has every line after a kill.

A worker script hands a result back to the notebook with :func:`write_result`::

    # worker.py, run by every rank
    import torch, torch.distributed as dist
    from ddp_lab.launch import write_result
    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    write_result({"sum": t.item()})          # rank 0 writes, the others return

    # notebook
    >>> from ddp_lab.launch import torchrun
    >>> res = torchrun("worker.py", nproc=2)  # doctest: +SKIP
    [rank0] ...
    torchrun: 2 processes, exit 0, 3.1 s
    >>> res.result                            # doctest: +SKIP
    {'sum': 3.0}

Command line: ``python -m ddp_lab.launch --nproc 2 worker.py -- --flag value``.
Linux and macOS only: the tree is found and killed by :mod:`ddp_lab.proctree` (through
``/proc``, or ``ps`` where there is none).
"""

from ddp_lab.launch.result import LaunchError, LaunchFailed, LaunchResult, LaunchTimeout
from ddp_lab.launch.start import RESULT_ENV, torchrun, write_result

__all__ = [
    "RESULT_ENV",
    "LaunchError",
    "LaunchFailed",
    "LaunchResult",
    "LaunchTimeout",
    "torchrun",
    "write_result",
]
