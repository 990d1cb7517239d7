"""Atomic writes (a killed stage never leaves a half-written file or model folder that DVC could cache),
jsonl reading and content hashes of input files."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from llmpipe.core.errors import UserError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a temporary folder beside `final`; on success it replaces `final` in one rename.

    On an exception the temporary folder is removed and `final` (if any) is left as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes 0700; give the folder the usual permissions
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(final: str | Path, mode: str = "w") -> Iterator[Any]:
    """Open a temporary file beside `final` for writing; rename it over `final` when the block succeeds."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
    try:
        with os.fdopen(fd, mode) as fh:
            yield fh
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: str | Path, obj: Any) -> None:
    """Write `obj` as indented JSON, atomically."""
    with atomic_file(path) as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.write("\n")


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write one JSON object per line, atomically; returns the number of rows."""
    n = 0
    with atomic_file(path) as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a jsonl file into memory (see `iter_jsonl`)."""
    return list(iter_jsonl(path))


def iter_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """The rows of a jsonl file, one at a time (memory bounded by the longest line); blank lines are skipped.

    Raises:
        ValueError: A line is not UTF-8 or not a JSON object; the message gives the file and line number.
        FileNotFoundError: The file does not exist.
    """
    return (row for _, row in numbered_jsonl(path))


def numbered_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """`iter_jsonl` with each row's 1-based line number, for messages about a row's content."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            line = decode_line(raw, path, lineno)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg}); fix or remove that line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row


def decode_line(raw: bytes, path: str | Path, lineno: int) -> str:
    """`raw` (one line of `path`) as UTF-8.

    Raises:
        ValueError: ``<path>:<lineno>: not UTF-8 …`` with the byte and its column.
    """
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}:{lineno}: not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1}); "
            "save the file as UTF-8"
        ) from None


def safetensors_problem(f: Path) -> str | None:
    """Why the safetensors file `f` is not whole (no header, a header longer than the file, or a size other
    than its header declares), or None. Reads the header only, so it catches truncation, not bit flips."""
    size = f.stat().st_size
    with f.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return "no header"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return f"header of {n} bytes in a {size}-byte file"
        try:
            header = json.loads(fh.read(n))
        except ValueError:
            return "unreadable header"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    return None if 8 + n + end == size else f"{size} bytes, its header says {8 + n + end}"


def hash_paths(paths: list[Path]) -> str:
    """SHA-256 over the relative names and bytes of every file under `paths` (files or folders), in order.

    Files are read in chunks, so memory stays bounded however large they are.

    Raises:
        UserError: An input does not exist (an earlier stage has not run).
    """
    h = hashlib.sha256()
    for root in map(Path, paths):
        if not root.exists():
            raise UserError(f"{root}: missing input of this stage; run the stages before it first (dvc repro)")
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for f in files:
            h.update(str(f.relative_to(root) if f != root else f.name).encode())
            with f.open("rb") as fh:
                h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()
