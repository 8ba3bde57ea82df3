"""lm-evaluation-harness: ``--model luka_bench`` (luka_bench/lm_eval.py) on the local fixture tasks in
tests/lm_eval_tasks (generative, multiple choice, perplexity), offline. method=full gives lm-eval's own hf model's
samples on the same weights; a compressing method holds its budget; the runner's data= path and lm-eval give the
same answers to the same prompts; the model is found by lm-eval's command line with no import (the .pth)."""
from __future__ import annotations

import json
import math
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lm_eval")

import luka_bench as lb  # noqa: E402
from luka_bench import engine as E  # noqa: E402

from conftest import ROOT, TailFeed, compose, in_process, tiny  # noqa: E402

TASKS = ROOT / "tests" / "lm_eval_tasks"
PTH = "luka_bench-lm_eval.pth"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
       "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """conf/model/tiny_llama's weights and byte tokenizer saved as a hub-layout folder, for lm-eval's hf model."""
    lm = tiny("llama", num_hidden_layers=2)
    folder = tmp_path_factory.mktemp("tiny_llama")
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS), include_defaults=False)  # indexing lm-eval's own ~10 s


def evaluate(model: str, model_args: str, tasks: list[str], task_manager, limit=None, **kw) -> dict:
    import lm_eval

    import luka_bench.lm_eval  # noqa: F401 - registers --model luka_bench in this process (no .pth here)

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=task_manager,
                                   log_samples=True, device="cpu", limit=limit, **kw)


def same_samples(a: dict, b: dict, tol: float = 1e-3) -> None:
    """Every task's logged samples equal: generations exactly, log-likelihoods to ``tol``, is-greedy exactly."""
    assert a.keys() == b.keys()
    for task in a:
        assert len(a[task]) == len(b[task]) > 0
        for x, y in zip(sorted(a[task], key=lambda s: s["doc_id"]), sorted(b[task], key=lambda s: s["doc_id"])):
            assert x["doc_id"] == y["doc_id"] and x["prompt_hash"] == y["prompt_hash"]
            for rx, ry in zip(x["resps"], y["resps"]):
                for vx, vy in zip(rx, ry):
                    if isinstance(vx, str):
                        assert vx == vy, (task, x["doc_id"])
                    elif isinstance(vx, (list, tuple)):  # (log-likelihood, is_greedy); a JSONL file has strings
                        assert float(vx[0]) == pytest.approx(float(vy[0]), abs=tol), (task, x["doc_id"])
                        assert str(vx[1]) == str(vy[1]), (task, x["doc_id"])
                    else:  # a rolling log-likelihood
                        assert vx == pytest.approx(vy, abs=tol * max(1.0, abs(vy) / 100)), (task, x["doc_id"])
            assert x["filtered_resps"] == y["filtered_resps"] or task.endswith(("_mc", "_ppl", "_abcd_bytes"))


# ---------------------------------------------------------------------------------------------------------------
# Registration: no import in user code
# ---------------------------------------------------------------------------------------------------------------

def test_the_pth_registers_luka_bench_when_lm_eval_loads_its_models(tmp_path):
    """A fresh interpreter that processes the package's .pth (as it processes site-packages at start-up) has
    ``luka_bench`` in lm-eval's model registry beside lm-eval's own models once ``lm_eval.models`` is loaded, as a
    lazy placeholder: nothing heavy (torch) is imported at start-up or by the registration. (That the placeholder
    loads and runs: the command-line tests below, in a fresh process too.)"""
    shutil.copy(ROOT / PTH, tmp_path / PTH)
    code = ("import site, sys; site.addsitedir(sys.argv[1]); "
            "assert 'luka_bench.lm_eval_plugin' in sys.modules and 'lm_eval' not in sys.modules; "
            "import lm_eval.models; from lm_eval.api.registry import model_registry as r; "
            "print(r._objs['luka_bench'], r._objs['hf'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["luka_bench.lm_eval:LukaBenchLM", "lm_eval.models.huggingface:HFLM", "False"]


def test_editable_and_wheel_installs_ship_the_pth(tmp_path):
    """setup.py puts the .pth at the root of both the editable wheel (scripts/setup.sh's ``pip install -e``) and
    the normal wheel, i.e. into site-packages."""
    build = ROOT / "build"
    had_build = build.exists()
    code = ("import json, sys; from setuptools import build_meta as b; d = sys.argv[1]; "
            "names = [b.build_editable(d), b.build_wheel(d)]; open(d + '/names.json', 'w').write(json.dumps(names))")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True,
                             text=True, timeout=300)
    finally:
        if not had_build:
            shutil.rmtree(build, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-2000:]
    for name in json.loads((tmp_path / "names.json").read_text()):
        with zipfile.ZipFile(tmp_path / name) as z:
            assert z.read(PTH) == (ROOT / PTH).read_bytes(), name


