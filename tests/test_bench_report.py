"""The benchmark scripts' shared report: the command, the machine and the payload, written where verdicts.py reads."""

import json

import pytest

from toptheta.results import bench_report


def test_a_report_names_its_command_machine_and_payload(tmp_path):
    command = bench_report.command_line("bench_x.py", ["--n", "3"])
    assert command == "python scripts/bench_x.py --n 3"
    meta = bench_report.finish(bench_report.machine(model="m"))
    assert meta["model"] == "m" and meta["torch_threads"] >= 1 and len(meta["load_end"]) == 3
    assert "at start" in bench_report.describe(meta) and "at end" in bench_report.describe(meta)
    bench_report.write(tmp_path / "sub" / "x", command, meta, {"rows": [1, 2]}, ["# Title", "", "| a |"])
    report = json.loads((tmp_path / "sub" / "x.json").read_text())
    assert list(report) == ["command", "meta", "rows"] and report["rows"] == [1, 2]
    md = (tmp_path / "sub" / "x.md").read_text().splitlines()
    assert md[0] == "Command: `python scripts/bench_x.py --n 3`" and md[2] == "# Title"
    assert not list((tmp_path / "sub").glob("*.tmp*"))  # written atomically: no temporary file left


def _verdicts_script():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("verdicts_script", Path(__file__).parents[1] / "scripts" / "verdicts.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_verdicts_reads_the_command_from_a_report(tmp_path):
    script = _verdicts_script()
    bench_report.write(tmp_path / "x", "python scripts/bench_x.py --n 3", bench_report.machine(), {}, ["text"])
    assert script._command_in((tmp_path / "x.md").read_text().splitlines()[0]) == "python scripts/bench_x.py --n 3"


def test_provenance_counts_each_runs_thresholds_figures_on_one_line(tmp_path):
    """make_figures draws every Top-θ run's thresholds (thresholds-<run_id>{,-hist,-by_length}): one provenance line
    counts them instead of listing hundreds of names as if no command had made them."""
    script = _verdicts_script()
    (tmp_path / "figures").mkdir()
    names = ["thresholds-0123456789abcdef.csv", "thresholds-0123456789abcdef-hist.png",
             "thresholds-fedcba9876543210-by_length.pdf", "index.md", "tradeoff-tiny-smoke-0shot-acc.csv"]
    (tmp_path / "figures" / "manifest.txt").write_text("\n".join(names) + "\n")
    lines = script.provenance(tmp_path)
    assert [line for line in lines if "thresholds" in line] == [
        ("  - each Top-θ run's own thresholds (`runs/<run_id>/`, made by that run's command): `thresholds-<run_id>`, "
         "`-by_length`, `-hist` for 2 runs")]
    assert any("`tradeoff-tiny-smoke-0shot-acc`" in line for line in lines)
    assert any(line.startswith("  - the whole store: `index`") for line in lines)


def test_provenance_names_the_fewest_experiments_that_make_a_tables_runs(tmp_path):
    """A table's runs (its csv's run_id column) are attributed to the experiments whose sweeps plan them: the fewest
    that make them all (a smol protocol over a paper one on a tie), and direct commands for runs no sweep plans."""
    from toptheta.results import sweeps

    script = _verdicts_script()
    figures = tmp_path / "figures"
    figures.mkdir()
    (figures / "tradeoff-tiny-smoke-0shot-acc.csv").write_text("series,k,run_id\ndense,,aaa\nTop-k,4,bbb\nTop-k,8,ccc\n")
    (figures / "ablation-tiny-smoke-0shot-acc.csv").write_text("series,k,run_id\ndense,,aaa\nTop-k,4,bbb\n")
    (figures / "manifest.txt").write_text("tradeoff-tiny-smoke-0shot-acc.csv\ntradeoff-tiny-smoke-0shot-acc-fig.png\n"
                                          "ablation-tiny-smoke-0shot-acc.csv\n")
    for run_id in ("aaa", "bbb", "ccc", "ddd"):
        (tmp_path / "runs" / run_id).mkdir(parents=True)
        (tmp_path / "runs" / run_id / "DONE").write_text("")
    owners = sweeps.Owners(by_run={"aaa": ["x/paper", "x/smol", "y/smol"], "bbb": ["x/paper", "x/smol"],
                                   "ddd": ["y/smol"]},
                           planned={"x/paper": 2, "x/smol": 5, "y/smol": 2}, unplannable={"z/paper": "no data"})
    lines = script.provenance(tmp_path, owners)
    assert "  - `python run.py -m experiment=x/smol`: `ablation-tiny-smoke-0shot-acc`" in lines
    assert any(line.startswith("  - `python run.py -m experiment=x/smol`; direct `python run.py` commands")
               and line.endswith(": `tradeoff-tiny-smoke-0shot-acc`") for line in lines)
    assert "  - `python run.py -m experiment=x/smol`: 2 of its 5 runs" in lines
    assert "  - `python run.py -m experiment=y/smol`: 2 of its 2 runs" in lines
    assert any(line.startswith("  - direct `python run.py` commands") and line.endswith(": 1 runs") for line in lines)
    assert any("`z/paper` (no data)" in line for line in lines)
    assert sweeps.cover(["aaa", "ddd"], owners) == (["y/smol"], 0)


def test_run_owners_plans_a_sweep_and_records_one_it_cannot_plan():
    from toptheta.results import sweeps

    owners = sweeps.run_owners(["longbench/smol", "no_such/smol"])
    assert owners.planned == {"longbench/smol": 7} and list(owners.unplannable) == ["no_such/smol"]
    assert len(owners.by_run) == 7 and all(names == ["longbench/smol"] for names in owners.by_run.values())
    # a store holding SmolLM2 runs only: longbench/smol (Qwen2.5-Coder) cannot own any, so it is not planned
    with sweeps.composing():
        assert sweeps._job_models("longbench/smol") == {"qwen2.5-coder-0.5b"}
    assert sweeps.run_owners(["longbench/smol"], models={"smollm2-135m"}).planned == {}
    assert sweeps.run_owners(["longbench/smol"], models={"qwen2.5-coder-0.5b"}).planned == {"longbench/smol": 7}


def test_a_plan_is_cached_until_what_it_is_computed_from_changes(tmp_path, monkeypatch):
    from toptheta import pipeline
    from toptheta.results import sweeps

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path))
    with sweeps.composing():
        first = sweeps.plan_jobs("longbench/smol")
        assert len(list((tmp_path / "plans").glob("*.json"))) == 1

        def no_planning(cfg):
            raise AssertionError("planned again")

        monkeypatch.setattr(pipeline, "plan", no_planning)
        assert sweeps.plan_jobs("longbench/smol") == first  # read back, tuples and all
        sweeps._sources_fingerprint.cache_clear()
        monkeypatch.setattr(sweeps, "_sources_fingerprint", lambda: "an edited conf/")
        with pytest.raises(AssertionError, match="planned again"):
            sweeps.plan_jobs("longbench/smol")
        monkeypatch.undo()
        monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path))
        monkeypatch.setattr(pipeline, "plan", no_planning)
        with pytest.raises(AssertionError, match="planned again"):  # other overrides: another plan
            sweeps.plan_jobs("longbench/smol", ["results_dir=elsewhere"])
