"""KV methods: one per file, built from ``conf/method/*.yaml`` by Hydra (``_target_``). See ``base.py``."""