def test_bad_model_args_are_one_line():
    from luka_bench.errors import OneLineError
    from luka_bench.lm_eval import LukaBenchLM

    for args, words in [("model=tiny_llama,method=snapk", ["snapk", "snapkv"]),
                        ("model=tiny_llama,method=snapkv,method.budgt=0.1", ["budgt", "budget"]),
                        ("model=tiny_llama,method=snapkv,method.budget=2", ["method.budget=2"]),
                        ("model=tiny_llama,temperature=0", ["temperature", "method.<key>"]),
                        ("model=tiny_llama,model.dtype=fp8", ["fp8", "bfloat16"]),
                        ("model=no_such_model", ["no_such_model", "smollm2_135m"]),
                        ("pretrained=HuggingFaceTB/SmolLM2-135M", ["pretrained", "model="])]:
        with pytest.raises(OneLineError) as e:
            LukaBenchLM.create_from_arg_string(args, {"device": "cpu"})
        msg = str(e.value)
        assert "\n" not in msg and all(w in msg for w in words), (args, msg)


# ---------------------------------------------------------------------------------------------------------------
# Tiny model: equality with lm-eval's hf model, budget, the runner
# ---------------------------------------------------------------------------------------------------------------

def test_full_gives_the_hf_models_samples_on_a_tiny_model(tiny_folder, task_manager, one_thread):
    """Generations identical, log-likelihoods (multiple choice and rolling perplexity) to float tolerance, same
    metrics: with method=full luka_bench is lm-eval's hf model."""
    tasks = ["luka_fixture_gen", "luka_fixture_mc", "luka_fixture_ppl"]
    hf = evaluate("hf", f"pretrained={tiny_folder},dtype=float32", tasks, task_manager, limit=2)
    ours = evaluate("luka_bench", f"model={tiny_folder},method=full", tasks, task_manager, limit=2)
    same_samples(hf["samples"], ours["samples"])
    for task in ("luka_fixture_mc",):
        assert ours["results"][task]["acc,none"] == hf["results"][task]["acc,none"]
    kv = ours["config"]["luka_bench"]
    assert kv["method"] == "full" and kv["kv_ratio"]["mean"] == pytest.approx(1.0)
    assert kv["kv_tokens"]["mean"] == pytest.approx(kv["kv_tokens_full"]["mean"])
    assert set(kv["by_task"]) == set(tasks) and kv["n"] == 2 + 2 * 4 + 2


def test_a_compressing_method_holds_its_budget(tiny_folder, task_manager, one_thread):
    """SnapKV at 0.125: each generation holds at most ceil(0.125 x prompt) + generated tokens per layer, each
    choice's cache ceil(0.125 x context) + its continuation; the reported kv_ratio says so."""
    ours = evaluate("luka_bench", f"model={tiny_folder},method=snapkv,method.budget=0.125,method.window=16",
                    ["luka_fixture_gen", "luka_fixture_mc"], task_manager, limit=2)
    kv = ours["config"]["luka_bench"]
    assert kv["method_settings"]["budget"] == 0.125 and kv["method_settings"]["window"] == 16
    for task, new in (("luka_fixture_gen", 16), ("luka_fixture_mc", 8)):
        s = kv["by_task"][task]
        full = s["kv_tokens_full"]["mean"]
        assert s["kv_tokens"]["mean"] <= math.ceil(0.125 * full) + new, task
        assert s["kv_ratio"]["mean"] <= 0.125 + new / (full - new) + 1e-6, task
        assert s["kv_ratio"]["mean"] < 0.2


