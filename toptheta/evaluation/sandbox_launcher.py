"""The sandbox launcher: isolates one guest interpreter, enforces the limits, reports how it ended.

Run as a script, ``python -I -S -B sandbox_launcher.py '<spec json>'``, once per program, by
`toptheta.evaluation.sandbox`. It imports only cheap standard-library modules (it starts once per
program) and nothing of toptheta (``-I -S``: no site-packages). Isolation modes (see sandbox.py):

``namespace`` (root): new mount, network, PID and IPC namespaces; a read-only chroot; the guest
  runs under a fresh unprivileged uid with no account.
``userns`` (any user): the same namespaces, owned by a new *user* namespace in which our own uid
  appears as an unprivileged uid (1000). The mounts are built with the capabilities the new user
  namespace grants, then the guest is exec'd as that non-zero uid, which drops every capability.
``process``: no isolation, only the limits and a process group (opt-in, see sandbox.py).

In both namespace modes the guest is PID 1 of its own PID namespace: when it ends or is killed,
the kernel kills everything it forked, and it sees no process of the host. Inside the chroot it
sees /usr, /etc, /lib*, /bin, /sbin and the Python installation read-only, four harmless devices
and a private size-capped tmpfs at /tmp (its working directory); not /root, /home, /work, /proc or
the host's /tmp. The network namespace has only a loopback that is down.
"""

import json
import os
import resource
import signal
import sys
import time

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWIPC = 0x00020000, 0x10000000, 0x08000000
_CLONE_NEWNET, _CLONE_NEWPID = 0x40000000, 0x20000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
# statvfs f_flag bit -> mount flag: flags of a host mount that a user namespace may not clear
# ("locked"), so a read-only remount of our bind mount must repeat them.
_KEEP_FLAGS = ((os.ST_NOSUID, _MS_NOSUID), (os.ST_NODEV, _MS_NODEV), (os.ST_NOEXEC, _MS_NOEXEC),
               (os.ST_NOATIME, _MS_NOATIME), (os.ST_NODIRATIME, _MS_NODIRATIME),
               (os.ST_RELATIME, _MS_RELATIME))
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
# Host directories the interpreter needs (shared libraries, locale data, /etc/localtime).
_SYSTEM_PATHS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/etc")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
USERNS_UID = 1000  # the guest's uid inside its user namespace (userns mode)

_LIBC = None


def _libc():
    """(libc, ctypes), loaded on first use: only the namespace modes need them."""
    global _LIBC
    if _LIBC is None:
        import ctypes  # only the namespace modes: the launcher starts once per program, imports stay few

        _LIBC = (ctypes.CDLL(None, use_errno=True), ctypes)
    return _LIBC


def _check(ret: int, what: str) -> None:
    """Raise OSError with errno when a libc call returned -1."""
    if ret != 0:
        import ctypes  # only on a failed libc call: the launcher starts once per program, imports stay few

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags: int, data=None) -> None:
    libc, ctypes = _libc()
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source} -> {target}")


