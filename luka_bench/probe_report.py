"""The fidelity probe's report: its command line (``python -m luka_bench.probe``, which runs ``main`` here), the
methods it compares (``probe.methods``), its tables and its plots. What it measures is ``luka_bench.probe``.

Outputs in the run folder: ``probe_steps.csv`` (one row per example, continuation, step, layer, KV head),
``probe_layers.csv`` (means per method, layer, head), ``probe_summary.{csv,md}`` (per method: means over
layers and heads with the standard error over examples) and ``probe_by_layer.png``.
"""
from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import torch

from luka_bench.probe import METRICS, NEEDLE, Observer, capture, closed_loop, prompts, replay


def method_entries(spec) -> list[str]:
    """``probe.methods`` as a list of entries "name [key=value ...]"."""
    from luka_bench.errors import group_options

    if spec is None:
        return []
    if isinstance(spec, str):
        return group_options("method") if spec == "all" else [spec]
    return [str(s) for s in spec]


def compose_method(entry: str, base_overrides: list[str]):
    """Compose ``conf/method/<name>.yaml`` with the entry's own settings on top of the command line's."""
    from hydra import compose
    from hydra.utils import instantiate

    from luka_bench.errors import check_group_overrides

    name, *settings = shlex.split(entry)
    msg = check_group_overrides([f"method={name}"])
    if msg:
        from luka_bench.methods.base import MethodConfigError

        raise MethodConfigError(msg)
    keep = [o for o in base_overrides if not o.lstrip("+~").startswith(("method=", "method.", "probe.", "hydra"))]
    cfg = compose(config_name="config", overrides=keep + [f"method={name}"] +
                  [s if s.startswith("method.") else f"method.{s}" for s in settings])
    return instantiate(cfg.method)


def frame(obs: Observer, label: str):
    import pandas as pd

    if not obs.rows:
        return pd.DataFrame()
    rows = torch.stack(obs.rows)  # [R, Hkv, 2 + M]
    tags = obs.tags
    hkv = rows.shape[1]
    flat = rows.reshape(-1, rows.shape[-1]).numpy()
    df = pd.DataFrame(flat, columns=["layer", "head", *METRICS])
    df["layer"] = df["layer"].astype(int)
    df["head"] = df["head"].astype(int)
    for i, name in enumerate(("example", "continuation", "step")):
        df[name] = [t[i] for t in tags for _ in range(hkv)]
    df.insert(0, "method", label)
    return df


def summarise(df):
    """Per method: means over steps, layers and heads per example, then mean and standard error over examples.
    ``tokens`` and ``bytes`` are summed over layers and heads (one decode step of the whole model)."""
    import pandas as pd

    per_step = df.groupby(["method", "example", "continuation", "step"], sort=False).agg(
        rel_err=("rel_err", "mean"), recall=("recall", "mean"), mass=("mass", "mean"),
        tokens=("tokens", "sum"), bytes=("bytes", "sum"), held=("held", "mean"),
        rel_err_max=("rel_err", "max"), **{c: (c, "mean") for c in NEEDLE})
    per_ex = per_step.groupby(["method", "example"], sort=False).mean()
    g = per_ex.groupby("method", sort=False)
    mean, n = g.mean(), g.size()
    se = g.std(ddof=1).div(g.count().pow(0.5), axis=0).fillna(0.0)  # per column: NaN (no needle) items left out
    out = pd.DataFrame(index=mean.index)
    for c in mean.columns:
        out[c] = mean[c]
        out[f"{c}_se"] = se[c]
    out["n_examples"] = n
    return out


def summary_markdown(summary, topk: int) -> str:
    def pm(c, fmt):
        return [f"{m:{fmt}} ± {s:{fmt}}" for m, s in zip(summary[c], summary[f"{c}_se"])]

    cols = {"rel. L2 error": pm("rel_err", ".4f"), "max layer error": pm("rel_err_max", ".3f"),
            f"recall@{topk}": pm("recall", ".3f"), "mass": pm("mass", ".3f"),
            "tokens read / step": [f"{x:,.0f}" for x in summary["tokens"]],
            "KiB read / step": [f"{x / 1024:,.0f}" for x in summary["bytes"]],
            "held / seen": [f"{x:.3f}" for x in summary["held"]]}
    if "needle_recall" in summary and summary["needle_recall"].notna().any():
        cols.update({"needle read": pm("needle_recall", ".3f"), "needle mass": pm("needle_mass", ".3f"),
                     "needle mass read": pm("needle_mass_read", ".3f")})
    cols["n"] = [str(int(x)) for x in summary["n_examples"]]
    head = "| method | " + " | ".join(cols) + " |"
    sep = "|:--|" + "--:|" * len(cols)
    body = [f"| {m} | " + " | ".join(cols[c][i] for c in cols) + " |" for i, m in enumerate(summary.index)]
    return "\n".join([head, sep, *body])


