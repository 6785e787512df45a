"""A deterministic word corpus from text every Debian machine has offline.

Sources, in this order: ``/usr/share/doc`` (READMEs, changelogs, copyright
files; ``.gz`` files are gunzipped) and ``/usr/share/man`` (man pages,
gunzipped). Within a source, files are taken in sorted path order until the
corpus reaches its size. Each file is decoded as Latin-1, lower-cased and
reduced to its ``[a-z0-9]+`` tokens, written 64 words per line separated by
single spaces. Every tokeniser used by the benchmarks (Python ``split``,
the daemon's text mode, Spark's ``split``) therefore sees the same words.
The manifest (files used, words, distinct words, sha256) goes next to the
corpus so a figure names its exact input.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from typing import Any

__all__ = ["build_corpus", "SOURCES"]

SOURCES = {"doc": "/usr/share/doc", "man": "/usr/share/man"}
_TOKEN = re.compile(rb"[a-z0-9]+")
_WORDS_PER_LINE = 64


def _files(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                out.append(path)
    return sorted(out)


def _read(path: str) -> bytes:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        with open(path, "rb") as f:
            data = f.read()
        # Binary files (images, compressed archives other than gz) add noise.
        return b"" if b"\0" in data[:4096] else data
    except (OSError, EOFError, gzip.BadGzipFile):
        return b""


def build_corpus(out_dir: str, size_bytes: int, sources: tuple[str, ...] = ("doc", "man")) -> dict[str, Any]:
    """Write (or reuse) the corpus of ``size_bytes`` from ``sources``; return its manifest."""
    os.makedirs(out_dir, exist_ok=True)
    name = f"corpus-{'+'.join(sources)}-{size_bytes}"
    path = os.path.join(out_dir, name + ".txt")
    manifest_path = os.path.join(out_dir, name + ".json")
    if os.path.exists(path) and os.path.exists(manifest_path):
        with open(manifest_path) as f:
            return json.load(f)
    written, files, words = 0, 0, 0
    digest = hashlib.sha256()
    with open(path + ".tmp", "wb") as out:
        for src in sources:
            for p in _files(SOURCES[src]):
                if written >= size_bytes:
                    break
                tokens = _TOKEN.findall(_read(p).lower())
                if not tokens:
                    continue
                files += 1
                for i in range(0, len(tokens), _WORDS_PER_LINE):
                    line = b" ".join(tokens[i:i + _WORDS_PER_LINE]) + b"\n"
                    out.write(line)
                    digest.update(line)
                    written += len(line)
                    words += min(_WORDS_PER_LINE, len(tokens) - i)
                    if written >= size_bytes:
                        break
    os.replace(path + ".tmp", path)
    manifest = {"path": path, "sources": [SOURCES[s] for s in sources], "bytes": written, "files": files,
                "words": words, "sha256": digest.hexdigest()}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    return manifest


def split_lines(path: str, parts: int, out_dir: str) -> list[str]:
    """Split a corpus at line boundaries into ``parts`` files of about equal size."""
    with open(path, "rb") as f:
        data = f.read()
    paths, start = [], 0
    for i in range(parts):
        end = len(data) if i == parts - 1 else data.find(b"\n", (len(data) * (i + 1)) // parts) + 1 or len(data)
        p = os.path.join(out_dir, os.path.basename(path) + f".part{i}of{parts}")
        with open(p, "wb") as f:
            f.write(data[start:end])
        paths.append(p)
        start = end
    return paths
