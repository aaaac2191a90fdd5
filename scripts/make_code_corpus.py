#!/usr/bin/env python
"""Build the `python_code` task's documents: documented functions of Python's standard library.

HumanEval thresholds calibrated on code need code that is not HumanEval (its test prompts would leak into the
thresholds, method.md §9). The standard library is offline on every machine and PSF-licensed: this script takes
the public, documented top-level functions of a fixed list of pure-Python modules, splits each into its prompt
(signature and docstring, as a HumanEval prompt) and its body, and writes

    toptheta/data/python_code/{train,test}.jsonl.gz   {"id": "module.function", "prompt": ..., "body": ...}
    toptheta/data/python_code/LICENSE-PSF.txt          the standard library's licence, copied

Every fourth function (in module order, then source order) goes to test, the rest to train. The gzip headers
carry no name or time, so the same interpreter gives the same bytes; another Python version gives other
functions (PROVENANCE.md records the version used).

Usage:  python scripts/make_code_corpus.py [--out toptheta/data/python_code]
"""

from __future__ import annotations

import argparse
import ast
import gzip
import io
import json
import shutil
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("bisect", "heapq", "textwrap", "string", "fnmatch", "shlex", "colorsys", "calendar", "statistics",
           "fractions", "difflib", "base64", "quopri", "posixpath", "ntpath", "glob", "copy", "operator",
           "random", "ipaddress", "json/encoder", "json/decoder", "html/__init__", "csv", "datetime", "inspect",
           "functools", "tokenize", "keyword", "uuid", "urllib/parse", "email/utils",
           "gettext", "locale", "pprint", "reprlib", "secrets", "stat", "zipfile", "tarfile", "configparser")
MIN_BODY, MAX_CHARS = 40, 2500


def functions(source: str, module: str) -> list[dict]:
    """The module's public documented top-level functions as {id, prompt, body}."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list:
            continue
        doc = node.body[0] if node.body else None
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        if len(node.body) < 2:
            continue
        prompt = "".join(lines[node.lineno - 1:doc.end_lineno])
        body = "".join(lines[doc.end_lineno:node.end_lineno])
        if len(body.strip()) < MIN_BODY or len(prompt) + len(body) > MAX_CHARS:
            continue
        out.append({"id": f"{module.replace('/', '.').removesuffix('.__init__')}.{node.name}", "prompt": prompt,
                    "body": body})
    return out


def write_jsonl_gz(path: Path, records: list[dict]) -> None:
    raw = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records).encode("utf-8")
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as f:
        f.write(raw)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="toptheta/data/python_code")
    args = p.parse_args(argv)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    records = []
    for module in MODULES:
        path = stdlib / f"{module}.py"
        if path.is_file():
            records += functions(path.read_text(encoding="utf-8"), module)
    out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl_gz(out / "train.jsonl.gz", [r for i, r in enumerate(records) if i % 4 != 3])
    write_jsonl_gz(out / "test.jsonl.gz", [r for i, r in enumerate(records) if i % 4 == 3])
    shutil.copyfile(stdlib / "LICENSE.txt", out / "LICENSE-PSF.txt")
    print(f"Python {sys.version.split()[0]}: {len(records)} functions ({len(records) - len(records) // 4} train) "
          f"from {sum((stdlib / f'{m}.py').is_file() for m in MODULES)} modules -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
