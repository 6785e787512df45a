"""Keys of authenticated jobs (docs/security.md).

A keyed job has one random 128-bit *job key*, known to the switches of the
job and the controller. Each member seals its datagrams with its *member
key*, derived from the job key and its source id by the one function the
switch uses (implemented in Rust, exposed here)::

    job_key = fanin.new_job_key()
    sw.admit_job(fanin.switch.job_config(1, 4, key=job_key))
    s = fanin.Session(addr, job_id=1, rank=2, auth_key=fanin.derive_member_key(job_key, 1, 2))
"""

from __future__ import annotations

import os
from typing import Union

from fanin import _native

__all__ = ["KeyFileError", "derive_member_key", "new_job_key", "key_hex", "read_key_file", "write_key_file"]

KeyLike = Union[bytes, bytearray, str]


class KeyFileError(OSError, ValueError):
    """A key file that cannot be opened (missing, a folder, no permission):
    the OSError (``errno``, ``strerror``, ``filename``) that says why, and a
    ValueError too (as io.UnsupportedOperation is both), so the command
    lines that report a ValueError as one line (`fanin keys --job-key-file`,
    `--job ...,key_file=`) name the file instead of printing a traceback."""

    def __init__(self, action: str, err: OSError):
        super().__init__(err.errno, err.strerror, err.filename)
        self.action = action

    def __str__(self) -> str:
        return f"cannot {self.action} the key file {self.filename}: {self.strerror}"


def new_job_key() -> bytes:
    """16 random bytes from the operating system's CSPRNG."""
    return os.urandom(16)


def _key_bytes(key: KeyLike) -> bytes:
    if isinstance(key, str):
        try:
            key = bytes.fromhex(key)
        except ValueError:
            raise ValueError("a key given as text is 32 hex digits") from None
    if len(key) != 16:
        raise ValueError(f"a key is 16 bytes (128 bits), got {len(key)}")
    return bytes(key)


def key_hex(key: KeyLike) -> str:
    """The config-file form of a key: 32 hex digits."""
    return _key_bytes(key).hex()


def derive_member_key(job_key: KeyLike, job_id: int, src_id: int) -> bytes:
    """The member key of source ``src_id`` in job ``job_id`` (16 bytes)."""
    return _native.derive_member_key(_key_bytes(job_key), job_id, src_id)


def read_key_file(path: str) -> bytes:
    """A key from a file: 32 hex digits (surrounding whitespace ignored, as
    `fanin keys` writes them) or 16 raw bytes. A file that holds neither is
    a ValueError that names the file and its size, never its content (it is
    meant to be a secret); an unreadable one a :class:`KeyFileError` (an
    OSError and a ValueError)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise KeyFileError("read", e) from None
    if len(raw) == 16 and all(chr(b) in "0123456789abcdefABCDEF" for b in raw):
        # 16 hex digits are half a key typed as text, not 16 raw bytes (a
        # random key is all hex digits with odds of about 1e-17)
        raise ValueError(f"{path} holds 16 hex digits: a key is 32 hex digits (as `fanin keys` writes it) or 16 "
                         "raw bytes")
    if len(raw) == 16:
        return raw
    try:
        key = bytes.fromhex(raw.strip().decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != 16:
        raise ValueError(f"{path} holds {len(raw)} bytes that are not a key: write 32 hex digits (as `fanin keys` "
                         "does) or 16 raw bytes")
    return key


def write_key_file(path: str, key: KeyLike) -> None:
    """Write ``key`` as 32 hex digits and a newline to a new file that only
    its owner may read (mode 0600); an existing file is never replaced
    (FileExistsError). A file that cannot be made (no such folder, no
    permission) is a :class:`KeyFileError`."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise
    except OSError as e:
        raise KeyFileError("write", e) from None
    with os.fdopen(fd, "w") as f:
        f.write(key_hex(key) + "\n")