def test_runner_and_lm_eval_answer_the_same_prompts_alike(tmp_path, task_manager, one_thread):
    """The runner's data= path (query_aware=true: the whole prompt compressed) and --model luka_bench on the same
    prompts (written as an lm-eval task) give the same answers, under a compressing method."""
    from hydra.utils import instantiate
    from lm_eval.models.utils import postprocess_generated_text
    from lm_eval.tasks import TaskManager

    from luka_bench import run as R

    over = ["model=tiny_llama", "model.num_hidden_layers=2", "data=wikisalad_easy", "data.limit=1",
            "method=snapkv", "method.budget=0.25", "method.window=16", "query_aware=true", "max_new_tokens=8",
            "progress=false"]
    cfg = compose(*over)
    R.run(cfg, tmp_path / "run")
    recs = [json.loads(line) for line in (tmp_path / "run" / "predictions.jsonl").read_text().splitlines()]
    task = instantiate(cfg.data)
    lm = instantiate(cfg.model).load()
    task.prepare(lm.tokenizer, lm.max_context - 8, chat_template=lm.chat_template)
    rows = [{"id": q.id, "prompt": task.context_block(ex) + task.question_block(q) + task.answer_prefix(q)}
            for ex in task.examples() for q in ex.questions]
    assert [r["id"] for r in rows] == [r["item_id"] for r in recs] and not lm.chat_template
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "runner_prompts.yaml").write_text(
        f"task: runner_prompts\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\noutput_type: generate_until\ndoc_to_text: '{{{{prompt}}}}'\ndoc_to_target: ''\n"
        f"generation_kwargs:\n  until: {json.dumps(list(task.stop_strings))}\n  max_gen_toks: 8\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\nmetadata:\n  version: 1.0\n")
    args = "model=tiny_llama,model.num_hidden_layers=2,method=snapkv,method.budget=0.25,method.window=16"
    out = evaluate("luka_bench", args, ["runner_prompts"], TaskManager(include_path=str(tmp_path / "tasks"),
                                                                          include_defaults=False))
    got = {rows[s["doc_id"]]["id"]: s["resps"][0][0] for s in out["samples"]["runner_prompts"]}
    until = [*task.stop_strings, lm.tokenizer.decode([lm.tokenizer.eos_token_id])]
    want = {r["item_id"]: postprocess_generated_text(r["raw_output"], until, None) for r in recs}
    assert got == want and len(got) >= 2


def test_a_sampling_task_is_refused_in_one_line(tiny_folder, task_manager, one_thread):
    from luka_bench.errors import RunConfigError

    with pytest.raises(RunConfigError, match="do_sample=True .* decodes greedily; allowed: do_sample=false"):
        evaluate("luka_bench", f"model={tiny_folder}", ["luka_fixture_gen"], task_manager, limit=1,
                 gen_kwargs="do_sample=True,temperature=0.7")


# ---------------------------------------------------------------------------------------------------------------
# lm-eval's command line
# ---------------------------------------------------------------------------------------------------------------

