"""The config as the registry, outside a Hydra app: compose ``conf/config.yaml`` with overrides and build a group's
object from it with the command line's one-line errors. Used by the public API (``luka_bench.method``,
``luka_bench.load_model``), the probe and the studies in ``scripts/``.
"""
from __future__ import annotations

import json
from typing import Any

from luka_bench.errors import CONF_DIR, GROUPS, RunConfigError


def register_resolvers() -> None:
    """The config's resolvers: ``${luka_run_dir:...}`` for ``hydra.run.dir`` in conf/config.yaml (the run folder's
    name, ``results.run_dir_name``), ``${luka_not_identity:}`` (the keys left out of it,
    ``results.folder_name_excludes``) and ``${luka_laser_budget:...}`` (``laser_equal_budget``). Called by the
    command line before Hydra composes the config (not on import)."""
    from omegaconf import OmegaConf

    from luka_bench.results import folder_name_excludes, run_dir_name

    if not OmegaConf.has_resolver("luka_run_dir"):
        OmegaConf.register_new_resolver("luka_run_dir", lambda *parts: run_dir_name(*parts))
    if not OmegaConf.has_resolver("luka_not_identity"):
        OmegaConf.register_new_resolver("luka_not_identity", folder_name_excludes)
    if not OmegaConf.has_resolver("luka_laser_budget"):
        OmegaConf.register_new_resolver("luka_laser_budget", laser_equal_budget)


def laser_equal_budget(length, block: int, r: float = 0.25, divisor: int = 4) -> float:
    """``${luka_laser_budget:<data.length>,<block>}``: the fraction of a BABILong context (``"16k"``: the nominal
    ``16 * 1000 - 300`` tokens) that LASER-KV holds after its prefill with blocks of ``block``, ratio ``r`` and
    protection divisor ``divisor`` (``methods.laser_kv.held_tokens``) — the budget that makes a baseline hold as many
    tokens (the LASER-KV paper's tables, conf/laser_row/)."""
    from luka_bench.methods.laser_kv import held_tokens

    text = str(length).strip().lower()
    if not text.endswith("k") or not text[:-1].isdigit() or int(text[:-1]) < 1:
        raise ValueError(f"luka_laser_budget: data.length={length!r}; allowed: 1k, 2k, 4k, ... (BABILong lengths)")
    context = int(text[:-1]) * 1000 - 300
    return round(held_tokens(context, int(block), float(r), int(divisor)) / context, 6)


def compose(overrides: list[str], run_names: bool = False):
    """The composed config. ``run_names``: also set ``model_name``/``method_name``/``data_name`` from the group
    choices (as ``python -m luka_bench`` does) and drop Hydra's own keys, so the result can go to ``run.run``."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from omegaconf import open_dict

    register_resolvers()

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = hcompose(config_name="config", overrides=list(overrides), return_hydra_config=run_names)
    if run_names:
        choices = cfg.hydra.runtime.choices
        with open_dict(cfg):
            for g in GROUPS:
                cfg[f"{g}_name"] = choices[g]
            del cfg["hydra"]
            cfg.pop("sweep_name", None)
    return cfg


def build(cfg, group: str):
    """``cfg.<group>`` instantiated; a key its class does not take is a one-line RunConfigError naming it and
    the class's settings (Hydra's own error is a traceback)."""
    import dataclasses

    from hydra.errors import InstantiationException
    from hydra.utils import get_class, instantiate

    from luka_bench.errors import unwrap

    try:
        return instantiate(cfg[group])
    except InstantiationException as e:
        inner = unwrap(e)
        if isinstance(inner, TypeError) and "unexpected keyword argument" in str(inner):
            bad = str(inner).rsplit("argument", 1)[-1].strip(" '\"")
            try:
                cls = get_class(cfg[group]["_target_"])
                names = [f.name for f in dataclasses.fields(cls) if f.init] if dataclasses.is_dataclass(cls) else []
            except Exception:  # noqa: BLE001 - the message without the list is still one line
                names = []
            allowed = f"; allowed: {', '.join(names)}" if names else ""
            raise RunConfigError(f"{group}.{bad} is not a setting of {group}={cfg.get(f'{group}_name')}"
                                 f"{allowed}") from None
        from luka_bench.errors import one_line_errors

        if isinstance(inner, one_line_errors()):  # a bad value: its own one-line error, not Hydra's wrapper
            raise inner from None
        raise


def _value(v: Any) -> str:
    """A Python value as a Hydra override value (JSON is a subset of its grammar)."""
    return json.dumps(list(v) if isinstance(v, tuple) else v)


def group_overrides(group: str, name: str, settings: dict[str, Any]) -> list[str]:
    """``[group=name, group.key=value, ...]``, checked as the command line checks them: an unknown name or key is
    one line naming it and the allowed ones (``MethodConfigError`` / ``RunConfigError``)."""
    from luka_bench.errors import _settings_of, check_group_keys, check_group_overrides, group_options

    # a setting of the class that its config file leaves at the default (``rounding``) is added, as the command
    # line's ``+method.rounding=kvpress`` adds it
    keys, fields = _settings_of(group, name) if name in group_options(group) else ([], [])
    args = [f"{group}={name}"] + [f"{'+' if k in fields and k not in keys else ''}{group}.{k}={_value(v)}"
                                  for k, v in settings.items()]
    msg = check_group_overrides(args[:1]) or check_group_keys(args)
    if msg:
        if group == "method":
            from luka_bench.methods.base import MethodConfigError

            raise MethodConfigError(msg)
        raise RunConfigError(msg)
    return args


def build_group(group: str, name: str, /, **settings):
    """``conf/<group>/<name>.yaml`` with ``settings`` on top, instantiated and validated."""
    cfg = compose(group_overrides(group, name, settings), run_names=True)
    return build(cfg, group)


def compose_method(overrides: list[str]):
    """(the built method, the model config) for ``overrides`` such as ``["method=lychee", "method.x=1"]``."""
    cfg = compose(overrides, run_names=True)
    return build(cfg, "method"), cfg.model
