"""The lm-evaluation-harness model ``luka_bench``: every lm-eval task under any luka_bench KV method.

    lm_eval --model luka_bench --model_args model=smollm2_135m,method=snapkv,method.budget=0.125 --tasks <tasks>

A subclass of lm-eval's Hugging Face model (``HFLM``): tokenisation, chat templates (``--apply_chat_template``),
stop sequences, truncation, request caching and ``--log_samples`` are lm-eval's own code; what runs the model is
luka_bench's engine, one sequence at a time through a fresh method cache (``luka_bench.api.attach``):

Every request follows the engine's **tail rule** (``luka_bench.engine``): no token is scored or generated from
logits computed before the method compressed what precedes it. A request's context is split into the part that is
prefilled and compressed and a *tail* fed through the compressed cache: with ``--apply_chat_template`` the
generation prompt that follows the last user message (the end of its turn, the assistant header, any ``gen_prefix``
after it: kvpress's query-aware protocol, the runner's ``query_aware=true``), otherwise the context's last token.

- ``generate_until``: tail rule, then greedy decoding with the method active until a stop sequence (checked on the
  text decoded with special tokens, as lm-eval's stop criterion does), an end-of-sequence id or ``max_gen_toks``
  (``engine.prefill_with_tail`` + ``engine.greedy_decode``). Generation settings other than ``until``,
  ``max_gen_toks``, ``max_length`` and greedy decoding are refused in one line before any generation runs.
- ``loglikelihood``: tail rule (budget: a fraction of the compressed part), then the continuation teacher-forced
  through the compressed cache one token at a time (decode-time methods act on every token; ``engine.teacher_force``)
  and its log-probabilities summed as lm-eval's hf model takes them (log-softmax in the logits' dtype, or
  ``softmax_dtype``). The choices of one question share one prefill and tail: each continuation runs from a clone
  of that cache (``MethodCache.clone``).
- ``loglikelihood_rolling``: one protocol for every window, whatever the document's length: the runner's perplexity
  protocol (``data=pg19``, ``engine.teacher_forced_nll``) on the window's tokens — its first token is the prefill,
  every other token (the window's unscored context, then its scored tokens) a decode step through the method's
  cache, the budget a fraction of the window. Decode-time methods act on every scored token; a prefill-time method
  has a one-token prefill to compress, so it holds everything (use a log-likelihood task for those).

After a run the method's memory is printed and written into the results JSON as ``config.luka_bench`` (see
``kv_report``). Registered with lm-eval by ``luka_bench.lm_eval_plugin`` (installed as a ``.pth``), or by
importing this module. ``python -m luka_bench.lm_eval <lm_eval arguments>`` runs lm-eval's command line with the
model registered, for installs without the ``.pth``.

Absolute imports only: inside this module ``lm_eval`` is lm-evaluation-harness, never this file.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from luka_bench import engine as E
from luka_bench.errors import OneLineError, RunConfigError
from luka_bench.metrics import kv_ratio
from luka_bench.prompting import generation_prompt, text_tail

log = logging.getLogger("luka_bench.lm_eval")

# HFLM's own model_args that keep their meaning with a model luka_bench loads (the others configure a loading
# that luka_bench does instead: pretrained, revision, dtype, device, parallelize, peft, ...).
HFLM_ARGS = ("batch_size", "max_batch_size", "max_length", "truncation", "add_bos_token", "prefix_token_id",
             "think_end_token", "enable_thinking", "chat_template_args", "logits_cache", "softmax_dtype")
# Accepted and without effect here: lm-eval's --trust_remote_code puts trust_remote_code=True into --model_args (it
# also lets datasets run their scripts); luka_bench loads a model with transformers' own classes, whose attention
# the methods replace, so no model code from a hub runs either way.
ACCEPTED_ARGS = ("trust_remote_code",)
# Generation settings honoured (greedy decoding): the others are refused before any generation runs, unless set to
# the value that leaves greedy decoding unchanged.
GEN_HONOURED = ("until", "max_gen_toks", "max_length", "do_sample", "temperature")
GEN_NO_OP = {"num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "top_p": 1.0, "top_k": None,
             "min_new_tokens": 0, "min_length": 0, "no_repeat_ngram_size": 0, "length_penalty": 1.0}
# Fields of a model's generation config that change greedy decoding in ``--model hf`` (logits processors), with the
# value that does not: a model whose config sets one is named at load (not applied here).
GEN_CONFIG_PROCESSORS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None,
                         "min_length": 0, "min_new_tokens": None, "suppress_tokens": None,
                         "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
                         "sequence_bias": None, "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0,
                         "exponential_decay_length_penalty": None}
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
        elif k in TASK_ARGS or k in ACCEPTED_ARGS:
            continue
        elif k == "pretrained":
            raise LmEvalArgsError(f"--model_args pretrained={v!r} is the hf model's name for it; --model luka_bench "
                                  f"takes model=<a conf/model name, a hub id or a local folder> (model={v})")
        else:
            allowed = ", ".join(["model", "method", "model.<key>", "method.<key>", "dtype", "device",
                                 *HFLM_ARGS, *TASK_ARGS, *ACCEPTED_ARGS])
            raise LmEvalArgsError(f"--model_args {k}={v!r} is not an argument of --model luka_bench; allowed: "
                                  f"{allowed}")
    return model_s, method_s, hf


def _batch_size(value: Any) -> int:
    """lm-eval's ``batch_size`` as the number of rows decoded together: an integer >= 1 (lm-eval's default "1"
    included); ``auto`` (lm-eval's search for the largest batch that fits) is refused in one line: a request's rows
    hold caches of different sizes, which that search does not see."""
    text = str(value).strip()
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise RunConfigError(f"batch_size={value}: --model luka_bench takes an integer >= 1 (requests decoded together "
                         f"as the rows of one batch); 'auto' searches for a batch that fits by one padded forward, "
                         f"which a method's caches do not follow")


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


def _processes() -> int:
    """How many processes the launcher started (``accelerate launch``, ``torchrun``: ``WORLD_SIZE``)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def _cli_asks_use_cache() -> bool:
    """lm-eval's command line was given ``--use_cache`` (seen before the model loads)."""
    import sys

    return _in_lm_eval_cli() and any(a == "--use_cache" or a.startswith("--use_cache=") for a in sys.argv[1:])


USE_CACHE_REFUSED = ("--use_cache is refused by --model luka_bench: lm-eval keys its response cache by the request "
                     "alone, not by the model, the method or its settings, so two methods would share answers; "
                     "allowed: run without --use_cache (--cache_requests, which caches the built requests, is fine)")


def _gen_setting_problem(kwargs: dict, task: str | None) -> str | None:
    """A one-line reason a request's (normalised) generation settings cannot be honoured, else None."""
    if kwargs.get("do_sample"):
        return (f"generation_kwargs do_sample=True (temperature={kwargs.get('temperature')}) in task {task!r}: "
                "--model luka_bench decodes greedily; allowed: do_sample=false (--gen_kwargs do_sample=false)")
    for k, v in kwargs.items():
        if k in GEN_HONOURED:
            continue
        if k in GEN_NO_OP and v == GEN_NO_OP[k]:
            continue
        return (f"generation_kwargs {k}={v!r} in task {task!r} is not honoured by --model luka_bench (greedy "
                f"decoding); allowed: {', '.join(GEN_HONOURED)} (do_sample=false)"
                + (f", or {k}={GEN_NO_OP[k]!r}" if k in GEN_NO_OP else ""))
    return None


def generation_config_not_applied(model) -> dict[str, Any]:
    """The model's generation-config settings that ``--model hf``'s ``model.generate`` would apply to greedy
    decoding (logits processors) and ``--model luka_bench`` does not: named at load and in the kv report."""
    gc = getattr(model, "generation_config", None)
    if gc is None:
        return {}
    out = {}
    for k, neutral in GEN_CONFIG_PROCESSORS.items():
        v = getattr(gc, k, neutral)
        if v is not None and v != neutral and not (isinstance(v, (list, dict)) and not v):
            out[k] = v
    return out


class LukaBenchLM(HFLM):
    """``--model luka_bench``: lm-eval's hf model run through a luka_bench KV method (module docstring).

    model_args: ``model=`` a conf/model name, a hub id or a local folder (default smollm2_135m); ``method=`` a
    conf/method name (default full); ``model.<key>=`` / ``method.<key>=`` settings on top, checked as the
    luka_bench command line checks them; ``dtype=`` / ``device=`` (``--device``) as ``model.dtype`` /
    ``model.device``; and HFLM's ``max_length`` (default: the model's ``max_context``), ``truncation``,
    ``add_bos_token``, ``prefix_token_id``, ``think_end_token``, ``enable_thinking``, ``chat_template_args``,
    ``batch_size`` (an integer: that many requests decoded or teacher-forced together as the rows of one batch, each
    prefilled alone in its own cache: every result is the request's alone; ``auto`` is refused in one line)."""

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
        if _processes() > 1:
            raise RunConfigError(f"--model luka_bench runs in one process; got WORLD_SIZE={_processes()} (accelerate "
                                 "launch / torchrun): its results and kv figures would not be gathered; allowed: "
                                 "1 process (run lm_eval without the launcher, one process per GPU and task subset)")
        if _cli_asks_use_cache():
            raise RunConfigError(USE_CACHE_REFUSED)
        device = _device_setting(model_s.get("device"), explicit="model.device" in kwargs)
        if device is None:
            model_s.pop("device", None)
        else:
            model_s["device"] = device
        self.luka_model, self.luka_method = str(model), str(method)
        built = lb.method(self.luka_method, **method_s)  # checked before the model loads
        if built.question_in_prompt:  # lm-eval's requests do not say where a question starts in the context
            raise RunConfigError(f"--model_args method={self.luka_method}: it needs the question's span inside the "
                                 "compressed prompt, which lm-eval's requests do not give; allowed: any other "
                                 "method (run it with the runner's query_aware=true)")
        loaded = load(self.luka_model, model_s)
        self.loaded = loaded
        self.rows = _batch_size(hf.pop("batch_size", 1))
        hf.pop("max_batch_size", None)  # only read with batch_size=auto, which is refused
        hf.setdefault("max_length", loaded.max_context)
        if hf.get("add_bos_token") is not None and hasattr(loaded.tokenizer, "add_bos_token"):
            # what --model hf does by loading its tokenizer with add_bos_token=: the tokenizer itself adds the BOS
            # (lm-eval's own encoding only switches special tokens on, which adds none to a tokenizer set not to)
            loaded.tokenizer.add_bos_token = bool(hf["add_bos_token"])
        super().__init__(pretrained=loaded.model, tokenizer=loaded.tokenizer, backend="causal", batch_size=1, **hf)
        self._attach = contextlib.ExitStack()
        self.kv = self._attach.enter_context(lb.attach(loaded, built))
        self.method = built
        self._eos_ids = E.eos_token_ids(self.model, self.tokenizer)
        self._chat = False  # lm-eval applies a chat template (apply_chat_template is called per request then)
        self._gen_prompt = generation_prompt(self.tokenizer)
        self.not_applied = generation_config_not_applied(self.model)
        if self.not_applied:
            log.warning("the model's generation config sets %s, which --model hf's generate applies to greedy "
                        "decoding; --model luka_bench does not apply them",
                        ", ".join(f"{k}={v!r}" for k, v in self.not_applied.items()))
        self._records: list[dict] = []
        self._tasks: list[str | None] | None = None

    def set_cache_hook(self, cache_hook) -> None:
        """lm-eval's ``--use_cache`` (``CachingLM``) hands its database here: refused (``USE_CACHE_REFUSED``)."""
        if getattr(cache_hook, "dbdict", None) is not None:
            raise RunConfigError(USE_CACHE_REFUSED)
        super().set_cache_hook(cache_hook)

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        self._chat = True
        return super().apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)

    def _tail(self, context: str | None, n_ids: int) -> int:
        """How many of a request's ``n_ids`` context ids are its tail (module docstring): with a chat template
        applied, from the generation prompt after the last user message to the end (any ``gen_prefix`` included);
        otherwise the last token. At most ``n_ids - 1`` (something is compressed)."""
        n = 1
        if self._chat and self._gen_prompt and context:
            at = context.rfind(self._gen_prompt)
            if at >= 0:
                n = text_tail(self.tok_encode, context, context[at:])
        return max(1, min(n, n_ids - 1)) if n_ids > 1 else 0

    def _prefill(self, ids: list[int], tail: int):
        """(cache, logits) of a request's context under the tail rule: ``ids`` minus its last ``tail`` prefilled
        and compressed (the budget a fraction of that part), the tail fed through the compressed cache. A context
        of one token (``tail`` 0) is its own prefill: nothing precedes it to compress."""
        if not tail:
            cache = self.kv.new_cache(reference_length=len(ids))
            return cache, E.prefill(self.model, ids, cache)
        cache = self.kv.new_cache(reference_length=len(ids) - tail)
        return cache, E.prefill_with_tail(self.model, ids[:-tail], ids[-tail:], cache).logits

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
            "kv_ratio": kv_ratio(mem["kv_bytes_peak"], mem["kv_bytes_full"]),
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
                  self.method.settings_json(), "protocol": "tail rule: chat generation prompt, else last token",
                  "generation_config_not_applied": {k: str(v) for k, v in self.not_applied.items()},
                  **summary(rows),
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

        settings = ", ".join(f"{k}={v}" for k, v in report["method_settings"].items())  # KVMethod.settings
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
        settings = []
        for req in requests:  # every request's settings checked before any generation runs
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            problem = _gen_setting_problem(kwargs, req.task_name)
            if problem is not None:
                raise RunConfigError(problem)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            if self.max_length - max_gen_toks <= 0:
                raise RunConfigError(f"max_gen_toks={max_gen_toks} leaves no room for the prompt in max_length="
                                     f"{self.max_length}; allowed: max_gen_toks < max_length")
            settings.append((until, max_gen_toks, kwargs.get("max_length")))
        out = []
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running generate_until requests")
        # ``batch_size`` requests decoded together, each in its own cache
        for group in E.in_batches(zip(requests, settings), self.rows):
            rows = []
            for req, (until, max_gen_toks, max_length) in group:
                context, gen_kwargs = req.args
                ids, _ = self.tok_batch_encode([context], left_truncate_len=self.max_length - max_gen_toks,
                                               truncation=self.truncation)
                if max_length is not None:  # hf semantics: prompt + generation
                    max_gen_toks = int(max_length) - ids.shape[1]
                ids = ids[0].tolist()
                rows.append((req, until, max_gen_toks, *self._prefill(ids, self._tail(context, len(ids)))))
            gens = E.greedy_decode_rows(self.model, self.tokenizer, [r[3] for r in rows],
                                        torch.stack([r[4] for r in rows]), [r[2] for r in rows], self._eos_ids,
                                        [tuple(r[1]) for r in rows], special_stops=True)
            for (req, until, _, cache, _), gen in zip(rows, gens):
                out.append(self._finish(req, until, cache, gen))
                bar.update(1)
        bar.close()
        return out

    def _finish(self, req, until, cache, gen) -> str:
        """A generation's text as lm-eval's hf model returns it (thinking cut, stop sequences applied), noted."""
        context, gen_kwargs = req.args
        toks = gen.token_ids
        think = self.think_end_token
        if isinstance(think, int) and think in toks:
            toks = toks[len(toks) - toks[::-1].index(think):]
        s = self.tok_decode(toks)
        if isinstance(think, int):
            s = s.lstrip()
        s = postprocess_generated_text(s, until, think if isinstance(think, str) else None)
        self._note(cache, "generate_until", req.task_name)
        self.cache_hook.add_partial("generate_until", (context, gen_kwargs), s)
        return s

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

    def _score(self, rows: list[tuple]) -> list[tuple[float, bool]]:
        """For rows (cache, tail logits, continuation) teacher-forced together (``teacher_force_rows``): the sum of
        log p(continuation) and whether each token was the argmax; log-softmax in ``softmax_dtype`` (None: the
        logits' dtype) and summed in it, as lm-eval's hf model."""
        forced = E.teacher_force_rows(self.model, [r[0] for r in rows], torch.stack([r[1] for r in rows]),
                                      [r[2] for r in rows], dtype=self.softmax_dtype)
        return [(float(f.logprobs.sum()), bool(f.greedy.all())) for f in forced]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        tasks = self._tasks if self._tasks is not None and len(self._tasks) == len(requests) else None
        groups: dict[tuple[tuple[int, ...], int], list[tuple[int, list[int]]]] = {}
        for i, (request_str, ctx, cont) in enumerate(requests):
            ctx = self._fit(ctx, cont)
            context = request_str[0] if request_str is not None else None
            tail = self._tail(context, len(ctx))
            groups.setdefault((tuple(ctx), tail), []).append((i, list(cont)))
        res: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                   desc="Running loglikelihood requests")

        def rows():  # (request, cache, logits, continuation): a context prefilled once, each choice on a clone
            for (ctx, tail), items in groups.items():
                base, logits = self._prefill(list(ctx), tail)
                for k, (i, cont) in enumerate(items):
                    yield i, base if k == len(items) - 1 else base.clone(), logits, cont

        def score(batch):  # ``batch_size`` choices (of any contexts) teacher-forced together
            for (i, cache, _, _), r in zip(batch, self._score([b[1:] for b in batch])):
                res[i] = r
                self._note(cache, "loglikelihood", tasks[i] if tasks else None)
                request_str = requests[i][0]
                if request_str is not None:
                    self.cache_hook.add_partial("loglikelihood", request_str, r)
                bar.update(1)

        for batch in E.in_batches(rows(), self.rows):
            score(batch)
        bar.close()
        return res

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Every window by the runner's perplexity protocol (module docstring): the window's first token is the
        prefill (nothing to compress before it), every other token a decode step through the method's cache; the
        window's own context tokens are fed, not scored."""
        out = []
        for req in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood_rolling"):
            (string,) = req.args
            windows = map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1))
            total = 0.0
            for group in E.in_batches(windows, self.rows):  # ``batch_size`` windows teacher-forced together
                docs = [list(ctx) + list(cont) for ctx, cont in group]
                for (ctx, _), (f, cache) in zip(group, E.forced_documents(self.model, self.kv, docs,
                                                                          self.softmax_dtype)):
                    total += float(f.logprobs[len(ctx) - 1:].sum())
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
