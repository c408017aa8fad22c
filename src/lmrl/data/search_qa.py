"""``search_qa``: questions about invented people, answerable only through a search tool.

A world is drawn from ``world_seed``: ``num_people`` people with invented names (two or three
syllables, all distinct), each living in one of ``num_cities`` invented cities and working
for another person. The corpus holds one passage per person, titled with the name::

    Vokar lives in Lumo and works for Quel.

Questions (``world_seed`` fixes the world, the task's seed the draw of questions):

- one hop, ``where does Vokar live?``: search ``Vokar``, read the city;
- two hops (a ``two_hop`` fraction), ``where does the boss of Vokar live?``: search
  ``Vokar``, read the boss ``Quel``, search ``Quel``, read the city.

No model knows these facts from its weights, and the people asked about in the test split are
never asked about in the train split (``test_fraction`` of the people are held out), so a
policy that memorizes train answers gains nothing on test: only searching helps. A guess
without searching is right about once in ``num_cities``.

The ground truth is Search-R1's ``{"target": [city]}``; ``extra_info`` holds the hops, the
names to search (``queries``), and each hop's city or boss (``facts``).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmrl.errors import DataError

__all__ = ["World", "generate", "make_world", "passage", "write_corpus"]

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z"]
_VOWELS = ["a", "e", "i", "o", "u"]
_CODAS = ["", "", "n", "r", "l", "s", "k"]


@dataclass(frozen=True)
class World:
    """People (names), where each lives, whom each works for, and who may be asked about in
    the test split."""

    people: tuple[str, ...]
    city: dict[str, str]
    boss: dict[str, str]
    held_out: frozenset[str]


def _name(rng: random.Random, syllables: int) -> str:
    parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)]
    return ("".join(parts) + rng.choice(_CODAS)).capitalize()


def _names(rng: random.Random, count: int, syllables: tuple[int, ...], taken: set[str]):
    out: list[str] = []
    while len(out) < count:
        name = _name(rng, rng.choice(syllables))
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


@functools.lru_cache(maxsize=8)
def make_world(
    world_seed: int = 0, num_people: int = 2000, num_cities: int = 50, test_fraction: float = 0.2
) -> World:
    """The world of ``world_seed`` (cached: every split and the corpus see the same one).

    Raises:
        DataError: sizes too small (fewer than 2 people or cities) or ``test_fraction``
            outside (0, 1).
    """
    if num_people < 4 or num_cities < 2:
        raise DataError(
            f"search_qa: need num_people >= 4 and num_cities >= 2, got {num_people}, {num_cities}"
        )
    if not 0 < test_fraction < 1:
        raise DataError(f"search_qa: test_fraction must be in (0, 1), got {test_fraction}")
    rng = random.Random(f"search_qa-world-{world_seed}")
    taken: set[str] = set()
    cities = _names(rng, num_cities, (2,), taken)
    people = _names(rng, num_people, (2, 3), taken)
    city = {p: rng.choice(cities) for p in people}
    boss = {p: rng.choice([q for q in rng.sample(people, 2) if q != p]) for p in people}
    held = frozenset(people[: max(1, int(num_people * test_fraction))])
    return World(tuple(people), city, boss, held)


def passage(world: World, person: str) -> dict[str, str]:
    """A person's passage: ``{"title": name, "text": "<name> lives in <city> and works for <boss>."}``."""
    return {
        "title": person,
        "text": f"{person} lives in {world.city[person]} and works for {world.boss[person]}.",
    }


def generate(
    rng: random.Random,
    split: str = "train",
    two_hop: float = 0.25,
    world_seed: int = 0,
    num_people: int = 2000,
    num_cities: int = 50,
    test_fraction: float = 0.2,
) -> tuple[str, Any, dict[str, Any]]:
    """One question of ``split`` (see the module docstring)."""
    if not 0 <= two_hop <= 1:
        raise DataError(f"search_qa: two_hop must be in [0, 1], got {two_hop}")
    world = make_world(world_seed, num_people, num_cities, test_fraction)
    pool = sorted(world.held_out) if split == "test" else world.people[len(world.held_out) :]
    person = rng.choice(pool)
    if rng.random() < two_hop:
        boss = world.boss[person]
        answer = world.city[boss]
        extra = {"hops": 2, "queries": [person, boss], "facts": [boss, answer]}
        return f"where does the boss of {person} live?", {"target": [answer]}, extra
    answer = world.city[person]
    extra = {"hops": 1, "queries": [person], "facts": [answer]}
    return f"where does {person} live?", {"target": [answer]}, extra


def write_corpus(
    out_dir: str | Path,
    world_seed: int = 0,
    num_people: int = 2000,
    num_cities: int = 50,
    test_fraction: float = 0.2,
    **_: Any,
) -> Path:
    """Write ``corpus.parquet`` (``title``, ``text``, one row per person) into ``out_dir``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    world = make_world(world_seed, num_people, num_cities, test_fraction)
    path = Path(out_dir) / "corpus.parquet"
    rows = [{"id": str(i), **passage(world, p)} for i, p in enumerate(world.people)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
