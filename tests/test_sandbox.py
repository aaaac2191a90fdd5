"""The sandbox contains hostile programs and still passes a correct one afterwards.

Every adversarial program here is bounded on its own (a fork bomb of at most 128 processes,
a 1 s timeout), so a broken sandbox fails the test instead of taking the machine down.
"""

import os
import socket
import subprocess
import sys
import uuid

import pytest

from toptheta.evaluation import sandbox
from toptheta.evaluation.sandbox import SandboxLimits, isolation_level, run_program, run_programs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")

FAST = SandboxLimits(timeout_s=1.0)
SPIN = SandboxLimits(timeout_s=0.5)  # for programs that only ever end by timeout
CORRECT = "def add(a, b):\n    return a + b\n\nassert add(2, 3) == 5\n"
# 2**7 = 128 processes at most even with no limit at all; RLIMIT_NPROC (32) refuses some.
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


def namespace_only():
    if isolation_level() != "namespace":
        pytest.skip("needs namespace isolation (root on Linux); this machine has 'process' only")


def sandbox_processes() -> list[str]:
    """Processes still running under a sandbox uid, or left as children of this test process."""
    out = subprocess.run(["ps", "-eo", "uid=,pid=,ppid=,args="], capture_output=True, text=True).stdout
    lo, hi = sandbox._UID_BASE, sandbox._UID_BASE + sandbox._UID_COUNT
    me = str(os.getpid())
    stray = []
    for line in out.splitlines():
        uid, pid, ppid, args = (line.split(None, 3) + [""])[:4]
        if lo <= int(uid) < hi or (ppid == me and "sandbox" in args):
            stray.append(line)
    return stray


@pytest.fixture(autouse=True)
def no_stray_processes():
    yield
    assert sandbox_processes() == []


def test_correct_program_passes_and_failing_one_fails():
    good = run_program(CORRECT, FAST)
    assert good.passed and good.status == "passed"
    bad = run_program("assert 1 + 1 == 3, 'wrong sum'\n", FAST)
    assert not bad.passed and bad.status == "failed"
    assert "wrong sum" in bad.detail


def test_infinite_loop_times_out_and_is_killed():
    result = run_program("while True:\n    pass\n", SPIN)
    assert result.status == "timeout" and not result.passed
    assert result.seconds < SPIN.timeout_s + 3


def test_fork_bomb_is_contained():
    result = run_program(FORK_BOMB, SPIN)
    assert not result.passed and result.status == "timeout"
    assert "fork refused" in result.stdout  # the process cap, not the machine, stopped it


def test_huge_allocation_fails():
    result = run_program("x = bytearray(40 * 2**30)\n", FAST)
    assert result.status == "failed" and "MemoryError" in result.detail


def test_files_outside_the_sandbox_are_untouched(tmp_path):
    namespace_only()
    marker = f"/tmp/toptheta-sandbox-test-{uuid.uuid4().hex}"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    write_outside = f"open({marker!r}, 'w').write('x')\nopen({str(tmp_path / 'new.txt')!r}, 'w')\n"
    delete_outside = f"import os\nos.remove({str(victim)!r})\n"
    write_system = "open('/etc/toptheta-sandbox-test', 'w')\n"
    try:
        results = [run_program(src, FAST) for src in (write_outside, delete_outside, write_system)]
        assert [r.status for r in results] == ["failed"] * 3
        assert not os.path.exists(marker)
        assert victim.read_text() == "keep me"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]
        assert not os.path.exists("/etc/toptheta-sandbox-test")
    finally:  # if the sandbox leaked, leave the machine as it was
        for path in (marker, "/etc/toptheta-sandbox-test"):
            if os.path.exists(path):
                os.remove(path)


def test_sockets_cannot_connect_to_localhost():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        programs = [f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"]
        if isolation_level() == "namespace":
            # Past the prelude's guard: only the empty network namespace stops this one.
            programs.append("import _socket\nraw = _socket.socket.__mro__[1]()\n"
                            f"raw.connect(('127.0.0.1', {port}))\n")
        for src in programs:
            result = run_program(src, FAST)
            assert result.status == "failed", result
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody ever connected
    finally:
        server.close()


@pytest.mark.parametrize("early_exit", ["import sys\nsys.exit(0)", "import os\nos._exit(0)",
                                        "raise SystemExit"])
def test_exiting_with_status_zero_before_the_end_is_a_failure(early_exit):
    source = early_exit + "\nassert False, 'the checks would have failed'\n"
    result = run_program(source, FAST)
    assert result.status == "failed" and not result.passed
    assert "before the end" in result.detail


def test_megabytes_of_output_are_truncated():
    source = "print('x' * 20_000_000, flush=True)\nimport os\nos.write(1, b'y' * 20_000_000)\nassert False\n"
    result = run_program(source, FAST)
    assert result.status == "failed"
    assert len(result.stdout) <= FAST.max_output_bytes
    assert result.stdout.startswith("x" * 1000) and "truncated" in result.stdout


def test_adversaries_in_parallel_then_a_correct_program_passes():
    hostile = ["while True:\n    pass\n", FORK_BOMB, "x = bytearray(40 * 2**30)\n",
               "import os\nos._exit(0)\n", "print('z' * 10_000_000)\nassert False\n"]
    results = run_programs(hostile + [CORRECT], FAST)
    assert [r.passed for r in results] == [False] * len(hostile) + [True]
    assert run_program(CORRECT, FAST).passed


def test_process_isolation_fallback_still_scores_correctly():
    assert run_program(CORRECT, FAST, isolation="process").passed
    assert run_program("import sys\nsys.exit(0)\n", FAST, isolation="process").status == "failed"
    bomb = run_program(FORK_BOMB, SPIN, isolation="process")
    assert bomb.status == "timeout" and "fork refused" in bomb.stdout


def test_bad_limits_are_rejected_with_a_fix():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        SandboxLimits(memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="isolation"):
        run_program(CORRECT, FAST, isolation="docker")
