"""The course trainer: one readable loop where every distributed concern is a line.

Run it on every GPU of a node, on CPU processes, or as one plain process::

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.train --model mlp --epochs 1
    python -m ddp_lab.train --model mlp --epochs 1        # one process, says so on start

Outputs land in ``--out``: ``summary.json`` (final loss, accuracy, steps, world size,
samples/s, seconds), ``metrics.jsonl`` (a record every ``--log-every`` steps, from rank 0),
``model.pt`` (the final state dict of the unwrapped model) and ``events.jsonl`` (the run's
timeline: start, resume, checkpoints, faults); with ``--profile DIR`` a trace per rank
(:mod:`ddp_lab.profiling`). ``--help`` lists every flag.

The pieces around the loop have rooms of their own: the command line (:mod:`ddp_lab.options`),
the optimizer step in lab 5's order (:mod:`ddp_lab.optim`), records at no per-step cost
(:mod:`ddp_lab.monitor`), checkpoints and the resumable data order (:mod:`ddp_lab.checkpoint`),
the rollback rule at a checkpoint (:mod:`ddp_lab.rollback`), faults and failures explained
(:mod:`ddp_lab.faults`), host memory kept between steps (:mod:`ddp_lab.hostmem`).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab import data as data_mod
from ddp_lab.checkpoint import (
    Checkpoints,
    Position,
    ResumableSampler,
    check_resumable,
    write_atomic,
)
from ddp_lab.dist import (
    CommMeter,
    DistEnv,
    ddp_bucket_count,
    print0,
    settle_ddp_buckets,
    setup,
    sync_buffers,
    teardown,
    unwrap,
)
from ddp_lab.errors import UsageError, exit_on_usage_error
from ddp_lab.faults import Events, Faults, InjectedFault, attempt, process_start_time
from ddp_lab.hostmem import keep_freed_memory
from ddp_lab.models import build_model, has_batchnorm
from ddp_lab.monitor import Clock, NormWarning, Recorder, Window
from ddp_lab.optim import autocast, optimizer_step, warmup_schedule
from ddp_lab.options import (
    PROG,
    Config,
    build_parser,
    check_environment,
    describe_model,
    gpt_config,
    parse_args,
)
from ddp_lab.profiling import StepProfiler, parse_schedule
from ddp_lab.rollback import checkpoint
from ddp_lab.syncbn import convert_sync_batchnorm_auto
from ddp_lab.text import TEXT_DATASETS, perplexity

__all__ = ["Config", "build_parser", "check_environment", "main", "parse_args", "train"]


def wrap_model(model: torch.nn.Module, cfg: Config, env: DistEnv) -> torch.nn.Module:
    """Move the model to its device, convert BatchNorm when asked, and wrap it in DDP."""
    if cfg.sync_bn and has_batchnorm(model):
        # nn.SyncBatchNorm on CUDA; ddp_lab's own on the CPU (nn.SyncBatchNorm refuses it).
        model = convert_sync_batchnorm_auto(model, env.device)
    model = model.to(env.device)
    if env.distributed:
        device_ids = [env.local_rank] if env.device.type == "cuda" else None
        model = DDP(model, device_ids=device_ids)
    return model


def save_atomic(obj, path: str) -> None:
    """``torch.save`` through a temporary file, fsync and rename: a crash or a full disk
    never leaves half a file, nor destroys the one saved before."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    write_atomic(buf.getvalue(), path)


def make_loader(
    dataset: torch.utils.data.Dataset, cfg: Config, env: DistEnv
) -> tuple[torch.utils.data.DataLoader, ResumableSampler]:
    """This rank's training loader: ``DistributedSampler``'s order that can resume mid-epoch
    (:class:`~ddp_lab.checkpoint.ResumableSampler`), full batches only, and its own seeded
    generator, so that loading never draws from the global RNG."""
    sampler = ResumableSampler(len(dataset), env.world_size, env.rank, seed=cfg.seed)
    if len(sampler) < cfg.batch_size:
        raise UsageError(
            f"each of the {env.world_size} process(es) gets {len(sampler)} training samples, "
            f"fewer than one batch of {cfg.batch_size}; lower --batch-size or use more data"
        )
    workers = cfg.num_workers
    if workers is None:
        workers = 4 if env.device.type == "cuda" else 0
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        pin_memory=env.device.type == "cuda",
        generator=torch.Generator().manual_seed(cfg.seed),
        persistent_workers=workers > 0,
    )
    return loader, sampler


