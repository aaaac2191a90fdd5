"""``toptheta-eval``: lm-eval's own command line, with the ``toptheta`` model and our offline tasks.

    toptheta-eval --model toptheta --tasks arc_challenge --limit 50 \\
        --model_args pretrained=smollm2-135m,sparsifier=toptheta,k=64,placement=post,comp=vmc

Why a wrapper: lm-eval finds models only in its registry and has no plugin discovery, so its ``lm_eval``
command cannot know ``toptheta``. This script registers it (``import toptheta`` does) and runs lm-eval's
command line (lm_eval._cli.HarnessCLI) with every argument as given, with one addition: tasks of our
catalogue (``smoke``, ``arc_challenge``, ``hellaswag``, ... see toptheta.evaluation.tasks) are rendered for
the ``data_dir`` of ``--model_args`` (default ``auto``: the data shipped with toptheta) into a temporary
``--include_path``, so they run offline; a user's own ``--include_path`` is merged in. Any other task is
lm-eval's own (hub data).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import toptheta  # noqa: F401  (registers the "toptheta" model with lm-eval)

from .evaluation.tasks import check_tasks, resolve_data_dir, task_names
from .evaluation.tasks.render import STATIC_DIR, write_task_dir


def main(argv: list[str] | None = None) -> None:
    from lm_eval.utils import setup_logging  # lm-eval: loaded when the command runs, not on import

    from .compat import HarnessCLI  # lm-eval's private command-line class (compat.__getattr__, lazy on purpose)

    setup_logging()
    parser = HarnessCLI()
    saved = sys.argv
    sys.argv = ["toptheta-eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        args = parser.parse_args()  # lm-eval's parser: every lm_eval flag, its help and its errors
    finally:
        sys.argv = saved
    with tempfile.TemporaryDirectory(prefix="toptheta-eval-tasks-") as tmp:
        if getattr(args, "command", None) == "run":
            args.include_path = include_dir(args.tasks or [], (args.model_args or {}).get("data_dir", "auto"),
                                            args.include_path, Path(tmp))
        parser.execute(args)


def include_dir(tasks: list[str], data_dir, user_include: str | None, target: Path) -> str | None:
    """Fill ``target`` with the YAMLs our catalogue's ``tasks`` need (and the user's include path); its path.

    lm-eval's command line takes one include path, so our static tasks, the rendered ones and the user's
    files are copied into one directory. None (nothing to add) when no task is ours.
    """
    ours = [t for t in tasks if t in set(task_names())]
    if not ours:
        return user_include
    resolved = resolve_data_dir(data_dir)
    check_tasks(ours, resolved, None)  # a missing data file fails here, before the model loads
    write_task_dir(target, ours, resolved)
    for path in STATIC_DIR.iterdir():
        if path.suffix in (".yaml", ".py"):
            shutil.copy2(path, target / path.name)
    if user_include:
        shutil.copytree(Path(user_include).expanduser(), target / "user", dirs_exist_ok=True)
    return str(target)


if __name__ == "__main__":
    main()