def lm_eval_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """lm-eval's command line in a fresh process. Where the package was installed with the .pth (scripts/setup.sh)
    the ``lm_eval`` console script itself; in a checkout installed before it (a shared development venv) the
    same entry point with the checkout's .pth processed first, as site-packages would."""
    installed = any((Path(p) / PTH).exists() for p in site.getsitepackages())
    script = Path(sys.executable).with_name("lm_eval")
    if installed and script.exists():
        cmd = [str(script), *args]
    else:
        (cwd / "site").mkdir(exist_ok=True)
        shutil.copy(ROOT / PTH, cwd / "site" / PTH)
        cmd = [sys.executable, "-c", "import site, sys; site.addsitedir(sys.argv.pop(1)); sys.argv[0] = 'lm_eval'; "
               "from lm_eval.__main__ import cli_evaluate; cli_evaluate()", str(cwd / "site"), *args]
    return subprocess.run(cmd, cwd=cwd, env={**ENV, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)


def lm_eval_cli_here(args: list[str], cwd: Path) -> SimpleNamespace:
    """lm-eval's command line (its ``cli_evaluate``, ``sys.argv`` set as the shell sets it) in this process, with
    luka_bench registered by its import: (returncode, stdout, stderr). A fresh process spends ~20 s importing
    lm-eval; ``lm_eval_cli`` (the real console script and the .pth) runs in ``test_smollm2_cli_...``."""
    import lm_eval.tasks
    from lm_eval.__main__ import cli_evaluate

    import luka_bench.lm_eval  # noqa: F401 - what the .pth does in a fresh process

    manager = lm_eval.tasks.TaskManager
    # the command indexes lm-eval's own task configs (~15 s) before it looks up ours (--include_path): here only
    # ours are indexed, the tasks run are the same
    lm_eval.tasks.TaskManager = lambda *a, **kw: manager(*a, **{**kw, "include_defaults": False})
    try:
        return in_process(cli_evaluate, ["lm_eval", *args], cwd)
    finally:
        lm_eval.tasks.TaskManager = manager


def cli_samples(out_dir: Path) -> tuple[dict, dict]:
    """(results JSON, {task: samples}) that ``--output_path out_dir --log_samples`` wrote."""
    results = json.loads(next(out_dir.rglob("results_*.json")).read_text())
    samples = {}
    for f in out_dir.rglob("samples_*.jsonl"):
        task = f.name[len("samples_"):].rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in f.read_text().splitlines()]
    return results, samples


