"""Make ``lm_eval --model luka_bench`` work with no import in user code.

lm-evaluation-harness 0.4.13 has no plugin discovery: ``lm_eval.models.MODEL_MAPPING`` is a fixed table that
``lm_eval.models`` registers lazily into ``lm_eval.api.registry.model_registry`` when it is imported, and nothing
reads entry points. What it does support is registering a lazy placeholder (``"module:Class"``) in that registry
before a model is looked up. So the package installs one line into site-packages,
``luka_bench-lm_eval.pth`` (see setup.py), which Python runs at start-up; it imports this module, which costs
nothing but itself (no torch, no lm_eval): it waits for ``lm_eval.models`` to be imported (``get_model`` imports
it before any lookup) and then registers ``luka_bench`` -> ``luka_bench.lm_eval:LukaBenchLM`` beside lm-eval's own
models. The model module itself (torch, transformers, lm_eval's HFLM) is imported only when ``--model luka_bench``
is used.

Without the ``.pth`` (a copy of the package put on ``sys.path`` by hand): ``import luka_bench.lm_eval`` before
calling ``lm_eval.simple_evaluate``, or run ``python -m luka_bench.lm_eval <lm_eval arguments>``.
"""
from __future__ import annotations

import sys

NAME = "luka_bench"
TARGET = "luka_bench.lm_eval:LukaBenchLM"
_WATCHED = "lm_eval.models"


def register() -> None:
    """Register the placeholder in lm-eval's model registry (idempotent; lm_eval.models must be loaded)."""
    from lm_eval.api.registry import model_registry

    if NAME not in model_registry:
        model_registry.register(NAME, target=TARGET)


class _Loader:
    """Wraps the loader of ``lm_eval.models``: runs it, then registers."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        register()

    def __getattr__(self, name):  # get_resource_reader, is_package, ... as the wrapped loader has them
        return getattr(self._loader, name)


class _Finder:
    """A meta-path finder that only looks at ``lm_eval.models``: it asks the other finders for its spec and wraps
    the loader; after that one import it removes itself."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != _WATCHED:
            return None
        uninstall()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Register now if lm_eval.models is loaded, else when it is."""
    if _WATCHED in sys.modules:
        register()
    elif _Finder not in sys.meta_path:
        sys.meta_path.insert(0, _Finder)


def uninstall() -> None:
    while _Finder in sys.meta_path:
        sys.meta_path.remove(_Finder)


install()
