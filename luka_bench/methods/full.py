"""Full attention: every token kept, exact attention. The reference every other method is compared with."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from luka_bench.methods.base import KVMethod, MethodConfigError


@dataclass
class Full(KVMethod):
    """Exact attention over the whole cache (SDPA, grouped KV heads). ``budget`` must be 1.0."""

    name: ClassVar[str] = "full"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget != 1.0:
            raise MethodConfigError(f"method.budget={self.budget:g} is not allowed for 'full': it keeps every "
                                    "token (allowed: 1.0); pick an evicting method, e.g. method=streaming_llm")
