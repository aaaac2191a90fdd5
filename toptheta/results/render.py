"""Tables as Markdown and LaTeX, figures as PNG and PDF, byte-identical on every rerun.

Determinism: matplotlib stamps a PDF with its creation date and both formats with the software
version; the metadata below removes both, so rerunning make_figures on the same store rewrites the
same bytes (and git sees no change). Numbers are formatted by one function for both table formats.
"""

from __future__ import annotations

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


_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                  "θ": r"$\theta$", "σ": r"$\sigma$", "±": r"$\pm$", "≡": r"$\equiv$", "×": r"$\times$",
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
