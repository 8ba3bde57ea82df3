"""Hydra composition for the scripts: ``conf/config.yaml`` with overrides, outside a Hydra app."""
from __future__ import annotations

from pathlib import Path

CONF = Path(__file__).resolve().parent.parent / "conf"


def compose(overrides: list[str], run_names: bool = False):
    """The composed config. ``run_names``: also set ``model_name``/``method_name``/``data_name`` from the group
    choices (as ``python -m luka_bench`` does) and drop Hydra's own keys, so the result can go to ``run.run``."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from omegaconf import open_dict

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = hcompose(config_name="config", overrides=overrides, return_hydra_config=run_names)
    if run_names:
        choices = cfg.hydra.runtime.choices
        with open_dict(cfg):
            for g in ("model", "method", "data"):
                cfg[f"{g}_name"] = choices[g]
            del cfg["hydra"]
            cfg.pop("sweep_name", None)
    return cfg


def compose_method(overrides: list[str]):
    """(the instantiated method, the model config) for ``overrides`` such as ``["method=lychee", "method.x=1"]``."""
    from hydra.utils import instantiate

    cfg = compose(overrides)
    return instantiate(cfg.method), cfg.model
