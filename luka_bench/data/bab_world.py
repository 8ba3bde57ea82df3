"""A bAbI-style world simulator: the offline source of BABILong stories (tasks qa1-qa10).

People move between locations, pick up, drop and hand over objects; a story is the list of fact sentences the
simulation emits, followed by one question about the final state whose answer follows from one or more of
those facts. The tasks follow the spirit of the bAbI tasks (Weston et al., 2015) that BABILong wraps:

=====  ==========================  ===========================================  =============================
task   bAbI name                   question                                     answers
=====  ==========================  ===========================================  =============================
qa1    single supporting fact      Where is Mary?                               a location
qa2    two supporting facts        Where is the football?                       a location
qa3    three supporting facts      Where was the football before the kitchen?   a location
qa4    two-argument relations      What is north of the kitchen? /              a location
                                   What is the kitchen north of?
qa5    three-argument relations    Who gave the apple to Fred? / Who did Fred   a person or an object
                                   give the apple to? / What did Fred give to
                                   Bill? / Who gave the apple? / Who received
                                   the apple?
qa6    yes/no questions            Is Mary in the garden?                       yes / no
qa7    counting                    How many objects is Mary carrying?           none / one / two / three
qa8    lists / sets                What is Mary carrying?                       nothing / apple / apple,milk
qa9    simple negation             Is Mary in the garden?                       yes / no
qa10   indefinite knowledge        Is Bill in the school?                       yes / no / maybe
=====  ==========================  ===========================================  =============================

Names, locations and objects are those of bAbI (and therefore of the official BABILong label sets), so the
official scorer applies unchanged.

World rules (checked by the simulator, so every story is consistent):
- a person's location is unknown until their first move; a person never "moves" to where they already are;
- ``take``: the taker's location is known, nobody holds the object, and the object is either not yet placed
  anywhere or lies at the taker's location ("... got the milk there."); the object is then at that location;
- ``drop``: only the holder drops, and the object stays at the holder's location;
- ``give``: only the holder gives, to another person at the same (known) location;
- an object that is held moves with its holder.

Two independent implementations answer every question: the simulator (which knows the events) and
:func:`replay`, which parses the rendered fact sentences back and re-derives the answer from text alone. The tests
check that they agree for hundreds of seeds.

``generate_story(task, rng)`` is a pure function of the task and the state of ``rng``.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "TASKS", "TASK_NAMES", "Story", "generate_story", "replay", "COUNT_WORDS",
]

TASK_NAMES: dict[str, str] = {
    "qa1": "single-supporting-fact",
    "qa2": "two-supporting-facts",
    "qa3": "three-supporting-facts",
    "qa4": "two-arg-relations",
    "qa5": "three-arg-relations",
    "qa6": "yes-no-questions",
    "qa7": "counting",
    "qa8": "lists-sets",
    "qa9": "simple-negation",
    "qa10": "indefinite-knowledge",
}
TASKS: tuple[str, ...] = tuple(TASK_NAMES)

PEOPLE = ("Mary", "John", "Daniel", "Sandra")
PEOPLE_QA5 = ("Bill", "Fred", "Jeff", "Mary")
PEOPLE_QA10 = ("Bill", "Fred", "Julie", "Mary")
ROOMS = ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office")
PLACES_QA10 = ("school", "park", "office", "kitchen", "cinema", "bedroom")
OBJECTS = ("apple", "football", "milk")
DIRECTIONS = {"north": (0, 1), "south": (0, -1), "east": (1, 0), "west": (-1, 0)}
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}
COUNT_WORDS = ("none", "one", "two", "three")

MOVE_VERBS = ("moved to", "went to", "journeyed to", "travelled to", "went back to")
TAKE_VERBS = ("picked up", "got", "grabbed", "took")
DROP_VERBS = ("dropped", "put down", "discarded", "left")
GIVE_VERBS = ("gave", "handed", "passed")

# number of facts before the question (inclusive ranges); bAbI stories are of this order
N_FACTS: dict[str, tuple[int, int]] = {
    "qa1": (2, 10), "qa2": (4, 14), "qa3": (6, 18), "qa4": (2, 2), "qa5": (4, 14),
    "qa6": (2, 10), "qa7": (3, 12), "qa8": (3, 12), "qa9": (2, 10), "qa10": (2, 10),
}


@dataclass
class Story:
    """One bAbI sample: facts in order, one question, its answer, and which facts support the answer."""

    task: str
    facts: list[str]
    question: str
    answer: str
    supporting: list[int]  # indices into ``facts``, increasing
    meta: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------
# the simulator
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Event:
    kind: str  # move | take | drop | give
    person: str
    arg: str  # location (move) or object
    to: str | None = None  # receiver (give)


class _World:
    """State + the rules above. ``apply`` appends the event and its rendered sentence."""

    def __init__(self, rng: random.Random, people, places, objects):
        self.rng = rng
        self.people = tuple(people)
        self.places = tuple(places)
        self.objects = tuple(objects)
        self.loc: dict[str, str | None] = {p: None for p in self.people}
        self.holder: dict[str, str | None] = {o: None for o in self.objects}
        self.obj_loc: dict[str, str | None] = {o: None for o in self.objects}
        self.events: list[_Event] = []
        self.facts: list[str] = []

    def held_by(self, p: str) -> list[str]:
        return [o for o in self.objects if self.holder[o] == p]

    def options(self, kinds: tuple[str, ...]) -> list[_Event]:
        out: list[_Event] = []
        for p in self.people:
            here = self.loc[p]
            if "move" in kinds:
                out += [_Event("move", p, pl) for pl in self.places if pl != here]
            if here is None:
                continue
            for o in self.objects:
                if "take" in kinds and self.holder[o] is None and self.obj_loc[o] in (None, here):
                    out.append(_Event("take", p, o))
                if self.holder[o] == p:
                    if "drop" in kinds:
                        out.append(_Event("drop", p, o))
                    if "give" in kinds:
                        out += [_Event("give", p, o, q) for q in self.people if q != p and self.loc[q] == here]
        return out

    def step(self, weights: dict[str, float]) -> None:
        kinds = tuple(k for k, w in weights.items() if w > 0)
        opts = self.options(kinds)
        by_kind: dict[str, list[_Event]] = {}
        for e in opts:
            by_kind.setdefault(e.kind, []).append(e)
        ks = sorted(by_kind, key=kinds.index)
        kind = self.rng.choices(ks, weights=[weights[k] for k in ks])[0]
        self.apply(self.rng.choice(by_kind[kind]))

    def apply(self, e: _Event) -> None:
        rng = self.rng
        if e.kind == "move":
            assert e.arg != self.loc[e.person]
            self.loc[e.person] = e.arg
            for o in self.held_by(e.person):
                self.obj_loc[o] = e.arg
            s = f"{e.person} {rng.choice(MOVE_VERBS)} the {e.arg}."
        elif e.kind == "take":
            assert self.holder[e.arg] is None and self.loc[e.person] is not None
            self.holder[e.arg] = e.person
            self.obj_loc[e.arg] = self.loc[e.person]
            s = f"{e.person} {rng.choice(TAKE_VERBS)} the {e.arg} there."
        elif e.kind == "drop":
            assert self.holder[e.arg] == e.person
            self.holder[e.arg] = None
            s = f"{e.person} {rng.choice(DROP_VERBS)} the {e.arg} there."
        elif e.kind == "give":
            assert self.holder[e.arg] == e.person and e.to is not None
            assert self.loc[e.to] == self.loc[e.person] is not None
            self.holder[e.arg] = e.to
            s = f"{e.person} {rng.choice(GIVE_VERBS)} the {e.arg} to {e.to}."
        else:  # pragma: no cover
            raise ValueError(e.kind)
        self.events.append(e)
        self.facts.append(s)

    # -- history queries (used for supporting facts) -----------------------------------------------------
    def last(self, pred, before: int | None = None) -> int | None:
        end = len(self.events) if before is None else before
        for i in range(end - 1, -1, -1):
            if pred(self.events[i]):
                return i
        return None


def _last_move(w: _World, p: str, before: int | None = None) -> int | None:
    return w.last(lambda e: e.kind == "move" and e.person == p, before)


def _n_facts(task: str, rng: random.Random) -> int:
    lo, hi = N_FACTS[task]
    return rng.randint(lo, hi)


def _simulate(rng: random.Random, task: str, people, places, objects, weights, n: int,
              first_moves: bool = False) -> _World:
    w = _World(rng, people, places, objects)
    if first_moves:
        order = list(w.people)
        rng.shuffle(order)
        for p in order[: min(len(order), max(1, n // 3))]:
            w.apply(_Event("move", p, rng.choice(w.places)))
    while len(w.events) < n:
        w.step(weights)
    return w


# ---------------------------------------------------------------------------------------------------------------
# task generators: each returns a Story or None (then the caller draws again)
# ---------------------------------------------------------------------------------------------------------------


def _story(task: str, w: _World, question: str, answer: str, supporting, **meta) -> Story:
    sup = sorted({int(i) for i in supporting if i is not None})
    return Story(task, list(w.facts), question, answer, sup, meta)


def _gen_qa1(rng: random.Random) -> Story | None:
    w = _simulate(rng, "qa1", PEOPLE, ROOMS, (), {"move": 1.0}, _n_facts("qa1", rng))
    moved = [p for p in PEOPLE if w.loc[p] is not None]
    p = rng.choice(moved)
    return _story("qa1", w, f"Where is {p}?", str(w.loc[p]), [_last_move(w, p)])


def _gen_qa6(rng: random.Random) -> Story | None:
    w = _simulate(rng, "qa6", PEOPLE, ROOMS, (), {"move": 1.0}, _n_facts("qa6", rng))
    moved = [p for p in PEOPLE if w.loc[p] is not None]
    p = rng.choice(moved)
    if rng.random() < 0.5:
        place, answer = w.loc[p], "yes"
    else:
        place, answer = rng.choice([r for r in ROOMS if r != w.loc[p]]), "no"
    return _story("qa6", w, f"Is {p} in the {place}?", answer, [_last_move(w, p)])


_OBJ_WEIGHTS = {"move": 0.5, "take": 0.3, "drop": 0.2}


def _gen_qa2(rng: random.Random) -> Story | None:
    w = _simulate(rng, "qa2", PEOPLE, ROOMS, OBJECTS, _OBJ_WEIGHTS, _n_facts("qa2", rng), first_moves=True)
    placed = [o for o in OBJECTS if w.obj_loc[o] is not None]
    if not placed:
        return None
    o = rng.choice(placed)
    h = w.holder[o]
    if h is not None:  # held: the take and the holder's last move
        take = w.last(lambda e: e.kind == "take" and e.arg == o)
        sup = [take, _last_move(w, h)]
    else:  # lying somewhere: the drop and where the dropper was then (or the take, if never carried away)
        drop = w.last(lambda e: e.kind == "drop" and e.arg == o)
        dropper = w.events[drop].person
        sup = [drop, _last_move(w, dropper, drop)]
    return _story("qa2", w, f"Where is the {o}?", str(w.obj_loc[o]), sup)


def _object_history(w: _World, o: str) -> list[tuple[str, list[int]]]:
    """Locations the object occupied, in order (consecutive repeats merged), each with the facts that put it
    there: a take at the taker's location -> (the taker's last move, the take); a move of its holder -> (the
    take that made them the holder, the move)."""
    hist: list[tuple[str, list[int]]] = []
    holder: str | None = None
    take_idx: int | None = None
    where: dict[str, tuple[str, int]] = {}
    for i, e in enumerate(w.events):
        if e.kind == "move":
            where[e.person] = (e.arg, i)
            if holder == e.person and e.arg != (hist[-1][0] if hist else None):
                hist.append((e.arg, [take_idx, i]))
        elif e.kind == "take" and e.arg == o:
            holder, take_idx = e.person, i
            loc, mi = where[e.person]
            if not hist or hist[-1][0] != loc:
                hist.append((loc, [mi, i]))
        elif e.kind == "drop" and e.arg == o:
            holder = None
        elif e.kind == "give" and e.arg == o:  # pragma: no cover - qa3 worlds have no give
            holder, take_idx = e.to, i
    return hist


def _gen_qa3(rng: random.Random) -> Story | None:
    weights = {"move": 0.55, "take": 0.3, "drop": 0.15}
    w = _simulate(rng, "qa3", PEOPLE, ROOMS, OBJECTS, weights, _n_facts("qa3", rng), first_moves=True)
    cands = []
    for o in OBJECTS:
        hist = _object_history(w, o)
        locs = [h[0] for h in hist]
        for i in range(1, len(hist)):
            if locs.count(locs[i]) == 1:
                cands.append((o, hist, i))
    if not cands:
        return None
    o, hist, i = rng.choice(cands)
    sup = hist[i][1] + hist[i - 1][1]
    return _story("qa3", w, f"Where was the {o} before the {hist[i][0]}?", hist[i - 1][0], sup)


def _gen_qa4(rng: random.Random) -> Story | None:
    n = _n_facts("qa4", rng)
    rooms = list(ROOMS)
    rng.shuffle(rooms)
    pos = {rooms[0]: (0, 0)}
    cells = {(0, 0): rooms[0]}
    facts: list[tuple[str, str, str]] = []  # (a, direction, b): "The a is direction of the b."
    for k in range(1, n + 1):
        new = rooms[k]
        opts = [(b, d) for b in pos for d, (dx, dy) in DIRECTIONS.items()
                if (pos[b][0] + dx, pos[b][1] + dy) not in cells]
        b, d = rng.choice(sorted(opts))
        dx, dy = DIRECTIONS[d]
        pos[new] = (pos[b][0] + dx, pos[b][1] + dy)
        cells[pos[new]] = new
        facts.append((new, d, b) if rng.random() < 0.5 else (b, OPPOSITE[d], new))
    j = rng.randrange(len(facts))
    a, d, b = facts[j]
    if rng.random() < 0.5:
        question, answer = f"What is {d} of the {b}?", a
    else:
        question, answer = f"What is the {a} {d} of?", b
    w = _World(rng, (), (), ())
    w.facts = [f"The {x} is {dd} of the {y}." for x, dd, y in facts]
    return _story("qa4", w, question, answer, [j])


def _gen_qa5(rng: random.Random) -> Story | None:
    places = rng.sample(ROOMS, 3)
    weights = {"move": 0.35, "take": 0.25, "drop": 0.1, "give": 0.6}
    w = _simulate(rng, "qa5", PEOPLE_QA5, places, OBJECTS, weights, _n_facts("qa5", rng), first_moves=True)
    gives = [i for i, e in enumerate(w.events) if e.kind == "give"]
    if not gives:
        return None
    g = rng.choice(gives)
    e = w.events[g]
    forms = [
        ("Who gave the {o} to {q}?", "person", lambda x: x.arg == e.arg and x.to == e.to),
        ("Who did {p} give the {o} to?", "to", lambda x: x.person == e.person and x.arg == e.arg),
        ("What did {p} give to {q}?", "arg", lambda x: x.person == e.person and x.to == e.to),
        ("Who gave the {o}?", "person", lambda x: x.arg == e.arg),
        ("Who received the {o}?", "to", lambda x: x.arg == e.arg),
    ]
    rng.shuffle(forms)
    for template, slot, match in forms:
        # the question must point at this give: it is the most recent give matching the question
        if w.last(lambda x: x.kind == "give" and match(x)) == g:
            q = template.format(o=e.arg, p=e.person, q=e.to)
            return _story("qa5", w, q, str(getattr(e, slot)), [g])
    return None


def _holding_support(w: _World, p: str) -> list[int]:
    """The take/drop/give facts that made ``p`` hold (or stop holding) objects."""
    return [i for i, e in enumerate(w.events)
            if (e.kind in ("take", "drop", "give") and e.person == p) or (e.kind == "give" and e.to == p)]


_COUNT_WEIGHTS = {"move": 0.35, "take": 0.35, "drop": 0.15, "give": 0.25}


def _holding_world(rng: random.Random, task: str) -> tuple[_World, str] | None:
    """A story world of take/drop/give facts and a person who held something in it (None: nobody did)."""
    w = _simulate(rng, task, PEOPLE, ROOMS[:4], OBJECTS, _COUNT_WEIGHTS, _n_facts(task, rng), first_moves=True)
    involved = [p for p in PEOPLE if _holding_support(w, p)]
    return (w, rng.choice(involved)) if involved else None


def _gen_qa7(rng: random.Random) -> Story | None:
    if (picked := _holding_world(rng, "qa7")) is None:
        return None
    w, p = picked
    n = len(w.held_by(p))
    return _story("qa7", w, f"How many objects is {p} carrying?", COUNT_WORDS[n], _holding_support(w, p))


def _gen_qa8(rng: random.Random) -> Story | None:
    if (picked := _holding_world(rng, "qa8")) is None:
        return None
    w, p = picked
    held = w.held_by(p)
    # order of acquisition (the most recent take/give that gave p each object)
    got = {o: w.last(lambda e, o=o: e.arg == o and ((e.kind == "take" and e.person == p)
                                                    or (e.kind == "give" and e.to == p))) for o in held}
    answer = ",".join(sorted(held, key=lambda o: got[o])) if held else "nothing"
    return _story("qa8", w, f"What is {p} carrying?", answer, _holding_support(w, p))


def _gen_qa9(rng: random.Random) -> Story | None:
    n = _n_facts("qa9", rng)
    w = _World(rng, PEOPLE, ROOMS, ())
    know: dict[str, tuple[str, str, int]] = {}  # person -> (in|not, place, fact index)
    for i in range(n):
        p = rng.choice(PEOPLE)
        r = rng.random()
        if p in know and know[p][0] == "in" and r < 0.35:
            place = know[p][1] if rng.random() < 0.7 else rng.choice(ROOMS)
            w.facts.append(f"{p} is {rng.choice(('not', 'no longer'))} in the {place}.")
            know[p] = ("not", place, i)
        else:
            place = rng.choice([x for x in ROOMS if know.get(p, ("", "", 0))[1:2] != (x,)])
            w.facts.append(f"{p} {rng.choice(MOVE_VERBS)} the {place}." if r < 0.7 else f"{p} is in the {place}.")
            know[p] = ("in", place, i)
    p = rng.choice(sorted(know))
    state, place, idx = know[p]
    if state == "not":
        return _story("qa9", w, f"Is {p} in the {place}?", "no", [idx])
    if rng.random() < 0.5:
        return _story("qa9", w, f"Is {p} in the {place}?", "yes", [idx])
    other = rng.choice([x for x in ROOMS if x != place])
    return _story("qa9", w, f"Is {p} in the {other}?", "no", [idx])


def _gen_qa10(rng: random.Random) -> Story | None:
    n = _n_facts("qa10", rng)
    w = _World(rng, PEOPLE_QA10, PLACES_QA10, ())
    know: dict[str, tuple[tuple[str, ...], int]] = {}  # person -> (possible places, fact index)
    for i in range(n):
        p = rng.choice(PEOPLE_QA10)
        if rng.random() < 0.45:
            a, b = rng.sample(PLACES_QA10, 2)
            w.facts.append(f"{p} is either in the {a} or the {b}.")
            know[p] = ((a, b), i)
        else:
            place = rng.choice(PLACES_QA10)
            w.facts.append(f"{p} {rng.choice(MOVE_VERBS)} the {place}." if rng.random() < 0.6
                           else f"{p} is in the {place}.")
            know[p] = ((place,), i)
    p = rng.choice(sorted(know))
    places, idx = know[p]
    want = rng.choice(("yes", "no", "maybe") if len(places) == 2 else ("yes", "no"))
    if want == "no":
        place = rng.choice([x for x in PLACES_QA10 if x not in places])
    else:
        place = rng.choice(places)
        want = "maybe" if len(places) == 2 else "yes"
    return _story("qa10", w, f"Is {p} in the {place}?", want, [idx])


_GENERATORS = {
    "qa1": _gen_qa1, "qa2": _gen_qa2, "qa3": _gen_qa3, "qa4": _gen_qa4, "qa5": _gen_qa5,
    "qa6": _gen_qa6, "qa7": _gen_qa7, "qa8": _gen_qa8, "qa9": _gen_qa9, "qa10": _gen_qa10,
}


def generate_story(task: str, rng: random.Random, max_tries: int = 1000) -> Story:
    """One story of ``task`` drawn with ``rng`` (deterministic for a given rng state)."""
    if task not in _GENERATORS:
        raise ValueError(f"unknown bAbI task {task!r}; allowed: {', '.join(TASKS)}")
    for _ in range(max_tries):
        s = _GENERATORS[task](rng)
        if s is not None:
            return s
    raise RuntimeError(f"could not generate a {task} story in {max_tries} tries")  # pragma: no cover


# ---------------------------------------------------------------------------------------------------------------
# replay: answer a question from the fact sentences alone (an independent check of the simulator)
# ---------------------------------------------------------------------------------------------------------------

_W = r"([A-Za-z]+)"
_RE_MOVE = re.compile(rf"^{_W} (?:moved|went back|went|journeyed|travelled) to the {_W}\.$")
_RE_TAKE = re.compile(rf"^{_W} (?:picked up|got|grabbed|took) the {_W} there\.$")
_RE_DROP = re.compile(rf"^{_W} (?:dropped|put down|discarded|left) the {_W} there\.$")
_RE_GIVE = re.compile(rf"^{_W} (?:gave|handed|passed) the {_W} to {_W}\.$")
_RE_IS = re.compile(rf"^{_W} is in the {_W}\.$")
_RE_NOT = re.compile(rf"^{_W} is (?:not|no longer) in the {_W}\.$")
_RE_EITHER = re.compile(rf"^{_W} is either in the {_W} or the {_W}\.$")
_RE_REL = re.compile(rf"^The {_W} is (north|south|east|west) of the {_W}\.$")


def _parse(fact: str) -> tuple:
    for kind, rx in (("move", _RE_MOVE), ("take", _RE_TAKE), ("drop", _RE_DROP), ("give", _RE_GIVE),
                     ("not", _RE_NOT), ("either", _RE_EITHER), ("is", _RE_IS), ("rel", _RE_REL)):
        m = rx.match(fact)
        if m:
            return (kind, *m.groups())
    raise ValueError(f"unparseable fact: {fact!r}")


def replay(task: str, facts: list[str], question: str) -> str:
    """The answer to ``question`` derived from the fact sentences alone (raises on an ill-posed question)."""
    ev = [_parse(f) for f in facts]
    loc: dict[str, str] = {}
    holder: dict[str, str | None] = {}
    obj_at: dict[str, str] = {}
    carried: dict[str, list[str]] = {}  # person -> objects in order of acquisition
    hist: dict[str, list[str]] = {}  # object -> locations visited
    knowledge: dict[str, tuple[str, tuple[str, ...]]] = {}  # person -> (in|not|either, places)
    gives: list[tuple[str, str, str]] = []
    rel: dict[tuple[str, str], str] = {}  # (place, direction) -> what lies in that direction of place

    def visit(o: str, place: str) -> None:
        h = hist.setdefault(o, [])
        if not h or h[-1] != place:
            h.append(place)

    for e in ev:
        kind = e[0]
        if kind in ("move", "is"):
            p, place = e[1], e[2]
            loc[p] = place
            knowledge[p] = ("in", (place,))
            for o in carried.get(p, []):
                obj_at[o] = place
                visit(o, place)
        elif kind == "take":
            p, o = e[1], e[2]
            assert holder.get(o) is None, f"{o} taken while held"
            assert o not in obj_at or obj_at[o] == loc[p], f"{o} is not where {p} is"
            holder[o] = p
            carried.setdefault(p, []).append(o)
            obj_at[o] = loc[p]
            visit(o, loc[p])
        elif kind == "drop":
            p, o = e[1], e[2]
            assert holder.get(o) == p
            holder[o] = None
            carried[p].remove(o)
        elif kind == "give":
            p, o, q = e[1], e[2], e[3]
            assert holder.get(o) == p and loc.get(p) == loc.get(q) and p != q
            holder[o] = q
            carried[p].remove(o)
            carried.setdefault(q, []).append(o)
            gives.append((p, o, q))
        elif kind == "not":
            knowledge[e[1]] = ("not", (e[2],))
        elif kind == "either":
            knowledge[e[1]] = ("either", (e[2], e[3]))
        elif kind == "rel":
            a, d, b = e[1], e[2], e[3]
            for key, val in (((b, d), a), ((a, OPPOSITE[d]), b)):
                assert rel.get(key, val) == val, "inconsistent map"
                rel[key] = val

    if task in ("qa1",):
        (p,) = re.match(r"^Where is ([A-Z][a-z]+)\?$", question).groups()
        return loc[p]
    if task == "qa2":
        (o,) = re.match(r"^Where is the ([a-z]+)\?$", question).groups()
        return obj_at[o]
    if task == "qa3":
        o, place = re.match(r"^Where was the ([a-z]+) before the ([a-z]+)\?$", question).groups()
        h = hist[o]
        assert h.count(place) == 1 and h.index(place) > 0, "ill-posed qa3 question"
        return h[h.index(place) - 1]
    if task == "qa4":
        m = re.match(r"^What is (north|south|east|west) of the ([a-z]+)\?$", question)
        if m:
            return rel[(m.group(2), m.group(1))]
        a, d = re.match(r"^What is the ([a-z]+) (north|south|east|west) of\?$", question).groups()
        return rel[(a, OPPOSITE[d])]
    if task == "qa5":
        for rx, known, want in (
            (r"^Who gave the ([a-z]+) to ([A-Z][a-z]+)\?$", (1, 2), 0),
            (r"^Who did ([A-Z][a-z]+) give the ([a-z]+) to\?$", (0, 1), 2),
            (r"^What did ([A-Z][a-z]+) give to ([A-Z][a-z]+)\?$", (0, 2), 1),
            (r"^Who gave the ([a-z]+)\?$", (1,), 0),
            (r"^Who received the ([a-z]+)\?$", (1,), 2),
        ):
            m = re.match(rx, question)
            if m:
                vals = dict(zip(known, m.groups()))
                for g in reversed(gives):
                    if all(g[k] == v for k, v in vals.items()):
                        return g[want]
                raise AssertionError("no matching give")
        raise ValueError(f"unknown qa5 question {question!r}")
    if task in ("qa6", "qa9", "qa10"):
        p, place = re.match(r"^Is ([A-Z][a-z]+) in the ([a-z]+)\?$", question).groups()
        state, places = knowledge[p]
        if state == "in":
            return "yes" if place == places[0] else "no"
        if state == "not":
            assert place == places[0], "ill-posed negation question"
            return "no"
        return "maybe" if place in places else "no"
    if task == "qa7":
        (p,) = re.match(r"^How many objects is ([A-Z][a-z]+) carrying\?$", question).groups()
        return COUNT_WORDS[len(carried.get(p, []))]
    if task == "qa8":
        (p,) = re.match(r"^What is ([A-Z][a-z]+) carrying\?$", question).groups()
        return ",".join(carried.get(p, [])) or "nothing"
    raise ValueError(f"unknown task {task!r}")
