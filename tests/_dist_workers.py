"""Worker functions for multi-process tests (importable, so spawn can find them)."""

from __future__ import annotations

import os
import sys

import torch


def evaluate_worker(rank: int, world_size: int, tmp_dir: str, size: int, model_name: str):
    from ddp_lab.data import SyntheticCIFAR, evaluate
    from ddp_lab.dist import DistEnv
    from ddp_lab.models import build_model

    torch.manual_seed(0)
    model = build_model(model_name)
    env = DistEnv(rank=rank, world_size=world_size, backend="gloo")
    result = evaluate(model, SyntheticCIFAR(size, "test"), env, batch_size=16)
    torch.save(result, os.path.join(tmp_dir, f"eval-{rank}.pt"))


def _run_lab03(module, namespace: dict | None, inputs: dict, rank: int, world: int):
    """``module.run_rank`` on this rank with ``namespace`` (the references) in place of the
    student's file, or with the file in the current folder when ``namespace`` is None."""
    from ddp_lab.checks import guards

    os.environ.setdefault("LOCAL_RANK", str(rank))  # torchrun's variable (one node)
    loader = guards.load_student_file
    if namespace is not None:
        guards.load_student_file = lambda path, forbid=(), ns=namespace: dict(ns)
    try:
        (case,) = inputs["cases"]
        return module.run_rank({}, inputs, case, rank, world)
    finally:
        guards.load_student_file = loader


def lab03_reference_worker(rank: int, world_size: int, tmp_dir: str, seed: int):
    """Run lab 3's distributed exercises (2 to 5) on this rank with the *reference* answers
    in place of the student's files, through the exercises' own ``run_rank`` on their
    grading inputs (``make_inputs(seed)``: runs on 2 and 3 ranks in one job); save what each
    returns as ``<grade_id>-<rank>.pt``."""
    from ddp_lab.answers.lab03 import references as ref
    from ddp_lab.checks.lab03 import ex2_ddp_train, ex3_evaluate, ex4_my_ddp, ex5_bucketed_ddp

    answers = {
        ex2_ddp_train: {
            "setup": ref.ddp_setup,
            "train": ref.ddp_train,
            "teardown": ref.ddp_teardown,
        },
        ex3_evaluate: {"evaluate": ref.evaluate},
        ex4_my_ddp: {"MyDDP": ref.MyDDP},
        ex5_bucketed_ddp: {"BucketedDDP": ref.BucketedDDP},
    }
    os.chdir(tmp_dir)
    for module, namespace in answers.items():
        inputs = module.make_inputs(torch.Generator().manual_seed(seed))
        out = _run_lab03(module, namespace, inputs, rank, world_size)
        torch.save(out, os.path.join(tmp_dir, f"{module.EXERCISE.grade_id}-{rank}.pt"))


def lab03_mistakes_worker(rank: int, world_size: int, tmp_dir: str, seed: int):
    """Run each of lab 3's ``MORE_MISTAKES`` (distributed exercises, none of which raises)
    through its exercise's ``run_rank`` on the grading inputs; save ``<name>-<rank>.pt``."""
    from ddp_lab.answers.lab03.mistakes import MORE_MISTAKES
    from ddp_lab.checks.contract import exercises
    from ddp_lab.checks.runner import split_magics

    table = exercises("lab03_ddp")
    work = os.path.join(tmp_dir, f"rank{rank}")  # each rank its own files: no torn reads
    os.makedirs(work, exist_ok=True)
    os.chdir(work)
    for mistake in MORE_MISTAKES:
        ex = table[f"test_{mistake.cell}"]
        module = sys.modules[ex.judge.__module__]
        _, files = split_magics(mistake.source)
        for name, text in files.items():
            with open(name, "w") as f:
                f.write(text)
        inputs = module.make_inputs(torch.Generator().manual_seed(seed))
        out = _run_lab03(module, None, inputs, rank, world_size)
        torch.save(out, os.path.join(tmp_dir, f"{mistake.name}-{rank}.pt"))
