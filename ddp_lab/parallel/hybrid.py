"""Hybrid layouts: ``data x tensor x pipeline`` degrees -> who talks to whom, memory and
communication per GPU and step.

The seeds' hybrid parallelism, the way Megatron-LM and its successors lay it out on
``dp * tp * pp`` GPUs: tensor parallelism inside a node (its all-reduces run every layer,
on the fastest links), pipeline stages across nodes (one activation per micro-batch goes
to the next stage), data parallelism outermost (one gradient all-reduce per step). Rank
``r`` sits at ``(data d, pipeline p, tensor t)`` with ``r = (d * pp + p) * tp + t``.

:func:`plan` is a small calculator for a GPT-like transformer (``layers`` blocks of width
``hidden``, about ``12 * hidden**2`` parameters per block, embeddings left out). It takes
the memory function as an argument: your ``memory_per_rank`` of lab 7's exercise 1, applied
to the data-parallel group of a GPU's parameters. Communication counts the bytes one GPU
sends per training step with ring collectives (an all-reduce of ``S`` bytes over ``n``
GPUs sends ``2 (n - 1) / n * S``), in the precision of ``bytes_per_number``:

- data: the gradient all-reduce (ZeRO stage 3: all-gather twice and a reduce-scatter,
  ``3 (n - 1) / n * S``);
- tensor: per block and micro-batch, two all-reduces of the activations in forward and two
  in backward (attention and MLP, each a column- then a row-parallel layer);
- pipeline: per micro-batch one activation forward and one gradient backward.

Example:
    >>> layout(dp=2, tp=2, pp=2)["tensor"][:2]
    [[0, 1], [2, 3]]
"""

from __future__ import annotations

from collections.abc import Callable


def coords(rank: int, tp: int, pp: int) -> tuple[int, int, int]:
    """``(data, pipeline, tensor)`` coordinates of ``rank``.

    Example:
        >>> coords(5, tp=2, pp=2)
        (1, 0, 1)
    """
    return rank // (tp * pp), (rank // tp) % pp, rank % tp


def layout(dp: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """The process groups of a ``dp x tp x pp`` job: lists of ranks that talk together.

    Returns:
        ``{"tensor": [...], "pipeline": [...], "data": [...]}``: the ranks of each tensor
        group (same data replica and stage), pipeline group (same replica and tensor slice:
        the stages in order) and data group (same stage and tensor slice: the replicas).
    """
    world = dp * tp * pp
    ranks = {coords(r, tp, pp): r for r in range(world)}
    return {
        "tensor": [[ranks[d, p, t] for t in range(tp)] for d in range(dp) for p in range(pp)],
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
) -> dict:
    """Memory and communication per GPU and step of one layout.

    Args:
        layers, hidden, seq: the transformer (blocks, width, tokens per sequence).
        global_batch: sequences per optimizer step, over all data replicas.
        dp, tp, pp: data, tensor and pipeline degrees (``layers`` divisible by ``pp``).
        micro_batches: micro-batches per step on each pipeline (GPipe).
        memory_fn: ``memory_fn(numels, bytes_per_number, world_size, stage)``, a list of
            per-rank dicts of bytes (lab 7, exercise 1).
        zero_stage: ZeRO stage over the data-parallel group.
        bytes_per_number: 2 for bf16 parameters and gradients (their AdamW state counts
            the same here; real mixed precision keeps fp32 moments and master weights).

    Returns:
        ``params`` (numbers per GPU), ``memory`` (the most loaded rank's dict from
        ``memory_fn``, plus ``total``), ``comm`` (bytes sent per step: ``data``, ``tensor``,
        ``pipeline``, ``total``), ``bubble`` and ``micro_batch`` (sequences).
    """
    if layers % pp or global_batch % (dp * micro_batches):
        raise ValueError("layers must split over pp, the batch over dp x micro_batches")
    per_gpu = 12 * hidden * hidden * layers // (tp * pp)
    rows = memory_fn([per_gpu], bytes_per_number, dp, zero_stage)
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
