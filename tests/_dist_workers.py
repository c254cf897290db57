"""Worker functions for multi-process tests (importable, so spawn can find them)."""

from __future__ import annotations

import os

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


def lab03_reference_worker(rank: int, world_size: int, tmp_dir: str, seed: int):
    """Run lab 3's distributed exercises (2 to 4) on this rank with the *reference* answers
    in place of the student's files, through the exercises' own ``run_rank``; save what each
    returns as ``<grade_id>-<rank>.pt``."""
    from ddp_lab.answers.lab03 import references as ref
    from ddp_lab.checks import guards
    from ddp_lab.checks.lab03 import ex2_ddp_train, ex3_evaluate, ex4_my_ddp

    answers = {
        ex2_ddp_train: {
            "setup": ref.ddp_setup,
            "train": ref.ddp_train,
            "teardown": ref.ddp_teardown,
        },
        ex3_evaluate: {"evaluate": ref.evaluate},
        ex4_my_ddp: {"MyDDP": ref.MyDDP},
    }
    os.chdir(tmp_dir)
    for module, namespace in answers.items():
        case = module.case(torch.Generator().manual_seed(seed), world_size)
        loader = guards.load_student_file
        guards.load_student_file = lambda path, forbid=(), ns=namespace: dict(ns)
        try:
            out = module.run_rank({}, {"cases": [case]}, case, rank, world_size)
        finally:
            guards.load_student_file = loader
        torch.save(out, os.path.join(tmp_dir, f"{module.EXERCISE.grade_id}-{rank}.pt"))
