"""KV methods: one per file, built from ``conf/method/*.yaml`` by Hydra (``_target_``). See ``base.py`` (the interface) and ``docs/internals.md`` (where each part lives)."""
