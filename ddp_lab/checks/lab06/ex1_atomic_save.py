"""Exercise 1: ``save_checkpoint`` / ``load_checkpoint``, atomic and checksummed.

The student's two functions run in the student process, watched by the checker:

- ``os.fsync`` / ``os.fdatasync`` / ``os.replace`` / ``os.rename`` are recorded (which file,
  how large it was at that moment);
- two failures are injected while a save runs over an existing checkpoint: the state holds
  an object that raises when it is serialised (the program dies in the middle of writing),
  and the file size limit (``RLIMIT_FSIZE``) is set to half the checkpoint's size (the disk
  fills up in the middle of writing); a third one runs on a fresh path;
- the checker computes the SHA-256 of ``path`` after every save, damages copies of a good
  file (truncated: empty, half, all but the last byte; one byte flipped: the first, the
  middle, the last, a random one) and loads each, loads a good copy under another name, and
  loads with ``map_location="meta"``.

The judge (another process) asks for: every save that returned left ``path`` holding
exactly its state (``torch.equal``, dtypes, structure); every failed save raised and left
``path`` byte for byte as it was (the previous checkpoint, or no file) and nothing else in
the folder; the good save renamed a temporary file of ``path``'s folder onto ``path`` after
an ``fsync`` of the complete file; every damaged file raised ``ValueError``; the good copy
loaded under its new name; ``map_location`` reached ``torch.load``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab06.instruments import Explodes, disk_full_at, recorded_file_ops
from ddp_lab.checks.values import plain, randint

NAME = "ckpt.pt"


# --- the case set ------------------------------------------------------------------------


def _training_state(gen: torch.Generator) -> dict:
    d, h = randint(gen, 40, 60), randint(gen, 100, 160)
    w = torch.randn(h, d, generator=gen)
    return {
        "model": {"hidden.weight": w, "hidden.bias": torch.randn(h, generator=gen)},
        "optimizer": {
            "state": {0: {"momentum_buffer": torch.randn(h, d, generator=gen)}, 1: {}},
            "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": [0, 1]}],
        },
        "epoch": randint(gen, 0, 9),
        "step": randint(gen, 1, 10_000),
        "rng": [torch.randint(0, 255, (64,), generator=gen, dtype=torch.uint8) for _ in range(2)],
        "flags": {"model": "mlp", "lr": 0.1, "amp": None, "sync_bn": False},
        "extra": [torch.zeros(0), torch.tensor(3.5, dtype=torch.float64), torch.ones(3) > 0],
    }


def _large_state(gen: torch.Generator) -> dict:
    n = randint(gen, 50_000, 70_000)
    return {"weights": torch.randn(n, generator=gen), "step": randint(gen, 1, 10_000)}


def _case(gen: torch.Generator, kind: str) -> dict:
    make = _training_state if kind == "training" else _large_state
    first = make(gen)
    second = _like(first, gen)
    return {"kind": kind, "first": first, "second": second, "flip_at": _uniform01(gen)}


def _uniform01(gen: torch.Generator) -> float:
    return float(torch.rand(1, generator=gen, dtype=torch.float64))


def _like(state, gen: torch.Generator):
    """``state`` with new random values in its float tensors (same sizes: a full disk at
    half the first file's size stops the second one half-way too)."""
    if isinstance(state, torch.Tensor):
        if state.is_floating_point() and state.numel():
            return torch.randn(state.shape, generator=gen, dtype=torch.float64).to(state.dtype)
        return state.clone()
    if isinstance(state, dict):
        return {k: _like(v, gen) for k, v in state.items()}
    if isinstance(state, list):
        return [_like(v, gen) for v in state]
    return state


def make_inputs(gen: torch.Generator) -> dict:
    """Two cases: a training checkpoint (model, optimizer, counters, RNG states, an empty and
    a 0-d tensor; the first save fails on a fresh path) and a large tensor (damage lands in
    its bytes)."""
    return {"cases": [_case(gen, "training"), _case(gen, "large")]}


def _sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _said(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:300]


def _load(load, path: Path, **kwargs):
    try:
        return {"state": plain(load(str(path), **kwargs))}
    except NotImplementedError:
        raise  # the released stub: the visible check asks to finish the exercise
    except Exception as err:  # noqa: BLE001 - the student's error, reported
        return {"error": _said(err), "value_error": isinstance(err, ValueError)}


def _step(ns: dict, folder: Path, state: dict, how: str) -> dict:
    """One save (``how``: ``"save"``, ``"crash"`` or ``"full"``), then what it left."""
    save, path = ns["save_checkpoint"], folder / NAME
    ops: list = []
    raised = None
    limit = max(1, (path.stat().st_size if path.is_file() else 4096) // 2)
    try:
        with recorded_file_ops(folder, ops):
            if how == "crash":
                save({**state, "zz_unpicklable": Explodes()}, str(path))
            elif how == "full":
                with disk_full_at(limit):
                    save(state, str(path))
            else:
                save(state, str(path))
    except NotImplementedError:
        raise  # the released stub
    except Exception as err:  # noqa: BLE001 - expected for the injected failures
        raised = _said(err)
    out = {
        "how": how,
        "raised": raised,
        "files": sorted(p.name for p in folder.iterdir()),
        "sha": _sha(path),
        "ops": ops,
    }
    if how == "save" and raised is None:
        out["loaded"] = _load(ns["load_checkpoint"], path)
    return out


def _damaged(data: bytes, flip_at: float) -> list[tuple[str, bytes]]:
    n = len(data)

    def flipped(i: int) -> bytes:
        return data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1 :]

    return [
        ("an empty file", b""),
        (f"the first {n // 2} of {n} bytes", data[: n // 2]),
        (f"all but the last of {n} bytes", data[:-1]),
        ("the first byte flipped", flipped(0)),
        (f"byte {n // 2} of {n} flipped", flipped(n // 2)),
        (f"byte {int(flip_at * n)} of {n} flipped", flipped(int(flip_at * n))),
        (f"the last byte of {n} flipped", flipped(n - 1)),
    ]


def _run_case(ns: dict, case: dict, folder: Path) -> dict:
    folder.mkdir(parents=True)
    plan = [("crash", "first")] if case["kind"] == "training" else []
    plan += [("save", "first"), ("crash", "second"), ("full", "second"), ("save", "second")]
    steps = [_step(ns, folder, case[which], how) for how, which in plan]
    out: dict = {"steps": steps, "plan": [w for _, w in plan], "damaged": []}
    path = folder / NAME
    if steps[-1]["raised"] is not None or not path.is_file():
        return out
    data = path.read_bytes()
    elsewhere = folder.parent / f"{folder.name}-copies"
    elsewhere.mkdir()
    load = ns["load_checkpoint"]
    for i, (how, blob) in enumerate(_damaged(data, case["flip_at"])):
        (elsewhere / f"damaged-{i}.bin").write_bytes(blob)
        out["damaged"].append({"how": how, **_load(load, elsewhere / f"damaged-{i}.bin")})
    shutil.copy(path, elsewhere / "renamed-copy.bin")
    out["copy"] = _load(load, elsewhere / "renamed-copy.bin")
    try:
        meta = load(str(path), map_location="meta")
        out["meta_devices"] = sorted({t.device.type for t in _tensors(meta)})
    except Exception as err:  # noqa: BLE001 - the student's error, reported
        out["meta_devices"], out["meta_error"] = ["error"], _said(err)
    return out


def run(ns: dict, inputs: dict, workdir: Path) -> dict:
    """Every case through the student's functions, in folders of ``workdir``."""
    root = Path(workdir) / "ex1"
    return {"cases": [_run_case(ns, c, root / f"case{i}") for i, c in enumerate(inputs["cases"])]}


# --- the judge -----------------------------------------------------------------------------


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, list):
        for v in value:
            yield from _tensors(v)


def same_state(got, want) -> bool:
    """``got`` equals ``want`` (both plain): same structure, tensors equal with their dtype."""
    if isinstance(want, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and bool(torch.equal(got, want))
        )
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and set(got) == set(want)
            and all(same_state(got[k], want[k]) for k in want)
        )
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(same_state(g, w) for g, w in zip(got, want, strict=True))
        )
    return type(got) is type(want) and got == want


WHAT = {
    "crash": "a save whose state raised while being serialised (a crash mid-write)",
    "full": "a save that ran out of disk space half-way (RLIMIT_FSIZE)",
    "save": "a save",
}


def rename_problem(ops: list) -> str | None:
    """What is wrong with how a good save reached ``path`` (renames and fsyncs), or None."""
    onto = [op for op in ops if op[0] == "rename" and op[2] == NAME]
    if not onto:
        return (
            f"nothing was renamed onto {NAME}: the file was written in place, so a crash in "
            "the middle leaves a damaged checkpoint under its name; write a temporary file in "
            "the same folder, then os.replace it onto path"
        )
    last = ops.index(onto[-1])
    src, size = onto[-1][1], onto[-1][3]
    if os.sep in src or src.startswith(".."):
        return (
            f"the temporary file {src} is not in path's folder: a rename to another folder (or "
            "file system) may copy the bytes, which is not atomic; create it next to path"
        )
    synced = [op for op in ops[:last] if op[0] in ("fsync", "fdatasync") and op[1] == src]
    if not synced:
        return (
            f"no os.fsync of the temporary file {src} before the rename: the rename can "
            "reach the disk before the bytes do, and a power cut leaves an empty or partial "
            "file under the checkpoint's name"
        )
    if synced[-1][2] < size:
        return (
            f"os.fsync ran when {src} held {synced[-1][2]} of its {size} bytes: the rest was "
            "still in Python's buffer; call f.flush() before os.fsync(f.fileno())"
        )
    return None


def _step_problem(step: dict, state, before: str | None, where: str) -> str | None:
    what = WHAT[step["how"]]
    if step["how"] != "save":
        if step["raised"] is None:
            return (
                f"{where}: {what} returned normally: a failed save must raise (the caller "
                "would believe the checkpoint is safe, and delete the older ones)"
            )
        if step["sha"] != before:
            if before is None:
                return (
                    f"{where}: {what} left a file at path where there was none before: it "
                    "was written in place; write a temporary file and rename it onto path "
                    "only once it is complete"
                )
            if step["sha"] is None:
                return f"{where}: {what} deleted the previous checkpoint"
            return (
                f"{where}: {what} changed the previous checkpoint (its SHA-256 is not the "
                "same): it was written in place; write a temporary file and rename it"
            )
        left = [f for f in step["files"] if f != NAME]
        if left:
            return (
                f"{where}: {what} left {', '.join(left)} in the folder: remove the "
                "temporary file when the save fails (then re-raise)"
            )
        return None
    if step["raised"] is not None:
        return f"{where}: save_checkpoint raised {step['raised']}"
    loaded = step.get("loaded", {})
    if "error" in loaded:
        return f"{where}: load_checkpoint of a good file raised {loaded['error']}"
    if not same_state(loaded.get("state"), state):
        return f"{where}: load_checkpoint did not give back the state that was saved"
    left = [f for f in step["files"] if f != NAME]
    if left:
        return f"{where}: the save left {', '.join(left)} next to the checkpoint"
    if why := rename_problem(step["ops"]):
        return f"{where}: {why}"
    return None


def _damage_problem(item: dict, where: str) -> str | None:
    if "state" in item:
        return (
            f"{where}: load_checkpoint returned a state from a damaged file ({item['how']}): "
            "verify the checksum of the bytes before torch.load, and raise ValueError"
        )
    if not item["value_error"]:
        return (
            f"{where}: load_checkpoint of a damaged file ({item['how']}) raised "
            f"{item['error']}, not ValueError: check the checksum first and raise ValueError "
            "(a caller then knows to fall back to the previous checkpoint)"
        )
    return None


def case_problem(case: dict, out: dict) -> str | None:
    """The first thing wrong in one case, or None."""
    where = f"the {case['kind']} checkpoint"
    before = None
    for step, which in zip(out["steps"], out["plan"], strict=True):
        if why := _step_problem(step, plain(case[which]), before, where):
            return why
        before = step["sha"]
    if len(out.get("damaged", [])) != 7:
        return f"{where}: the damaged-file checks did not run"
    loaded = [item for item in out["damaged"] if "state" in item]  # the worse one first
    for item in loaded + out["damaged"]:
        if why := _damage_problem(item, where):
            return why
    copy = out.get("copy", {})
    if not same_state(copy.get("state"), plain(case["second"])):
        return (
            f"{where}: a good checkpoint copied to another name did not load "
            f"({copy.get('error', 'a different state')}): keep everything in the one file"
        )
    if out.get("meta_devices") != ["meta"]:
        return (
            f"{where}: load_checkpoint(path, map_location='meta') gave tensors on "
            f"{out.get('meta_devices')} ({out.get('meta_error', '')}): pass map_location to "
            "torch.load (each rank loads onto its own device)"
        )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Atomic saves, intact previous checkpoints, detected damage (see the module)."""
    cases = outputs.get("cases")
    if not isinstance(cases, list) or len(cases) != len(inputs["cases"]):
        raise CheckFailed("expected one result per case")
    for case, out in zip(inputs["cases"], cases, strict=True):
        if why := case_problem(case, out):
            raise CheckFailed(why)
    synced_dir = any(
        op[0] in ("fsync", "fdatasync") and op[1] == "."
        for out in cases
        for step in out["steps"]
        for op in step["ops"]
    )
    folder = " (and the folder fsync'ed)" if synced_dir else ""
    damaged = sum(len(out["damaged"]) for out in cases)
    return (
        "save_checkpoint writes a temporary file, fsyncs it and renames it onto path"
        f"{folder}; a crash or a full disk mid-write left the previous checkpoint intact; "
        f"load_checkpoint refused {damaged} truncated or flipped files with ValueError"
    )


def visible_inputs(gen: torch.Generator) -> dict:
    """The training checkpoint only."""
    return {"cases": [_case(gen, "training")]}


EXERCISE = Exercise(
    "test_ex1_atomic_save",
    ("ex1_atomic_save",),
    "atomic checksummed save, verifying load",
    make_inputs,
    judge,
    run=run,
    forbid_modules=("ddp_lab.checkpoint",),
    timeout=60,
    visible_inputs=visible_inputs,
)
