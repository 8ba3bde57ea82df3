"""The lm-evaluation-harness model ``luka_bench``: every lm-eval task under any luka_bench KV method.

    lm_eval --model luka_bench --model_args model=smollm2_135m,method=snapkv,method.budget=0.125 --tasks <tasks>

A subclass of lm-eval's Hugging Face model (``HFLM``): tokenisation, chat templates (``--apply_chat_template``),
stop sequences, truncation, request caching and ``--log_samples`` are lm-eval's own code; what runs the model is
luka_bench's engine, one sequence at a time through a fresh method cache (``luka_bench.api.attach``):

- ``generate_until``: the request's whole prompt is the context the method compresses (the question is inside
  it: kvpress's "query-aware" protocol, the runner's ``query_aware=true``), then greedy decoding with the method
  active until a stop sequence, an end-of-sequence id or ``max_gen_toks`` (``engine.prefill`` +
  ``engine.greedy_answer``, as the runner answers).
- ``loglikelihood``: the context is prefilled and compressed (budget: a fraction of the context), then the
  continuation is teacher-forced through the compressed cache one token at a time (decode-time methods act on
  every token) and its log-probabilities (fp32 log-softmax) summed. Requests sharing a context share one
  prefill: each continuation runs from a clone of the compressed cache (``MethodCache.clone``).
- ``loglikelihood_rolling``: lm-eval's rolling windows, each window's first token(s) the prefill and the rest
  teacher-forced, the budget a fraction of the whole window (the runner's perplexity protocol).

After a run the method's memory is printed and written into the results JSON as ``config.luka_bench`` (see
``kv_report``). Registered with lm-eval by ``luka_bench.lm_eval_plugin`` (installed as a ``.pth``), or by
importing this module. ``python -m luka_bench.lm_eval <lm_eval arguments>`` runs lm-eval's command line with the
model registered, for installs without the ``.pth``.

Absolute imports only: inside this module ``lm_eval`` is lm-evaluation-harness, never this file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from luka_bench import engine as E
from luka_bench.errors import OneLineError, RunConfigError

log = logging.getLogger("luka_bench.lm_eval")

# HFLM's own model_args that keep their meaning with a model luka_bench loads (the others configure a loading
# that luka_bench does instead: pretrained, revision, dtype, device, parallelize, peft, ...).
HFLM_ARGS = ("batch_size", "max_batch_size", "max_length", "truncation", "add_bos_token", "prefix_token_id",
             "think_end_token", "enable_thinking", "chat_template_args", "logits_cache")
# Read by tasks, not by the model: RULER's synthetic tasks build their data with ``tokenizer=`` (or ``model=``,
# when it is a hub id), which lm-eval hands them from --model_args. (``pretrained=``, which RULER reads too, is
# refused: it would look like it chooses the model.)
TASK_ARGS = ("tokenizer",)
HUB_MODEL_SETTINGS = ("dtype", "device", "revision", "max_context", "chat_template")


class LmEvalArgsError(OneLineError, ValueError):
    """A bad ``--model_args`` entry for ``--model luka_bench``. One line."""


def _split_args(args: dict[str, Any]) -> tuple[dict, dict, dict]:
    """(model settings, method settings, HFLM args) of ``--model_args`` minus ``model``/``method``; anything
    else is a one-line error naming it and the allowed keys."""
    model_s, method_s, hf = {}, {}, {}
    for k, v in args.items():
        if k.startswith("model."):
            model_s[k[len("model."):]] = v
        elif k.startswith("method."):
            method_s[k[len("method."):]] = v
        elif k in HFLM_ARGS:
            hf[k] = v
        elif k in ("dtype", "device"):  # lm-eval's names (--device, hf's dtype=) for the model's settings
            model_s.setdefault(k, v)
        elif k in TASK_ARGS:
            continue
        elif k == "pretrained":
            raise LmEvalArgsError(f"--model_args pretrained={v!r} is the hf model's name for it; --model luka_bench "
                                  f"takes model=<a conf/model name, a hub id or a local folder> (model={v})")
        else:
            allowed = ", ".join(["model", "method", "model.<key>", "method.<key>", "dtype", "device",
                                 *HFLM_ARGS, *TASK_ARGS])
            raise LmEvalArgsError(f"--model_args {k}={v!r} is not an argument of --model luka_bench; allowed: "
                                  f"{allowed}")
    return model_s, method_s, hf


def _device_setting(device: Any, explicit: bool) -> Any:
    """lm-eval's ``--device`` (its command line passes ``cuda:0`` when none is given) as ``model.device``: on a
    machine without CUDA a CUDA device falls back to ``auto``, as lm-eval's own hf model does; a device given as
    ``model.device=`` is checked strictly by the model loader."""
    if device is None or explicit:
        return device
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        log.info("--device %s: no CUDA GPU here, using model.device=auto", device)
        return "auto"
    return device


def _in_lm_eval_cli() -> bool:
    """This process is lm-eval's command line (``lm_eval``, ``python -m lm_eval``, ``python -m luka_bench.lm_eval``)."""
    import sys
    from pathlib import Path

    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    return argv0.name in ("lm_eval", "lm-eval") or (argv0.name == "__main__.py" and argv0.parent.name == "lm_eval") \
        or (argv0.name == "lm_eval.py" and argv0.parent.name == "luka_bench")


