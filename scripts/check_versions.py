"""Run the tests that touch transformers and lm-eval internals against other releases of those libraries.

    python scripts/check_versions.py transformers==5.25.0 "transformers==5.24.0 lm-eval==0.4.13"
    python scripts/check_versions.py --pinned        # the lowest and the highest release pyproject.toml allows

Each argument is one combination (requirements separated by spaces). For each, the requirements are installed with
`pip install --no-deps --target` into a fresh overlay folder under /tmp, together with any dependency the release
newly needs that the current environment lacks (pure-Python packages; torch is never installed: a release that
needs another torch is reported as a failure). The overlay goes first on PYTHONPATH, so it shadows the
environment's copy without changing the environment. The script checks that the overlay's versions are the ones
imported, then runs `subset()` (every test file that imports transformers or lm_eval, plus the few that reach them
through toptheta: attention registration and masks, backends, cached decoding, lm-eval task loading, the HFLM
adapter and the toptheta-eval command line, the prefix cache) and prints one line per combination: PASS or FAIL,
the versions, the time and the failing tests. Logs (pip and pytest output) stay in --workdir.

`--pinned` reads the transformers and lm-eval requirements of pyproject.toml: the lowest combination is each lower
bound exactly (`>=5.20` becomes `==5.20`), the highest is the requirement itself, which pip resolves to the newest
release it allows. Needs the package index (network) for the installs; the tests themselves stay offline.
Exit status: 0 all passed, 1 a combination failed its tests, 2 a combination could not be installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib  # Python >= 3.11
except ModuleNotFoundError:  # Python 3.10: the copy pip vendors
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent

# The tests that reach into transformers or lm-eval: every test file that imports either (found anew on each run,
# so a new test file is covered without editing this list), and these, which reach them only through toptheta
# (cached decoding, the thresholds a model folder carries). About 3.5 minutes on 2 idle cores.
THROUGH_TOPTHETA = ["tests/test_decode_step.py", "tests/test_checkpoint_thresholds.py"]
IMPORTS_A_LIBRARY = re.compile(r"^\s*(from|import) (transformers|lm_eval)\b", re.MULTILINE)


def subset(root: Path = ROOT) -> list[str]:
    """The test files to run: those importing transformers or lm_eval, then THROUGH_TOPTHETA (where present)."""
    files = [f"tests/{f.name}" for f in sorted((root / "tests").glob("test_*.py"))
             if IMPORTS_A_LIBRARY.search(f.read_text())]
    return files + [f for f in THROUGH_TOPTHETA if (root / f).exists() and f not in files]


PINNED = ("transformers", "lm-eval")  # the libraries whose internals we use


def pinned_combinations(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """[lowest, highest]: each pinned library at its lower bound, and at its full requirement (newest allowed)."""
    deps = {canonicalize_name(Requirement(d).name): Requirement(d)
            for d in tomllib.loads(pyproject.read_text())["project"]["dependencies"]}
    lowest, highest = [], []
    for name in PINNED:
        req = deps[canonicalize_name(name)]
        lower = [s.version for s in req.specifier if s.operator == ">="]
        if len(lower) != 1:
            raise SystemExit(f"pyproject.toml: {req} needs exactly one '>=' bound to know its lowest release")
        lowest.append(f"{req.name}=={lower[0]}")
        highest.append(f"{req.name}{req.specifier}")
    return [" ".join(lowest), " ".join(highest)]


def _installed(name: str, paths: list[str]) -> str | None:
    """The version of `name` that Python would import with `paths` as its path, or None."""
    for dist in importlib.metadata.distributions(path=paths):
        if canonicalize_name(dist.metadata["Name"] or "") == canonicalize_name(name):
            return dist.version
    return None


def _pip(target: Path, requirements: list[str], log) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--upgrade", "--target", str(target),
           "--disable-pip-version-check", "--quiet", *requirements]
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"pip could not install {' '.join(requirements)} (see the log)")


def build_overlay(requirements: list[str], target: Path, log) -> dict[str, str]:
    """Install `requirements` (and what they newly need) into `target`; return {name: installed version}."""
    _pip(target, requirements, log)
    paths = [str(target), *sys.path]
    wanted = [Requirement(r) for r in requirements]
    # Follow the dependencies the overlay's packages declare until the overlay plus this environment satisfies
    # them all; each round adds only what is missing or too old, and never torch (the CPU/CUDA build is ours).
    seen: set[str] = set()
    while wanted:
        req = wanted.pop()
        if canonicalize_name(req.name) in seen:
            continue
        seen.add(canonicalize_name(req.name))
        dist = next(iter(importlib.metadata.distributions(name=req.name, path=[str(target)])), None)
        for line in (dist.requires or []) if dist else []:
            dep = Requirement(line)
            if dep.marker is not None and not dep.marker.evaluate({"extra": ""}):
                continue
            have = _installed(dep.name, paths)
            if have is not None and dep.specifier.contains(have, prereleases=True):
                continue
            if canonicalize_name(dep.name) == "torch":
                raise RuntimeError(f"{req.name} needs {dep}, this environment has torch {have}")
            _pip(target, [f"{dep.name}{dep.specifier}"], log)
            wanted.append(dep)
    return {canonicalize_name(r.name): _installed(r.name, [str(target)]) for r in map(Requirement, requirements)}


def _check_shadowing(versions: dict[str, str], env: dict, target: Path, log) -> None:
    """Fail unless the test process imports each library from the overlay at the installed version."""
    modules = {"transformers": "transformers", "lm-eval": "lm_eval"}
    probe = "; ".join(f"import {m}, importlib.metadata as md; print('{n}', md.version('{n}'), {m}.__file__)"
                      for n, m in modules.items() if n in versions)
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True)
    log.write(out.stdout + out.stderr)
    if out.returncode:
        raise RuntimeError(f"the overlay does not import: {out.stderr.strip().splitlines()[-1:]}")
    for line in out.stdout.splitlines():
        name, version, path = line.split(" ", 2)
        if version != versions[name] or not path.startswith(str(target)):
            raise RuntimeError(f"{name} {version} imported from {path}, not {versions[name]} from the overlay")


def check(combination: str, tests: list[str], workdir: Path, timeout: float) -> dict:
    """Install one combination into an overlay and run `tests` with it; {'status', 'versions', 'seconds', ...}."""
    requirements = combination.split()
    target = Path(tempfile.mkdtemp(prefix="overlay-", dir=workdir))
    log_path = target.with_suffix(".log")
    start = time.monotonic()
    with open(log_path, "w") as log:
        try:
            versions = build_overlay(requirements, target, log)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]),
                       HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
            _check_shadowing(versions, env, target, log)
        except RuntimeError as error:
            shutil.rmtree(target, ignore_errors=True)
            return {"combination": combination, "status": "NOT INSTALLED", "error": str(error), "log": log_path}
        cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *tests]
        log.write(f"$ PYTHONPATH={target} {' '.join(cmd)}\n")
        log.flush()
        try:
            done = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout)
            output, code = done.stdout, done.returncode
        except subprocess.TimeoutExpired as expired:
            partial = expired.output or b""  # bytes even under text=True
            partial = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
            output, code = partial + f"\nTIMEOUT after {timeout:.0f}s\n", -1
        log.write(output)
    shutil.rmtree(target, ignore_errors=True)
    lines = output.strip().splitlines()
    return {"combination": combination, "status": "PASS" if code == 0 else "FAIL", "versions": versions,
            "seconds": time.monotonic() - start, "summary": lines[-1] if lines else "",
            "failed": [ln.removeprefix("FAILED ") for ln in lines if ln.startswith("FAILED ")], "log": log_path}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("combinations", nargs="*", help="e.g. transformers==5.25.0 or 'transformers==5.24.0 lm-eval==0.4.13'")
    parser.add_argument("--pinned", action="store_true", help="the lowest and highest releases pyproject.toml allows")
    parser.add_argument("--tests", nargs="+", default=None, help="test files or node ids (default: subset())")
    parser.add_argument("--workdir", default=None, help="where overlays and logs go (default: a new folder in /tmp)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for one combination's tests")
    args = parser.parse_args(argv)
    combinations = args.combinations + (pinned_combinations() if args.pinned else [])
    if not combinations:
        parser.error("give combinations or --pinned")
    tests = args.tests or subset()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="toptheta-versions-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for combination in combinations:
        print(f"== {combination}", flush=True)
        result = check(combination, tests, workdir, args.timeout)
        results.append(result)
        if result["status"] == "NOT INSTALLED":
            print(f"   NOT INSTALLED: {result['error']} (log: {result['log']})", flush=True)
            continue
        versions = ", ".join(f"{n} {v}" for n, v in result["versions"].items())
        print(f"   {result['status']}  {versions}  {result['seconds']:.0f}s  {result['summary']}", flush=True)
        for failed in result["failed"]:
            print(f"     {failed}")
    if any(r["status"] == "NOT INSTALLED" for r in results):
        return 2
    return 0 if all(r["status"] == "PASS" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
