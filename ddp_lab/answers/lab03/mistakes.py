"""Typical wrong answers of lab 3, and what the grader must say about each.

Each source replaces the whole solution cell, written as a student would (not as an edit of
the solution: the sample class's ``mistake`` student must not look like a copy). The first
mistake of each exercise is the one the sample class's ``mistake`` student submits; every
one in ``MISTAKES`` fails its own exercise with its ``reason`` through the real grader
(``tests/test_mistakes.py``). ``MORE_MISTAKES`` (distributed exercises, more of them than
the grader's rounds should cost) fail theirs on real gloo groups in ``tests/test_lab03.py``,
``REFUSED`` in one process there.
``FORGED_FILES`` are the result files the sample class's cheat leaves next to the notebook
(a friend's solution files: the grader rebuilds every file from the submitted notebook's
cells, so they change nothing).
"""

from __future__ import annotations

import json
from pathlib import Path

from ddp_lab.answers import Mistake
from ddp_lab.answers.lab03 import wrong_sources as src

LAB = "lab03_ddp"

MISTAKES = [
    # --- exercise 1: MySampler --------------------------------------------------------------
    Mistake(
        "ex1_shard_sampler",
        "no_epoch_in_the_seed",  # every epoch repeats the first one's order (no set_epoch)
        src.sampler(seed="self.seed"),
        "epoch 1 reads exactly what epoch 0 read",
    ),
    Mistake("ex1_shard_sampler", "global_rng", src.sampler(generator=None), "both read sample"),
    Mistake(
        "ex1_shard_sampler",
        "always_drops",
        src.sampler(length="self.n // self.world_size"),
        "drop_last=False: every rank reads ceil",
    ),
    Mistake(
        "ex1_shard_sampler",
        "pads_only_once",  # one sample on 3 ranks needs the order repeated twice
        src.sampler(pad="once"),
        "the shortfall padded",
    ),
    Mistake(
        "ex1_shard_sampler",
        "len_of_the_data_set",
        src.sampler(len_="self.n"),
        "len(sampler) is",
    ),
    Mistake(
        "ex1_shard_sampler",
        "always_shuffles",
        src.sampler(shuffle="True"),
        "with shuffle=False the ranks take turns",
    ),
    Mistake(
        "ex1_shard_sampler",
        "generator_made_once",  # the second pass over an epoch reads another order
        src.sampler(generator="init"),
        "two passes over epoch 2 gave different indices",
    ),
    Mistake(
        "ex1_shard_sampler",
        "contiguous_blocks",  # lengths and shuffles right, but not DistributedSampler's rule
        src.sampler(deal="blocks"),
        "take turns along it",
    ),
    # --- exercise 2: ddp_train.py ---------------------------------------------------------------
    Mistake(
        "ex2_ddp_train",
        "no_distributed_sampler",  # every rank reads the same batches
        src.ddp_train(sampler=False),
        "every rank read the same samples",
    ),
    Mistake(
        "ex2_ddp_train",
        "device_from_rank",  # right on one node, a missing GPU on the second
        src.ddp_train(device_from="RANK"),
        "RANK counts the processes of every node",
    ),
    Mistake(
        "ex2_ddp_train",
        "no_set_epoch",
        src.ddp_train(set_epoch=False),
        "set_epoch",
    ),
    # --- exercise 3: evaluate.py ----------------------------------------------------------------
    Mistake(
        "ex3_evaluate",
        "distributed_sampler",  # padded shards count some samples twice
        src.EVAL_SAMPLER,
        "DistributedSampler pads",
    ),
    Mistake("ex3_evaluate", "mean_of_accuracies", src.EVAL_MEAN, "mean of the ranks' accuracies"),
    Mistake("ex3_evaluate", "returns_tensors", src.EVAL_TENSORS, "promises int, int and float"),
    # --- exercise 4: my_ddp.py ------------------------------------------------------------------
    Mistake(
        "ex4_my_ddp",
        "waits_immediately",  # right gradients, but backward stands still for every message
        src.my_ddp(hook="wait"),
        "do not wait for an all-reduce right after starting it",
    ),
    Mistake(
        "ex4_my_ddp",
        "divides_before_the_sum_arrives",
        src.my_ddp(finish="divide_first"),
        "SUM",
    ),
    Mistake("ex4_my_ddp", "never_waits", src.my_ddp(finish="no_wait"), "holds its own gradient"),
    # --- exercise 5: bucketed_ddp.py ------------------------------------------------------------
    Mistake(
        "ex5_bucketed_ddp",
        "forward_order",  # unbalanced buckets: the first layers' bucket fills last
        src.bucketed(order="forward"),
        "buckets of the forward order",
    ),
    Mistake(
        "ex5_bucketed_ddp",
        "cap_ignored",  # one bucket: nothing overlaps
        src.bucketed(cap="ignored"),
        "close a bucket once it holds at least",
    ),
    Mistake(
        "ex5_bucketed_ddp",
        "four_bytes_an_element",
        src.bucketed(size="4"),
        "measure a tensor in bytes",
    ),
    # --- exercise 6: warmup_steps_for -----------------------------------------------------------
    Mistake("ex6_warmup_steps", "floors_the_ratio", src.warmup_steps_for(steady="floor"), "floor"),
    Mistake("ex6_warmup_steps", "rounds_the_ratio", src.warmup_steps_for(steady="round"), "round"),
    Mistake(
        "ex6_warmup_steps", "one_step_too_many", src.warmup_steps_for(steady="plus_one"), "k + 1"
    ),
    Mistake(
        "ex6_warmup_steps",
        "ignores_the_samples",
        src.warmup_steps_for(data="ignored"),
        "fewer than warmup_samples",
    ),
    Mistake(
        "ex6_warmup_steps",
        "ignores_the_rise",
        src.warmup_steps_for(steady="ignored"),
        "raises the rate by",
    ),
    Mistake(
        "ex6_warmup_steps",
        "no_accum_steps",
        src.warmup_steps_for(glob="no_accum"),
        "counts the accumulated micro-batches",
    ),
    Mistake(
        "ex6_warmup_steps",
        "samples_of_one_process",
        src.warmup_steps_for(data="per_process"),
        "samples of every process",
    ),
    Mistake(
        "ex6_warmup_steps",
        "always_warms_up",
        src.warmup_steps_for(at_least_one=True),
        "the shortest",
    ),
    Mistake("ex6_warmup_steps", "returns_a_float", src.warmup_steps_for(as_float=True), "an int"),
]

