"""What every benchmark in `scripts/` writes beside its numbers, in one place.

A benchmark's ratios only mean something with the machine they were measured on: its CPU count, torch threads,
library versions, the date and the load average before and after (another job on the cores shows up there).
Each writes ``STEM.json`` (the command first, then the machine, then its own payload) and ``STEM.md`` (the command
on the first line), atomically, so `scripts/verdicts.py` can say which command made each file.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

from ..atomic import write_text_atomic

ROOT = Path(__file__).resolve().parents[2]


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces this run: the real command line, or `python scripts/<script> ARGV` when
    main() was called from Python (tests, notebooks)."""
    if argv is None:
        return " ".join(["python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    return " ".join(["python", f"scripts/{script}", *argv])


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine(**extra: Any) -> dict[str, Any]:
    """The machine now (call it after setting torch's threads, before the timed work); `finish` adds the load
    average at the end."""
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "load_start": _load(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **extra}


def finish(meta: dict[str, Any]) -> dict[str, Any]:
    meta["load_end"] = _load()
    return meta


def describe(meta: dict[str, Any]) -> str:
    """One sentence on the machine, for the Markdown report."""
    end = f", {meta['load_end']} at end" if "load_end" in meta else ""
    return (f"{meta['cpus']} CPUs ({meta['torch_threads']} torch threads), torch {meta['torch']}, transformers "
            f"{meta['transformers']}, {meta['date']}, load average {meta['load_start']} at start{end}.")


def output_stem(out: str | Path) -> Path:
    """--out as given, relative to the repository (where results/bench lives) unless absolute."""
    out = Path(out)
    return out if out.is_absolute() else ROOT / out


def write(out: str | Path, command: str, meta: dict[str, Any], payload: dict[str, Any],
          markdown: Sequence[str]) -> None:
    """STEM.json: {"command", "meta", **payload}; STEM.md: the command, a blank line, then `markdown`."""
    stem = output_stem(out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(stem.with_suffix(".json"), json.dumps({"command": command, "meta": meta, **payload}, indent=2) + "\n")
    write_text_atomic(stem.with_suffix(".md"), "\n".join([f"Command: `{command}`", "", *markdown]) + "\n")
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.md')}")
