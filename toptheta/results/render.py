"""Tables as Markdown and LaTeX, figures as PNG and PDF, byte-identical on every rerun.

Determinism: matplotlib stamps a PDF with its creation date and both formats with the software
version; the metadata below removes both, so rerunning make_figures on the same store rewrites the
same bytes (and git sees no change). Numbers are formatted by one function for both table formats.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from ..atomic import atomic_write, write_text_atomic

PNG_METADATA = {"Software": None}
PDF_METADATA = {"Creator": None, "Producer": None, "CreationDate": None, "ModDate": None}
FIGURE_FORMATS = ("png", "pdf")


def cell(value: Any) -> str:
    """One table cell: floats to 4 significant digits, missing values blank."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if pd.api.types.is_scalar(value) and pd.isna(value):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown(table: pd.DataFrame) -> str:
    """A DataFrame as a GitHub Markdown table."""
    rows = [list(map(str, table.columns)), ["---"] * len(table.columns)]
    rows += [[cell(v).replace("|", "\\|") for v in record] for record in table.itertuples(index=False)]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n"



def doc_text(doc: str, start: int = 0, stop: int | None = None) -> str:
    """Paragraphs ``start:stop`` of a docstring (separated by blank lines) as one line of prose: the text a table
    prints beside itself is its module's or function's own description."""
    return " ".join(" ".join(doc.split("\n\n")[start:stop]).split())

_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                  "θ": r"$\theta$", "ρ": r"$\rho$", "σ": r"$\sigma$", "±": r"$\pm$", "≡": r"$\equiv$", "×": r"$\times$",
                  "≤": r"$\le$", "≥": r"$\ge$", "·": r"$\cdot$", "−": "-"}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def latex(table: pd.DataFrame, caption: str = "") -> str:
    """A DataFrame as a booktabs `tabular` (numbers right-aligned), with the caption as a comment line."""
    numeric = [pd.api.types.is_numeric_dtype(table[c]) for c in table.columns]
    spec = "".join("r" if n else "l" for n in numeric)
    lines = [f"% {latex_escape(caption)}" if caption else "%", f"\\begin{{tabular}}{{{spec}}}", "\\toprule",
             " & ".join(latex_escape(str(c)) for c in table.columns) + r" \\", "\\midrule"]
    for record in table.itertuples(index=False):
        lines.append(" & ".join(latex_escape(cell(v)) for v in record) + r" \\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines) + "\n"


def write_text(path: Path, text: str) -> None:
    write_text_atomic(path, text)


def save_figure(fig, path: Path, fmt: str) -> None:
    """Save `fig` as `fmt` (png or pdf) without timestamps or version strings."""
    if fmt not in FIGURE_FORMATS:
        raise ValueError(f"figure format {fmt!r}: use one of {', '.join(FIGURE_FORMATS)}")
    metadata = PNG_METADATA if fmt == "png" else PDF_METADATA
    atomic_write(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=150, metadata=metadata))


class RenderRecord:
    """What each figure file was drawn from, so that a rerun draws only the figures whose inputs changed.

    Drawing dominates make_figures (most of its figures are the per-run threshold histograms, which change only
    when a run is added). A figure given a `key` (a digest of the input files it reads) is drawn again unless the
    record holds, for each of its files, the same key and the sha256 of the bytes now on disk. The key is combined
    with a fingerprint of the drawing code (every module of toptheta.results, the `sources` given, matplotlib's
    version and rcParams), so a change of code or style draws everything again; a file edited or deleted since is
    drawn again. The record lives in the cache directory (``render/<digest of the output folder>.json``), not in
    the output folder: a fresh clone draws every figure once, and the files it writes are the same either way.
    """

    def __init__(self, out: Path, sources: tuple[Path, ...] = (), enabled: bool = True):
        import matplotlib

        from ..cachedir import cache_dir

        self.enabled = enabled
        self.path = cache_dir("render", hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16] + ".json")
        code = hashlib.sha256()
        for source in sorted(Path(__file__).parent.glob("*.py")) + sorted(Path(s) for s in sources):
            code.update(source.name.encode() + b"\0" + source.read_bytes())
        code.update(f"{matplotlib.__version__}\0{sorted(matplotlib.rcParams.items())!r}".encode())
        self.code = code.hexdigest()
        self.entries: dict[str, dict[str, str]] = {}
        if enabled and self.path.is_file():
            try:
                self.entries = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError):  # an unreadable record only costs a redraw
                self.entries = {}

    def key(self, *inputs: Any) -> str:
        """A key for a figure drawn from `inputs` (paths, whose bytes count, or JSON-able values) by this code."""
        digest = hashlib.sha256(self.code.encode())
        for item in inputs:
            digest.update(Path(item).read_bytes() if isinstance(item, Path) else json.dumps(item).encode())
            digest.update(b"\0")
        return digest.hexdigest()

    def current(self, key: str, paths: list[Path]) -> bool:
        """Whether every one of `paths` exists as it was drawn from `key`."""
        return self.enabled and all(
            p.is_file() and self.entries.get(p.name) == {"key": key, "sha256": _sha256(p)} for p in paths)

    def drawn(self, key: str, paths: list[Path]) -> None:
        for p in paths:
            self.entries[p.name] = {"key": key, "sha256": _sha256(p)}

    def save(self, names: set[str]) -> None:
        """Keep the entries of the files this run wrote (named in `names`)."""
        self.entries = {name: entry for name, entry in sorted(self.entries.items()) if name in names}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.path, json.dumps(self.entries, indent=0, sort_keys=True) + "\n")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
