"""The experiment catalogue: `experiments/<artefact>/<protocol>.yaml`, read as data.

Each file is a Hydra `experiment` option (conf/experiment links to experiments/) and starts with

    # @package _global_
    # python run.py -m experiment=<artefact>/<protocol>      <- the exact command
    # artefact: ...   protocol: ...   methods: ...   feeds: ...   cost: ...

(a field continues on following comment lines indented by three spaces). `experiments/method/` holds
the named configurations the sweeps combine (`+experiment/method=toptheta-post-vmc`): the paper's
series, one file each. This module parses those headers, lists the jobs a sweep expands to (the
cartesian product of `hydra.sweeper.params`, command-line overrides replacing swept keys, as Hydra's
basic sweeper does), and tells which experiment a results file comes from. No Hydra import.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

HEADER_FIELDS = ("artefact", "protocol", "methods", "feeds", "cost")
METHOD_GROUP = "method"  # experiments/method/: configurations, not experiments
COMMAND_PREFIX = "python run.py -m experiment="


def experiments_dir() -> Path:
    """`experiments/` at the repository root (beside the `toptheta` package)."""
    return Path(__file__).resolve().parents[2] / "experiments"


def list_experiments(root: str | Path | None = None) -> list[str]:
    """Every experiment option, e.g. ['calib_size/paper', 'calib_size/smol', ...], sorted."""
    root = Path(root) if root else experiments_dir()
    names = [p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml")]
    return sorted(n for n in names if n.split("/")[0] != METHOD_GROUP)


def list_methods(root: str | Path | None = None) -> list[str]:
    root = Path(root) if root else experiments_dir()
    return sorted(p.stem for p in (root / METHOD_GROUP).glob("*.yaml"))


def read_header(name: str, root: str | Path | None = None) -> dict[str, str]:
    """The header of one experiment: package, command, and the fields of HEADER_FIELDS (text, joined)."""
    path = (Path(root) if root else experiments_dir()) / f"{name}.yaml"
    lines = path.read_text(encoding="utf-8").splitlines()
    comments = []
    for line in lines:
        if not line.startswith("#"):
            break
        comments.append(line[1:].strip() if not line.startswith("#   ") else "\t" + line[4:].strip())
    header: dict[str, str] = {"package": comments[0] if comments else "", "command": ""}
    if len(comments) > 1:
        header["command"] = comments[1]
    field = None
    for text in comments[2:]:
        match = re.match(r"(\w+): (.*)", text)
        if match and match.group(1) in HEADER_FIELDS:
            field = match.group(1)
            header[field] = match.group(2)
        elif field and text.startswith("\t"):
            header[field] += " " + text.strip()
    return header


def read_config(name: str, root: str | Path | None = None) -> dict[str, Any]:
    path = (Path(root) if root else experiments_dir()) / f"{name}.yaml"
    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def sweep_params(name: str, root: str | Path | None = None) -> dict[str, str]:
    """`hydra.sweeper.params` of one experiment as {key: 'a,b,c'} (values as strings)."""
    params = ((read_config(name, root).get("hydra") or {}).get("sweeper") or {}).get("params") or {}
    return {str(k): _as_override_text(v) for k, v in params.items()}


def _as_override_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def split_choices(text: str) -> list[str]:
    """'a,b,{0:512,1:512},null' -> ['a', 'b', '{0:512,1:512}', 'null'] (commas inside brackets or quotes stay)."""
    out, depth, quote, current = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
            continue
        current += ch
    out.append(current.strip())
    return [c for c in out if c]


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def jobs(name: str, overrides: Sequence[str] = (), root: str | Path | None = None) -> list[list[str]]:
    """The override lists of every job `python run.py -m experiment=<name> <overrides>` launches.

    Command-line overrides replace a swept key (Hydra's rule); a comma list on the command line is a
    sweep of its own. Each job starts with `experiment=<name>`; duplicates are dropped, order kept.
    """
    params = sweep_params(name, root)
    given = {override_key(o): o for o in overrides}
    axes = []
    for key, values in params.items():
        if key.lstrip("+~") in given:
            continue
        axes.append([f"{key}={v}" for v in split_choices(values)])
    for override in overrides:
        key, _, value = override.partition("=")
        axes.append([f"{key}={v}" for v in split_choices(value)] or [override])
    out, seen = [], set()
    for combo in itertools.product(*axes):
        job = [f"experiment={name}", *combo]
        if tuple(job) not in seen:
            seen.add(tuple(job))
            out.append(job)
    return out


def covering_jobs(name: str, overrides: Sequence[str] = (), root: str | Path | None = None) -> list[list[str]]:
    """A few jobs in which every value of every swept axis appears at least once (the axes zipped, cycling the
    shorter ones): enough to compose-check a large sweep without composing its whole product."""
    full = jobs(name, overrides, root)
    axes = [sorted({job[i] for job in full}, key=[job[i] for job in full].index) for i in range(1, len(full[0]))]
    width = max((len(a) for a in axes), default=1)
    return [[f"experiment={name}", *(axis[i % len(axis)] for axis in axes)] for i in range(width)]


def catalogue(root: str | Path | None = None) -> list[dict[str, Any]]:
    """One record per experiment: name, artefact folder, protocol, header fields, number of sweep jobs."""
    records = []
    for name in list_experiments(root):
        header = read_header(name, root)
        artefact, _, protocol = name.partition("/")
        records.append({"name": name, "artefact": artefact, "protocol": protocol, **header,
                        "jobs": len(jobs(name, root=root))})
    return records


def experiments_feeding(filename: str, records: Sequence[Mapping[str, Any]] | None = None) -> list[str]:
    """The commands of the experiments whose `feeds:` names a file like `filename` (its stem's prefix).

    A feeds entry such as `results/figures/tradeoff-smollm2-135m-{arc_easy,arc_challenge}-0shot-...` matches
    `tradeoff-smollm2-135m-arc_easy-0shot-limit500-acc_norm.png`; `<model>` and `*` match anything.
    """
    records = records if records is not None else catalogue()
    stem = Path(filename).name
    hits = []
    for record in records:
        for pattern in re.findall(r"results/figures/(\S+)", record.get("feeds", "")):
            if _matches(pattern.rstrip(";,."), stem):
                hits.append(record["command"])
                break
    return hits


def _matches(pattern: str, name: str) -> bool:
    """Whether `name` starts like the feeds pattern: {a,b} alternatives, <...> and * wildcards; the pattern's
    extension (`.csv`, `.{csv,md,tex}`) is dropped, so its figures (`-kept_attn.png`) match as well."""
    pattern = re.sub(r"\.(\{[^}]*\}|\w+)$", "", pattern)
    regex = ""
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "{":
            end = pattern.index("}", i)
            regex += "(" + "|".join(re.escape(a) for a in pattern[i + 1:end].split(",")) + ")"
            i = end + 1
            continue
        if ch == "<":
            end = pattern.index(">", i)
            regex += ".+"
            i = end + 1
            continue
        regex += ".*" if ch == "*" else re.escape(ch)
        i += 1
    return re.fullmatch(regex + r"([-.].*)?", name) is not None
