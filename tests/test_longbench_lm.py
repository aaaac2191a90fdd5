"""LongBench through lm-eval: offline subset tasks, head+tail truncation, chat template, scoring.

Offline data are tiny LongBench-schema files written per test; the multi_news file shipped in
toptheta/data is only checked to resolve.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import load_tasks, tiny_model, tiny_tokenizer
from toptheta.evaluation import lm_eval_adapter as adapter
from toptheta.evaluation.tasks import check_tasks

SHIPPED_DATA = Path(__file__).resolve().parents[1] / "toptheta" / "data"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _record(i: int, dataset: str, context: str, question: str = "") -> dict:
    """One record in THUDM LongBench's schema."""
    return {"input": question, "context": context, "answers": [f"summary number {i} of the news"],
            "length": len(context.split()), "dataset": dataset, "language": "en", "all_classes": None,
            "_id": f"{dataset}-{i}"}


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """<tmp>/longbench/{multi_news,qmsum}.jsonl; multi_news's first record is long (~1.2k tokens)."""
    root = tmp_path / "data"
    (root / "longbench").mkdir(parents=True)
    news = [_record(0, "multi_news", "HEAD-OF-NEWS " + " ".join(f"w{j}" for j in range(300)) + " END-OF-NEWS"),
            _record(1, "multi_news", "A short passage."),
            _record(2, "multi_news", "Another short passage.")]
    meetings = [_record(i, "qmsum", f"Meeting {i}: we discussed the budget.", f"What about item {i}?")
                for i in range(2)]
    for name, rows in (("multi_news", news), ("qmsum", meetings)):
        text = "".join(json.dumps(r) + "\n" for r in rows)
        (root / "longbench" / f"{name}.jsonl").write_text(text, encoding="utf-8")
    return root





def test_any_subset_file_becomes_lm_evals_own_task(data_dir):
    loaded = load_tasks(["longbench_multi_news", "longbench_qmsum"], data_dir)
    news, meetings = loaded["longbench_multi_news"], loaded["longbench_qmsum"]
    assert (len(news.eval_docs), len(meetings.eval_docs)) == (3, 2)
    assert news.config.dataset_path == "json" and news.config.output_type == "generate_until"
    # lm-eval's prompt and metrics, on our records; qmsum's query (`input`) reaches its prompt.
    assert news.doc_to_text(news.eval_docs[1]).startswith("You are given several news passages.")
    assert "A short passage." in news.doc_to_text(news.eval_docs[1])
    assert meetings.doc_to_text(meetings.eval_docs[1]).endswith("Query: What about item 1?\nAnswer:")
    assert news.config.process_results.__name__ == "get_rouge_with_score"
    assert news.config.generation_kwargs["max_gen_toks"] == 512


