"""Defaults a card or a config calls "paper" (or the reference code's) are the paper's values: read from the real
composed configs (conf/method/*.yaml) and from the method classes' own defaults, so a silent change fails here.
Values: /work/shared/reference.md and the papers (LuKA §3-4; LycheeCluster App. A-B, eq. 2; LASER-KV Eq. 1,
§4.2; StreamingLLM; H2O; SnapKV reference code and kvpress's SnapKVPress)."""
from __future__ import annotations

import re

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import CONF, compose

# method config -> {dotted key: (paper value, source)}
PAPER = {
    "lychee": {
        "token_budget": (1024, "App. A: token budget 1024"),
        "sink": (16, "App. A: 16 sink tokens"),
        "buffer": (128, "App. A: buffer of 128 tokens"),
        "min_chunk": (8, "App. A: chunks of 8-16 tokens"),
        "max_chunk": (16, "App. A"),
        "pooling": ("mean", "§5 / Table 3: mean pooling (max is the ablation)"),
        "cluster_size": (2, "App. A/E: ~2 chunks per fine cluster"),
        "max_coarse": (64, "App. A: coarse units <= 64"),
        "kmeans_iters": (10, "App. A: spherical k-means, 10 iterations"),
        "full_layers": (2, "App. A: first 2 layers full"),
        "ranking": ("ub", "eq. 2: UB = q.mu + |q| r"),
        "chunking": ("structure", "§4.1: structure-aware chunking"),
    },
    "luka_clustered": {
        "page_size": (16, "LuKA: fixed pages of 16 tokens"),
        "tail": (128, "LuKA: the most recent >= 128 tokens stay raw"),
        "sink": (0, "LuKA: no raw sink"),
        "compress_every": (16, "LuKA: segment/compress every 16 decode steps"),
        "refine.rule": ("top_k", "LuKA Table 1 / Fig. 3: top-k refinement"),
        "refine.k": (3, "LuKA: k = 3"),
        "levels": (1, "LuKA: one summary level in the experiments"),
    },
    "luka_lined": {
        "budget": (0.125, "LuKA: heavy hitters ~1/8 of the prompt"),
        "min_recent": (128, "LuKA: raw tail of at least 128 tokens"),
        "decay": (None, "LuKA: accumulated without decay (reference code's 0.99 is not the paper's)"),
        "recent_budget": ("on_top", "LuKA: 1/8 heavy hitters plus the tail"),
    },
    "luka_mixed": {
        "rules.0.layers": ("first:8/36,last:8/36", "LuKA §3.3: first 8 and last 8 of 36 layers lined"),
        "rules.0.method.min_recent": (128, "lined: tail >= 128"),
        "rules.0.method.decay": (None, "lined: no decay"),
        "rules.0.method.recent_budget": ("on_top", "lined: 1/8 heavy hitters plus the tail"),
        "budget": (0.125, "lined: 1/8"),
        "default.page_size": (16, "clustered: pages of 16"),
        "default.tail": (128, "clustered: tail 128"),
        "default.compress_every": (16, "clustered: every 16 steps"),
        "default.refine.k": (3, "clustered: top-3"),
    },
    "laser_kv": {
        "budget": (0.25, "LASER-KV: r = 0.25"),
        "block_size": (4096, "LASER-KV: S = 4096"),
        "divisor": (4, "LASER-KV: protection divisor n = 4"),
        "alpha": (0.75, "LASER-KV §4.2: Exact(0.75) + MagicPIG(0.25)"),
    },
    "snapkv": {
        "window": (64, "SnapKV reference code / kvpress SnapKVPress: window 64"),
        "kernel": (5, "kvpress SnapKVPress: kernel 5"),
        "pooling": ("avg", "SnapKV reference code / kvpress: average pooling"),
    },
    "pyramidkv": {
        "window": (64, "KVCache-Factory PyramidKVCluster / kvpress PyramidKVPress: window 64"),
        "kernel": (5, "PyramidKVCluster: kernel 5"),
        "pooling": ("avg", "PyramidKVCluster: avgpool"),
        "beta": (20, "PyramidKV: beta 20"),
        "budget_rule": ("paper", "KVCache-Factory's integer pyramid and fallbacks"),
    },
    "adakv": {
        "window": (32, "AdaKV experiments/LongBench/pred.py: window 32"),
        "kernel": (7, "AdaKV experiments: kernel 7"),
        "pooling": ("max", "AdaKV experiments: maxpool"),
        "alpha": (0.2, "AdaKV experiments: floor_alpha 0.2"),
        "rule": ("paper", "AdaptiveSnapKVCluster: round((1 - alpha) n_h + alpha B')"),
    },
    "streaming_llm": {"sink": (4, "StreamingLLM: 4 attention sinks")},
    "h2o": {
        "recent_fraction": (0.5, "H2O: half heavy hitters, half recent"),
        "decay": (None, "H2O: accumulated without decay"),
    },
}


def get(node, dotted: str):
    for part in dotted.split("."):
        node = node[int(part)] if part.isdigit() else node[part]
    return node


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_defaults_in_the_configs_and_the_classes(name):
    cfg = compose(f"method={name}").method
    for key, (value, source) in PAPER[name].items():
        got = get(OmegaConf.to_container(cfg, resolve=True), key)
        assert got == value, f"conf/method/{name}.yaml {key} = {got!r}; paper: {value!r} ({source})"
    # the class behind the config, built with its own defaults, agrees too (tests build methods from the class,
    # users from the config); luka_lined / luka_mixed are configs over h2o / layered, whose class defaults differ
    if name in CLASS_DEFAULTS_ARE_PAPER:
        built = type(instantiate(cfg))()
        for key, (value, source) in PAPER[name].items():
            node = built
            for part in key.split("."):
                node = getattr(node, part)
            assert node == value, f"{type(built).__name__}().{key} = {node!r}; paper: {value!r} ({source})"


CLASS_DEFAULTS_ARE_PAPER = ("lychee", "luka_clustered", "laser_kv", "snapkv", "streaming_llm", "h2o", "pyramidkv",
                            "adakv")


def yaml_paper_claims(path) -> list[str]:
    """Dotted keys of a config whose line comment cites the paper ("paper"), nesting by indentation."""
    stack: list[tuple[int, str]] = []
    out = []
    for line in path.read_text().splitlines():
        m = re.match(r"^(\s*)(- )?([A-Za-z_][\w]*):(.*)$", line)
        if not m:
            continue
        indent = len(m.group(1)) + (2 if m.group(2) else 0)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if m.group(2):  # a list item: its index is not tracked beyond the first (rules.0)
            stack.append((indent - 1, "0"))
        key = ".".join([k for _, k in stack] + [m.group(3)])
        comment = m.group(4).split("#", 1)[1] if "#" in m.group(4) else ""
        if re.search(r"\bpaper\b", comment, re.I) and "not the paper" not in comment.lower():
            out.append(key)
        stack.append((indent, m.group(3)))
    return out


def test_every_paper_claim_in_a_config_is_checked():
    """A config line whose comment says "paper" must have its value in the table above: new claims get tested."""
    missing = []
    for path in sorted((CONF / "method").glob("*.yaml")):
        for key in yaml_paper_claims(path):
            if key not in PAPER.get(path.stem, {}):
                missing.append(f"{path.stem}: {key}")
    assert not missing, f"paper defaults without a check in PAPER: {missing}"