#: More wrong answers of the distributed exercises (tested on real gloo groups).
MORE_MISTAKES = [
    Mistake(
        "ex2_ddp_train",
        "no_set_device",
        src.ddp_train(set_device=False),
        "never made cuda:",
    ),
    Mistake("ex2_ddp_train", "no_ddp_wrapper", src.ddp_train(ddp=False), "trained alone"),
    Mistake("ex3_evaluate", "no_all_reduce", src.EVAL_LOCAL, "sum the counts over the ranks"),
    Mistake(
        "ex4_my_ddp",
        "blocking_all_reduce",  # lab 1's synchronous hook
        src.my_ddp(hook="blocking"),
        "start each all-reduce with async_op=True",
    ),
    Mistake(
        "ex4_my_ddp",
        "everything_in_finish",
        src.my_ddp(hook="none"),
        "every all-reduce started after backward had ended",
    ),
    Mistake("ex4_my_ddp", "no_broadcast", src.my_ddp(broadcast=False), "broadcast every"),
    Mistake(
        "ex5_bucketed_ddp",
        "bucket_per_gradient",
        src.bucketed(cap="per_gradient"),
        "one all-reduce per bucket, not one per gradient",
    ),
    Mistake(
        "ex5_bucketed_ddp",
        "waits_immediately",
        src.bucketed(hook="wait"),
        "do not wait for an all-reduce right after starting it",
    ),
    Mistake(
        "ex5_bucketed_ddp",
        "buckets_used_once",
        src.bucketed(reset=False),
        "get the buckets ready again",
    ),
    Mistake("ex5_bucketed_ddp", "sum_not_mean", src.bucketed(divide=False), "SUM"),
]


#: Wrong answers refused before any collective (an error on every rank): tested in one process.
REFUSED = [
    Mistake(
        "ex4_my_ddp",
        "torch_ddp_inside",
        src.TORCH_DDP_INSIDE,
        "must not use torch's DistributedDataParallel",
    ),
]


def _solution_files() -> dict[str, str]:
    """The files the solution notebook's %%writefile cells write: what a cheat would copy."""
    path = Path(__file__).resolve().parents[3] / "solutions" / LAB / f"{LAB}.ipynb"
    files: dict[str, str] = {}
    if not path.is_file():
        return files
    for cell in json.loads(path.read_text())["cells"]:
        text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        first, _, body = text.partition("\n")
        if first.startswith("%%writefile ") and cell["metadata"].get("nbgrader", {}).get(
            "solution"
        ):
            files[first.split()[1]] = body
    return files


# A friend's solution files next to the notebook: the grader rebuilds every file from the
# submitted notebook's cells, so they change nothing.
FORGED_FILES = _solution_files()
