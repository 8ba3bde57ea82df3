"""Loaders and scoring for the local lm-eval fixture tasks (``--include_path tests/lm_eval_tasks``): the JSON lines
next to this file, read with ``datasets`` offline from any working directory."""
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(name: str):
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(HERE / f"{name}.jsonl")})


def load_gen(**kwargs):  # lm-eval passes the run's metadata (the model_args); not needed here
    return _load("gen")


def load_mc(**kwargs):
    return _load("mc")


def load_abcd(**kwargs):
    return _load("abcd")


def load_ppl(**kwargs):
    return _load("ppl")


def contains(doc, results):
    """1 when the gold answer appears in the answer (case-insensitive): a short model answers in a sentence."""
    return {"contains": float(doc["answer"].lower() in results[0].lower())}
