"""Declared settings (``luka_bench.methods.base.setting``): every constraint declared beside a field of a method that
``conf/method/*.yaml`` builds refuses a bad value with a one-line ``MethodConfigError`` naming
``method.<field>=<value>`` — so a new method's constraints are tested the moment they are declared."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from luka_bench.config import build_group
from luka_bench.methods.base import Allowed, KVMethod, MethodConfigError, declared_settings, setting
from luka_bench.methods.layered import Layered

CONFIGS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "method").glob("*.yaml"))
NEEDS = {"duo_attention": {"pattern_seed": 0}}  # a config that names no pattern: a run must give one


def bad_values(allowed: Allowed, kind: str) -> list:
    """Values ``allowed`` refuses: past each bound, of the wrong type."""
    if allowed.holds_every_token:
        return [0.5]
    if kind == "bool":
        return ["yes", 1]
    if kind == "str":
        return ["no-such-choice"] if allowed.choices else []
    bad: list = ["x", True] + ([1.5] if kind == "int" else [])
    if allowed.choices is not None:
        return bad + [max(allowed.choices) + 1, min(allowed.choices) - 1]
    if allowed.within is not None:
        lo, hi = (float(x) for x in allowed.within[1:-1].split(","))
        bad += [lo if allowed.within[0] == "(" else lo - 1, hi if allowed.within[-1] == ")" else hi + 1]
    if allowed.above is not None:
        bad.append(allowed.above)
    if allowed.at_least is not None:
        bad.append(allowed.at_least - 1)
    return bad


def refusals(obj, path: str, rebuild) -> None:
    """Every declared constraint of ``obj`` refuses its bad values (``rebuild(**changes)``: the method with changed
    settings), each in one line naming ``<path><field>=<value!r>``."""
    for f, allowed, kind, _ in declared_settings(type(obj)):
        if allowed.nested is not None:
            inner = getattr(obj, f.name)
            refusals(inner, f"{path}{f.name}.",
                     lambda _f=f, _inner=inner, **ch: rebuild(**{_f.name: dataclasses.replace(_inner, **ch)}))
            continue
        bads = bad_values(allowed, kind)
        assert bads, f"{path}{f.name}: declared, but with nothing this test can refuse"
        for bad in bads:
            with pytest.raises(MethodConfigError) as e:
                rebuild(**{f.name: bad})
            msg = str(e.value)
            assert "\n" not in msg and f"{path}{f.name}={bad!r}" in msg, (path, f.name, bad, msg)


def methods_in(m: KVMethod) -> list[KVMethod]:
    """``m`` and, for a layered config, each rule's method and the default."""
    return [m] + ([r for _, r in m.rules] + [m.default] if isinstance(m, Layered) else [])


@pytest.mark.parametrize("name", CONFIGS)
def test_every_declared_constraint_refuses_a_bad_value_in_one_line(name):
    for m in methods_in(build_group("method", name, **NEEDS.get(name, {}))):
        refusals(m, "method.", lambda _m=m, **ch: dataclasses.replace(_m, **ch))


def test_the_messages_shapes():
    @dataclasses.dataclass
    class Toy(KVMethod):
        window: int = setting(64, at_least=1, note="reference: 32-64")
        rate: float = setting(0.5, within="(0, 1]")
        floor: float | None = setting(None, at_least=1)
        temperature: float = setting(1.0, above=0)
        levels: int = setting(1, choices=(1, 2, 3))
        pooling: str = setting("avg", choices=("avg", "max"))
        aware: bool = setting(False)

    @dataclasses.dataclass
    class Later(Toy):  # a redeclared default keeps its constraint
        window: int = 32

    cases = {
        "window": (0, "method.window=0 must be an integer >= 1 (reference: 32-64)"),
        "rate": (0, "method.rate=0 must be in (0, 1]"),
        "floor": (0.5, "method.floor=0.5 must be null or >= 1"),
        "temperature": (0, "method.temperature=0 must be > 0"),
        "levels": (4, "method.levels=4 must be 1, 2 or 3"),
        "pooling": ("min", "method.pooling='min' is unknown; allowed: avg, max"),
        "aware": ("yes", "method.aware='yes' must be true or false"),
    }
    for cls in (Toy, Later):
        for key, (bad, message) in cases.items():
            with pytest.raises(MethodConfigError) as e:
                cls(**{key: bad})
            assert str(e.value) == message
    t = Later(rate=1, floor=None)
    assert t.window == 32 and type(t.rate) is float and t.floor is None  # floats stored as floats; null allowed
    with pytest.raises(MethodConfigError, match=r"^method\.window=True must be an integer >= 1"):
        Later(window=True)  # a bool is not an integer
