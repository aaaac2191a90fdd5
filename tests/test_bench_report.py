"""The benchmark scripts' shared report: the command, the machine and the payload, written where verdicts.py reads."""

import json

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
