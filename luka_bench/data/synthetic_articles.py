"""Offline, deterministic generator of SQuAD-v2-format articles about invented entities.

Why: SQuAD v2 is not reachable without a model hub, and real Wikipedia facts can often be answered from a model's
prior. These articles describe entities that do not exist (towns, people, companies, species, ships, festivals,
inventions, rivers, sports clubs, bands) whose names are built from random syllables and whose attributes
(years, numbers, places, colours, people...) are drawn at random, so every answer has to come from the context.

Design rules, so that the articles are usable as WikiSalad material:
- Every sentence states one fact in a clear, direct sentence and names the entity; the matching question reuses
  the sentence's wording ("X was founded in 1843 ..." -> "In what year was X founded?").
- Each attribute (fact key) appears at most once per article, so every question has one answer in the article.
- Each paragraph has 3-5 sentences: 3-4 fact sentences (each with one QA pair) plus sometimes one filler sentence
  without a question. Every sentence is longer than 50 characters (WikiSalad drops shorter fragments).
- The answer is never part of the question; answers are short (a name, a number, a year, a place, a colour...).
- Output is the SQuAD v2 JSON schema; ``answer_start`` is exact (the answer text is at that offset).

``generate_squad(n_articles, seed)`` is a pure function of its arguments.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["generate_squad", "KINDS"]

# ---------------------------------------------------------------------------------------------------------------
# invented names
# ---------------------------------------------------------------------------------------------------------------

_ONSETS = ["b", "br", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "tr", "v", "z"]
_NUCLEI = ["a", "e", "i", "o", "u", "a", "e", "o"]
_CODAS = ["", "", "n", "r", "l", "s", "m", "nd", "k", "x", "th"]

_COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "grey", "brown", "pink", "white"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December"]
_WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_PROFESSIONS = ["fisherman", "blacksmith", "weaver", "miller", "carpenter", "shepherd", "baker", "potter",
                "sailor", "bookbinder", "stonemason", "tailor"]
_INSTRUMENTS = ["harp", "fiddle", "bagpipe", "flute", "drum", "lute", "accordion", "trumpet", "cello", "zither",
                "banjo", "oboe"]
_MATERIALS = ["oak", "pine", "granite", "marble", "copper", "bronze", "iron", "brick", "limestone", "cedar",
              "brass", "walnut"]
_FOODS = ["lentils", "barley", "smoked eel", "plums", "chestnuts", "goat cheese", "honey", "rye", "mushrooms",
          "turnips", "walnuts", "cabbage", "onions", "raisins"]


@dataclass
class _Ctx:
    rng: random.Random
    used: set[str]
    state: dict[str, str] = field(default_factory=dict)
    base_year: int = 1800

    # -- names ----------------------------------------------------------------------------------------------
    def word(self, min_syl: int = 2, max_syl: int = 3) -> str:
        """A new invented word (capitalised), never returned twice by the same generator."""
        rng = self.rng
        for _ in range(1000):
            n = rng.randint(min_syl, max_syl)
            w = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) for _ in range(n)) + rng.choice(_CODAS)
            if 4 <= len(w) <= 9 and w not in self.used:
                self.used.add(w)
                return w.capitalize()
        raise RuntimeError("name space exhausted")  # pragma: no cover

    def person(self) -> str:
        return f"{self.word(2, 2)} {self.word(2, 2)}"

    # -- values ---------------------------------------------------------------------------------------------
    def pick(self, pool: list[str], exclude: tuple[str, ...] = ()) -> str:
        return self.rng.choice([p for p in pool if p not in exclude])

    def year(self, lo: int = 0, hi: int = 0) -> str:
        """A year at base_year + [lo, hi] (all years of an article hang off one base year, so they are coherent)."""
        return str(self.base_year + self.rng.randint(lo, hi))

    def num(self, lo: int, hi: int, unit: str = "", commas: bool = False) -> str:
        v = self.rng.randint(lo, hi)
        s = f"{v:,}" if commas else str(v)
        return f"{s} {unit}" if unit else s


@dataclass(frozen=True)
class Fact:
    """One attribute of an entity: its value generator and (sentence, question) phrasings.

    Templates use ``{n}`` for the entity's name and ``{a}`` for the answer (exactly once in the sentence).
    """

    key: str
    value: Callable[[_Ctx], str]
    variants: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Kind:
    """A topic kind: how to name an entity (title, name used in text), its facts in sections, filler sentences."""

    name: str
    make_name: Callable[[_Ctx], tuple[str, str]]
    sections: tuple[tuple[Fact, ...], ...]
    fillers: tuple[str, ...]


def F(key: str, value: Callable[[_Ctx], str], *variants: tuple[str, str]) -> Fact:
    return Fact(key, value, tuple(variants))


# ---------------------------------------------------------------------------------------------------------------
# topic kinds
# ---------------------------------------------------------------------------------------------------------------

TOWN = Kind(
    "town",
    lambda c: (lambda w: (w, w))(c.word(2, 3)),
    (
        (
            F("founded", lambda c: c.year(0, 0),
              ("{n} was founded in {a}, when the first houses were built near the old ford.",
               "In what year was {n} founded?"),
              ("The town of {n} was established in {a}, when a mill was built beside the stream.",
               "When was the town of {n} established?")),
            F("founder", lambda c: c.person(),
              ("The first settlers of {n} were led by a fisherman named {a}.", "Who led the first settlers of {n}?"),
              ("According to the town records, the first mayor of {n} was {a}.",
               "According to the town records, who was the first mayor of {n}?")),
            F("old_name", lambda c: c.word(2, 2),
              ("In its early years, the town of {n} was known by the name {a}.",
               "By what name was {n} known in its early years?"),
              ("The original name of {n} was {a}, which meant place of the reeds.",
               "What was the original name of {n}?")),
            F("fire", lambda c: c.year(40, 150),
              ("Much of {n} was destroyed by a great fire in {a}, and the town was rebuilt in stone.",
               "In what year was much of {n} destroyed by a great fire?"),
              ("A great fire destroyed most of the wooden houses of {n} in {a}.",
               "When did a great fire destroy most of the wooden houses of {n}?")),
        ),
        (
            F("river", lambda c: c.word(2, 2),
              ("{n} lies on the northern bank of the {a} River, about forty kilometres from the sea.",
               "On which river does {n} lie?"),
              ("The {a} River flows through the centre of {n} before it reaches the lake.",
               "Which river flows through the centre of {n}?")),
            F("province", lambda c: c.word(2, 3),
              ("{n} is the largest town in the province of {a} and its main trading centre.",
               "In which province is {n} the largest town?"),
              ("{n} belongs to the province of {a}, in the hilly north of the country.",
               "To which province does {n} belong?")),
            F("altitude", lambda c: c.num(120, 2400),
              ("The centre of {n} stands at an altitude of {a} metres above sea level.",
               "At what altitude in metres does the centre of {n} stand?"),
              ("The town of {n} is built on a wide plateau at a height of {a} metres.",
               "At what height in metres is the town of {n} built?")),
            F("population", lambda c: c.num(1200, 95000, commas=True),
              ("{n} has a population of about {a} people, most of whom live near the market.",
               "What is the population of {n}?"),
              ("At the last census, {a} people were living in the town of {n}.",
               "How many people were living in {n} at the last census?")),
            F("bridges", lambda c: c.num(3, 19),
              ("There are {a} bridges in {n}, and the oldest of them is made of wood.",
               "How many bridges are there in {n}?"),),
        ),
        (
            F("industry", lambda c: c.pick(["salt mining", "wool weaving", "glassmaking", "shipbuilding",
                                            "copper smelting", "cheese making", "paper making", "rope making",
                                            "clockmaking", "brewing", "pottery", "tanning"]),
              ("The economy of {n} depends mostly on {a}, which employs a third of its workers.",
               "What does the economy of {n} depend on mostly?"),
              ("For centuries the main industry of {n} has been {a}.",
               "What has been the main industry of {n} for centuries?")),
            F("market_day", lambda c: c.pick(_WEEKDAYS),
              ("A large market is held in {n} every {a}, and traders come from the nearby villages.",
               "On which day is the large market held in {n}?"),
              ("Farmers bring their goods to the market square of {n} every {a} morning.",
               "On which morning do farmers bring their goods to the market square of {n}?")),
            F("railway", lambda c: c.year(60, 200),
              ("The railway reached {n} in {a}, and the journey to the capital became much shorter.",
               "In what year did the railway reach {n}?"),
              ("The first train arrived at the station of {n} in {a}.",
               "When did the first train arrive at the station of {n}?")),
            F("product", lambda c: c.pick(["woollen blankets", "smoked fish", "copper pots", "apple cider",
                                           "glass beads", "leather boots", "clay pipes", "straw hats",
                                           "silk scarves", "pickled herring"]),
              ("The most famous product of {n} is {a}, which are sold in many distant cities.",
               "What is the most famous product of {n}?"),),
        ),
        (
            F("feast_month", lambda c: c.pick(_MONTHS),
              ("Every year in {a}, the people of {n} celebrate the harvest feast with music and dancing.",
               "In which month do the people of {n} celebrate the harvest feast?"),),
            F("tower", lambda c: c.word(2, 2) + " Tower",
              ("The tallest building in {n} is the {a}, a bell tower built of red stone.",
               "What is the tallest building in {n}?"),),
            F("flag", lambda c: c.pick(_COLOURS, ("white",)),
              ("The flag of {n} is {a}, with a single white star in the middle.", "What colour is the flag of {n}?"),
              ("The town flag of {n} shows a white fish on a {a} background.",
               "What colour is the background of the town flag of {n}?")),
            F("twin", lambda c: c.word(2, 3),
              ("{n} has been twinned with the distant town of {a} for many years.",
               "Which town has {n} been twinned with?"),),
            F("mayor", lambda c: c.person(),
              ("The current mayor of {n} is {a}, a former teacher at the town school.",
               "Who is the current mayor of {n}?"),),
            F("dish", lambda c: c.pick(_FOODS),
              ("The traditional dish of {n} is a thick soup made with {a}.",
               "What is the traditional soup of {n} made with?"),),
        ),
    ),
    (
        "The streets of the old town are narrow and paved with round stones.",
        "Many visitors come in the summer to walk along the quiet river paths.",
        "The town also has a small museum devoted to local history and crafts.",
        "In winter the roads leading to the town are often blocked by deep snow.",
    ),
)

PERSON = Kind(
    "person",
    lambda c: (lambda p: (p, p))(c.person()),
    (
        (
            F("born", lambda c: c.year(0, 0),
              ("{n} was born in {a}, the youngest of four children.", "In what year was {n} born?"),
              ("The scholar {n} was born in the winter of {a}.", "In what year was the scholar {n} born?")),
            F("hometown", lambda c: c.word(2, 3),
              ("{n} grew up in the town of {a}, where the family owned a small shop.",
               "In which town did {n} grow up?"),
              ("{n} spent a quiet childhood in {a}, a town known for its orchards.",
               "Where did {n} spend a quiet childhood?")),
            F("father", lambda c: c.pick(_PROFESSIONS),
              ("The father of {n} worked as a {a} and taught the child to read at home.",
               "What did the father of {n} work as?"),),
            F("academy", lambda c: c.word(2, 3) + " Academy",
              ("At the age of sixteen, {n} went to study at the {a}.",
               "Where did {n} go to study at the age of sixteen?"),
              ("{n} was a student at the {a} for six years.", "Where was {n} a student for six years?")),
        ),
        (
            F("mentor", lambda c: c.person(),
              ("At the academy, {n} became the pupil of the old scholar {a}.",
               "Whose pupil did {n} become at the academy?"),),
            F("field", lambda c: c.pick(["botanist", "mapmaker", "astronomer", "engineer", "painter", "composer",
                                         "physician", "architect", "chemist", "poet", "sculptor", "geologist"]),
              ("{n} is best remembered today as a {a} of great patience.", "What is {n} best remembered as?"),
              ("Most people know {n} as a {a} who worked mostly alone.", "What do most people know {n} as?")),
            F("book", lambda c: c.rng.choice(["The {w} Letters", "A History of {w}", "The {w} Notebooks",
                                              "Winter in {w}"]).format(w=c.word(2, 3)),
              ("The most famous book written by {n} is called {a}.",
               "What is the most famous book written by {n} called?"),),
            F("moved", lambda c: c.word(2, 3),
              ("In later life {n} moved to the city of {a} and opened a workshop there.",
               "To which city did {n} move in later life?"),),
        ),
        (
            F("medal", lambda c: c.word(2, 2) + " Medal",
              ("{n} received the {a} for a lifetime of careful work.", "Which medal did {n} receive?"),),
            F("spouse", lambda c: c.person(),
              ("{n} married {a}, a musician from the same street.", "Whom did {n} marry?"),),
            F("children", lambda c: c.num(3, 9),
              ("{n} had {a} children, and two of them also became scholars.",
               "How many children did {n} have?"),),
            F("instrument", lambda c: c.pick(_INSTRUMENTS),
              ("In the evenings {n} liked to play the {a} for friends and neighbours.",
               "What instrument did {n} like to play in the evenings?"),),
        ),
        (
            F("died", lambda c: c.year(45, 90),
              ("{n} died in {a} and was buried in the garden of the academy.", "In what year did {n} die?"),),
            F("statue_town", lambda c: c.word(2, 3),
              ("A bronze statue of {n} stands in the main square of {a}.",
               "In which town does a bronze statue of {n} stand?"),),
            F("pet", lambda c: c.pick(["parrot", "tortoise", "greyhound", "cat", "goat", "raven", "donkey"]),
              ("{n} kept a {a} that followed its owner everywhere in the house.",
               "What animal did {n} keep?"),),
            F("prize_money", lambda c: c.num(200, 9000),
              ("In a will, {n} left {a} gold coins to the library of the academy.",
               "How many gold coins did {n} leave to the library of the academy?"),),
        ),
    ),
    (
        "Letters from that time describe a shy child who loved long walks.",
        "Much of the work was done by candlelight in a small rented room.",
        "Several of the original notebooks are now kept in a public library.",
        "Friends later remembered a kind and patient teacher with a dry humour.",
    ),
)

_COMPANY_SUFFIX = ["Company", "& Sons", "Works", "Industries", "Manufacturing", "Brothers"]
_PRODUCTS = ["bicycles", "sewing machines", "pocket watches", "oil lamps", "typewriters", "umbrellas",
             "wooden toys", "fishing nets", "pianos", "telescopes", "iron stoves", "saddles", "matches", "soap"]

COMPANY = Kind(
    "company",
    lambda c: (lambda n: (n, n))(f"{c.word(2, 3)} {c.rng.choice(_COMPANY_SUFFIX)}"),
    (
        (
            F("founded", lambda c: c.year(0, 0),
              ("{n} was founded in {a} in a small workshop behind a bakery.", "In what year was {n} founded?"),
              ("The company {n} was set up in {a} with money borrowed from friends.",
               "In what year was the company {n} set up?")),
            F("founder", lambda c: c.person(),
              ("{n} was started by {a}, who had trained as a clockmaker.", "Who started {n}?"),
              ("The founder of {n} was {a}, the son of a village teacher.", "Who was the founder of {n}?")),
            F("first_factory", lambda c: c.word(2, 3),
              ("The first factory of {n} was opened in the town of {a}.",
               "In which town was the first factory of {n} opened?"),),
        ),
        (
            F("product", lambda c: c.pick(_PRODUCTS),
              ("{n} is best known for making {a} of very good quality.", "What is {n} best known for making?"),
              ("The main product of {n} has always been {a}.", "What has always been the main product of {n}?")),
            F("hq", lambda c: c.word(2, 3),
              ("The headquarters of {n} are in the city of {a}, close to the harbour.",
               "In which city are the headquarters of {n}?"),
              ("{n} has its head office in {a}, next to the central station.",
               "Where does {n} have its head office?")),
            F("employees", lambda c: c.num(40, 25000, commas=True),
              ("Today {n} employs about {a} people in three countries.",
               "About how many people does {n} employ today?"),),
            F("market", lambda c: c.word(2, 3),
              ("Most of the goods made by {n} are sold in the country of {a}.",
               "In which country are most of the goods made by {n} sold?"),),
        ),
        (
            F("director", lambda c: c.person(),
              ("The current director of {n} is {a}, who joined as an apprentice.",
               "Who is the current director of {n}?"),),
            F("logo", lambda c: c.pick(_COLOURS),
              ("The logo of {n} is a {a} anchor inside a circle.", "What colour is the anchor in the logo of {n}?"),),
            F("rival", lambda c: f"{c.word(2, 3)} {c.rng.choice(_COMPANY_SUFFIX)}",
              ("The main rival of {n} is {a}, a firm from the same region.", "What is the main rival of {n}?"),),
        ),
        (
            F("crisis", lambda c: c.year(20, 120),
              ("{n} nearly went bankrupt in {a}, after a fire destroyed its warehouse.",
               "In what year did {n} nearly go bankrupt?"),),
            F("shops", lambda c: c.num(3, 400),
              ("{n} now runs {a} shops, most of them in small towns.", "How many shops does {n} now run?"),),
            F("motto", lambda c: c.pick(["Slow and sure", "Made to last", "Always forward", "Light for all",
                                         "Honest work", "Built by hand", "Nothing wasted"]),
              ("The motto of {n}, painted above every door, is {a}.", "What is the motto of {n}?"),),
        ),
    ),
    (
        "The company has always kept its prices low and its designs simple.",
        "Its workers are known for their long service and careful handwork.",
        "Old advertisements for the firm are now valued by many collectors.",
    ),
)

_ANIMALS = ["owl", "finch", "lizard", "frog", "beetle", "hare", "heron", "moth", "salamander", "tortoise", "bat",
            "newt", "shrew", "snail", "crab", "toad"]

SPECIES = Kind(
    "species",
    lambda c: (lambda n: (n, n))(f"{c.word(2, 3)} {c.rng.choice(_ANIMALS)}"),
    (
        (
            F("length", lambda c: c.num(3, 90),
              ("The {n} grows to a length of about {a} centimetres when fully adult.",
               "To what length in centimetres does the {n} grow?"),),
            F("colour", lambda c: c.pick(_COLOURS, ("white",)),
              ("The back of the {n} is {a}, while its belly is pale and spotted.",
               "What colour is the back of the {n}?"),),
            F("weight", lambda c: c.num(5, 900),
              ("An adult {n} weighs about {a} grams, which is heavy for its size.",
               "How many grams does an adult {n} weigh?"),),
            F("local_name", lambda c: c.word(2, 3),
              ("In the local language the {n} is called the {a}.",
               "What is the {n} called in the local language?"),),
        ),
        (
            F("habitat", lambda c: c.word(2, 3),
              ("The {n} lives only in the pine forests of the {a} region.",
               "In the pine forests of which region does the {n} live?"),
              ("The {n} is found only in the marshes of the {a} region.",
               "In the marshes of which region is the {n} found?")),
            F("diet", lambda c: c.pick(["small snails", "berries", "seeds", "moths", "worms", "water beetles",
                                        "pine nuts", "grasshoppers", "fallen fruit", "ants", "clover"]),
              ("The {n} feeds mainly on {a}, which it finds at night.", "What does the {n} feed mainly on?"),
              ("The favourite food of the {n} is {a}, which it gathers at dawn.",
               "What is the favourite food of the {n}?")),
            F("predator", lambda c: c.pick(["red fox", "eagle", "pine marten", "grass snake", "stoat", "wildcat",
                                            "otter", "buzzard", "weasel"]),
              ("The main enemy of the {n} is the {a}, which hunts it in the open.",
               "What is the main enemy of the {n}?"),),
        ),
        (
            F("discoverer", lambda c: c.person(),
              ("The {n} was first described by the naturalist {a}.", "Which naturalist first described the {n}?"),),
            F("discovered", lambda c: c.year(0, 0),
              ("Scientists first recorded the {n} in {a}, during a long expedition.",
               "In what year did scientists first record the {n}?"),),
            F("lifespan", lambda c: c.num(2, 40),
              ("In the wild, the {n} can live for up to {a} years.",
               "For how many years can the {n} live in the wild?"),),
        ),
        (
            F("young", lambda c: c.num(2, 12),
              ("A female {n} usually has {a} young each spring.",
               "How many young does a female {n} usually have each spring?"),),
            F("sound", lambda c: c.pick(["a soft whistle", "a sharp click", "a low hum", "a loud croak",
                                         "a short bark", "a high chirp"]),
              ("When it is frightened, the {n} makes {a} to warn the others.",
               "What sound does the {n} make when it is frightened?"),),
            F("protected", lambda c: c.year(60, 200),
              ("Hunting the {n} has been forbidden by law since {a}.",
               "Since what year has hunting the {n} been forbidden by law?"),),
        ),
    ),
    (
        "It is shy and is rarely seen by the people who live near its home.",
        "Very little is known about how it spends the coldest months of the year.",
        "Its numbers have fallen as the old forests were cleared for farmland.",
    ),
)

SHIP = Kind(
    "ship",
    lambda c: (lambda w: (f"{w} (ship)", w))(c.word(2, 3)),
    (
        (
            F("launched", lambda c: c.year(0, 0),
              ("{n} was launched in {a} as a three-masted merchant ship.", "In what year was {n} launched?"),),
            F("shipyard", lambda c: c.word(2, 3),
              ("{n} was built at the shipyard of {a}, on the western coast.",
               "At which shipyard was {n} built?"),),
            F("owner", lambda c: f"{c.word(2, 3)} & Sons",
              ("{n} was owned by {a}, a trading house from the capital.", "Who owned {n}?"),),
            F("length", lambda c: c.num(30, 120),
              ("The ship {n} was {a} metres long and could carry a heavy cargo.",
               "How many metres long was the ship {n}?"),),
        ),
        (
            F("captain", lambda c: c.person(),
              ("The first captain of {n} was {a}, who commanded her for eleven years.",
               "Who was the first captain of {n}?"),),
            F("crew", lambda c: c.num(12, 300),
              ("{n} usually sailed with a crew of {a} sailors and two cooks.",
               "How many sailors were in the crew of {n}?"),),
            F("first_voyage", lambda c: c.word(2, 3),
              ("On her first voyage, {n} sailed to the port of {a}.",
               "To which port did {n} sail on her first voyage?"),),
        ),
        (
            F("cargo", lambda c: c.pick(["tea", "wool", "timber", "salt", "coffee", "grain", "spices", "coal",
                                         "tobacco", "cotton", "sugar", "wine"]),
              ("For most of her life {n} carried {a} between the northern ports.", "What did {n} mostly carry?"),),
            F("figurehead", lambda c: c.pick(["lion", "swan", "dolphin", "eagle", "mermaid", "dragon", "horse",
                                              "bear", "unicorn"]),
              ("The figurehead of {n} was a carved wooden {a} painted in gold.",
               "What animal was the figurehead of {n}?"),),
            F("hull", lambda c: c.pick(_COLOURS, ("white",)),
              ("The hull of {n} was painted {a} with a thin white stripe.",
               "What colour was the hull of {n} painted?"),),
        ),
        (
            F("wrecked", lambda c: c.year(10, 60),
              ("{n} ran aground in a storm in {a} and was never repaired.",
               "In what year did {n} run aground in a storm?"),),
            F("wreck_island", lambda c: c.word(2, 3),
              ("The wreck of {n} still lies near the island of {a}.",
               "Near which island does the wreck of {n} still lie?"),),
            F("bell", lambda c: c.word(2, 3),
              ("The bell of {n} was saved and now hangs in a church in {a}.",
               "In which town does the bell of {n} now hang?"),),
        ),
    ),
    (
        "Her crossings were slow but she was known as a safe and steady ship.",
        "Many letters from her sailors have been kept by their families.",
        "Paintings of the ship can still be seen in the harbour museum.",
    ),
)

FESTIVAL = Kind(
    "festival",
    lambda c: (lambda n: (n, n))(f"{c.word(2, 3)} {c.rng.choice(['Festival', 'Fair', 'Carnival'])}"),
    (
        (
            F("town", lambda c: c.word(2, 3),
              ("The {n} is held every year in the town of {a}.", "In which town is the {n} held every year?"),),
            F("month", lambda c: c.pick(_MONTHS),
              ("The {n} takes place in {a}, when the first apples are ripe.",
               "In which month does the {n} take place?"),),
            F("first_held", lambda c: c.year(0, 0),
              ("The {n} was first held in {a}, after a long and difficult winter.",
               "In what year was the {n} first held?"),),
            F("founder", lambda c: c.person(),
              ("The {n} was started by {a}, a baker who wanted to cheer up the neighbours.",
               "Who started the {n}?"),),
        ),
        (
            F("days", lambda c: c.num(2, 14),
              ("The {n} lasts for {a} days and ends with fireworks over the lake.",
               "How many days does the {n} last?"),),
            F("event", lambda c: c.pick(["a boat race", "a lantern parade", "a horse race", "a tug of war",
                                         "a singing contest", "a cheese rolling race", "a kite contest"]),
              ("The main event of the {n} is {a} on the last evening.", "What is the main event of the {n}?"),),
            F("crown", lambda c: c.pick(["straw", "copper", "silver", "oak leaves", "willow", "tin", "flowers"]),
              ("The winners at the {n} receive a crown made of {a}.",
               "What is the crown given to the winners at the {n} made of?"),),
        ),
        (
            F("bread", lambda c: c.pick(_FOODS),
              ("The traditional bread of the {n} is baked with {a} and salt.",
               "What is the traditional bread of the {n} baked with?"),),
            F("ribbons", lambda c: c.pick(_COLOURS),
              ("During the {n}, people wear {a} ribbons in their hair.",
               "What colour ribbons do people wear during the {n}?"),),
            F("instrument", lambda c: c.pick(_INSTRUMENTS),
              ("The music of the {n} is played mostly on the {a}.",
               "On which instrument is the music of the {n} played mostly?"),),
        ),
        (
            F("visitors", lambda c: c.num(800, 90000, commas=True),
              ("About {a} visitors come to the {n} each year.", "About how many visitors come to the {n} each year?"),),
            F("honours", lambda c: c.person(),
              ("The {n} honours {a}, a shepherd who once saved the town from a flood.",
               "Whom does the {n} honour?"),),
            F("cancelled", lambda c: c.year(20, 150),
              ("The {n} was cancelled only once, in {a}, because of heavy rain.",
               "In what year was the {n} cancelled?"),),
        ),
    ),
    (
        "Families travel from far away and camp in the fields around the town.",
        "The streets are decorated with paper flags for the whole week.",
        "Children spend the days playing old games in the main square.",
    ),
)

_DEVICES = ["engine", "loom", "pump", "lamp", "press", "clock", "plough", "mill", "calculator", "crane"]

INVENTION = Kind(
    "invention",
    lambda c: (lambda n: (n, n))(f"{c.word(2, 3)} {c.rng.choice(_DEVICES)}"),
    (
        (
            F("inventor", lambda c: c.person(),
              ("The {n} was invented by {a}, a young engineer.", "Who invented the {n}?"),),
            F("built", lambda c: c.year(0, 0),
              ("The first working {n} was built in {a} in a workshop near the harbour.",
               "In what year was the first working {n} built?"),),
            F("tested_town", lambda c: c.word(2, 3),
              ("The {n} was first tested in the town of {a}.", "In which town was the {n} first tested?"),),
        ),
        (
            F("power", lambda c: c.pick(["steam", "wind", "water", "horses", "clockwork springs",
                                         "compressed air", "peat fire"]),
              ("The {n} was powered by {a} and needed very little care.", "What was the {n} powered by?"),),
            F("frame", lambda c: c.pick(_MATERIALS),
              ("The frame of the {n} was made of {a} to keep it steady.", "What was the frame of the {n} made of?"),),
            F("weight", lambda c: c.num(20, 900),
              ("The original {n} weighed about {a} kilograms and needed two people to move it.",
               "How many kilograms did the original {n} weigh?"),),
            F("purpose", lambda c: c.pick(["pumping water out of mines", "weaving carpets", "grinding grain",
                                           "printing maps", "measuring the tides", "cutting ice",
                                           "sorting letters", "lifting stones"]),
              ("The {n} was designed for {a}, which had always been slow and tiring work.",
               "What was the {n} designed for?"),),
        ),
        (
            F("nickname", lambda c: "Old " + c.word(2, 2),
              ("Workers soon gave the {n} the nickname {a}.", "What nickname did workers give the {n}?"),),
            F("sold", lambda c: c.num(30, 9000, commas=True),
              ("More than {a} copies of the {n} were sold in the first ten years.",
               "How many copies of the {n} were sold in the first ten years?"),),
            F("price", lambda c: c.num(5, 500),
              ("Each {n} cost {a} silver coins when it was first sold.",
               "How many silver coins did each {n} cost when it was first sold?"),),
        ),
        (
            F("museum", lambda c: c.word(2, 3),
              ("The original {n} is now kept in the museum of {a}.", "Where is the original {n} now kept?"),),
            F("paint", lambda c: c.pick(_COLOURS),
              ("Most early models of the {n} were painted {a}.",
               "What colour were most early models of the {n} painted?"),),
            F("replaced", lambda c: c.year(30, 90),
              ("The {n} was replaced by electric machines in {a}.",
               "In what year was the {n} replaced by electric machines?"),),
        ),
    ),
    (
        "At first many people doubted that such a machine could ever work.",
        "Its simple design was copied by many workshops in other countries.",
        "Drawings of the machine were printed in several popular magazines.",
    ),
)

RIVER = Kind(
    "river",
    lambda c: (lambda n: (n, n))(c.word(2, 3) + " River"),
    (
        (
            F("length", lambda c: c.num(40, 900),
              ("The {n} is {a} kilometres long from its source to its mouth.",
               "How many kilometres long is the {n}?"),),
            F("source", lambda c: "Mount " + c.word(2, 3),
              ("The {n} rises on the rocky slopes of {a}.", "On the slopes of which mountain does the {n} rise?"),),
            F("mouth", lambda c: c.word(2, 3) + " Sea",
              ("The {n} flows into the {a} near a small fishing village.", "Into which sea does the {n} flow?"),),
        ),
        (
            F("tributary", lambda c: c.word(2, 3),
              ("The largest tributary of the {n} is the {a}, which joins it from the east.",
               "What is the largest tributary of the {n}?"),),
            F("city", lambda c: c.word(2, 3),
              ("The largest city on the {n} is {a}, which grew up around an old ferry.",
               "What is the largest city on the {n}?"),),
            F("bridges", lambda c: c.num(3, 60),
              ("The {n} is crossed by {a} bridges along its whole course.", "How many bridges cross the {n}?"),),
        ),
        (
            F("fish", lambda c: c.pick(["trout", "salmon", "pike", "eel", "carp", "perch", "sturgeon", "catfish"]),
              ("The {n} is famous for its {a}, which are caught in the spring.", "What fish is the {n} famous for?"),),
            F("water_colour", lambda c: c.pick(_COLOURS, ("white", "black", "pink")),
              ("The water of the {n} looks {a} because of the minerals in its bed.",
               "What colour does the water of the {n} look?"),),
            F("width", lambda c: c.num(40, 900),
              ("Near its mouth the {n} is {a} metres wide and very slow.", "How many metres wide is the {n} near its mouth?"),),
        ),
        (
            F("flood", lambda c: c.year(0, 150),
              ("In {a}, the {n} flooded and destroyed many farms along its banks.",
               "In what year did the {n} flood and destroy many farms?"),),
            F("dam_builder", lambda c: c.person(),
              ("The great dam on the {n} was designed by the engineer {a}.",
               "Who designed the great dam on the {n}?"),),
            F("meaning", lambda c: c.pick(["slow water", "silver snake", "cold stream", "bright path", "grey horse",
                                           "singing water", "old road"]),
              ("The name of the {n} comes from an old word meaning {a}.",
               "What does the old word behind the name of the {n} mean?"),),
        ),
    ),
    (
        "Its banks are lined with willows and small sandy beaches.",
        "In dry summers the river becomes shallow enough to cross on foot.",
        "Boats once carried timber and grain down the river to the coast.",
    ),
)

_CLUB_FORMS = ["{w} Rovers", "{w} Athletic", "{w} United", "{w} Wanderers", "{w} Harriers"]

CLUB = Kind(
    "club",
    lambda c: (lambda n: (n, n))(c.rng.choice(_CLUB_FORMS).format(w=c.word(2, 3))),
    (
        (
            F("founded", lambda c: c.year(0, 0),
              ("{n} was founded in {a} by a group of railway workers.", "In what year was {n} founded?"),),
            F("sport", lambda c: c.pick(["football", "rugby", "hockey", "basketball", "handball", "volleyball"]),
              ("{n} mainly plays {a}, although it also has a small cycling team.",
               "What does {n} mainly play?"),),
            F("town", lambda c: c.word(2, 3),
              ("{n} is based in the town of {a}, near the northern border.", "In which town is {n} based?"),),
        ),
        (
            F("stadium", lambda c: c.word(2, 2) + " Park",
              ("{n} plays its home games at {a}, an old ground by the river.",
               "Where does {n} play its home games?"),),
            F("capacity", lambda c: c.num(900, 40000, commas=True),
              ("The home ground of {n} holds {a} spectators.", "How many spectators does the home ground of {n} hold?"),),
            F("shirts", lambda c: c.pick(_COLOURS, ("black",)),
              ("The players of {n} wear {a} shirts with black sleeves.",
               "What colour shirts do the players of {n} wear?"),),
            F("mascot", lambda c: c.pick(["heron", "fox", "badger", "otter", "lynx", "stag", "falcon", "wolf",
                                          "boar", "owl", "hare", "raven"]),
              ("The mascot of {n} is a {a}, which also appears on the club badge.", "What is the mascot of {n}?"),),
        ),
        (
            F("coach", lambda c: c.person(),
              ("The coach of {n} is {a}, a former goalkeeper of the club.", "Who is the coach of {n}?"),),
            F("scorer", lambda c: c.person(),
              ("The top scorer in the history of {n} is {a}.", "Who is the top scorer in the history of {n}?"),),
            F("titles", lambda c: c.num(2, 12),
              ("{n} has won the national championship {a} times.",
               "How many times has {n} won the national championship?"),),
        ),
        (
            F("rival", lambda c: c.rng.choice(_CLUB_FORMS).format(w=c.word(2, 3)),
              ("The fiercest rival of {n} is {a}, a club from across the river.",
               "Who is the fiercest rival of {n}?"),),
            F("first_title", lambda c: c.year(10, 90),
              ("{n} won its first national title in {a} after a dramatic final.",
               "In what year did {n} win its first national title?"),),
            F("fans", lambda c: c.pick(["the Millers", "the Lanterns", "the Anchors", "the Ravens", "the Hammers",
                                        "the Pilgrims", "the Saints", "the Foxes"]),
              ("The supporters of {n} are known as {a} in the local press.",
               "What are the supporters of {n} known as?"),),
        ),
    ),
    (
        "Its matches against local teams often draw large and noisy crowds.",
        "The club also runs a school where young players learn the game.",
        "Old photographs of the team hang in a small room under the stand.",
    ),
)

_BAND_FORMS = ["{w} Quartet", "{w} Ensemble", "{w} Choir", "{w} Band", "{w} Orchestra"]

BAND = Kind(
    "band",
    lambda c: (lambda n: (n, n))(c.rng.choice(_BAND_FORMS).format(w=c.word(2, 3))),
    (
        (
            F("formed", lambda c: c.year(0, 0),
              ("The {n} was formed in {a} by four friends from the same street.", "In what year was the {n} formed?"),),
            F("city", lambda c: c.word(2, 3),
              ("The {n} comes from the city of {a}, where it still plays every summer.",
               "Which city does the {n} come from?"),),
            F("leader", lambda c: c.person(),
              ("The leader of the {n} is the singer {a}, who also writes most of its songs.",
               "Who is the leader of the {n}?"),),
        ),
        (
            F("instrument", lambda c: c.pick(_INSTRUMENTS),
              ("The sound of the {n} is built around the {a}, which is rare in popular music.",
               "Around which instrument is the sound of the {n} built?"),),
            F("members", lambda c: c.num(3, 12),
              ("The {n} has {a} members, and most of them play more than one instrument.",
               "How many members does the {n} have?"),),
            F("jackets", lambda c: c.pick(_COLOURS),
              ("On stage, the members of the {n} always wear {a} jackets.",
               "What colour jackets do the members of the {n} wear on stage?"),),
        ),
        (
            F("album", lambda c: c.rng.choice(["{w} Nights", "Songs of {w}", "The {w} Road", "Leaving {w}"]).format(
                w=c.word(2, 3)),
              ("The first album of the {n} was called {a}.", "What was the first album of the {n} called?"),),
            F("hit", lambda c: c.rng.choice(["{w} Morning", "Rain over {w}", "The {w} Waltz", "Dear {w}"]).format(
                w=c.word(2, 3)),
              ("The best-known song of the {n} is {a}, which was played on the radio for months.",
               "What is the best-known song of the {n}?"),),
            F("label", lambda c: c.word(2, 3) + " Records",
              ("The {n} records its music for the small label {a}.", "For which label does the {n} record?"),),
        ),
        (
            F("tour", lambda c: c.year(2, 30),
              ("In {a}, the {n} went on its first tour abroad.",
               "In what year did the {n} go on its first tour abroad?"),),
            F("prize", lambda c: c.word(2, 2) + " Prize",
              ("The {n} won the {a} for its third album.", "Which prize did the {n} win for its third album?"),),
            F("hall", lambda c: c.word(2, 3) + " Hall",
              ("The most famous concert of the {n} took place in the {a}.",
               "Where did the most famous concert of the {n} take place?"),),
        ),
    ),
    (
        "Its songs are simple and often tell stories about ordinary people.",
        "Critics have praised the warm and unusual sound of its recordings.",
        "Its concerts usually end with the whole audience singing along.",
    ),
)

KINDS: tuple[Kind, ...] = (TOWN, PERSON, COMPANY, SPECIES, SHIP, FESTIVAL, INVENTION, RIVER, CLUB, BAND)

# ---------------------------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------------------------


def _render(template: str, name: str, answer: str) -> tuple[str, int]:
    """Fill ``{n}``/``{a}``; return the sentence and the offset of the answer in it."""
    pre, post = template.split("{a}")
    pre = pre.replace("{n}", name)
    post = post.replace("{n}", name)
    sent = pre + answer + post
    return sent[0].upper() + sent[1:], len(pre)


def _article(kind: Kind, ctx: _Ctx, art_id: str) -> dict:
    rng = ctx.rng
    title, name = kind.make_name(ctx)
    paragraphs = []
    for p_idx, section in enumerate(kind.sections):
        k = min(len(section), rng.choice((3, 3, 4)))
        chosen = sorted(rng.sample(range(len(section)), k))  # keep the section's natural order
        items: list[tuple[str, str | None, str | None, int]] = []  # (sentence, question, answer, offset)
        for i in chosen:
            fact = section[i]
            answer = fact.value(ctx)
            sent_t, q_t = rng.choice(fact.variants)
            sent, off = _render(sent_t, name, answer)
            q = q_t.replace("{n}", name)
            items.append((sent, q, answer, off))
        if kind.fillers and rng.random() < 0.5:
            filler = rng.choice(kind.fillers)
            items.insert(rng.randint(1, len(items)), (filler, None, None, 0))
        context, qas = "", []
        for sent, q, answer, off in items:
            if context:
                context += " "
            if q is not None:
                qas.append({
                    "id": f"{art_id}-p{p_idx}-q{len(qas)}",
                    "question": q,
                    "is_impossible": False,
                    "answers": [{"text": answer, "answer_start": len(context) + off}],
                })
            context += sent
        paragraphs.append({"context": context, "qas": qas})
    return {"title": title, "kind": kind.name, "paragraphs": paragraphs}


def generate_squad(n_articles: int = 200, seed: int = 0, kinds: tuple[str, ...] | None = None) -> dict:
    """``n_articles`` invented articles in SQuAD v2 JSON form (``{"version": "v2.0", "data": [...]}``).

    Deterministic in ``(n_articles, seed, kinds)``; article kinds cycle through ``kinds`` (default: all ten) in a
    seeded shuffled order, so topics are balanced. Names are unique across the whole output.
    """
    if n_articles < 0:
        raise ValueError(f"n_articles must be >= 0, got {n_articles}")
    by_name = {k.name: k for k in KINDS}
    if kinds is None:
        pool = list(KINDS)
    else:
        unknown = [k for k in kinds if k not in by_name]
        if unknown:
            raise ValueError(f"unknown article kind(s) {unknown}; allowed: {sorted(by_name)}")
        pool = [by_name[k] for k in kinds]
    rng = random.Random(f"synthetic-articles:{seed}")
    used: set[str] = set()
    data = []
    order: list[Kind] = []
    for a in range(n_articles):
        if not order:
            order = list(pool)
            rng.shuffle(order)
        kind = order.pop()
        ctx = _Ctx(rng=rng, used=used, base_year=rng.randint(1520, 1890))
        data.append(_article(kind, ctx, f"syn{seed}-{a:05d}"))
    return {"version": "v2.0", "data": data}


if __name__ == "__main__":  # pragma: no cover - quick look at the output
    import json
    import sys

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    print(json.dumps(generate_squad(n, 0), indent=1))