def _plot_by_layer(layers, path: Path, panels: dict[str, str], suptitle: str | None = None) -> None:
    """One panel per metric (``panels``: column -> title), one line per method: means over KV heads, steps and
    prompts by layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels) + (1 if len(panels) < 3 else 0), 4))
    by_layer = layers.groupby(["method", "layer"], sort=False)[list(panels)].mean().reset_index()
    for ax, (metric, title) in zip(axes, panels.items()):
        for m, d in by_layer.groupby("method", sort=False):
            ax.plot(d["layer"], d[metric], marker="o", ms=3, label=m)
        ax.set_xlabel("layer")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if suptitle:
        fig.suptitle(suptitle, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(layers, path: Path) -> None:
    _plot_by_layer(layers, path, {"rel_err": "relative L2 error of the attention output",
                                  "recall": "recall of the true top-k", "mass": "exact attention mass attended"})


def plot_needle(layers, path: Path, mode: str) -> None:
    """Needle recall (share of the needle's tokens read) and the exact attention mass on the needle tokens read,
    by layer, one line per method."""
    _plot_by_layer(layers, path, {"needle_recall": "needle recall: share of its tokens read",
                                  "needle_mass_read": "exact attention mass on needle tokens read"}, mode)


def write_tables(frames, seconds, cpu, out_dir: Path, topk: int, plot_it: bool, closed: bool, what: str):
    import pandas as pd

    df = pd.concat(frames, ignore_index=True)
    df.to_csv(out_dir / "probe_steps.csv", index=False)
    layers = df.groupby(["method", "layer", "head"], sort=False)[list(METRICS)].mean().reset_index()
    layers.to_csv(out_dir / "probe_layers.csv", index=False)
    summary = summarise(df)
    summary["seconds"] = pd.Series(seconds)
    summary["cpu_seconds"] = pd.Series(cpu)
    summary.to_csv(out_dir / "probe_summary.csv")
    mode = "closed loop (generation with the method)" if closed else "open loop (replay of full-attention Q/K/V)"
    md = f"{summary_markdown(summary, topk)}\n\n{mode}; {what}; mean ± standard error over prompts\n"
    (out_dir / "probe_summary.md").write_text(md, encoding="utf-8")
    if plot_it:
        plot(layers, out_dir / "probe_by_layer.png")
        if layers["needle_recall"].notna().any():
            plot_needle(layers, out_dir / "probe_needle_by_layer.png", mode)
    return md, summary


def probe(cfg, out_dir: str | Path, overrides: list[str] | None = None):
    """The probe command: capture (or load) every prompt, run every method, write and print the tables."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    p = cfg.probe
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(int(cfg.seed))
    entries = method_entries(p.methods) or [cfg.get("method_name") or "method"]
    methods = []
    for e in entries:
        if p.methods is None:
            methods.append((e, instantiate(cfg.method)))
        else:
            methods.append((e, compose_method(e, overrides or [])))
    steps, topk = int(p.steps), int(p.topk)
    if steps < 1 or topk < 1:
        from luka_bench.methods.base import MethodConfigError

        raise MethodConfigError(f"probe.steps={steps} and probe.topk={topk} must be integers >= 1")
    task = instantiate(cfg.data)
    lm = instantiate(cfg.model).load()
    for _, method in methods:  # methods that read token strings (LycheeCluster) need the tokenizer
        method.bind(lm.tokenizer)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    todo = prompts(lm, task, steps, int(p.questions))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    frames, seconds, cpu = [], {}, {}
    caps = None
    if not p.closed_loop:
        t0, c0 = time.perf_counter(), time.process_time()
        caps = [capture(lm, pr, p.cache_dir, model_cfg) for pr in todo]
        print(f"captured {len(caps)} prompt(s) ({', '.join(str(c.context) for c in caps)} context tokens) "
              f"in {time.perf_counter() - t0:.1f}s ({time.process_time() - c0:.1f}s CPU)", file=sys.stderr)
    for label, method in methods:
        t0, c0 = time.perf_counter(), time.process_time()
        for e, pr in enumerate(todo):
            obs = closed_loop(lm, method, pr, topk, (e,)) if p.closed_loop else replay(method, caps[e], topk, (e,), pr.needle)
            frames.append(frame(obs, label))
        seconds[label], cpu[label] = time.perf_counter() - t0, time.process_time() - c0
        print(f"{label}: {seconds[label]:.1f}s ({cpu[label]:.1f}s CPU)", file=sys.stderr)
        md, summary = write_tables(frames, seconds, cpu, out_dir, topk, bool(p.plot), p.closed_loop,
                          f"model {cfg.get('model_name')}, data {cfg.get('data_name')}, {len(todo)} prompt(s), "
                          f"{steps} decode steps each")  # after every method: a long probe shows what it has
    print(md)
    print(f"-> {out_dir}")
    return summary


def main() -> None:
    from luka_bench.errors import CONF_DIR, GROUPS, check_group_overrides
    from luka_bench.errors import one_line_errors, unwrap

    msg = check_group_overrides(sys.argv[1:])
    if msg:
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)

    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, open_dict

    from luka_bench.config import register_resolvers

    register_resolvers()

    @hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="probe")
    def _app(cfg: DictConfig):
        hc = HydraConfig.get()
        with open_dict(cfg):
            for g in GROUPS:
                cfg[f"{g}_name"] = hc.runtime.choices.get(g)
        try:
            probe(cfg, hc.runtime.output_dir, list(hc.overrides.task))
        except Exception as e:  # noqa: BLE001 - known bad input as one line, the rest re-raised
            inner = unwrap(e)
            if isinstance(inner, one_line_errors()):
                print(f"error: {inner}", file=sys.stderr)
                sys.exit(2)
            raise

    _app()
