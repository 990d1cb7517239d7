"""Run untrusted Python (a model's function and the hidden tests of its task) in a process of its own.

Each program runs in a fresh interpreter (``python -I -S``: no site, no user paths, no ``PYTHON*`` variables)
started in a new session, so its whole process group is killed afterwards, with:

- a wall-clock timeout (the parent SIGKILLs the group: a program that ignores signals or sleeps is stopped too);
- CPU-time, address-space (memory), file-size and core-file limits (``resource.setrlimit``), and no new
  processes (``RLIMIT_NPROC`` 0);
- a scratch working folder of its own, removed afterwards, and an environment stripped of the parent's variables;
- stdin at end of file, stdout and stderr discarded (a program that prints gigabytes only burns its time);
- no network where the OS allows it: a network namespace of its own (``unshare(CLONE_NEWNET)``, as root or in a
  user namespace); :attr:`Outcome.network_isolated` says whether it got one;
- as root, where ``nobody`` can read the interpreter's standard library: the uid and gid of ``nobody``, so it
  cannot write or delete what is not world-writable (an interpreter installed under a private ``/root`` cannot
  run as ``nobody``: the program then runs as root, behind the guard below);
- a guard inside the interpreter (as nanochat's and OpenAI's human-eval execution do): ``os.fork``, ``os.system``,
  the ``exec``/``spawn``/``kill`` family and file removal are gone, ``subprocess``, ``socket``, ``ctypes`` and
  ``multiprocessing`` cannot be imported, and ``open`` refuses to write outside the scratch folder.

What is not isolated: the program can read any file the user it runs as can read, and the guard is Python-level
(a program that reaches the interpreter's internals can undo it); the kernel limits and, as root, the ``nobody``
uid hold regardless. It can also write to its result pipe and so misreport its own tests. Written here rather
than taken from a library: none of the execution sandboxes on the package registry runs without a container
runtime, a server or a CPython build of its own.

The results come back over a pipe, one byte per test, so a program killed halfway still has its first tests
counted. :func:`run_many` runs programs on a thread pool sized to the cores, one process each.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

NOBODY = 65534
"""uid and gid a program runs as when the parent is root."""


@dataclass(frozen=True)
class Limits:
    """What one program may use.

    Attributes:
        timeout_s: Wall-clock seconds from start (interpreter start-up included) to SIGKILL.
        cpu_s: CPU seconds (``RLIMIT_CPU``).
        memory_mb: Address space in MiB (``RLIMIT_AS``).
        file_mb: Largest file it may write, MiB (``RLIMIT_FSIZE``).
    """

    timeout_s: float = 3.0
    cpu_s: int = 3
    memory_mb: int = 512
    file_mb: int = 8


@dataclass(frozen=True)
class Outcome:
    """How one program fared against its tests.

    Attributes:
        passed: Tests that ran without raising.
        total: Tests given.
        status: ``ok`` (every test reported), ``timeout`` (killed at the wall-clock limit) or ``crash`` (ended
            before reporting every test: ``os._exit``, a signal, a limit).
        network_isolated: Whether the program ran in a network namespace of its own.
        pid: The process id (also its process group and session id).
    """

    passed: int
    total: int
    status: Literal["ok", "timeout", "crash"]
    network_isolated: bool
    pid: int

    @property
    def fraction(self) -> float:
        """Share of the tests passed (0.0 without tests)."""
        return self.passed / self.total if self.total else 0.0


_DRIVER = r"""
import json, os, sys
job = json.loads(sys.stdin.read())
fd = job["fd"]
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)
isolated = False
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    isolated = libc.unshare(0x40000000) == 0 or libc.unshare(0x10000000 | 0x40000000) == 0
except Exception:
    pass
import resource
if job["nobody"] is not None:
    os.setgroups([])
    os.setgid(job["nobody"])
    os.setuid(job["nobody"])
mb = 1 << 20
for limit, value in ((resource.RLIMIT_CPU, job["cpu_s"]), (resource.RLIMIT_AS, job["memory_mb"] * mb),
                     (resource.RLIMIT_FSIZE, job["file_mb"] * mb), (resource.RLIMIT_CORE, 0),
                     (resource.RLIMIT_NPROC, 0)):
    resource.setrlimit(limit, (value, value))
os.write(fd, b"N" if isolated else b"n")
import builtins, io
here = os.getcwd() + os.sep
real_open, real_os_open = builtins.open, os.open
def _inside(path):
    return os.path.realpath(path).startswith(here)
def guarded_open(file, mode="r", *args, **kwargs):
    if isinstance(file, (str, bytes, os.PathLike)) and set(mode) & set("wax+") and not _inside(file):
        raise PermissionError("the sandbox writes only in its scratch folder")
    return real_open(file, mode, *args, **kwargs)