def interpreter() -> str:
    """The base interpreter binary: in a venv, the one the venv was made from (stdlib only)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _python_paths() -> list[str]:
    """Directories of the interpreter installation not already under a system path."""
    paths = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix),
             os.path.dirname(interpreter())}
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
    host = os.statvfs(src).f_flag
    keep = sum(ms for st, ms in _KEEP_FLAGS if host & st)
    # A bind mount takes flags only on a second, remount call.
    _mount(None, dst, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | extra | keep)


def _build_root(spec: dict, uid: int) -> None:
    """Inside the new mount namespace: build the view described in the module docstring."""
    newroot = spec["newroot"]
    # Private propagation first, or the mounts below would leak into the host's namespace.
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    _mount("tmpfs", newroot, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    home = os.path.realpath(spec["home"])
    for p in _python_paths():  # e.g. a Python built with --prefix=$HOME would show all of $HOME
        if home == p or home.startswith(p + os.sep):
            raise OSError(f"the Python installation {p} contains the home directory {home}, which the "
                          "sandbox must not show; use a Python installed elsewhere (a venv of it is fine)")
    for src in _SYSTEM_PATHS + tuple(_python_paths()) + _DEVICES:
        if os.path.lexists(src):
            _bind_readonly(src, newroot)
    tmp = newroot + "/tmp"
    os.makedirs(tmp)
    _mount("tmpfs", tmp, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={spec['tmpfs_bytes']},nr_inodes=1024,mode=0700,uid={uid},gid={uid}")
    for name in os.listdir(spec["workdir"]):  # the guest script and its inputs
        with open(os.path.join(spec["workdir"], name), "rb") as f, open(f"{tmp}/{name}", "wb") as g:
            g.write(f.read())
    _mount(None, newroot, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.chroot(newroot)  # a chrooted process may not create user namespaces (no way back out)
    os.chdir("/tmp")


def _set_limits(spec: dict) -> None:
    cpu = int(spec["timeout_s"]) + 1  # wall-clock timeout is the real bound; this stops spinning children
    limits = [(resource.RLIMIT_AS, spec["memory_bytes"]), (resource.RLIMIT_CPU, cpu),
              (resource.RLIMIT_FSIZE, spec["max_file_bytes"]),
              (resource.RLIMIT_NOFILE, spec["max_open_files"]), (resource.RLIMIT_CORE, 0)]
    # RLIMIT_NPROC counts the processes of one uid (per user namespace). The namespace modes give
    # every program its own (uid or user namespace), so it caps exactly that program; in process
    # mode it would count all of this user's processes (and root is exempt), so it is not set.
    if spec["mode"] != "process":
        limits.append((resource.RLIMIT_NPROC, spec["max_processes"]))
    for res, value in limits:
        resource.setrlimit(res, (value, value))


def _lock_down(uid: int | None) -> None:
    """Drop to `uid` (namespace mode), forbid privilege gain, die with the launcher."""
    libc, _ = _libc()
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise OSError(f"could not drop to uid {uid}")
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    # Set after setuid, which clears it: if the launcher dies, the program dies too.
    _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")


def _enter_user_namespace() -> None:
    """Unshare a user namespace (with the others) and appear in it as USERNS_UID/GID."""
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:  # as root the guest would be the host's root: RLIMIT_NPROC exempt
        raise OSError("userns mode is for unprivileged users; as root use 'namespace'")
    libc, _ = _libc()
    flags = _CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC
    _check(libc.unshare(flags), "unshare(CLONE_NEWUSER)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{USERNS_UID} {uid} 1"),
                       ("gid_map", f"{USERNS_UID} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _enter_and_exec(spec: dict) -> None:
    """Child of the launcher: isolate, limit, drop privileges, exec the guest. Never returns."""
    env = {**CHILD_ENV, **spec["env"]}
    mode = spec["mode"]
    # Own session and process group: kill(0, ...) reaches only the guest's processes, never the
    # launcher, and the launcher can kill the whole group (process mode).
    os.setsid()
    if mode in ("namespace", "userns"):
        uid = spec["uid"] if mode == "namespace" else USERNS_UID
        _build_root(spec, uid)
        env.update(HOME="/tmp", TMPDIR="/tmp")
    else:
        os.chdir(spec["workdir"])
        env.update(HOME=spec["workdir"], TMPDIR=spec["workdir"])
    _set_limits(spec)
    if mode == "namespace":
        _lock_down(spec["uid"])
    else:  # userns: already USERNS_UID; exec as a non-zero uid drops the namespace's capabilities
        _lock_down(None)
    exe = interpreter()
    os.execve(exe, [exe, "-I", "-S", "-B"] + spec["argv"], env)


def wait_exit(pid: int, timeout_s: float) -> bool:
    """Block until child `pid` can be reaped or `timeout_s` passes; True if it ended in time."""
    try:  # a pidfd wakes us the moment the child ends (Linux >= 5.3)
        import select  # here, not at the top: the launcher starts once per program, imports stay few

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
    timed_out = not wait_exit(pid, timeout_s)
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


def main(spec_json: str) -> None:
    """The launcher: unshare, fork the guest (PID 1 of its namespace), wait, report."""
    spec = json.loads(spec_json)
    status_fd = spec["status_fd"]
    os.set_inheritable(status_fd, False)  # the program must not be able to forge the outcome
    try:
        if spec["mode"] == "namespace":
            libc, _ = _libc()
            _check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC), "unshare")
        elif spec["mode"] == "userns":
            _enter_user_namespace()
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
    main(sys.argv[1])
