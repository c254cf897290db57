"""One checkpoint file: a checksummed ``torch.save`` payload, written atomically.

The file is one header line ``DDPLAB-CKPT 1 sha256=<hex>`` followed by a ``torch.save``
payload (read back with ``weights_only=True``). Writing goes to a temporary file in the same
folder, is flushed and fsync'ed, then renamed over the final name (and the folder
fsync'ed): a crash or a full disk never leaves half a file under a checkpoint's name, and
never touches an older checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import os

import torch

MAGIC = b"DDPLAB-CKPT 1 sha256="


class CorruptCheckpoint(Exception):
    """A checkpoint file that cannot be trusted (bad header, checksum mismatch, unreadable)."""


def encode(state: dict) -> bytes:
    """``state`` serialised with ``torch.save``, behind a header line with its SHA-256.

    Example:
        >>> decode(encode({"step": 3}))["step"]
        3
    """
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    return MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def verify(data: bytes) -> bytes:
    """The payload of :func:`encode`'s bytes, after checking the header and the checksum.

    Raises:
        CorruptCheckpoint: bad header, or checksum mismatch (a truncated or damaged file).
    """
    head, sep, payload = data.partition(b"\n")
    if not (sep and head.startswith(MAGIC)):
        raise CorruptCheckpoint("no checkpoint header")
    if hashlib.sha256(payload).hexdigest().encode() != head[len(MAGIC) :]:
        raise CorruptCheckpoint(f"checksum mismatch ({len(data)} bytes: truncated or damaged)")
    return payload


def decode(data: bytes, map_location: str | torch.device | None = None) -> dict:
    """The state inside :func:`encode`'s bytes, after checking the checksum.

    Raises:
        CorruptCheckpoint: bad header, checksum mismatch (a truncated file) or bad payload.
    """
    payload = verify(data)
    try:
        return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except Exception as err:  # a payload that hashes right but does not load
        raise CorruptCheckpoint(f"unreadable payload ({type(err).__name__})") from None


def write_atomic(data: bytes, path: str) -> None:
    """Write ``data`` to ``path`` so that ``path`` holds either its old content or all of
    ``data``: temporary file in the same folder, flush, fsync, rename, fsync the folder.

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "x")
        >>> write_atomic(b"hello", p)
        >>> open(p, "rb").read()
        b'hello'
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
