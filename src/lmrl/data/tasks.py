"""The built-in tasks, generated procedurally and written as verl-style parquet.

``TASKS`` maps a name to a `TaskSpec` whose generator draws one example from a
``random.Random``; `write_task` writes ``train.parquet`` and ``test.parquet`` with verl's
columns::

    data_source  the task's name (also its scorer's name)
    prompt       [{"role": "user", "content": ...}]
    ability      "digits" | "math" | "logic" | "counting" | "sorting" | "comparison" | "search"
    reward_model {"style": "rule", "ground_truth": ...}
    extra_info   {"split": "train" | "test", "index": i, ...task fields}

Choices: generation is seeded and sequential (the same seed writes the same files); the
test split is drawn first and every prompt is unique across both splits (train never contains
a test prompt); a task whose space of prompts is too small for the requested sizes is an error
rather than a silent repeat.

- ``digits`` (the demo's task): ``"reverse 48213"`` -> ``"31284"``, 4-6 digits, short enough
  for a char-level model trained from scratch; ``op="sort"`` sorts instead.
- ``arithmetic``: GSM8K-style word problems (a few sentence templates, small integers, 1-3
  operations) answered after ``####``; the ground truth is the integer as a string, as in
  verl's preprocessed GSM8K.
- ``countdown``: see ``lmrl.data.countdown``.
- ``knights_knaves``: see ``lmrl.data.knights_knaves``.
- ``count``, ``sort``, ``add``, ``compare``: small tasks for tiny models, see
  ``lmrl.data.small_tasks``.
- ``search_qa``: questions only a search tool answers (it also writes ``corpus.parquet``),
  see ``lmrl.data.search_qa``.
- ``shapes``: prompts for a flow-matching image model and the images it is pre-trained on
  (``images.parquet``), see ``lmrl.data.shapes``.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmrl.data import countdown, knights_knaves, search_qa, shapes, small_tasks
from lmrl.errors import DataError

Example = tuple[str, Any, dict[str, Any]]  # (prompt content, ground truth, extra_info fields)


@dataclass(frozen=True)
class TaskSpec:
    """A built-in task.

    Attributes:
        name: the task name, also its ``data_source``.
        generate: ``generate(rng, **options) -> (content, ground_truth, extra fields)``.
        ability: verl's ``ability`` column.
        num_train, num_test: default split sizes.
        description: one line for ``lmrl tasks``.
        assets: ``assets(out_dir, **options) -> Path`` writes a file the task needs beside its
            splits (``search_qa``'s corpus), or None. A generator with a ``split`` parameter
            is told which split it draws for.
    """

    name: str
    generate: Callable[..., Example]
    ability: str
    num_train: int
    num_test: int
    description: str
    assets: Callable[..., Path] | None = None


# ---------------------------------------------------------------------------- digits
DIGIT_OPS = ("reverse", "sort")


def generate_digits(
    rng: random.Random, op: str = "reverse", min_len: int = 4, max_len: int = 6
) -> Example:
    """``"reverse 48213"`` -> ``"31284"`` (or ``"sort 48213"`` -> ``"12348"``).

    Args:
        rng: the task's random generator.
        op: ``"reverse"`` or ``"sort"``.
        min_len, max_len: the number of digits is uniform in this range.
    """
    if op not in DIGIT_OPS:
        raise DataError(f"digits: op must be one of {list(DIGIT_OPS)}, got {op!r}")
    if not 1 <= min_len <= max_len:
        raise DataError(f"digits: need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))
    answer = digits[::-1] if op == "reverse" else "".join(sorted(digits))
    return f"{op} {digits}", answer, {"op": op}


# ---------------------------------------------------------------------------- arithmetic
_PEOPLE = (("Tom", "he"), ("Anna", "she"), ("Ravi", "he"), ("Mei", "she"), ("Carlos", "he"),
           ("Fatima", "she"), ("Jonas", "he"), ("Lena", "she"), ("Kofi", "he"), ("Sara", "she"))  # fmt: skip
_ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells")
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def _story(rng: random.Random) -> tuple[str, int]:
    """A quantity changed by 1-3 steps (buy, give away, double, halve)."""
    (name, pron), item = rng.choice(_PEOPLE), rng.choice(_ITEMS)
    value = rng.randint(2, 30)
    sentences = [f"{name} has {value} {item}."]
    for _ in range(rng.randint(1, 3)):
        step = rng.choice(("add", "sub", "mul", "half"))
        if step == "half" and value % 2 == 0 and value > 0:
            sentences.append(f"{pron.capitalize()} gives half of them to a friend.")
            value //= 2
        elif step == "mul" and value <= 50:
            k = rng.choice((2, 3))
            word = {2: "doubles", 3: "triples"}[k]
            sentences.append(f"Then {pron} {word} the number of {item} {pron} has.")
            value *= k
        elif step == "sub" and value > 1:
            b = rng.randint(1, value - 1)
            sentences.append(f"{pron.capitalize()} gives away {b} {item}.")
            value -= b
        else:
            b = rng.randint(1, 20)
            sentences.append(f"{pron.capitalize()} buys {b} more {item}.")
            value += b
    sentences.append(f"How many {item} does {name} have now?")
    return " ".join(sentences), value


def _shopping(rng: random.Random) -> tuple[str, int]:
    (name, _), item = rng.choice(_PEOPLE), rng.choice(_ITEMS)
    count, price = rng.randint(2, 9), rng.randint(1, 9)
    bill = rng.choice([b for b in (10, 20, 50, 100) if b >= count * price])
    text = (
        f"{name} buys {count} {item} at ${price} each and pays with a ${bill} bill. "
        f"How much change, in dollars, does {name} get?"
    )
    return text, bill - count * price


def _reading(rng: random.Random) -> tuple[str, int]:
    (name, pron) = rng.choice(_PEOPLE)
    per_day, days = rng.randint(3, 25), rng.randint(2, 7)
    if rng.random() < 0.5:
        return (
            f"{name} reads {per_day} pages every day for {days} days. "
            f"How many pages does {pron} read in total?",
            per_day * days,
        )
    extra = rng.randint(1, 30)
    return (
        f"{name} reads {per_day} pages every day for {days} days, and then {extra} more pages "
        f"on the last evening. How many pages does {pron} read in total?",
        per_day * days + extra,
    )


def _sharing(rng: random.Random) -> tuple[str, int]:
    (name, pron), item = rng.choice(_PEOPLE), rng.choice(_ITEMS)
    friends, each = rng.randint(2, 6), rng.randint(2, 9)
    kept = rng.randint(1, 9) if rng.random() < 0.5 else 0
    self_ = "herself" if pron == "she" else "himself"
    share = (
        f"keeps {kept} for {self_} and shares the rest equally" if kept else "shares them equally"
    )
    return (
        f"{name} has {friends * each + kept} {item}. {pron.capitalize()} {share} among "
        f"{friends} friends. How many {item} does each friend get?",
        each,
    )


def _boxes(rng: random.Random) -> tuple[str, int]:
    item = rng.choice(_ITEMS)
    boxes, per_box = rng.randint(2, 9), rng.randint(3, 12)
    lost = rng.randint(1, boxes * per_box - 1)
    return (
        f"A shop has {boxes} boxes with {per_box} {item} in each box. {lost} of the {item} "
        f"are damaged. How many {item} are not damaged?",
        boxes * per_box - lost,
    )


_TEMPLATES = (_story, _shopping, _reading, _sharing, _boxes)


def generate_arithmetic(rng: random.Random) -> Example:
    """A GSM8K-style word problem; the ground truth is the integer answer as a string."""
    question, answer = rng.choice(_TEMPLATES)(rng)
    return f"{question} {GSM8K_INSTRUCTION}", str(answer), {"answer": answer}


# ---------------------------------------------------------------------------- registry
TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec(
            "digits", generate_digits, "digits", 10_000, 256,
            "reverse 4-6 digits, partial credit per position (the demo's task)",
        ),
        TaskSpec(
            "arithmetic", generate_arithmetic, "math", 5_000, 256,
            "GSM8K-style word problems, answer after ####",
        ),
        TaskSpec(
            "countdown", countdown.generate, "math", 5_000, 256,
            "reach a target with + - * / and each number once, <answer> equation",
        ),
        TaskSpec(
            "knights_knaves", knights_knaves.generate, "logic", 5_000, 256,
            "Logic-RL's Knights and Knaves puzzles, 2-8 people, unique solution",
        ),
        TaskSpec(
            "count", small_tasks.generate_count, "counting", 10_000, 256,
            "4373931 count 3 -> 3; 1 right, 0.1 any other number",
        ),
        TaskSpec(
            "sort", small_tasks.generate_sort, "sorting", 10_000, 256,
            "sort dbfa -> abdf (3-6 letters), partial credit per position",
        ),
        TaskSpec(
            "add", small_tasks.generate_add, "math", 8_000, 256,
            "47+85 -> 132 (numbers below 100), partial credit per digit",
        ),
        TaskSpec(
            "compare", small_tasks.generate_compare, "comparison", 10_000, 256,
            "max 47 5 81 -> 81 (3 numbers), partial credit by rank",
        ),
        TaskSpec(
            "search_qa", search_qa.generate, "search", 2_000, 256,
            "where does Vokar live? (invented people, answer by searching the corpus it "
            "writes; a quarter need two searches), exact match",
            assets=search_qa.write_corpus,
        ),
        TaskSpec(
            "shapes", shapes.generate, "image", 60, 12,
            "two red circles on the left: prompts for the flow model (lmrl demo --task flow), "
            "and images.parquet, the set it is pre-trained on",
            assets=shapes.write_images,
        ),
    )
}  # fmt: skip


def get_task(name: str) -> TaskSpec:
    """The task called ``name``.

    Raises:
        DataError: an unknown name (the message lists the tasks).
    """
    if name not in TASKS:
        raise DataError(f"unknown task {name!r}; tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def generate_rows(
    name: str,
    num_train: int | None = None,
    num_test: int | None = None,
    seed: int = 0,
    prompt_format: str | None = None,
    **options: Any,
) -> dict[str, list[dict[str, Any]]]:
    """Generate both splits of a task as lists of verl-style rows.

    Args:
        name: a key of ``TASKS``.
        num_train, num_test: split sizes (default the task's).
        seed: the generator's seed.
        prompt_format: None writes the prompt as chat messages (``[{"role": "user",
            "content": ...}]``, templated at training time); a format string with one ``{}``
            writes it as a plain string (e.g. ``"{}="`` gives ``"reverse 48213="``), rendered
            as one user turn under the chat template unless ``data.prompt_template=verbatim``
            keeps it as it is (shorter prompts for tiny models; ``lmrl.data.layout``).
        **options: passed to the task's generator (e.g. ``op="sort"`` for ``digits``).

    Returns:
        ``{"train": rows, "test": rows}``; no prompt appears twice.

    Raises:
        DataError: an unknown task, a negative size, or too few distinct prompts for the
            sizes asked.
    """
    spec = get_task(name)
    if prompt_format is not None and (
        not isinstance(prompt_format, str) or prompt_format.count("{}") != 1
    ):
        raise DataError(
            f"prompt_format must be None or a string with exactly one '{{}}', got {prompt_format!r}"
        )
    sizes = {
        "test": spec.num_test if num_test is None else num_test,
        "train": spec.num_train if num_train is None else num_train,
    }
    for split, size in sizes.items():
        if not isinstance(size, int) or size < 0:
            raise DataError(f"num_{split} must be an int >= 0, got {size!r}")
    rng = random.Random(seed)
    takes_split = "split" in inspect.signature(spec.generate).parameters
    seen: set[str] = set()
    out: dict[str, list[dict[str, Any]]] = {}
    for split in ("test", "train"):
        rows: list[dict[str, Any]] = []
        misses = 0
        while len(rows) < sizes[split]:
            split_option = {"split": split} if takes_split else {}
            content, truth, extra = spec.generate(rng, **split_option, **options)
            if content in seen:
                misses += 1
                if misses > 100 * sizes[split] + 1000:
                    raise DataError(
                        f"task {name!r}: only {len(seen)} distinct prompts found, fewer than "
                        f"num_train + num_test = {sizes['train'] + sizes['test']}"
                    )
                continue
            seen.add(content)
            rows.append(
                {
                    "data_source": name,
                    "prompt": (
                        [{"role": "user", "content": content}]
                        if prompt_format is None
                        else prompt_format.replace("{}", content)
                    ),
                    "ability": spec.ability,
                    "reward_model": {"style": "rule", "ground_truth": truth},
                    "extra_info": {"split": split, "index": len(rows), **extra},
                }
            )
        out[split] = rows
    return {"train": out["train"], "test": out["test"]}


def write_task(
    name: str,
    out_dir: str | Path,
    seed: int = 0,
    num_train: int | None = None,
    num_test: int | None = None,
    prompt_format: str | None = None,
    **options: Any,
) -> dict[str, Path]:
    """Generate a built-in task and write ``train.parquet`` and ``test.parquet``.

    Args:
        name: a key of ``TASKS`` (``digits``, ``arithmetic``, ``countdown``, ``knights_knaves``).
        out_dir: the directory to write (created if missing).
        seed: the generator's seed (same seed, same files).
        num_train, num_test: split sizes (default the task's).
        prompt_format: None = chat-message prompts; a string with one ``{}`` = plain-string
            prompts (see `generate_rows`).
        **options: passed to the task's generator.

    Returns:
        ``{"train": path, "test": path}``, and the task's asset by its file's stem:
        ``"corpus"`` for ``search_qa``, ``"images"`` for ``shapes``.

    Raises:
        DataError: see `generate_rows`; or ``out_dir`` is a file or cannot be written (checked
            before anything is generated; a file there is left as it was).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"{out} is a file, not a directory; give a directory to write the task to")
    splits = generate_rows(name, num_train, num_test, seed, prompt_format, **options)
    paths = {}
    try:
        out.mkdir(parents=True, exist_ok=True)
        for split, rows in splits.items():
            path = out / f"{split}.parquet"
            pq.write_table(pa.Table.from_pylist(rows), path)
            paths[split] = path
        assets = get_task(name).assets
        if assets is not None:
            path = assets(out, **options)
            paths[path.stem] = path
    except OSError as err:  # a parent that is a file, no permission, a full disk
        raise DataError(f"cannot write the {name} task to {out}: {err}") from None
    return paths
