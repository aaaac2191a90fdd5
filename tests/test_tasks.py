"""toptheta's lm-eval tasks and adapter: smoke task, offline YAMLs, checks, calibration requests.

Runs fully offline, on the data shipped in toptheta/data (never a folder outside the checkout).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import load_tasks, tiny_model, tiny_tokenizer
from toptheta.evaluation import lm_eval_adapter as adapter
from toptheta.evaluation import task_loading
from toptheta.evaluation.calibration_inputs import build_requests
from toptheta.evaluation.tasks import DATA_DIR_ENV, SHIPPED_DATA_DIR, check_tasks, fewshot_source, resolve_data_dir, task_names
from toptheta.evaluation.tasks.static.smoke_data import smoke_docs

DATA_DIR = SHIPPED_DATA_DIR
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()





def _jsonl(path: Path) -> list[dict]:
    text = gzip.decompress(path.read_bytes()).decode("utf-8") if path.suffix == ".gz" else path.read_text("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# ---------------------------------------------------------------- shipped data


def test_shipped_data_matches_its_provenance_checksums():
    """Every file listed in toptheta/data/PROVENANCE.md is shipped, with the listed checksums, and nothing else."""
    table = re.findall(r"^\| (\S+\.jsonl\.gz) \| (\d+) .*?\| ([0-9a-f]{64}) \| ([0-9a-f]{64}) \|$",
                       (DATA_DIR / "PROVENANCE.md").read_text(encoding="utf-8"), re.M)
    assert len(table) == 11
    assert sorted(str(p.relative_to(DATA_DIR)) for p in DATA_DIR.rglob("*.gz")) == sorted(row[0] for row in table)
    for rel, records, sha_jsonl, sha_gz in table:
        packed = (DATA_DIR / rel).read_bytes()
        raw = gzip.decompress(packed)
        assert hashlib.sha256(packed).hexdigest() == sha_gz, rel
        assert hashlib.sha256(raw).hexdigest() == sha_jsonl, rel
        assert raw.count(b"\n") == int(records), rel


def test_data_dir_auto_is_the_shipped_copy_unless_the_environment_says_otherwise(tmp_path, monkeypatch):
    assert resolve_data_dir("auto") == SHIPPED_DATA_DIR and SHIPPED_DATA_DIR.is_dir()
    assert resolve_data_dir("hub") is None and resolve_data_dir(None) is None
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert resolve_data_dir("auto") == tmp_path.resolve()
    assert resolve_data_dir("hub") is None  # an explicit choice beats the environment


def test_plain_and_gzipped_files_both_resolve(tmp_path):
    from toptheta.evaluation.tasks.render import write_task_dir

    (tmp_path / "data" / "arc_easy").mkdir(parents=True)
    for split in ("train", "validation"):
        (tmp_path / "data" / "arc_easy" / f"{split}.jsonl").write_text("{}\n")
    (tmp_path / "data" / "arc_easy" / "test.jsonl.gz").write_bytes(gzip.compress(b"{}\n"))
    check_tasks(["arc_easy"], tmp_path / "data", 0)
    (tmp_path / "out").mkdir()
    write_task_dir(tmp_path / "out", ["arc_easy"], tmp_path / "data")
    text = (tmp_path / "out" / "arc_easy.yaml").read_text()
    assert "arc_easy/test.jsonl.gz" in text and "arc_easy/train.jsonl\"" in text


# ---------------------------------------------------------------- smoke task


def test_smoke_docs_are_deterministic_well_formed_and_disjoint():
    docs = smoke_docs()
    assert docs == smoke_docs()
    assert {split: len(d) for split, d in docs.items()} == {"test": 40, "train": 40}
    for doc in docs["test"] + docs["train"]:
        assert len(doc["choices"]) == len(set(doc["choices"])) == 4
        assert 0 <= doc["label"] < 4
    assert not {d["question"] for d in docs["test"]} & {d["question"] for d in docs["train"]}
    # Pinned so an accidental change of the generator (and so of smoke scores) is noticed.
    assert docs["test"][0] == {"question": "What is 1 plus 11?", "choices": ["22", "14", "12", "10"], "label": 2}


def test_evaluate_end_to_end_offline_through_a_custom_attention_function(tokenizer):
    """smoke and arc_easy (the shipped data) through lm-eval on a tiny model.

    HFLM takes our model object as is, including a registered custom attention function. One
    evaluate call covers both tasks: each call costs lm-eval ~4 s of environment reporting.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def counting_sdpa(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    tasks = ["smoke", "arc_easy", "python_code"]
    name = "tests_counting_sdpa"
    AttentionInterface.register(name, counting_sdpa)
    try:
        model = tiny_model(tokenizer)
        model.set_attn_implementation(name)
        res = adapter.evaluate_tasks(model, tokenizer, tasks, data_dir="auto", num_fewshot=None, limit=5,
                                     log_samples=True)
    finally:
        AttentionInterface._global_mapping.pop(name, None)
    assert calls, "the custom attention function was never called"
    for task in tasks[:2]:
        row = res["results"][task]
        assert 0.0 <= row["acc,none"] <= 1.0 and 0.0 <= row["acc_norm,none"] <= 1.0
        assert "acc_stderr,none" in row and res["n-shot"][task] == 0
    code = res["results"]["python_code"]  # a random model: about ln(vocabulary) nats per byte-token character
    assert 4.0 < code["nats_per_char,none"] < 8.0 and code["acc,none"] == 0.0
    assert res["n-samples"]["smoke"] == {"original": 40, "effective": 5}
    assert res["toptheta"]["data_sources"]["smoke"] == "toptheta (generated in code)"
    assert res["n-samples"]["arc_easy"] == {"original": 2376, "effective": 5}
    assert res["toptheta"]["data_sources"]["arc_easy"] == str(DATA_DIR)
    assert res["configs"]["arc_easy"]["dataset_path"] == "json"
    assert res["toptheta"]["data_sources"]["python_code"].startswith("toptheta/data/python_code")
    assert [len(res["samples"][t]) for t in tasks] == [5, 5, 5]  # per-sample outputs kept


# ---------------------------------------------------------------- checks before model work


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tasks": "smoke"}, "non-empty list"),
        ({"tasks": ["smoke", "smoke"]}, "more than once"),
        ({"limit": 1.0}, "use an int for a document count"),
        ({"limit": 0}, ">= 1"),
        ({"num_fewshot": -1}, "num_fewshot"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_bad_arguments_fail_before_the_model_is_touched(kwargs, match):
    args = {"tasks": ["smoke"], "data_dir": None, "num_fewshot": None, "limit": 2} | kwargs
    tasks = args.pop("tasks")
    with pytest.raises(ValueError, match=match):
        adapter.evaluate_tasks(None, None, tasks, **args)  # model=None: never reached


def test_data_dir_errors_name_the_missing_path(tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"{missing}.*not a directory"):
        adapter.resolve_data_dir(missing)
    monkeypatch.setenv(DATA_DIR_ENV, str(missing))
    with pytest.raises(FileNotFoundError, match=r"\$TOPTHETA_DATA_DIR"):
        adapter.resolve_data_dir("auto")

    (tmp_path / "arc_easy").mkdir()
    (tmp_path / "arc_easy" / "test.jsonl").write_text("{}\n")
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert adapter.resolve_data_dir("auto") == tmp_path.resolve()
    with pytest.raises(FileNotFoundError) as err:
        adapter.evaluate_tasks(None, None, ["arc_easy"], data_dir="auto", num_fewshot=0, limit=2)
    assert "arc_easy/train.jsonl" in str(err.value) and str(tmp_path / "arc_easy" / "train.jsonl") in str(err.value)


def test_offline_tasks_without_train_split_explain_the_alternatives(tmp_path):
    (tmp_path / "hellaswag").mkdir()
    (tmp_path / "hellaswag" / "validation.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="cross-dataset calibration, e.g. calibration task 'arc_challenge'"):
        adapter.calibration_requests(
            None, "hellaswag", data_dir=tmp_path, num_fewshot=0, limit=2, max_length=None
        )
    check_tasks(["hellaswag_calibration"], None, 5)  # online it uses the hub's train split
    # Few-shot offline: allowed, drawn from validation without the evaluated doc, and reported.
    check_tasks(["hellaswag"], tmp_path, 5)
    assert "validation" in fewshot_source("hellaswag", tmp_path, 5)
    assert fewshot_source("hellaswag", tmp_path, 0) is None
    assert fewshot_source("hellaswag", None, 5) is None
    assert fewshot_source("arc_easy", tmp_path, 5) is None


def test_every_base_task_has_a_calibration_variant():
    names = task_names()
    for base in ("smoke", "arc_challenge", "arc_easy", "hellaswag", "medmcqa"):
        assert base in names and f"{base}_calibration" in names


def test_rendered_yamls_change_only_the_data_source(tmp_path):
    """Prompts, choices and metrics stay lm-eval's own: offline YAMLs differ from the stock ones
    only in where the documents come from, hub YAMLs not at all, calibration only in splits."""
    from lm_eval.tasks._yaml_loader import load_yaml

    from toptheta.evaluation.tasks.catalog import BASE_TASKS, stock_tasks_dir
    from toptheta.evaluation.tasks.render import write_task_dir

    data_keys = {"dataset_path", "dataset_name", "dataset_kwargs", "training_split"}
    # Without an offline train split, few-shot examples come from the evaluated split.
    no_train_keys = {"test_split", "fewshot_split"}
    names = ["arc_challenge", "arc_easy", "hellaswag", "medmcqa", "arc_easy_calibration"]
    for data_dir, sub in ((tmp_path / "some data", "offline"), (None, "hub")):
        out = tmp_path / sub
        out.mkdir()
        write_task_dir(out, names, data_dir)
        for name in names[:4]:
            stock = load_yaml(stock_tasks_dir() / BASE_TASKS[name].stock_yaml, resolve_func=False)
            ours = load_yaml(out / f"{name}.yaml", resolve_func=False)
            changed = {k for k in stock.keys() | ours.keys() if stock.get(k) != ours.get(k)}
            allowed = (data_keys | (no_train_keys if name in ("hellaswag", "medmcqa") else set())) if data_dir else set()
            assert changed <= allowed, (name, changed)
        calib = load_yaml(out / "arc_easy_calibration.yaml", resolve_func=False)
        base = load_yaml(out / "arc_easy.yaml", resolve_func=False)
        changed = {k for k in calib.keys() | base.keys() if calib.get(k) != base.get(k)}
        assert changed == {"task", "tag", "test_split", "fewshot_split"}
        assert (calib["test_split"], calib["fewshot_split"]) == ("train", "train")
    offline = load_yaml(tmp_path / "offline" / "arc_easy.yaml", resolve_func=False)
    assert offline["dataset_kwargs"]["data_files"]["test"] == str(tmp_path / "some data" / "arc_easy" / "test.jsonl")


# ---------------------------------------------------------------- offline YAMLs on real data

# task -> (file whose records are the evaluated docs, relative to the data dir)
OFFLINE_EVAL_FILES = {
    "arc_challenge": "arc_challenge/test.jsonl.gz",
    "arc_easy": "arc_easy/test.jsonl.gz",
    "hellaswag": "hellaswag/validation.jsonl.gz",
    "medmcqa": "medmcqa/validation.jsonl.gz",
    "arc_challenge_calibration": "arc_challenge/train.jsonl.gz",
    "arc_easy_calibration": "arc_easy/train.jsonl.gz",
}


def test_offline_yamls_resolve_against_the_shipped_data():
    loaded = load_tasks(list(OFFLINE_EVAL_FILES), DATA_DIR)
    for name, rel in OFFLINE_EVAL_FILES.items():
        task = loaded[name]
        records = _jsonl(DATA_DIR / rel)
        assert len(task.eval_docs) == len(records), name
        assert len(list(task.doc_iterator(limit=3))) == 3, name
        first = task.eval_docs[0]
        if "question" in records[0]:  # ARC, MedMCQA: lm-eval keeps the raw fields
            assert first["question"] == records[0]["question"], name
        else:  # HellaSwag: lm-eval's process_docs ran on our rows
            assert first["query"].startswith(records[0]["activity_label"] + ":")
    assert loaded["arc_easy"].config.dataset_path == "json"
    # No offline train split: few-shot examples come from the evaluated split, and lm-eval leaves
    # the evaluated document out exactly when fewshot split == test split.
    for name in ("hellaswag", "medmcqa"):
        task = loaded[name]
        assert task.fewshot_cfg.split == task.config.test_split == "validation", name
        task.set_fewshot_seed(seed=1)
        doc = task.eval_docs[0]
        assert task.fewshot_context(doc, num_fewshot=2).count(task.doc_to_text(doc)) == 1


def test_hellaswag_split_evaluates_after_the_documents_it_draws_exemplars_and_calibration_from():
    """The long-row protocol's HellaSwag: validation's head is the train split (exemplars, calibration), the rest is
    evaluated, so no evaluated question is ever an exemplar or a calibration document."""
    from toptheta.evaluation.tasks.catalog import HELLASWAG_HEAD

    records = _jsonl(DATA_DIR / "hellaswag/validation.jsonl.gz")
    loaded = load_tasks(["hellaswag_split", "hellaswag_split_calibration"], DATA_DIR)
    task, calib = loaded["hellaswag_split"], loaded["hellaswag_split_calibration"]
    assert len(task.eval_docs) == len(records) - HELLASWAG_HEAD and len(calib.eval_docs) == HELLASWAG_HEAD
    label = lambda r: r["activity_label"] + ": " + r["ctx_a"]  # noqa: E731  (the start of lm-eval's query)
    assert task.eval_docs[0]["query"].startswith(label(records[HELLASWAG_HEAD]))
    assert calib.eval_docs[-1]["query"].startswith(label(records[HELLASWAG_HEAD - 1]))
    assert task.fewshot_cfg.split == "train" and calib.config.test_split == "train"
    evaluated = {d["query"] for d in task.eval_docs}
    assert not evaluated & {d["query"] for d in calib.eval_docs}
    task.set_fewshot_seed(seed=1)
    context = task.fewshot_context(task.eval_docs[0], num_fewshot=3)
    assert context.count(task.doc_to_text(task.eval_docs[0])) == 1  # the question itself, once, at the end
    with pytest.raises(ValueError, match="no hub version"):
        check_tasks(["hellaswag_split"], None, 10)
    check_tasks(["hellaswag_split_calibration"], DATA_DIR, 10)  # calibrates offline: it has a train split


# ---------------------------------------------------------------- calibration requests


def test_prompts_from_compiled_templates_are_lm_evals_own(monkeypatch):
    """lm-eval compiles a prompt template on every use; ours compiles each once: the same prompts, byte for byte."""
    from lm_eval import utils

    def requests():
        resolved = resolve_data_dir("auto")
        with adapter.task_include_paths(["arc_easy"], resolved) as include_paths:
            task = task_loading.load_tasks(task_loading.task_manager(include_paths), ["arc_easy"], resolved,
                                       "first_n")["arc_easy"]
            build_requests(task, 5, 6, 1234)
        return [instance.args for instance in task.instances]

    cached = requests()
    assert utils.apply_template._toptheta_cached and utils.apply_template.compiled.cache_info().hits > 0
    monkeypatch.setattr(task_loading, "compile_templates_once", lambda: None)
    monkeypatch.setattr(utils, "apply_template", utils.apply_template.stock)  # lm-eval's own, compiling each time
    assert requests() == cached and len(cached) == 6 * 4
    assert not getattr(utils.apply_template, "_toptheta_cached", False)


def test_calibration_requests_on_smoke_are_deterministic(tokenizer):
    kwargs = {"data_dir": None, "num_fewshot": 1, "limit": 4, "max_length": None, "seed": 7}
    first = adapter.calibration_requests(tokenizer, "smoke", **kwargs)
    assert first == adapter.calibration_requests(tokenizer, "smoke_calibration", **kwargs)
    assert first and all(isinstance(seq, list) and all(isinstance(t, int) for t in seq) for seq in first)
    # 4 train docs x 4 choices, minus inputs HFLM would share (single-token choices).
    assert len(first) <= 16 and len(set(map(tuple, first))) == len(first)
    assert all(seq[0] == tokenizer.bos_token_id for seq in first)
    # Docs come from the train split, in document order.
    assert tokenizer.decode(first[0]).startswith("<s>Answer the question about numbers or letters")
    assert all(len(seq) > 64 for seq in first)  # tiny-llama's default k = 64 has rows to calibrate on
    assert smoke_docs()["train"][0]["question"] in tokenizer.decode(first[0])
    clipped = adapter.calibration_requests(tokenizer, "smoke", **(kwargs | {"max_length": 12}))
    assert all(len(seq) <= 12 for seq in clipped)


def test_encode_request_matches_hflm(tokenizer):
    """Our tokenization of a request is exactly HFLM's, empty and BOS-prefixed contexts included."""
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=tiny_model(tokenizer), tokenizer=tokenizer, batch_size=1)
    captured = []
    lm._loglikelihood_tokens = lambda reqs, disable_tqdm=False: captured.extend(reqs) or [(0.0, True)] * len(reqs)
    pairs = [
        ("Question: What is 1 plus 11?\nAnswer:", " 12"),
        ("Trailing spaces  ", "x"),
        ("", "only a continuation"),
        ("<s>Already has BOS", " yes"),
        ("Ünïcödé ", "ok"),
    ]
    lm.loglikelihood([SimpleNamespace(args=p) for p in pairs], disable_tqdm=True)
    for (context, continuation), (_, ctx_ids, cont_ids) in zip(pairs, captured, strict=True):
        assert adapter.encode_request(tokenizer, context, continuation) == (ctx_ids, cont_ids)


# ---------------------------------------------------------------- tasks outside our catalogue


def test_a_users_task_yaml_runs_by_include_path(tokenizer, tmp_path):
    """A name outside our catalogue is looked up under include_path (and lm-eval's own tasks)."""
    from toptheta.evaluation.tasks.render import STATIC_DIR

    (tmp_path / "my_task.yaml").write_text(f'include: "{STATIC_DIR / "smoke.yaml"}"\ntask: my_task\n')
    res = adapter.evaluate_tasks(tiny_model(tokenizer), tokenizer, ["my_task"], data_dir="auto", num_fewshot=0,
                                 limit=3, include_path=tmp_path)
    assert res["n-samples"]["my_task"] == {"original": 40, "effective": 3}
    assert res["toptheta"]["data_sources"]["my_task"].startswith("lm-eval task")


def test_unknown_lm_eval_task_names_close_matches(monkeypatch):
    """lm-eval's own index is replaced by a stand-in: building the real one takes ~25 s."""
    monkeypatch.setattr(task_loading, "task_manager", lambda paths, stock=False: SimpleNamespace(
        all_tasks=["arc_easy", "piqa", "smoke"] if stock else []))
    assert task_loading.check_external_tasks(["piqa"]) == []
    with pytest.raises(ValueError, match=r"unknown lm-eval task\(s\) \['arc_eazy'\].*Close names: arc_easy"):
        task_loading.check_external_tasks(["arc_eazy"])
    with pytest.raises(FileNotFoundError, match="include_path"):
        task_loading.check_external_tasks(["piqa"], "/no/such/folder")


def test_clip_samples_keeps_structure_and_bounds_size():
    long = "x" * 10_000
    samples = {"t": [{"doc_id": 0, "arguments": [(long, " a")], "doc": {"context": long}, "resps": [[(-1.0, True)]]}]}
    clipped = adapter.clip_samples(samples, max_chars=100)["t"][0]
    assert clipped["doc_id"] == 0 and clipped["arguments"][0][1] == " a" and clipped["resps"] == [[[-1.0, True]]]  # tuples become lists, as in JSON
    assert len(clipped["doc"]["context"]) < 200 and "9900 characters clipped" in clipped["arguments"][0][0]


# ---------------------------------------------------------------- python_code (HumanEval-disjoint calibration code)


def _python_code_docs() -> list[dict]:
    return [json.loads(line) for split in ("train", "test")
            for line in gzip.open(DATA_DIR / "python_code" / f"{split}.jsonl.gz", "rt", encoding="utf-8")]


def test_python_code_documents_are_functions_split_after_their_docstring_and_not_humaneval():
    from toptheta.evaluation.humaneval import load_problems

    docs = _python_code_docs()
    assert len(docs) == 242 and len({d["id"] for d in docs}) == 242
    for d in docs:
        tree = ast.parse(d["prompt"] + d["body"])
        assert isinstance(tree.body[0], ast.FunctionDef) and ast.get_docstring(tree.body[0]), d["id"]
        assert d["prompt"].rstrip()[-1] in "\"'", d["id"]  # the prompt ends with the docstring's closing quote
    text = "\n".join(d["prompt"] + d["body"] for d in docs)
    for problem in load_problems().values():  # no HumanEval prompt (its docstring's first line) is in the corpus
        fn = next(n for n in ast.walk(ast.parse(problem.prompt))
                  if isinstance(n, ast.FunctionDef) and n.name == problem.entry_point)
        lines = [line.strip() for line in (ast.get_docstring(fn) or "").splitlines() if len(line.strip()) >= 20]
        assert not lines or lines[0] not in text, problem.task_id
    assert (DATA_DIR / "python_code" / "LICENSE-PSF.txt").read_text().startswith("A. HISTORY OF THE SOFTWARE")


def test_python_code_calibrates_offline_on_whole_functions():
    from toptheta.evaluation.lm_eval_adapter import calibration_requests
    from toptheta.models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    sequences = calibration_requests(tokenizer, "python_code", data_dir=None, num_fewshot=0, limit=4, max_length=None)
    train = [json.loads(line) for line in gzip.open(DATA_DIR / "python_code" / "train.jsonl.gz", "rt")][:4]
    for ids, doc in zip(sequences, train):  # context + continuation (minus the last token) = the whole function
        assert tokenizer.decode(ids, skip_special_tokens=True) == (doc["prompt"] + doc["body"])[:-1]
    assert "python_code" in task_names() and "python_code_calibration" in task_names()


@pytest.mark.skipif(sys.version_info[:3] != (3, 11, 7), reason="the corpus was made with CPython 3.11.7's library")
def test_python_code_corpus_is_rebuilt_byte_for_byte(tmp_path):
    import subprocess

    subprocess.run([sys.executable, str(REPO / "scripts" / "make_code_corpus.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("train.jsonl.gz", "test.jsonl.gz", "LICENSE-PSF.txt"):
        assert (tmp_path / name).read_bytes() == (DATA_DIR / "python_code" / name).read_bytes(), name


def test_long_documents_are_deterministic_reach_their_lengths_and_calibrate_offline():
    from toptheta.evaluation.lm_eval_adapter import calibration_requests
    from toptheta.evaluation.tasks.static import long_documents_data as L
    from toptheta.models import build_tiny_tokenizer

    docs = L.documents("train")
    assert docs == L.documents("train") and docs != L.documents("test")
    assert len(docs) == len(L.LENGTHS) * L.DOCS_PER_LENGTH["train"] and len({d["id"] for d in docs}) == len(docs)
    longest = max(len(s) for s in L._sentences())
    for d in docs:  # a document stops at the first sentence that takes it to its length
        size = len(d["context"]) + len(d["ending"])
        assert d["length"] <= size + 1 < d["length"] + longest + 2, d["id"]
        assert d["ending"].startswith(" ") and d["ending"].rstrip().endswith(".")
    tokenizer = build_tiny_tokenizer()
    sequences = calibration_requests(tokenizer, "long_documents", data_dir=None, num_fewshot=0, limit=None,
                                     max_length=None)
    assert len(sequences) == len(docs)
    for ids, doc in zip(sequences, docs):  # the whole document is one row (minus its last token)
        assert tokenizer.decode(ids, skip_special_tokens=True) == (doc["context"] + doc["ending"])[:-1]
    assert "long_documents_calibration" in task_names()
