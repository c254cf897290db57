"""Hybrid layouts: ``data x tensor x pipeline`` degrees -> who talks to whom, memory and
communication per GPU and step.

The seeds' hybrid parallelism, the way Megatron-LM lays it out on ``dp * tp * pp`` GPUs
(its default rank order ``"tp-cp-ep-dp-pp"`` in ``megatron/core/parallel_state.py``,
``initialize_model_parallel``: tensor fastest, pipeline outermost). Rank ``r`` sits at
``(data d, pipeline p, tensor t)`` with ``r = (p * dp + d) * tp + t``: a tensor group is
``tp`` neighbouring GPUs of one node (its all-reduces run every layer, on the fastest
links), a data group steps by ``tp`` (one gradient all-reduce per step, overlapped with
backward), and a pipeline group steps by ``dp * tp``, so its stages land on different
nodes (one activation per micro-batch and cut, the least traffic, on the slowest links).

:func:`plan` is a small calculator for a GPT-like transformer (``layers`` blocks of width
``hidden``, about ``12 * hidden**2`` parameters per block, embeddings left out). It takes
the memory function as an argument: your ``memory_per_rank`` of lab 7's exercise 1, applied
to the data-parallel group of a GPU's parameters. Communication counts the bytes one GPU
sends per training step with ring collectives (an all-reduce of ``S`` bytes over ``n``
GPUs sends ``2 (n - 1) / n * S``: a reduce-scatter and an all-gather, ``(n - 1) / n * S``
each), in the precision of ``bytes_per_number``:

- data: the gradient all-reduce (ZeRO stage 3: all-gather twice and a reduce-scatter,
  ``3 (n - 1) / n * S``);
- tensor: per block and micro-batch, two all-reduces of the activations in forward and two
  in backward (attention and MLP, each a column- then a row-parallel layer);
- pipeline: per micro-batch one activation forward and one gradient backward.

Example:
    >>> groups = layout(dp=2, tp=2, pp=2)
    >>> groups["tensor"][:2], groups["data"][:2], groups["pipeline"][:2]
    ([[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 4], [1, 5]])
"""

from __future__ import annotations

from collections.abc import Callable


def coords(rank: int, dp: int, tp: int) -> tuple[int, int, int]:
    """``(data, pipeline, tensor)`` coordinates of ``rank``: the inverse of
    ``r = (p * dp + d) * tp + t``.

    Example:
        >>> coords(5, dp=2, tp=2)
        (0, 1, 1)
    """
    return (rank // tp) % dp, rank // (tp * dp), rank % tp


def layout(dp: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """The process groups of a ``dp x tp x pp`` job: lists of ranks that talk together.

    Returns:
        ``{"tensor": [...], "pipeline": [...], "data": [...]}``: the ranks of each tensor
        group (same data replica and stage), pipeline group (same replica and tensor slice:
        the stages in order) and data group (same stage and tensor slice: the replicas).
    """
    world = dp * tp * pp
    ranks = {coords(r, dp, tp): r for r in range(world)}
    return {  # each kind's groups in the order of their first rank
        "tensor": [[ranks[d, p, t] for t in range(tp)] for p in range(pp) for d in range(dp)],
        "pipeline": [[ranks[d, p, t] for p in range(pp)] for d in range(dp) for t in range(tp)],
        "data": [[ranks[d, p, t] for d in range(dp)] for p in range(pp) for t in range(tp)],
    }


def _ring_all_reduce(nbytes: float, n: int) -> float:
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def plan(
    layers: int,
    hidden: int,
    seq: int,
    global_batch: int,
    dp: int,
    tp: int,
    pp: int,
    micro_batches: int,
    memory_fn: Callable,
    zero_stage: int = 1,
    bytes_per_number: int = 2,
    state_bytes: int = 4,
) -> dict:
    """Memory and communication per GPU and step of one layout.

    Mixed-precision AdamW, as the ZeRO paper counts it (and as recipes keep it):
    ``bytes_per_number`` (bf16: 2) for the parameters and the gradients, ``state_bytes``
    (fp32: 4) for each of the optimizer's three numbers per parameter: the master copy of
    the weights, ``exp_avg`` and ``exp_avg_sq``. With 2 and 4 that is ``2 + 2 + 12 = 16``
    bytes per parameter. When both are the same (plain fp32 training) there is no master
    copy: ``4 + 4 + 8``.

    Args:
        layers, hidden, seq: the transformer (blocks, width, tokens per sequence).
        global_batch: sequences per optimizer step, over all data replicas.
        dp, tp, pp: data, tensor and pipeline degrees (``layers`` divisible by ``pp``).
        micro_batches: micro-batches per step on each pipeline (GPipe).
        memory_fn: ``memory_fn(numels, bytes_per_number, world_size, stage)``, a list of
            per-rank dicts of bytes (lab 7, exercise 1).
        zero_stage: ZeRO stage over the data-parallel group.
        bytes_per_number: bytes of a parameter, a gradient and an activation (2: bf16).
        state_bytes: bytes of one optimizer-state number (4: fp32).

    Returns:
        ``params`` (numbers per GPU), ``memory`` (the most loaded rank's ``params``,
        ``grads`` and ``optimizer`` bytes, plus ``total``), ``comm`` (bytes sent per step:
        ``data``, ``tensor``, ``pipeline``, ``total``), ``bubble`` and ``micro_batch``
        (sequences).
    """
    if layers % pp or global_batch % (dp * micro_batches):
        raise ValueError("layers must split over pp, the batch over dp x micro_batches")
    per_gpu = 12 * hidden * hidden * layers // (tp * pp)
    low = memory_fn([per_gpu], bytes_per_number, dp, zero_stage)  # params and grads
    high = memory_fn([per_gpu], state_bytes, dp, zero_stage)  # the two moments, fp32
    master = state_bytes != bytes_per_number  # a master copy, sharded like the moments
    rows = [
        {
            "params": lo["params"],
            "grads": lo["grads"],
            "optimizer": hi["optimizer"] + (hi["optimizer"] // 2 if master else 0),
        }
        for lo, hi in zip(low, high, strict=True)
    ]
    memory = dict(max(rows, key=lambda r: sum(r.values())))
    memory["total"] = sum(memory.values())
    mb = global_batch // (dp * micro_batches)
    act = mb * seq * hidden * bytes_per_number  # one micro-batch's activations
    grads = per_gpu * bytes_per_number
    data = (3 * (dp - 1) / dp * grads) if zero_stage >= 3 else _ring_all_reduce(grads, dp)
    tensor = 4 * (layers // pp) * micro_batches * _ring_all_reduce(act, tp)
    pipeline = 2 * micro_batches * act if pp > 1 else 0.0
    return {
        "params": per_gpu,
        "memory": memory,
        "comm": {
            "data": data,
            "tensor": tensor,
            "pipeline": pipeline,
            "total": data + tensor + pipeline,
        },
        "bubble": (pp - 1) / (micro_batches + pp - 1),
        "micro_batch": mb,
    }
