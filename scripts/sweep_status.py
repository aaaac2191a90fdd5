"""How far each experiment's sweep has got in its results store: runs finished, runs left, the jobs still to run.

    python scripts/sweep_status.py [EXPERIMENT ...] [--results DIR] [--jobs]

An experiment's runs are the ones `python run.py -m experiment=<name>` plans: every job of its sweep is composed
and planned as run.py does (configuration checks included, no model loaded), and a run counts as finished when its
directory in the store holds DONE. Runs shared between experiments (a dense baseline, an ablation reusing the
trade-off's runs) count in each. Default: every protocol but `paper` (GPU sweeps), in the store each experiment names
(`results_dir`, `results/` for the committed ones); `--results` reads another store. `--jobs` lists the override
lists of the jobs that still have a run to make (`python run.py <overrides>` runs one), each run left in one job: a
job whose runs an earlier listed job makes too (Top-k under calib.beyond=fit, the same run as under clamp) is left
out. A sweep with runs left and some finished gets an estimate of the time left: the runs left times the median wall
time of its finished runs (`seconds` in their stats.json, as measured wherever they ran). Exit status 0 whether or
not sweeps are complete; 2 on a name that is not an experiment. A run left that saved parts to resume from (a long
context's finished lengths) says which.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence

from toptheta.results import experiments, sweeps
from toptheta.store.runs import RunStore


def status(name: str, results: str | None = None) -> dict:
    """{'experiment', 'results', 'runs', 'done', 'left': [(run label, run id)], 'jobs_left': [override lists],
    'seconds': [wall time of each finished run that recorded one]}."""
    extra = [f"results_dir={results}"] if results else []
    runs: dict[str, str] = {}  # run id -> label, in plan order
    planned = sweeps.plan_jobs(name, extra)
    (store_dir,) = {job.results_dir for job in planned}  # an experiment sets results_dir once, for all its jobs
    store = RunStore(store_dir)
    for job in planned:
        for run_id, label in job.runs:
            runs.setdefault(run_id, label)
    jobs_left, covered = [], set()  # each run left in one job: the first that makes it
    for job in planned:
        missing = {run_id for run_id, _ in job.runs if not store.exists(run_id)}
        if missing - covered:
            jobs_left.append(job.overrides)
            covered |= missing
    left = [(label, run_id) for run_id, label in runs.items() if not store.exists(run_id)]
    saved = {run_id: parts for _, run_id in left if (parts := saved_parts(store, run_id))}
    return {"experiment": name, "results": store_dir, "runs": len(runs), "done": len(runs) - len(left),
            "left": left, "jobs_left": jobs_left, "saved": saved,
            "seconds": [t for run_id in runs if store.exists(run_id) and (t := _seconds(store, run_id)) is not None]}


def saved_parts(store: RunStore, run_id: str) -> str:
    """What an unfinished run has saved to resume from (RunStore.partial_dir: passkey's and ruler's finished
    lengths, ruler's finished batches of the length it was in), e.g. 'ruler_4096; 5 batches of ruler_8192'; ''."""
    partial = store.partial_dir(run_id)
    if not partial.is_dir():
        return ""
    lengths = sorted((p.stem for p in partial.glob("*.json")), key=lambda n: (len(n), n))
    batches = [f"{len(list(p.glob('*.json')))} batches of {p.name.removesuffix('.parts')}"
               for p in sorted(partial.glob("*.parts")) if p.name.removesuffix(".parts") not in lengths]
    return "; ".join(lengths + batches)


def _seconds(store: RunStore, run_id: str) -> float | None:
    try:
        return float(json.loads((store.run_dir(run_id) / "stats.json").read_text(encoding="utf-8"))["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def time_left(s: dict) -> str:
    """'≈ 2.9 h left at the 6.1-min median of 7 finished runs', or '' with nothing left or nothing to time by."""
    if not s["left"] or not s["seconds"]:
        return ""
    median = statistics.median(s["seconds"])
    total = median * len(s["left"]) / 3600
    return (f"; ≈ {total:.1f} h left at the {median / 60:.1f}-min median of {len(s['seconds'])} finished "
            f"run{'s' if len(s['seconds']) > 1 else ''}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="EXPERIMENT",
                        help="experiments, e.g. qa_tradeoff/smol (default: all but the paper protocols)")
    parser.add_argument("--results", default=None, help="read this store instead of the one each experiment names")
    parser.add_argument("--jobs", action="store_true", help="list the jobs that still have a run to make")
    args = parser.parse_args(argv)
    known = experiments.list_experiments()
    names = args.names or [n for n in known if not n.endswith("/paper")]  # the paper protocols are GPU sweeps
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"not an experiment: {', '.join(unknown)}; choose from: {', '.join(known)}", file=sys.stderr)
        return 2
    width = max(map(len, names))
    with sweeps.composing():
        for name in names:
            s = status(name, args.results)
            state = "complete" if not s["left"] else f"{len(s['left'])} left"
            print(f"{name:<{width}}  {s['done']:>3}/{s['runs']:<3} runs finished  ({state}{time_left(s)}; "
                  f"store {s['results']})")
            for run_id, parts in s["saved"].items():  # a run cut short: rerunning its job resumes there
                print(f"    saved to resume {run_id}: {parts}")
            if args.jobs:
                for job in s["jobs_left"]:
                    print("    python run.py " + " ".join(job))
    return 0


if __name__ == "__main__":
    sys.exit(main())