def guarded_os_open(path, flags, *args, **kwargs):
    if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC) and not _inside(path):
        raise PermissionError("the sandbox writes only in its scratch folder")
    return real_os_open(path, flags, *args, **kwargs)
builtins.open = io.open = guarded_open
os.open = guarded_os_open
for name in ("fork", "forkpty", "vfork", "system", "popen", "execl", "execle", "execlp", "execlpe", "execv",
             "execve", "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve",
             "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "kill", "killpg", "setsid", "setpgid",
             "setuid", "setgid", "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace",
             "truncate", "ftruncate", "chmod", "fchmod", "chown", "fchown", "lchown", "link", "symlink",
             "putenv", "unsetenv", "chdir", "fchdir", "chroot", "register_at_fork"):
    if hasattr(os, name):
        delattr(os, name)
for name in ("ctypes", "_ctypes", "subprocess", "_posixsubprocess", "multiprocessing", "_multiprocessing",
             "socket", "_socket", "pty", "shutil", "resource", "signal", "_signal", "threading", "_thread"):
    sys.modules[name] = None
space = {"__name__": "__main__", "__builtins__": builtins}
try:
    exec(compile(job["program"], "<program>", "exec"), space)
    defined = True
except BaseException:
    defined = False
write = os.write
for test in job["tests"]:
    result = b"0"
    if defined:
        try:
            exec(compile(test, "<test>", "exec"), space)
            result = b"1"
        except BaseException:
            pass
    write(fd, result)
os._exit(0)
"""


@functools.cache
def _as_nobody() -> int | None:
    """:data:`NOBODY` when the parent is root and ``nobody`` can read this interpreter's standard library (every
    folder above it searchable by others), else None: the program then runs as the parent's user."""
    if os.getuid() != 0:
        return None
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    folders = [stdlib, *stdlib.parents]
    if all(f.stat().st_mode & stat.S_IXOTH for f in folders) and stdlib.stat().st_mode & stat.S_IROTH:
        return NOBODY
    return None


def _environment() -> dict[str, str]:
    """The whole environment a program gets: none of the parent's variables (keys, tokens, paths)."""
    return {"PATH": os.defpath, "LC_ALL": "C.UTF-8"}


def _read_all(fd: int) -> bytes:
    """What the (now dead) writers left in the pipe `fd`, without blocking."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass


def run_program(program: str, tests: Sequence[str], limits: Limits = Limits()) -> Outcome:
    """Run `program`, then each of `tests` in its namespace, in a sandboxed process (see the module docstring).

    Args:
        program: Python source, e.g. a task's prompt (``def`` line and docstring) plus a candidate body.
        tests: Statements run one by one after it (e.g. ``assert f(2) == 5``); one passes when it raises nothing.
        limits: Time and memory bounds.

    Returns:
        The :class:`Outcome`; a program that does not compile, raises or exits while it is defined passes no test.
    """
    scratch = tempfile.mkdtemp(prefix="llmpipe-sandbox-")
    nobody = _as_nobody()
    if nobody is not None:
        os.chown(scratch, nobody, nobody)
    read_end, write_end = os.pipe()
    job = {"program": program, "tests": list(tests), "fd": write_end, "nobody": nobody, "cpu_s": limits.cpu_s,
           "memory_mb": limits.memory_mb, "file_mb": limits.file_mb}  # fmt: skip
    timed_out = False
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _DRIVER], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=scratch, env=_environment(),
                                pass_fds=(write_end,), start_new_session=True)  # fmt: skip
        os.close(write_end)
        write_end = -1
        try:
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except BrokenPipeError:  # it died before reading its job
            pass
        try:
            proc.wait(limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc.pid)  # also when it exited: anything it left in its group goes with it
        proc.wait()
        report = _read_all(read_end)
    finally:
        os.close(read_end)
        if write_end != -1:
            os.close(write_end)
        shutil.rmtree(scratch, ignore_errors=True)
    results = report[1 : 1 + len(tests)]
    # RLIMIT_CPU ends a busy program with SIGXCPU (SIGKILL past the hard limit) before the wall clock does on an
    # idle core: that is the time limit too, not a crash.
    out_of_time = timed_out or proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL)
    status = "timeout" if out_of_time else "ok" if len(results) == len(tests) and report else "crash"
    return Outcome(results.count(b"1"), len(tests), status, report[:1] == b"N", proc.pid)


def run_many(jobs: Sequence[tuple[str, Sequence[str]]], limits: Limits = Limits(), workers: int | None = None
             ) -> list[Outcome]:
    """:func:`run_program` of each ``(program, tests)``, at most `workers` at a time (default: the cores).

    Returns:
        The outcomes in the order of `jobs`.
    """
    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=min(len(jobs), workers or os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda job: run_program(job[0], job[1], limits), jobs))