def test_missing_subset_file_lists_the_files_found(data_dir, tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        check_tasks(["longbench_gov_report"], data_dir, None)
    message = str(err.value)
    assert str(data_dir / "longbench" / "gov_report.jsonl") in message
    assert "multi_news.jsonl, qmsum.jsonl" in message
    with pytest.raises(FileNotFoundError, match="no directory"):
        check_tasks(["longbench_qmsum"], tmp_path, None)
    with pytest.raises(ValueError, match="unknown task"):
        check_tasks(["longbench_not_a_subset"], data_dir, None)
    with pytest.raises(ValueError, match="unknown task"):  # LongBench has no train split
        check_tasks(["longbench_qmsum_calibration"], data_dir, None)
    check_tasks(["longbench_gov_report"], None, None)  # the hub has every subset


def test_rendered_longbench_yaml_changes_only_the_data_source(tmp_path):
    from lm_eval.tasks._yaml_loader import load_yaml

    from toptheta.evaluation.tasks.catalog import stock_tasks_dir
    from toptheta.evaluation.tasks.render import write_task_dir

    write_task_dir(tmp_path, ["longbench_qmsum"], tmp_path / "my data")
    stock = load_yaml(stock_tasks_dir() / "longbench" / "qmsum.yaml", resolve_func=False)
    ours = load_yaml(tmp_path / "longbench_qmsum.yaml", resolve_func=False)
    changed = {k for k in stock.keys() | ours.keys() if stock.get(k) != ours.get(k)}
    assert changed == {"dataset_path", "dataset_name", "dataset_kwargs", "process_docs"}
    assert ours["dataset_kwargs"]["data_files"]["test"] == str(tmp_path / "my data" / "longbench" / "qmsum.jsonl")


def test_middle_truncation_keeps_head_tail_and_special_tokens():
    from toptheta.evaluation.longbench_lm import MiddleTruncatingHFLM

    tok = tiny_tokenizer()
    lm = MiddleTruncatingHFLM(pretrained=tiny_model(tok), tokenizer=tok, batch_size=1, max_length=64)
    text = "".join(chr(ord("a") + i % 26) for i in range(100))
    ids = tok.encode(text)  # BOS + one token per byte
    assert lm.fit_context("short", 40) == "short"
    assert lm.tok_encode(lm.fit_context(text, 40)) == ids[:20] + ids[-20:]
    # A chat-templated context keeps its markers, and a leading BOS is not doubled.
    chat = "<s><|user|>\n" + text + "</s>\n<|assistant|>\n"
    fitted = lm.tok_encode(lm.fit_context(chat, 40))
    chat_ids = tok.encode(chat, add_special_tokens=False)
    assert fitted == chat_ids[:20] + chat_ids[-20:] and fitted.count(tok.bos_token_id) == 1
    assert tok.eos_token_id in fitted


def test_chat_template_rules():
    tok = tiny_tokenizer()
    assert not adapter._use_chat_template(["longbench_qmsum"], tok, False)
    with pytest.raises(ValueError, match="no chat template"):
        adapter._use_chat_template(["longbench_qmsum"], tok, True)
    tok.chat_template = CHAT_TEMPLATE
    assert adapter._use_chat_template(["longbench_qmsum"], tok, True)
    assert not adapter._use_chat_template(["longbench_trec", "longbench_lcc_e"], tok, True)  # raw, as LongBench
    with pytest.raises(ValueError, match="separate calls"):
        adapter._use_chat_template(["longbench_trec", "longbench_qmsum"], tok, True)


def test_end_to_end_with_chat_template_and_middle_truncation(data_dir, monkeypatch):
    """Two subsets through evaluate_tasks; every context reaches the model as head + tail of the
    chat-templated prompt, and lm-eval's LongBench metrics score the generations."""
    from lm_eval.models.huggingface import HFLM

    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    seen = []
    generate = HFLM._model_generate

    def spy(self, context, *args, **kwargs):
        seen.append(context[0].tolist())
        return generate(self, context, *args, **kwargs)

    monkeypatch.setattr(HFLM, "_model_generate", spy)
    max_length, max_gen_toks = 512, 8
    res = adapter.evaluate_tasks(
        tiny_model(tok), tok, ["longbench_multi_news", "longbench_qmsum"], data_dir=data_dir, num_fewshot=None,
        limit=2, max_length=max_length, chat_template=True, gen_kwargs={"max_gen_toks": max_gen_toks},
        log_samples=True, bootstrap_iters=0,
    )
    budget = max_length - max_gen_toks
    expected = []
    for task in ("longbench_multi_news", "longbench_qmsum"):
        row = res["results"][task]
        assert 0.0 <= row["rouge_score,none"] <= 1.0 and row["score,none"] == row["rouge_score,none"]
        assert res["n-samples"][task]["effective"] == 2
        for sample in res["samples"][task]:
            context = sample["arguments"][0][0]  # what lm-eval built, before our truncation
            assert context.startswith("<|user|>\nYou are given") and context.endswith("<|assistant|>\n")
            ids = tok.encode(context)
            expected.append(ids if len(ids) <= budget else ids[: budget // 2] + ids[-(budget // 2) :])
    assert sorted(seen) == sorted(expected)
    long_input = tok.decode(max(seen, key=len))
    assert len(max(seen, key=len)) == budget and "HEAD-OF-NEWS" in long_input and "END-OF-NEWS" in long_input
    assert res["configs"]["longbench_multi_news"]["dataset_path"] == "json"
    from toptheta import pipeline

    counted = pipeline._count_generated(res, tok)  # lm-eval's samples hold each generation as resps[0][0]
    assert 0 <= counted["generated_tokens"] <= 2 * max_gen_toks


def test_shipped_multi_news_resolves():
    import gzip

    task = load_tasks(["longbench_multi_news"], SHIPPED_DATA)["longbench_multi_news"]
    first = json.loads(gzip.open(SHIPPED_DATA / "longbench" / "multi_news.jsonl.gz", "rt", encoding="utf-8").readline())
    assert len(task.eval_docs) == 200
    assert task.eval_docs[0]["context"] == first["context"] and task.eval_docs[0]["answers"] == first["answers"]


def test_documents_decoded_together_score_as_one_at_a_time(data_dir, monkeypatch):
    """decode_batch=3: LongBench's three documents decode in one batch through MiddleTruncatingHFLM, with the
    generations and scores of one document at a time. The first is truncated to head + tail, so its context starts
    with the BOS text and the others do not: each is encoded as alone (HFLM would drop the others' BOS)."""
    from toptheta.evaluation.shared_context_lm import BatchedHFLM

    tok = tiny_tokenizer()
    model = tiny_model(tok)
    widths = []
    generate = BatchedHFLM._model_generate
    monkeypatch.setattr(BatchedHFLM, "_model_generate",
                        lambda self, context, *a, **kw: widths.append(len(context)) or generate(self, context, *a, **kw))
    runs = {}
    for decode_batch in (None, 3):
        runs[decode_batch] = adapter.evaluate_tasks(
            model, tok, ["longbench_multi_news"], data_dir=data_dir, num_fewshot=None, limit=3, max_length=512,
            gen_kwargs={"max_gen_toks": 8}, log_samples=True, bootstrap_iters=0, decode_batch=decode_batch)
    assert widths == [1, 1, 1, 3]
    one, batched = (runs[b]["samples"]["longbench_multi_news"] for b in (None, 3))
    assert [s["resps"] for s in batched] == [s["resps"] for s in one]
    assert runs[3]["results"]["longbench_multi_news"] == runs[None]["results"]["longbench_multi_news"]
    with pytest.raises(ValueError, match="decode_batch must be None or an int >= 1 with scoring"):
        adapter.evaluate_tasks(model, tok, ["longbench_multi_news"], data_dir=data_dir, num_fewshot=None, limit=1,
                               scoring="stock", decode_batch=2)