def load(model: str, model_settings: dict):
    """``luka_bench.load_model`` with its settings checked as the command line checks them."""
    import luka_bench as lb
    from luka_bench.errors import group_options

    if model not in group_options("model"):
        bad = [k for k in model_settings if k not in HUB_MODEL_SETTINGS]
        if bad:
            raise LmEvalArgsError(f"model.{bad[0]} is not a setting of a hub or folder model ({model}); allowed: "
                                  f"{', '.join(HUB_MODEL_SETTINGS)}")
    return lb.load_model(model, **model_settings)


def _method_settings(method) -> dict[str, Any]:
    if not dataclasses.is_dataclass(method):
        return {}
    out = {}
    for f in dataclasses.fields(method):
        v = getattr(method, f.name)
        if f.init and isinstance(v, (int, float, str, bool, type(None), list, tuple)):
            out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


class LukaBenchLM(HFLM):
    """``--model luka_bench``: lm-eval's hf model run through a luka_bench KV method (module docstring).

    model_args: ``model=`` a conf/model name, a hub id or a local folder (default smollm2_135m); ``method=`` a
    conf/method name (default full); ``model.<key>=`` / ``method.<key>=`` settings on top, checked as the
    luka_bench command line checks them; ``dtype=`` / ``device=`` (``--device``) as ``model.dtype`` /
    ``model.device``; and HFLM's ``max_length`` (default: the model's ``max_context``), ``truncation``,
    ``add_bos_token``, ``prefix_token_id``, ``think_end_token``, ``enable_thinking``, ``chat_template_args``,
    ``batch_size`` (accepted; requests run one at a time: a method's cache holds one sequence)."""

    def __init__(self, model: str = "smollm2_135m", method: str = "full", **kwargs) -> None:
        try:
            self._setup(model, method, kwargs)
        except OneLineError as e:
            if _in_lm_eval_cli():  # lm-eval's command line would print a traceback around the one line
                raise SystemExit(f"error: {e}") from None
            raise

    def _setup(self, model: str, method: str, kwargs: dict) -> None:
        import luka_bench as lb

        model_s, method_s, hf = _split_args(kwargs)
        device = _device_setting(model_s.get("device"), explicit="model.device" in kwargs)
        if device is None:
            model_s.pop("device", None)
        else:
            model_s["device"] = device
        self.luka_model, self.luka_method = str(model), str(method)
        built = lb.method(self.luka_method, **method_s)  # checked before the model loads
        loaded = load(self.luka_model, model_s)
        self.loaded = loaded
        bs = hf.pop("batch_size", 1)
        if str(bs) not in ("1", "auto", "auto:1", "None"):
            log.warning("batch_size=%s: luka_bench runs one sequence at a time (a method's cache holds one)", bs)
        hf.setdefault("max_length", loaded.max_context)
        super().__init__(pretrained=loaded.model, tokenizer=loaded.tokenizer, backend="causal", batch_size=1, **hf)
        self._attach = contextlib.ExitStack()
        self.kv = self._attach.enter_context(lb.attach(loaded, built))
        self.method = built
        self._eos_ids = E.eos_token_ids(self.model, self.tokenizer)
        self._records: list[dict] = []
        self._tasks: list[str | None] | None = None

    def close(self) -> None:
        """Detach the method from the model (the model's attention is restored)."""
        self._attach.close()

    # -- what a request held and read -------------------------------------------------------------------------
    def _note(self, cache, kind: str, task: str | None) -> None:
        mem = E.memory(cache)
        held = mem["kv_tokens"]
        att = cache.attended_stats()
        self._records.append({
            "task": task, "request_type": kind,
            "kv_ratio": mem["kv_bytes_peak"] / mem["kv_bytes_full"] if mem["kv_bytes_full"] else None,
            "kv_tokens": sum(held) / len(held) if held else None,
            "kv_tokens_full": cache.seen,
            "attended_tokens": att["attended_tokens"],
        })

    def kv_report(self, reset: bool = True) -> dict:
        """The method's memory over the sequences run since the last report: mean ± SE over them
        (``luka_bench.stats.mean_se``; one sequence per generation, per continuation and per rolling window) of
        ``kv_ratio`` (bytes held at most after the prefill's compression / what full attention holds then),
        ``kv_tokens`` (tokens a layer holds at the end, mean over layers), ``kv_tokens_full`` (the tokens full
        attention would hold: the sequence's length) and ``attended_tokens`` (held tokens attention read per
        decode step and layer; only sequences with a decode step); overall and per task."""
        from luka_bench.stats import mean_se

        def summary(rows: list[dict]) -> dict:
            out: dict[str, Any] = {"n": len(rows)}
            for key in ("kv_ratio", "kv_tokens", "kv_tokens_full", "attended_tokens"):
                vals = [float(r[key]) for r in rows if r.get(key) is not None]
                out[key] = mean_se(vals)
            return out

        rows = self._records
        tasks = sorted({str(r["task"]) for r in rows})
        report = {"model": self.luka_model, "method": self.luka_method, "method_settings":
                  _method_settings(self.method), **summary(rows),
                  "by_task": {t: summary([r for r in rows if str(r["task"]) == t]) for t in tasks}}
        if reset:
            self._records = []
        return report

    @staticmethod
    def format_report(report: dict) -> str:
        def f(s: dict, digits: int) -> str:
            if s["mean"] is None:
                return "n/a"
            se = "" if s["se"] is None else f" ± {s['se']:.{digits}f}"
            return f"{s['mean']:.{digits}f}{se}"

        def line(name: str, s: dict) -> str:
            return (f"  {name}: n={s['n']}  kv_ratio {f(s['kv_ratio'], 3)}  tokens held {f(s['kv_tokens'], 1)} of "
                    f"{f(s['kv_tokens_full'], 1)}  tokens read per step {f(s['attended_tokens'], 1)}")

        settings = ", ".join(f"{k}={v}" for k, v in report["method_settings"].items())
        lines = [f"luka_bench: method={report['method']} ({settings}) on model={report['model']}  "
                 "(mean ± SE over sequences)", line("all", report)]
        if len(report["by_task"]) > 1:
            lines += [line(t, s) for t, s in report["by_task"].items()]
        return "\n".join(lines)

    def get_model_info(self) -> dict:
        """lm-eval puts this into the results' ``config`` after the evaluation: the method's memory goes there as
        ``config.luka_bench`` (and is printed). No hub lookup of the model's revision (HFLM's would)."""
        report = self.kv_report()
        print(self.format_report(report), flush=True)
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(self.model.dtype), "luka_bench": report}

    # -- generate_until -----------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        out = []
        for req in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="Running generate_until requests"):
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            if kwargs.get("do_sample"):
                raise RunConfigError(f"generation_kwargs do_sample=True (temperature={kwargs.get('temperature')}) "
                                     f"in task {req.task_name!r}: --model luka_bench decodes greedily; allowed: "
                                     "do_sample=false (--gen_kwargs do_sample=false)")
            max_ctx_len = self.max_length - max_gen_toks
            if max_ctx_len <= 0:
                raise RunConfigError(f"max_gen_toks={max_gen_toks} leaves no room for the prompt in max_length="
                                     f"{self.max_length}; allowed: max_gen_toks < max_length")
            ids, _ = self.tok_batch_encode([context], left_truncate_len=max_ctx_len, truncation=self.truncation)
            if "max_length" in kwargs:  # hf semantics: prompt + generation
                max_gen_toks = int(kwargs.pop("max_length")) - ids.shape[1]
            ids = ids[0].tolist()
            cache = self.kv.new_cache(reference_length=len(ids))
            logits = E.prefill(self.model, ids, cache)
            gen = E.greedy_answer(self.model, self.tokenizer, cache, [], max_gen_toks, self._eos_ids, tuple(until),
                                  logits=logits)
            toks = gen.token_ids
            think = self.think_end_token
            if isinstance(think, int) and think in toks:
                toks = toks[len(toks) - toks[::-1].index(think):]
            s = self.tok_decode(toks)
            if isinstance(think, int):
                s = s.lstrip()
            s = postprocess_generated_text(s, until, think if isinstance(think, str) else None)
            self._note(cache, "generate_until", req.task_name)
            out.append(s)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), s)
        return out

    # -- loglikelihood ------------------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self._tasks = [r.task_name for r in requests]  # TemplateLM keeps the order in _loglikelihood_tokens
        try:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        finally:
            self._tasks = None

    def _fit(self, ctx: list[int], cont: list[int]) -> list[int]:
        """The context lm-eval's hf model would see: context + continuation cut from the left to max_length + 1
        tokens (the last token is only predicted)."""
        if len(cont) > self.max_length:
            raise RunConfigError(f"a continuation of {len(cont)} tokens exceeds max_length={self.max_length}")
        if len(ctx) + len(cont) > self.max_length + 1:
            ctx = (ctx + cont)[-(self.max_length + 1):][: -len(cont)]
        return list(ctx)

    @torch.no_grad()
    def _continuation(self, cache, logits: torch.Tensor, cont: list[int]) -> tuple[float, bool]:
        """Sum of log p(cont) teacher-forced through ``cache`` from the context's last logits, and whether each
        token was the argmax."""
        logps, greedy = [], []
        for j, tok in enumerate(cont):
            logps.append(torch.log_softmax(logits.float(), dim=-1)[tok])
            greedy.append(torch.argmax(logits) == tok)
            if j < len(cont) - 1:
                logits = E.forward(self.model, [tok], cache)
        return float(torch.stack(logps).sum()), bool(torch.stack(greedy).all())

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        tasks = self._tasks if self._tasks is not None and len(self._tasks) == len(requests) else None
        groups: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
        for i, (_, ctx, cont) in enumerate(requests):
            groups.setdefault(tuple(self._fit(ctx, cont)), []).append((i, list(cont)))
        res: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                   desc="Running loglikelihood requests")
        for ctx, items in groups.items():
            base = self.kv.new_cache(reference_length=len(ctx))
            logits = E.prefill(self.model, list(ctx), base)
            for k, (i, cont) in enumerate(items):
                cache = base if k == len(items) - 1 else base.clone()
                res[i] = self._continuation(cache, logits, cont)
                self._note(cache, "loglikelihood", tasks[i] if tasks else None)
                request_str = requests[i][0]
                if request_str is not None:
                    self.cache_hook.add_partial("loglikelihood", request_str, res[i])
                bar.update(1)
        bar.close()
        return res

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood_rolling"):
            (string,) = req.args
            windows = map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1))
            total = 0.0
            for ctx, cont in windows:
                cache = self.kv.new_cache(reference_length=len(ctx) + len(cont))
                logits = E.prefill(self.model, list(ctx), cache)
                total += self._continuation(cache, logits, list(cont))[0]
                self._note(cache, "loglikelihood_rolling", req.task_name)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return out


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with ``--model luka_bench`` registered (for installs without the ``.pth``)."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    # run as a script this file is ``__main__``: register the class of the module ``luka_bench.lm_eval``, the
    # name the .pth's placeholder points to
    from luka_bench.lm_eval import main as _main

    _main()
else:
    register_model("luka_bench")(LukaBenchLM)