def test_cli_full_gives_the_hf_models_samples_on_a_tiny_model(tiny_folder, task_manager, tmp_path, one_thread):
    """``lm_eval --model luka_bench ... --include_path tests/lm_eval_tasks --log_samples`` from the command line:
    the samples of lm-eval's hf model on the same folder, and the kv figures printed and in the results JSON."""
    out = lm_eval_cli_here(["--model", "luka_bench", "--model_args", f"model={tiny_folder},method=full",
                       "--tasks", "luka_fixture", "--include_path", str(TASKS), "--limit", "2", "--log_samples",
                       "--output_path", str(tmp_path / "out"), "--device", "cpu"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "luka_bench: method=full (budget=1.0, full_layers=0)" in out.stdout and "kv_ratio 1.000" in out.stdout
    results, samples = cli_samples(tmp_path / "out")
    assert results["config"]["luka_bench"]["n"] == 2 + 2 * 4
    hf = evaluate("hf", f"pretrained={tiny_folder},dtype=float32", ["luka_fixture_gen", "luka_fixture_mc"],
                  task_manager, limit=2)
    same_samples(hf["samples"], samples)


def test_in_lm_evals_command_line_a_bad_argument_is_one_line(monkeypatch, capsys):
    """lm-eval's command line prints a traceback around an exception from the model: there a one-line error
    leaves as ``error: ...`` and a non-zero exit instead."""
    from luka_bench.lm_eval import LukaBenchLM

    monkeypatch.setattr(sys, "argv", [str(Path(sys.executable).with_name("lm_eval")), "--model", "luka_bench"])
    with pytest.raises(SystemExit) as e:
        LukaBenchLM.create_from_arg_string("model=tiny_llama,method=h20", {"device": "cpu"})
    assert str(e.value).startswith("error: Unknown method 'h20'. Did you mean 'h2o'?") and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2 (the offline real model)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_cli_snapkv_with_chat_template(tmp_path):
    """The issue's command: SmolLM2 under SnapKV at 0.125 with the chat template, samples logged, kv printed."""
    out = lm_eval_cli(["--model", "luka_bench", "--model_args", "model=smollm2_135m,method=snapkv,method.budget=0.125",
                       "--tasks", "luka_fixture", "--include_path", str(TASKS), "--apply_chat_template",
                       "--log_samples", "--limit", "1", "--output_path", str(tmp_path / "out"), "--device", "cpu"],
                      tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "luka_bench: method=snapkv (budget=0.125" in out.stdout
    results, samples = cli_samples(tmp_path / "out")
    kv = results["config"]["luka_bench"]
    assert kv["n"] == 1 + 1 * 4 and 0 < kv["kv_ratio"]["mean"] < 0.2
    assert set(samples) == {"luka_fixture_gen", "luka_fixture_mc"}
    assert all("<|im_start|>" in s["arguments"]["gen_args_0"]["arg_0"] for s in samples["luka_fixture_gen"])


@pytest.mark.slow
def test_smollm2_sinks_only_first_token_differs_and_the_chat_tail_is_fed(task_manager, monkeypatch,
                                                                         smollm2_tokenizer):
    """SmolLM2 with its chat template on prompts whose answer is in the context, the answer begun ("The answer
    is:"): full attention's first generated tokens differ from those of StreamingLLM holding its 4 sinks only, and
    the tail fed through the compressed cache is what follows the user message (end of turn, assistant header, the
    answer's beginning)."""
    firsts, tails = [], []
    decode, pre = E.greedy_decode_rows, E.prefill_with_tail
    def first_token(*a, **k):
        gens = decode(*a, **k)
        firsts.extend(gen.token_ids[:1] for gen in gens)
        return gens

    monkeypatch.setattr(E, "greedy_decode_rows", first_token)
    monkeypatch.setattr(E, "prefill_with_tail", lambda m, h, t, c: tails.append(list(t)) or pre(m, h, t, c))
    for args in ("method=full", "method=streaming_llm,method.budget=0.005,method.sink=4"):
        evaluate("luka_bench", f"model=smollm2_135m,{args}", ["luka_fixture_gen_prefix"], task_manager, limit=2,
                 apply_chat_template=True)
    tok = smollm2_tokenizer
    assert tok.decode(tails[0]) == "<|im_end|>\n<|im_start|>assistant\nThe answer is:" and \
        tails[:2] == tails[2:]
    assert firsts[:2] != firsts[2:], [tok.decode(f) for f in firsts]


@pytest.mark.slow
def test_smollm2_full_gives_the_hf_models_samples_with_chat_template(task_manager, smollm2_tokenizer):
    from luka_bench.models import cache_root

    folder = cache_root() / "models" / "smollm2_135m"
    # the short variants (the context's last 300 characters): the reference's four multiple-choice forwards
    # over the whole ~400-token prompt took ~20 s of the test and prove nothing more about the template
    tasks = ["luka_fixture_short_gen", "luka_fixture_short_mc"]
    hf = evaluate("hf", f"pretrained={folder},dtype=float32", tasks, task_manager, limit=1, apply_chat_template=True)
    ours = evaluate("luka_bench", "model=smollm2_135m,method=full", tasks, task_manager, limit=1,
                    apply_chat_template=True)
    same_samples(hf["samples"], ours["samples"])
    assert set(ours["samples"]) == set(tasks) and all(len(ours["samples"][t]) == 1 for t in tasks)
    prompt = ours["samples"]["luka_fixture_short_gen"][0]["arguments"][0][0]  # (context, generation settings)
    assert "<|im_start|>" in prompt and len(prompt) < 600, prompt
    assert ours["results"]["luka_fixture_short_gen"]["contains,none"] == \
        hf["results"]["luka_fixture_short_gen"]["contains,none"]


# ---------------------------------------------------------------------------------------------------------------
# The tail rule under lm-eval, and what a reader of lm-eval's docs expects
# ---------------------------------------------------------------------------------------------------------------

def _loglikelihoods(out: dict, task: str) -> dict[tuple[int, int], float]:
    return {(s["doc_id"], j): float(r[0][0]) for s in out["samples"][task] for j, r in enumerate(s["resps"])}


def test_one_token_choices_see_the_compressed_cache(tiny_folder, task_manager, one_thread):
    """One-token multiple choice: a method holding 5 % of the context changes the choices' log-likelihoods (their
    one token comes after the tail, through the compressed cache); full and a method at budget 1.0 equal lm-eval's
    hf model."""
    task = ["luka_fixture_abcd_bytes"]
    hf = evaluate("hf", f"pretrained={tiny_folder},dtype=float32", task, task_manager, limit=3)
    assert all(len(s["arguments"][0][1]) == 1 for s in hf["samples"][task[0]])  # the choice is one token here
    ref = _loglikelihoods(hf, task[0])
    for args in ("method=full", "method=snapkv,method.budget=1.0", "method=streaming_llm,method.budget=1.0"):
        ours = evaluate("luka_bench", f"model={tiny_folder},{args}", task, task_manager, limit=3)
        same_samples(hf["samples"], ours["samples"])
    for args in ("method=streaming_llm,method.budget=0.05", "method=snapkv,method.budget=0.05,method.window=16"):
        ours = evaluate("luka_bench", f"model={tiny_folder},{args}", task, task_manager, limit=3)
        got = _loglikelihoods(ours, task[0])
        diff = [abs(got[k] - ref[k]) for k in ref]  # bit for bit 0 when the prefill's exact logits scored them
        assert min(diff) > 1e-6 and sum(diff) / len(diff) > 1e-3, (args, diff)
        assert ours["config"]["luka_bench"]["kv_ratio"]["mean"] < 0.1


def _count_tails(monkeypatch):
    from luka_bench import engine as E

    fed = []
    real = E.prefill_with_tail
    monkeypatch.setattr(E, "prefill_with_tail", lambda model, head, tail, cache: fed.append(
        (len(head), len(tail))) or real(model, head, tail, cache))
    return fed


def _watched(lm, feed):
    feed.watch(lm.model)
    return lm


def test_generation_feeds_the_last_token_through_the_compressed_cache(tiny_folder, task_manager, monkeypatch,
                                                                       one_thread):
    """generate_until without a chat template: the context's last token is the tail — one decode-phase forward
    before the first generated token. (That a sinks-only method's first token then differs from full's on a prompt
    whose answer needs the context: ``test_smollm2_sinks_only_first_token_differs``; the tiny random model's
    first token does not depend on its context.)"""
    import luka_bench.models as models

    feed = TailFeed(None, monkeypatch)
    load = models.HubModel.load
    monkeypatch.setattr(models.HubModel, "load", lambda self: _watched(load(self), feed))
    evaluate("luka_bench", f"model={tiny_folder},method=streaming_llm,method.budget=0.05", ["luka_fixture_gen"],
             task_manager, limit=2)
    assert feed.fed() == [1, 1]


def test_rolling_windows_follow_one_protocol_whatever_max_length(tiny_folder, task_manager, one_thread):
    """loglikelihood_rolling: every window by the runner's perplexity protocol (first token the prefill, every
    other token a decode step), so a prefill-only method has nothing to compress in any window: with two
    max_length values (documents not a multiple of either) SnapKV at 0.05 equals full, and full equals hf."""
    task = ["luka_fixture_ppl"]
    for max_length in (96, 160):
        hf = evaluate("hf", f"pretrained={tiny_folder},dtype=float32,max_length={max_length}", task, task_manager,
                      limit=2)
        full = evaluate("luka_bench", f"model={tiny_folder},method=full,max_length={max_length}", task,
                        task_manager, limit=2)
        snap = evaluate("luka_bench", f"model={tiny_folder},method=snapkv,method.budget=0.05,method.window=8,"
                        f"max_length={max_length}", task, task_manager, limit=2)
        same_samples(hf["samples"], full["samples"])
        same_samples(full["samples"], snap["samples"], tol=1e-4)
        n = [len(s["doc"]["text"].encode()) for s in full["samples"][task[0]]]
        assert all(k > max_length and k % max_length for k in n), n  # several windows, the last one partial


def test_use_cache_is_refused_in_one_line(tiny_folder, task_manager, tmp_path):
    from luka_bench.errors import RunConfigError

    with pytest.raises(RunConfigError) as e:
        evaluate("luka_bench", f"model={tiny_folder}", ["luka_fixture_gen"], task_manager, limit=1,
                 use_cache=str(tmp_path / "cache"))
    assert "--use_cache" in str(e.value) and "allowed:" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("gen_kwargs,word", [("num_beams=4", "num_beams=4"), ("repetition_penalty=1.3", "1.3"),
                                             ("min_new_tokens=3", "min_new_tokens"), ("top_k=5", "top_k=5")])
def test_unhonoured_generation_settings_are_refused_before_any_generation(tiny_folder, task_manager, monkeypatch,
                                                                          gen_kwargs, word):
    from luka_bench.errors import RunConfigError

    fed = _count_tails(monkeypatch)
    with pytest.raises(RunConfigError) as e:
        evaluate("luka_bench", f"model={tiny_folder}", ["luka_fixture_gen"], task_manager, limit=2,
                 gen_kwargs=gen_kwargs)
    assert word in str(e.value) and "allowed: until, max_gen_toks" in str(e.value) and "\n" not in str(e.value)
    assert fed == []


def test_a_special_token_stop_sequence_stops_generation(tiny_llama, one_thread):
    """lm-eval's stop criterion decodes with special tokens: ``special_stops`` stops at a special token's text
    (``</s>`` taken out of the end-of-sequence ids here, so only the stop string can stop it)."""
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    ids = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    with lb.attach(model, "full") as kv:
        cache = kv.new_cache()
        free = E.greedy_decode(model, tok, cache, E.prefill_with_tail(model, ids[:-1], ids[-1:], cache).logits, 12,
                               set(), ()).token_ids
        special = int(tok.convert_tokens_to_ids("</s>"))
        # the model's logits for the special id raised so it is generated at the third step
        handle = model.lm_head.register_forward_hook(
            lambda m, a, out: out.index_fill(-1, torch.tensor([special]), 1e4) if calls.append(1) or len(calls) == 3
            else out)
        calls: list[int] = []
        try:
            cache = kv.new_cache()
            logits = E.prefill_with_tail(model, ids[:-1], ids[-1:], cache).logits
            calls.clear()
            got = E.greedy_decode(model, tok, cache, logits, 12, set(), ("</s>",), special_stops=True).token_ids
            calls[:] = [0, 0]  # the same forwards once more, without reading special tokens
            cache = kv.new_cache()
            logits = E.prefill_with_tail(model, ids[:-1], ids[-1:], cache).logits
            calls.clear()
            plain = E.greedy_decode(model, tok, cache, logits, 12, set(), ("</s>",)).token_ids
        finally:
            handle.remove()
    assert got[-1] == special and len(got) < 12 and len(plain) == 12 and free != got


def test_add_bos_token_adds_the_bos(tiny_folder, task_manager, monkeypatch, one_thread):
    fed = []
    real = E.prefill_with_tail
    monkeypatch.setattr(E, "prefill_with_tail", lambda model, head, tail, cache: fed.append(head[0]) or
                        real(model, head, tail, cache))
    hf = evaluate("hf", f"pretrained={tiny_folder},dtype=float32,add_bos_token=True", ["luka_fixture_gen"],
                  task_manager, limit=1)
    ours = evaluate("luka_bench", f"model={tiny_folder},add_bos_token=True", ["luka_fixture_gen"], task_manager,
                    limit=1)
    from transformers import AutoTokenizer

    assert fed == [AutoTokenizer.from_pretrained(tiny_folder).bos_token_id]
    same_samples(hf["samples"], ours["samples"])


def test_trust_remote_code_is_accepted():
    from luka_bench.lm_eval import LukaBenchLM

    lm = LukaBenchLM.create_from_arg_string("model=tiny_llama,model.num_hidden_layers=1,trust_remote_code=True",
                                            {"device": "cpu"})
    assert lm.luka_method == "full"
    lm.close()


def test_several_processes_are_refused_before_the_model_loads(monkeypatch):
    """``accelerate launch`` / ``torchrun`` with several processes (``WORLD_SIZE``): one line, before any load."""
    import luka_bench.lm_eval as L
    from luka_bench.errors import RunConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(L, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(RunConfigError) as e:
        L.LukaBenchLM.create_from_arg_string("model=tiny_llama", {"device": "cpu"})
    assert "WORLD_SIZE=2" in str(e.value) and "allowed: 1 process" in str(e.value) and "\n" not in str(e.value)


def test_bfloat16_log_likelihoods_are_taken_as_the_hf_model_takes_them(tiny_folder, task_manager, one_thread):
    """dtype=bfloat16 on both: log-softmax in the logits' dtype and summed there, as lm-eval's hf model does."""
    task = ["luka_fixture_abcd_bytes"]
    hf = evaluate("hf", f"pretrained={tiny_folder},dtype=bfloat16", task, task_manager, limit=2)
    ours = evaluate("luka_bench", f"model={tiny_folder},dtype=bfloat16", task, task_manager, limit=2)
    same_samples(hf["samples"], ours["samples"], tol=1e-3)


def test_a_method_that_needs_the_question_in_the_prompt_is_refused_before_the_model_loads(monkeypatch):
    """FINCH's observation window is the question, whose span lm-eval's requests do not give: one line, no load."""
    import luka_bench.lm_eval as L
    from luka_bench.errors import RunConfigError

    monkeypatch.setattr(L, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(RunConfigError) as e:
        L.LukaBenchLM.create_from_arg_string("model=tiny_llama,method=finch", {"device": "cpu"})
    assert "method=finch" in str(e.value) and "allowed:" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("args", ["method=full", "method=snapkv,method.budget=0.25,method.window=16",
                                  "method=streaming_llm,method.budget=0.25"])
def test_batch_size_8_gives_batch_size_1s_samples(args, tiny_folder, task_manager, one_thread, monkeypatch):
    """``--batch_size 8``: requests decoded / teacher-forced together as the rows of one batch, each prefilled alone
    in its own cache — the one-token multiple choice's log-likelihoods (within 1e-4) and is-greedy, the generative
    task's generations and the rolling log-likelihoods equal ``--batch_size 1``'s, and so does what the method held."""
    tasks = ["luka_fixture_abcd_bytes", "luka_fixture_gen", "luka_fixture_ppl"]
    one = evaluate("luka_bench", f"model={tiny_folder},{args}", tasks, task_manager, limit=4, batch_size=1)
    from luka_bench import engine as E

    widths, real = [], E.forward_rows
    monkeypatch.setattr(E, "forward_rows", lambda model, toks, caches: widths.append(len(caches)) or
                        real(model, toks, caches))
    eight = evaluate("luka_bench", f"model={tiny_folder},{args}", tasks, task_manager, limit=4, batch_size=8)
    # the generative task's 4 requests decode as the 4 rows of one forward per step (a one-token choice is scored
    # from its tail's logits: no forward after them)
    assert max(widths) == 4
    same_samples(one["samples"], eight["samples"], tol=1e-4)
    kv1, kv8 = one["config"]["luka_bench"], eight["config"]["luka_bench"]
    assert kv8["n"] == kv1["n"] and kv8["kv_tokens"] == kv1["kv_tokens"] and kv8["kv_ratio"] == kv1["kv_ratio"]


def test_batch_size_auto_is_refused_in_one_line(tiny_folder):
    from luka_bench.errors import RunConfigError
    from luka_bench.lm_eval import LukaBenchLM

    with pytest.raises(RunConfigError, match=r"^batch_size=auto: --model luka_bench takes an integer >= 1") as e:
        LukaBenchLM(model=str(tiny_folder), method="full", batch_size="auto")
    assert "\n" not in str(e.value)