def make_faults(cfg: Config, env: DistEnv) -> Faults:
    """The run's :class:`~ddp_lab.faults.Faults` from ``--fail-at-step``, ``--fault`` and
    ``--fail-rank`` (default: the last rank)."""
    rank = cfg.fail_rank if cfg.fail_rank is not None else env.world_size - 1

    def rebuild() -> torch.nn.Module:  # --fault scramble: a fresh init, same on every rank
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed + 1)
            return build_model(cfg.model, gpt_config(cfg))

    return Faults(cfg.fail_at_step, cfg.fault, rank, env, None, cfg.pg_timeout, rebuild)


def train(cfg: Config, env: DistEnv, faults: Faults | None = None) -> dict:
    """Train as ``cfg`` says on the process group ``env``; rank 0 writes the outputs.

    Per step the loop does no host sync and no collective besides DDP's gradient
    all-reduce: the loss stays on the device and is averaged over ranks and steps only
    every ``--log-every`` steps (and on the last step); the gradient norm is computed only
    on those steps or when clipping needs it. With ``--ckpt-dir`` it checkpoints, with
    ``--resume`` it continues from the newest valid checkpoint, bit-identically.

    Args:
        cfg: the options (:func:`parse_args`).
        env: this process's :class:`~ddp_lab.dist.DistEnv`.
        faults: fault injection and error context (made from ``cfg`` when omitted).

    Returns:
        The summary dict (also written to ``cfg.out/summary.json`` by rank 0).
    """
    torch.manual_seed(cfg.seed)
    events = Events(cfg.out, env, fresh=not cfg.resume)
    events.log("start", when=process_start_time())
    events.log("joined")  # the process group is up (setup ran before)
    if faults is None:
        faults = make_faults(cfg, env)
    faults.events = events

    # Data: rank 0 first, so that only one process downloads.
    faults.at("the data barrier (rank 0 prepares the data set)")
    if env.distributed and not env.is_rank0:
        dist.barrier()
    train_set, test_set = data_mod.make_datasets(
        cfg.dataset, cfg.data_dir, cfg.train_size, cfg.test_size, seq_len=cfg.seq_len
    )
    if env.distributed and env.is_rank0:
        dist.barrier()
    loader, sampler = make_loader(train_set, cfg, env)
    micro_per_step = cfg.batch_size * cfg.accum_steps  # samples per rank per optimizer step
    steps_per_epoch = len(sampler) // micro_per_step
    if steps_per_epoch == 0:
        raise UsageError(
            f"one epoch has {len(sampler) // cfg.batch_size} micro-batches per process, "
            f"fewer than --accum-steps {cfg.accum_steps}; lower --accum-steps or --batch-size"
        )

    # Model: same seed on every rank; DDP also broadcasts rank 0's weights at wrap time.
    model = wrap_model(build_model(cfg.model, gpt_config(cfg)), cfg, env)
    comm = CommMeter(env.world_size).attach(model) if env.distributed else None
    params = [p for p in model.parameters() if p.requires_grad]
    lr = cfg.lr * (env.world_size * cfg.accum_steps if cfg.scale_lr else 1)
    optimizer = torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    scheduler = warmup_schedule(optimizer, cfg.warmup_steps)
    scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.amp == "fp16")
    global_batch = cfg.batch_size * env.world_size * cfg.accum_steps

    # Resume: every rank loads the same checkpoint onto its own device.
    pos, evals, resumed = Position(), [], None
    ckpts = None
    if cfg.ckpt_dir:
        ckpts = Checkpoints(cfg.ckpt_dir, env, cfg.keep_last, cfg.ckpt_format, model, optimizer)
    if cfg.resume:
        faults.at("loading the checkpoint")
        resumed = ckpts.load_latest()  # also restores this rank's RNG states
    if resumed is not None:
        check_resumable(resumed, cfg, env, len(train_set))
        unwrap(model).load_state_dict(resumed["model"])
        optimizer.load_state_dict(resumed["optimizer"])
        scaler.load_state_dict(resumed["scaler"])
        scheduler.load_state_dict(resumed["scheduler"])
        loader.generator.set_state(resumed["loader_generator"].cpu())
        pos = Position(resumed["step"], resumed["epoch"], resumed["epoch_samples"])
        if pos.step > 0:
            # DDP's rebuilt bucket layout, as an uninterrupted run has it by now
            example = torch.stack([train_set[0][0]] * 2).to(env.device)
            settle_ddp_buckets(model, example, autocast(cfg.amp, env.device))
            if comm is not None:
                comm.take()
        evals = resumed["evals"]
        events.log("resumed", step=pos.step, path=resumed["path"])
        print0(
            f"{PROG}: resumed from {resumed['path']} (step {pos.step}, epoch {pos.epoch})",
            env=env,
            file=sys.stderr,
        )
    sampler.set_epoch(pos.epoch, start=pos.samples)
    total_steps = pos.step + len(sampler) // micro_per_step
    total_steps += steps_per_epoch * max(0, cfg.epochs - pos.epoch - 1)
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)

    recorder = Recorder(cfg, env, total_steps, pos.step if resumed else None)
    print0(
        f"{PROG}: {env.world_size} process(es), backend {env.backend}, device "
        f"{env.device.type}; model {describe_model(cfg, unwrap(model))}, dataset {cfg.dataset} "
        f"({len(train_set)} "
        f"train / {len(test_set)} test); {total_steps} steps of global batch {global_batch}, "
        f"lr {lr:g}"
        + (f" after {cfg.warmup_steps} warm-up steps" if cfg.warmup_steps else "")
        + f"; a record every {cfg.log_every} step(s)",
        env=env,
        file=sys.stderr,
    )

    first_step, last_loss, rollbacks, pending = pos.step + 1, float("nan"), [], {}
    language = cfg.dataset in TEXT_DATASETS  # next-token prediction: perplexity too
    clock = Clock()
    window = Window(env, clock, comm)  # between two records: no .item(), no extra collective
    norm_warning = NormWarning(cfg.grad_norm_warn, env)
    prof = StepProfiler(cfg.profile, env.rank, env.device.type, parse_schedule(cfg.profile_steps))
    if comm is not None:
        comm.label = prof.enabled  # a range per bucket's all-reduce in the trace
    t_start = time.perf_counter()
    for epoch in range(pos.epoch, cfg.epochs):
        if pos.step >= total_steps:
            break
        # The epoch's order from (seed, epoch); after a resume, from where it stopped.
        sampler.set_epoch(epoch, start=pos.samples if epoch == pos.epoch else 0)
        pos.epoch, pos.samples = epoch, sampler.start
        steps_this_epoch = len(sampler) // micro_per_step
        batches = iter(loader)
        for _ in range(steps_this_epoch):
            if pos.step >= total_steps:
                break
            faults.before_step(pos.step + 1, model)  # --fail-at-step: raise, kill, hang, ...
            for micro in range(cfg.accum_steps):
                with prof.range("data"):
                    x, y = next(batches)
                    x = x.to(env.device, non_blocking=True)
                    y = y.to(env.device, non_blocking=True)
                # Gradients are all-reduced only on the last micro-step of the group.
                last_micro = micro == cfg.accum_steps - 1
                no_sync = env.distributed and not last_micro
                with model.no_sync() if no_sync else contextlib.nullcontext():
                    with prof.range("forward"), autocast(cfg.amp, env.device):
                        logits = model(x).flatten(0, -2)  # (predictions, classes): 1 or T each
                        loss = torch.nn.functional.cross_entropy(logits, y.flatten())
                    with prof.range("backward"):
                        scaler.scale(loss / cfg.accum_steps).backward()  # loss / K: a mean
                window.loss += loss.detach().float() / cfg.accum_steps
            log_now = (pos.step + 1) % cfg.log_every == 0 or pos.step + 1 == total_steps
            step_lr = optimizer.param_groups[0]["lr"]
            # unscale -> clip -> step (skipped on inf with fp16) -> update the loss scale
            with prof.range("optimizer"):
                grad_norm, skipped = optimizer_step(
                    optimizer, scaler, params, cfg.clip_grad_norm, need_norm=log_now
                )
            scheduler.step()  # the warm-up's next rate
            prof.step()
            pos.step += 1
            pos.samples += global_batch
            window.add_step(grad_norm, skipped)
            if pos.step == first_step:
                events.log("first_step", step=pos.step)

            if ckpts is not None and cfg.ckpt_every and pos.step % cfg.ckpt_every == 0:
                with clock.paused("checkpoint"):
                    state = (cfg, env, pos, model, optimizer, scaler, scheduler, loader, evals)
                    done = checkpoint(ckpts, state, test_set, faults, events)
                rollbacks += done
                pending.update({"rollback": done[-1]} if done else {})
            if log_now:  # one all-reduce and a few host reads per record, not per step
                faults.at(f"the loss all-reduce of the record at step {pos.step}")
                steps_in_window = window.steps
                stats = window.close(global_batch, grad_norm)
                last_loss = stats["loss"]
                record = {
                    "step": pos.step,
                    "epoch": epoch,
                    **stats,
                    "lr": step_lr,
                    "grad_norm_warn": norm_warning.check(
                        stats["grad_norm_max"], pos.step, cfg.clip_grad_norm
                    ),
                    **pending,  # a rollback since the last record
                }
                pending = {}
                if language:
                    record["perplexity"] = perplexity(stats["loss"])
                if scaler.is_enabled():
                    record["loss_scale"] = scaler.get_scale()
                else:
                    del record["skipped"]
                recorder.record(record, steps_in_window)

        epoch_done = pos.samples - sampler.start == steps_this_epoch * global_batch
        with clock.paused("eval"):
            faults.at(f"the evaluation after epoch {epoch}")
            sync_buffers(model, env)
            ev = data_mod.evaluate(unwrap(model), test_set, env)
            if language:  # accuracy and loss per predicted token
                ev["perplexity"] = perplexity(ev["loss"])
        evals.append({"epoch": epoch, "step": pos.step, **ev})
        recorder.scalar("eval/accuracy", ev["accuracy"], pos.step)
        print0(
            f"epoch {epoch}: step {pos.step}, test accuracy {ev['accuracy']:.4f}, "
            f"test loss {ev['loss']:.4f}"
            + (f", perplexity {ev['perplexity']:.2f}" if language else ""),
            env=env,
            file=sys.stderr,
        )
        if ckpts is not None and cfg.ckpt_every is None:  # default: at every epoch end
            if epoch_done:
                pos.epoch, pos.samples = epoch + 1, 0
            with clock.paused("checkpoint"):
                state = (cfg, env, pos, model, optimizer, scaler, scheduler, loader, evals)
                done = checkpoint(ckpts, state, test_set, faults, events, ev["accuracy"])
            rollbacks += done
            pending.update({"rollback": done[-1]} if done else {})
    recorder.close()
    prof.close()
    seconds = time.perf_counter() - t_start
    train_seconds = clock.train_seconds()
    done_here = pos.step - first_step + 1  # steps this process ran (after a resume: fewer)
    # the slowest rank sets the pace: the most page faults of any rank (ddp_lab.hostmem)
    faults = torch.tensor([clock.train_faults() / max(1, done_here - 1)], dtype=torch.float64)
    if env.distributed:
        faults = faults.to(env.device)
        dist.all_reduce(faults, op=dist.ReduceOp.MAX)
    summary = {
        "final_loss": last_loss,
        "accuracy": evals[-1]["accuracy"] if evals else float("nan"),
        "test_loss": evals[-1]["loss"] if evals else float("nan"),
        "steps": pos.step,
        "epochs": len(evals),
        "world_size": env.world_size,
        "backend": env.backend,
        "device": env.device.type,
        # training steps only: from the end of the first step, evaluation excluded
        "samples_per_s": (
            (done_here - 1) * global_batch / train_seconds if done_here > 1 else float("nan")
        ),
        "train_seconds": train_seconds,
        "page_faults_per_step": faults.item(),  # the largest of any rank, training steps
        "eval_seconds": clock.other.get("eval", 0.0),
        "checkpoint_seconds": clock.other.get("checkpoint", 0.0),
        "seconds": seconds,
        "global_batch": global_batch,
        "lr": lr,
        "log_every": cfg.log_every,
        "ddp_buckets": ddp_bucket_count(model) if env.distributed else None,
        "resumed_from": resumed["step"] if resumed else None,
        "attempt": attempt(),  # this torchrun agent's restarts
        "rollbacks": rollbacks,
        "evals": evals,
        "config": asdict(cfg),
    }
    if language:
        summary["perplexity"] = evals[-1]["perplexity"] if evals else math.nan
    if env.is_rank0:
        save_atomic(unwrap(model).state_dict(), os.path.join(cfg.out, "model.pt"))
        with open(os.path.join(cfg.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        events.log("done", step=pos.step)
        print0(
            f"{PROG}: done in {seconds:.1f} s, {summary['samples_per_s']:.0f} samples/s; "
            f"results in {cfg.out}/",
            env=env,
            file=sys.stderr,
        )
    return summary


@exit_on_usage_error(PROG)
def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ddp_lab.train`` and of torchrun's ``-m ddp_lab.train``.

    Returns 0 on success, 1 when an injected fault fired or a collective failed (timeout,
    lost peer: one ``error:`` line naming the rank, the collective and the step); usage
    errors exit with 2 (:mod:`ddp_lab.errors`).
    """
    cfg = parse_args(argv)
    if cfg.host_memory == "keep":
        keep_freed_memory()  # no page faults per step for activations freed and reallocated
    env = setup(cfg.backend, cfg.pg_timeout)
    faults = make_faults(cfg, env)
    try:
        check_environment(cfg, env)
        if cfg.dry_run:
            print0(
                json.dumps(
                    {
                        "config": asdict(cfg),
                        "world_size": env.world_size,
                        "backend": env.backend,
                        "device": str(env.device),
                    }
                ),
                env=env,
            )
            return 0
        train(cfg, env, faults)
    except InjectedFault as err:
        return _failed(env, str(err))
    except RuntimeError as err:
        line = faults.explain(err)
        if line is None:
            raise
        return _failed(env, line)
    finally:
        teardown()
    return 0


def _failed(env: DistEnv, line: str) -> int:
    print(f"{PROG}: error: [rank {env.rank}] {line}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
