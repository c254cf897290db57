"""The trainer's checkpoint step, with the seeds' rollback rule.

At every checkpoint (``--ckpt-every`` steps, or each epoch's end) every rank calls
:func:`checkpoint`. With ``--rollback-drop D`` it first evaluates the weights; when the test
accuracy fell more than ``D`` percentage points below the best checkpoint's, the best
checkpoint's weights, optimizer and scaler come back before the save (the seeds restore the
best checkpoint when validation accuracy drops by more than 5 points).
"""

from __future__ import annotations

import sys

import torch

from ddp_lab import data as data_mod
from ddp_lab.checkpoint import Checkpoints, training_state
from ddp_lab.dist import print0, sync_buffers, unwrap
from ddp_lab.faults import Events, Faults
from ddp_lab.options import PROG


def checkpoint(
    ckpts: Checkpoints,
    run: tuple,
    test_set: torch.utils.data.Dataset,
    faults: Faults,
    events: Events,
    accuracy: float | None = None,
) -> list[dict]:
    """Save the checkpoint of the current step (a collective: every rank calls it).

    With ``--rollback-drop`` the weights are evaluated first (unless ``accuracy`` is
    given); when the test accuracy fell more than that many points below the best
    checkpoint's, the best checkpoint's weights, optimizer and scaler state come back
    before saving (the step count, the LR schedule and the data order go on: the batches in
    between are skipped, as large training runs do after a loss spike).

    Args:
        ckpts: the run's checkpoints.
        run: ``(cfg, env, pos, model, optimizer, scaler, scheduler, loader, evals)``.
        test_set: the validation set of the rollback rule.
        faults: for the error context.
        events: the run's timeline.
        accuracy: the test accuracy of the current weights, when just measured.

    Returns:
        ``[rollback record]`` when it rolled back, else ``[]``.
    """
    cfg, env, pos, model, optimizer, scaler, scheduler, loader, evals = run
    faults.at(f"the checkpoint of step {pos.step}")
    rolled = []
    if cfg.rollback_drop is None:
        accuracy = None  # the best checkpoint matters only for a rollback
    else:
        if accuracy is None:
            sync_buffers(model, env)
            accuracy = data_mod.evaluate(unwrap(model), test_set, env)["accuracy"]
        if ckpts.dropped(accuracy, cfg.rollback_drop):
            best = ckpts.load_best()
            unwrap(model).load_state_dict(best["model"])
            optimizer.load_state_dict(best["optimizer"])
            scaler.load_state_dict(best["scaler"])
            rolled = [
                {
                    "step": pos.step,
                    "accuracy": accuracy,
                    "restored_step": best["step"],
                    "restored_accuracy": best["accuracy"],
                }
            ]
            events.log("rollback", **rolled[0])
            print0(
                f"{PROG}: rollback at step {pos.step}: test accuracy {accuracy:.4f} is more "
                f"than --rollback-drop {cfg.rollback_drop:g} points below the best "
                f"checkpoint's {best['accuracy']:.4f} (step {best['step']}); restored its "
                "weights, optimizer and scaler",
                env=env,
                file=sys.stderr,
            )
            accuracy = best["accuracy"]
    state = training_state(cfg, env, pos, model, optimizer, scaler, scheduler, loader, evals)
    info = ckpts.save(pos.step, state, accuracy)
    events.log(
        "checkpoint",
        step=pos.step,
        path=info["path"],
        bytes=info["bytes"],
        seconds=info["seconds"],
        accuracy=accuracy,
    )
    return rolled
