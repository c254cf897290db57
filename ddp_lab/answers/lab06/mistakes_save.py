"""Typical wrong checkpoint writers and loaders (lab 6, exercise 1), as students write them:
in place, without ``fsync``, without verifying the checksum, a temporary file in another
folder, errors swallowed, ``fsync`` before ``flush``, a temporary file left behind, an
``assert`` instead of ``ValueError``, ``map_location`` ignored, one ``os.write`` call.
Collected into ``MISTAKES`` / ``MORE_MISTAKES`` by :mod:`ddp_lab.answers.lab06.mistakes`.
"""

from __future__ import annotations

from ddp_lab.answers import Mistake

# --- exercise 1: save_checkpoint / load_checkpoint ----------------------------------------

_IMPORTS = """import hashlib
import io
import os
import shutil
import tempfile

import torch
"""

# a loader that checks a hex digest stored in the last 64 bytes (right for the savers below)
_LOAD_HEX = """

def load_checkpoint(path, map_location=None):
    with open(path, "rb") as f:
        raw = f.read()
    body, digest = raw[:-64], raw[-64:]
    if len(raw) < 64 or hashlib.sha256(body).hexdigest().encode() != digest:
        raise ValueError(f"{path}: bad checksum")
    return torch.load(io.BytesIO(body), map_location=map_location, weights_only=True)
"""


def _saver(write: str) -> str:
    """A save_checkpoint that serialises with a hex digest appended, then ``write``s it."""
    return (
        _IMPORTS
        + """

def save_checkpoint(state, path):
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest().encode()
"""
        + write
    )


_IN_PLACE = """
import hashlib
import io
import os

import torch


def save_checkpoint(state, path):
    # torch.save straight into the file, then the checksum of what is there
    torch.save(state, path)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(path, "ab") as f:
        f.write(digest.encode())
        f.flush()
        os.fsync(f.fileno())


def load_checkpoint(path, map_location=None):
    with open(path, "rb") as f:
        content = f.read()
    if hashlib.sha256(content[:-64]).hexdigest().encode() != content[-64:]:
        raise ValueError("checkpoint corrupted: " + path)
    return torch.load(io.BytesIO(content[:-64]), map_location=map_location, weights_only=True)
"""

_TMP_RENAME = """    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.write(digest)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
"""

SAVE_MISTAKES = [
    Mistake("ex1_atomic_save", "written_in_place", _IN_PLACE, "written in place"),
    Mistake(
        "ex1_atomic_save",
        "no_fsync",
        _saver(
            """    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data + digest)
        os.replace(tmp, path)
    except Exception:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
"""
        )
        + _LOAD_HEX,
        "no os.fsync of the temporary file",
    ),
    Mistake(
        "ex1_atomic_save",
        "checksum_not_verified",
        _saver(_TMP_RENAME)
        + """

def load_checkpoint(path, map_location=None):
    with open(path, "rb") as f:
        raw = f.read()
    return torch.load(io.BytesIO(raw[:-64]), map_location=map_location, weights_only=True)
""",
        "returned a state from a damaged file",
    ),
    Mistake(
        "ex1_atomic_save",
        "temp_in_tmp",
        _saver(
            """    with tempfile.NamedTemporaryFile(delete=False) as f:
        f.write(data + digest)
        f.flush()
        os.fsync(f.fileno())
    shutil.move(f.name, path)
"""
        )
        + _LOAD_HEX,
        "is not in path's folder",
    ),
    Mistake(
        "ex1_atomic_save",
        "swallows_errors",
        _saver(
            """    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data + digest)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:
        print("could not save the checkpoint:", e)
        if os.path.exists(tmp):
            os.remove(tmp)
"""
        )
        + _LOAD_HEX,
        "returned normally",
    ),
    Mistake(
        "ex1_atomic_save",
        "fsync_before_flush",
        _saver(
            """    tmp = path + ".tmp"
    try:
        f = open(tmp, "wb")
        f.write(data)
        f.write(digest)
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
"""
        )
        + _LOAD_HEX,
        "still in Python's buffer",
    ),
    Mistake(
        "ex1_atomic_save",
        "temp_left_behind",
        _saver(
            """    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data + digest)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
"""
        )
        + _LOAD_HEX,
        "remove the temporary file",
    ),
    Mistake(
        "ex1_atomic_save",
        "assert_on_damage",
        _saver(_TMP_RENAME)
        + """

def load_checkpoint(path, map_location=None):
    with open(path, "rb") as f:
        raw = f.read()
    assert hashlib.sha256(raw[:-64]).hexdigest().encode() == raw[-64:], "bad checksum"
    return torch.load(io.BytesIO(raw[:-64]), map_location=map_location, weights_only=True)
""",
        "not ValueError",
    ),
    Mistake(
        "ex1_atomic_save",
        "ignores_map_location",
        _saver(_TMP_RENAME) + _LOAD_HEX.replace("map_location=map_location", 'map_location="cpu"'),
        "pass map_location to torch.load",
    ),
    Mistake(
        "ex1_atomic_save",
        "one_os_write",
        _saver(
            """    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, data + digest)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
"""
        )
        + _LOAD_HEX,
        "os.write may write fewer bytes than asked",
    ),
]
