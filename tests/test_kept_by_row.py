"""scripts/kept_by_row.py: replaying stored runs' sparsifiers, the answer rows apart."""

import gzip
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

import toptheta
from conftest import cfg, load_script, tiny_model
from toptheta import pipeline

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    return load_script("kept_by_row")


def test_the_recorder_counts_what_the_statistics_count_and_the_answer_rows_apart(script):
    model, k, length, answer_from = tiny_model(), 3, 20, 15
    recorder = script.Recorder(2, 4)
    ids = torch.randint(0, 200, (1, length), generator=torch.Generator().manual_seed(0))
    with toptheta.sparsify(model, toptheta.TopK(k, "post"), [], observer=recorder) as stats, torch.inference_mode():
        recorder.first_answer_row = answer_from
        model(ids)
    assert (recorder.kept.sum() / recorder.valid.sum()).item() == pytest.approx(stats.kept_attention_fraction)
    # rows at positions ≥ answer_from: n = position + 1 valid keys, min(k, n) kept, in every head of both layers
    n = torch.arange(answer_from + 1, length + 1, dtype=torch.float64)
    assert torch.equal(recorder.answer_valid, torch.full((2, 4), n.sum().item(), dtype=torch.float64))
    assert torch.equal(recorder.answer_kept, torch.full((2, 4), n.clamp(max=k).sum().item(), dtype=torch.float64))
    assert torch.equal(recorder.answer_rows, torch.full((2, 4), float(len(n)), dtype=torch.float64))
    assert ((recorder.answer_mass / recorder.answer_rows) < 1).all()  # k of ≥ 16 keys: mass dropped


def test_a_stored_run_is_replayed_on_the_prompts_it_scored(tmp_path, script, capsys):
    pipeline.run(cfg("model=tiny-llama", "task=smoke", "task.num_fewshot=2", "task.limit=4", f"results_dir={tmp_path}",
                     "log_samples=true", "sparsifier=topk", "sparsifier.k=4", "comp=none"))
    (run_id,) = [p.name for p in (tmp_path / "runs").iterdir()
                 if json.loads((p / "config.json").read_text())["sparsifier"]["name"] == "topk"]
    samples = json.loads(gzip.open(tmp_path / "runs" / run_id / "samples.json.gz").read())["smoke"]
    out = tmp_path / "analysis"
    assert script.main([run_id, "--results", str(tmp_path), "--questions", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    table = (out / "kept_by_row.md").read_text()
    assert f"python scripts/kept_by_row.py {run_id} --questions 3" in table and "3 questions (tiny-llama)" in table
    assert "Top-k post" in printed
    config = json.loads((tmp_path / "runs" / run_id / "config.json").read_text())
    from toptheta.models import load_model

    _, tokenizer, _ = load_model("tiny-llama")
    pairs = script.prompts(tmp_path / "runs" / run_id, config, tokenizer, 3)
    gold = {s["doc_id"]: s["arguments"][int(s["target"])] for s in samples}
    assert len(pairs) == 3  # one prompt per question: its context and correct answer, as lm-eval scored them
    for doc, (context, answer) in enumerate(pairs):
        assert tokenizer.decode(answer).strip() == gold[doc][1].strip()
        assert tokenizer.decode(context).endswith(gold[doc][0][-40:])
    assert script.main(["no_such_run", "--results", str(tmp_path)]) == 2


def test_on_target_replays_the_rows_the_run_was_fitted_on_and_refuses_a_run_that_was_not(tmp_path, script, capsys):
    """--on target: the per-head shares of the matched run's own calibration rows (no test question), every causal
    element of each row counted once; an unmatched run has no such rows and is refused before any replay."""
    from conftest import sparse_rows
    from toptheta.matched import target_rows
    from toptheta.models import load_model
    from toptheta.spec import RunSpec

    rows = sparse_rows(tmp_path, "sparsifier=skipsoftmax", "sparsifier.placement=post", "comp=none",
                       "sparsifier.target_kept=0.3", "sparsifier.layer_k=null", "task.fewshot_sampler=first_n")
    run_id = rows[0]["run_id"]
    out = tmp_path / "analysis"
    replayed_args = [run_id, "--results", str(tmp_path), "--questions", "2", "--on", "target", "--out", str(out)]
    assert script.main(replayed_args) == 0
    assert not (out / "kept_by_row.csv").exists()  # the questions' table is another file
    table = (out / "kept_by_row-target.md").read_text()
    assert f"python scripts/kept_by_row.py {run_id} --questions 2 --on target" in table and "2 target rows" in table
    per_head = pd.read_csv(out / "kept_by_row-target.csv")
    assert per_head["answer_kept_fraction"].isna().all()  # no answer rows

    config = json.loads((tmp_path / "runs" / run_id / "config.json").read_text())
    model, tokenizer, _ = load_model("tiny-llama")
    fitted = target_rows(RunSpec.from_identity(config), model, tokenizer)[:2]
    replayed = script.target_rows(model, tokenizer, config, 2)
    assert [ids for ids, _ in replayed] == fitted and all(first == len(ids) for ids, first in replayed)
    shape = (model.config.num_hidden_layers, model.config.num_attention_heads)
    recorder = script.replay(model, tmp_path / "runs" / run_id, config, replayed, *shape)
    causal = sum(len(ids) * (len(ids) + 1) // 2 for ids in fitted)
    assert torch.equal(recorder.valid, torch.full(shape, float(causal), dtype=torch.float64))
    assert 0 < (recorder.kept.sum() / recorder.valid.sum()).item() < 1

    pipeline.run(cfg("model=tiny-llama", "task=smoke", "task.limit=2", f"results_dir={tmp_path / 'plain'}",
                     "log_samples=true", "sparsifier=topk", "sparsifier.k=4", "comp=none"))
    plain = next(p for p in (tmp_path / "plain" / "runs").iterdir()
                 if json.loads((p / "config.json").read_text())["sparsifier"]["name"] == "topk")
    assert script.main([plain.name, "--results", str(tmp_path / "plain"), "--on", "target"]) == 2
    assert "was not matched" in capsys.readouterr().err
    config_file = tmp_path / "runs" / run_id / "config.json"  # a generation task's run: fitted on decoded prompts
    config_file.write_text(json.dumps({**config, "target": {**config["target"], "kind": "ruler"}}))
    assert script.main([run_id, "--results", str(tmp_path), "--on", "target"]) == 2
    assert "ruler prompts that it decodes" in capsys.readouterr().err
