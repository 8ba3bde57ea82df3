"""Can the Hugging Face hub be reached? Found out once per process by opening one TCP connection (a few seconds
at most), before a run writes anything: without this, transformers and datasets retry for 60-90 s and print
dozens of warnings before failing. A hub model or dataset that is neither a local folder nor in the local hub
cache, on a machine whose hub cannot be reached, is then one line (``error: ...``, exit 2) and no run folder.

A cached one is loaded from the cache without asking the hub (``HubModel``: ``local_files_only``; datasets:
``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` set for this process before ``datasets`` is imported).
"""
from __future__ import annotations

import os
from pathlib import Path

# Seconds a connection to the hub may take before it counts as unreachable.
REACH_TIMEOUT_S = 3.0
_problems: dict[str, str | None] = {}  # endpoint -> why it cannot be reached (None: it can), this process


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _offline_env() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))


def server_problem(url: str, timeout: float = REACH_TIMEOUT_S) -> str | None:
    """Why the server at ``url`` (the hub, a W&B server) cannot be reached (a TCP connection within ``timeout``
    seconds), else None. Only a connection is opened: nothing is sent."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    if not u.hostname:
        return f"{url!r} has no host"
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        with socket.create_connection((u.hostname, port), timeout=timeout):
            return None
    except OSError as e:
        return f"unreachable at {u.hostname}:{port} ({type(e).__name__}{': ' + e.strerror if e.strerror else ''})"


def hub_problem(timeout: float = REACH_TIMEOUT_S) -> str | None:
    """Why the hub cannot be used here (offline mode set, or no connection within ``timeout`` s), else None."""
    if _offline_env():
        return "switched off (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE / HF_DATASETS_OFFLINE)"
    url = endpoint()
    if url not in _problems:
        _problems[url] = server_problem(url, timeout)
    return _problems[url]


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def is_cached(repo_id: str, repo_type: str = "model") -> bool:
    """True when ``repo_id`` has a folder in the local hub cache (``models--org--name``, ``datasets--...``)."""
    return (cache_dir() / f"{repo_type}s--{repo_id.replace('/', '--')}").is_dir()


def unavailable(repo_id: str, repo_type: str = "model") -> str | None:
    """Why ``repo_id`` cannot be had on this machine, else None. A local folder or a cached repo can; a cached
    repo on a machine without the hub is then read from the cache only (for datasets: the environment switch,
    which ``datasets`` reads when it is imported)."""
    if Path(os.path.expanduser(repo_id)).is_dir():
        return None
    why = hub_problem()
    if why is None:
        return None
    if is_cached(repo_id, repo_type):
        if repo_type == "dataset":
            os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return None
    return f"the hub ({endpoint()}) is {why}, and {repo_id} is not in the local cache ({cache_dir()})"
