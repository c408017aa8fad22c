"""Built-in task generators: the files load back, ground truths are right (checked by solvers
written independently here), splits do not overlap, generation is reproducible."""

from __future__ import annotations

import itertools
import re
from collections import Counter
from fractions import Fraction

import pytest

from lmrl.cli import main as cli_main
from lmrl.data import TASKS, RLDataset, generate_rows, write_task
from lmrl.errors import DataError
from lmrl.models.tiny import build_tokenizer
from lmrl.rewards.scorers import default_compute_score

SIZES = {"num_train": 50, "num_test": 20}  # shapes has 72 prompts in all


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def rows():
    return {name: generate_rows(name, seed=11, **SIZES) for name in TASKS}


def contents(split_rows):
    return [r["prompt"][0]["content"] for r in split_rows]


def test_task_names_and_unknown_task(tmp_path):
    assert sorted(TASKS) == [
        "add", "arithmetic", "compare", "count", "countdown", "digits", "knights_knaves",
        "search_qa", "shapes", "sort",
    ]  # fmt: skip
    with pytest.raises(
        ValueError,
        match="unknown task 'sudoku'; tasks: add, arithmetic, compare, count, countdown",
    ):
        write_task("sudoku", tmp_path)
    with pytest.raises(ValueError, match="num_train"):
        generate_rows("digits", num_train=-1)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_parquet_loads_back_through_lmrl_data(name, tmp_path, tok):
    paths = write_task(name, tmp_path / name, seed=5, num_train=12, num_test=4)
    assets = {"search_qa": {"corpus"}, "shapes": {"images"}}.get(name, set())
    assert set(paths) == {"train", "test"} | assets
    train = RLDataset(paths["train"], tok)
    test = RLDataset(paths["test"], tok)
    assert (len(train), len(test)) == (12, 4)
    row = train[0]
    assert row["data_source"] == name
    assert row["extra_info"]["split"] == "train" and row["extra_info"]["index"] == 0
    assert [test[i]["extra_info"]["split"] for i in range(4)] == ["test"] * 4
    assert tok.decode(row["input_ids"]).endswith("<|im_start|>assistant\n")
    batch = train.get_batch([0, 1, 2])
    assert batch["input_ids"].shape[0] == 3
    assert list(batch["ground_truth"]) == [train[i]["ground_truth"] for i in range(3)]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_splits_do_not_overlap_and_prompts_are_unique(name, rows):
    train, test = contents(rows[name]["train"]), contents(rows[name]["test"])
    assert (len(train), len(test)) == (SIZES["num_train"], SIZES["num_test"])
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_seeded_generation_is_reproducible(name, rows):
    assert generate_rows(name, seed=11, **SIZES) == rows[name]
    assert contents(generate_rows(name, seed=12, **SIZES)["train"]) != contents(rows[name]["train"])


def test_too_small_a_prompt_space_is_an_error():
    with pytest.raises(ValueError, match="only 10 distinct prompts"):
        generate_rows("digits", num_train=20, num_test=0, min_len=1, max_len=1)


# ---------------------------------------------------------------------------- digits
def test_digits_ground_truth(rows):
    for row in rows["digits"]["train"] + rows["digits"]["test"]:
        content = row["prompt"][0]["content"]
        op, digits = content.split(" ")
        assert op == "reverse" and 4 <= len(digits) <= 6 and digits.isdigit()
        assert row["reward_model"] == {"style": "rule", "ground_truth": digits[::-1]}
    sorted_rows = generate_rows("digits", num_train=5, num_test=0, op="sort")["train"]
    for row in sorted_rows:
        digits = row["prompt"][0]["content"].removeprefix("sort ")
        assert row["reward_model"]["ground_truth"] == "".join(sorted(digits))


# ---------------------------------------------------------------------------- small tasks
def _answers_score_one(name, row):
    truth = row["reward_model"]["ground_truth"]
    out = default_compute_score(name, f"{truth}<|im_end|>", truth, row["extra_info"])
    assert out == {"score": 1.0, "acc": 1.0}


def test_count_ground_truth(rows):
    counts = Counter()
    for row in rows["count"]["train"] + rows["count"]["test"]:
        digits, digit = re.fullmatch(r"(\d+) count (\d)", row["prompt"][0]["content"]).groups()
        assert 5 <= len(digits) <= 9 and row["extra_info"]["digit"] == digit
        assert row["reward_model"]["ground_truth"] == str(digits.count(digit))
        counts[digits.count(digit)] += 1
        _answers_score_one("count", row)
    assert set(counts) == {0, 1, 2, 3, 4}  # every count occurs, not mostly 0-1


def test_sort_ground_truth(rows):
    for row in rows["sort"]["train"] + rows["sort"]["test"]:
        letters = row["prompt"][0]["content"].removeprefix("sort ")
        assert 3 <= len(letters) <= 6 and letters.isalpha() and letters.islower()
        assert row["reward_model"]["ground_truth"] == "".join(sorted(letters))
        _answers_score_one("sort", row)


def column_carries(a: str, b: str) -> int:
    """Carries of ``a + b`` done column by column on the digit strings (this test's own)."""
    carry = total = 0
    for x, y in zip(a.zfill(4)[::-1], b.zfill(4)[::-1], strict=True):
        carry = (int(x) + int(y) + carry) // 10
        total += carry
    return total


def test_add_ground_truth_and_carries(rows):
    carried = 0
    for row in rows["add"]["train"] + rows["add"]["test"]:
        a, b = re.fullmatch(r"([1-9]\d?)\+([1-9]\d?)", row["prompt"][0]["content"]).groups()
        assert row["reward_model"]["ground_truth"] == str(int(a) + int(b))
        assert row["extra_info"]["carries"] == column_carries(a, b)
        carried += column_carries(a, b) > 0
        _answers_score_one("add", row)
    assert 0.5 < carried / (SIZES["num_train"] + SIZES["num_test"]) < 0.9
    for row in generate_rows("add", num_train=30, num_test=0, seed=2, min_carries=2)["train"]:
        a, b = row["prompt"][0]["content"].split("+")
        assert column_carries(a, b) == 2


def test_add_carry_count():
    from lmrl.data.small_tasks import _carries

    pairs = ((47, 85), (15, 14), (999, 1), (50, 50), (95, 5))
    assert [_carries(*p) for p in pairs] == [column_carries(str(a), str(b)) for a, b in pairs]
    assert [_carries(*p) for p in pairs] == [2, 0, 3, 1, 2]


def test_compare_ground_truth(rows):
    for row in rows["compare"]["train"] + rows["compare"]["test"]:
        numbers = row["prompt"][0]["content"].removeprefix("max ").split(" ")
        assert len(numbers) == 3 and len(set(numbers)) == 3
        assert all(n.isdigit() and len(n) <= 2 and str(int(n)) == n for n in numbers)
        assert row["reward_model"]["ground_truth"] == str(max(map(int, numbers)))
        assert row["extra_info"]["numbers"] == numbers
        _answers_score_one("compare", row)


@pytest.mark.parametrize(
    "name, options, match",
    [
        ("count", {"min_len": 0}, "count: need 1 <= min_len"),
        ("sort", {"min_len": 4, "max_len": 3}, "sort: need 1 <= min_len"),
        ("add", {"min_digits": 0}, "add: need 1 <= min_digits"),
        ("add", {"min_carries": 3}, "add: need 0 <= min_carries <= max_digits"),
        ("compare", {"min_count": 1}, "compare: need 2 <= min_count"),
        ("compare", {"max_digits": 0}, "compare: need max_digits >= 1"),
    ],
)
def test_small_task_bad_options(name, options, match):
    with pytest.raises(DataError, match=match):
        generate_rows(name, num_train=1, num_test=0, **options)


# ---------------------------------------------------------------------------- arithmetic
def solve_word_problem(text: str) -> int:
    """An interpreter of the problems' sentences, written for this test."""
    question = text.split(" Let's think")[0]
    n = [int(x) for x in re.findall(r"\d+", question)]
    if re.search(r"at \$\d+ each and pays with a \$\d+ bill", question):
        count, price, bill = n
        return bill - count * price
    if "pages every day" in question:
        return n[0] * n[1] + (n[2] if len(n) == 3 else 0)
    if question.startswith("A shop has"):
        return n[0] * n[1] - n[2]
    if "equally among" in question:
        kept = int(re.search(r"keeps (\d+)", question).group(1)) if "keeps" in question else 0
        friends = int(re.search(r"among (\d+) friends", question).group(1))
        assert (n[0] - kept) % friends == 0
        return (n[0] - kept) // friends
    sentences = question.split(". ")
    value = int(re.search(r"has (\d+)", sentences[0]).group(1))
    for sentence in sentences[1:-1]:
        number = re.search(r"\d+", sentence)
        if "buys" in sentence:
            value += int(number.group())
        elif "gives away" in sentence:
            value -= int(number.group())
        elif "half" in sentence:
            assert value % 2 == 0
            value //= 2
        elif "doubles" in sentence:
            value *= 2
        elif "triples" in sentence:
            value *= 3
        else:
            raise AssertionError(f"unknown sentence {sentence!r}")
    return value


def test_arithmetic_ground_truth(rows):
    for row in rows["arithmetic"]["train"] + rows["arithmetic"]["test"]:
        content = row["prompt"][0]["content"]
        assert content.endswith('output the final answer after "####".')
        truth = row["reward_model"]["ground_truth"]
        assert truth == str(solve_word_problem(content))
        assert int(truth) >= 0
        assert default_compute_score("arithmetic", f"so #### {truth}", truth)["score"] == 1.0


# ---------------------------------------------------------------------------- countdown
def test_countdown_ground_truth(rows):
    for row in rows["countdown"]["train"] + rows["countdown"]["test"]:
        truth = row["reward_model"]["ground_truth"]
        numbers, target = truth["numbers"], truth["target"]
        assert 3 <= len(numbers) <= 4 and 1 <= target <= 99
        content = row["prompt"][0]["content"]
        assert str(numbers) in content and f"equals {target}" in content
        solution = row["extra_info"]["solution"]
        assert re.fullmatch(r"[0-9+\-*/() ]+", solution)
        assert abs(eval(solution) - target) < 1e-9  # only digits and operators: safe to eval
        assert Counter(int(x) for x in re.findall(r"\d+", solution)) == Counter(numbers)
        answer = f"<answer>{solution}</answer>"
        assert default_compute_score("countdown", answer, truth)["score"] == 1.0


def reachable(numbers: list[int]) -> set[Fraction]:
    """Every value of an expression using each number once: split into two non-empty
    sub-multisets in every way (a brute force independent of the generator's)."""
    if len(numbers) == 1:
        return {Fraction(numbers[0])}
    out = set()
    idx = range(len(numbers))
    for k in range(1, len(numbers)):
        for left in itertools.combinations(idx, k):
            a = reachable([numbers[i] for i in left])
            b = reachable([numbers[i] for i in idx if i not in left])
            for x in a:
                for y in b:
                    out |= {x + y, x - y, x * y}
                    if y:
                        out.add(x / y)
    return out


def test_countdown_solver_agrees_with_an_independent_brute_force():
    from lmrl.data.countdown import solve

    for numbers, target in [
        ([5, 3, 2], 16),
        ([7, 7, 7], 1),
        ([1, 1, 1], 99),
        ([6, 4, 2], 3),
        ([2, 3, 5, 7], 97),
    ]:
        expected = Fraction(target) in reachable(numbers)
        assert (solve(numbers, target) is not None) == expected


# ---------------------------------------------------------------------------- knights and knaves
LEAF = re.compile(r"(\w+) is a (knight|knave)")


def parse_claim(text: str):
    """English statement -> function of {name: is_knight} (a parser written for this test)."""
    if text.startswith(("It ", "If ")):  # a capitalised keyword, never a name
        text = text[0].lower() + text[1:]

    def leaf(s):
        name, role = LEAF.fullmatch(s).groups()
        return lambda w: w[name] == (role == "knight")

    if text.startswith("it is not the case that "):
        inner = leaf(text.removeprefix("it is not the case that "))
        return lambda w: not inner(w)
    if text.startswith("if "):
        a, b = text.removeprefix("if ").split(" then ")
        fa, fb = leaf(a), leaf(b)
        return lambda w: (not fa(w)) or fb(w)
    for word, op in (
        (" if and only if ", lambda x, y: x == y),
        (" and ", lambda x, y: x and y),
        (" or ", lambda x, y: x or y),
    ):
        if word in text:
            a, b = text.split(word)
            fa, fb = leaf(a), leaf(b)
            return lambda w, fa=fa, fb=fb, op=op: op(fa(w), fb(w))
    return leaf(text)


def test_knights_knaves_unique_solution_by_brute_force(rows):
    sizes = set()
    for row in rows["knights_knaves"]["train"] + rows["knights_knaves"]["test"]:
        content = row["prompt"][0]["content"]
        names_text = re.search(r"You meet \d+ inhabitants: (.*?)\. ", content).group(1)
        names = re.split(r", | and ", names_text)
        claims = dict(re.findall(r'(\w+) says, "(.*?)\."', content))
        assert sorted(claims) == sorted(names)
        fns = {name: parse_claim(claim) for name, claim in claims.items()}
        consistent = []
        for roles in itertools.product([True, False], repeat=len(names)):
            world = dict(zip(names, roles, strict=True))
            if all(fns[name](world) == world[name] for name in names):
                consistent.append(list(roles))
        truth = row["reward_model"]["ground_truth"]
        assert truth["names"] == names
        assert consistent == [truth["solution"]]
        assert row["extra_info"]["num_people"] == len(names)
        sizes.add(len(names))
        answer = f"<think>...</think><answer>{truth['solution_text_format']}</answer>"
        assert default_compute_score("knights_knaves", answer, truth)["score"] == 3.0
    assert min(sizes) >= 2 and max(sizes) <= 8 and len(sizes) >= 5


def test_knights_knaves_size_range():
    for row in generate_rows(
        "knights_knaves", num_train=10, num_test=0, min_people=8, max_people=8
    )["train"]:
        assert len(row["reward_model"]["ground_truth"]["names"]) == 8
    with pytest.raises(ValueError, match="min_people"):
        generate_rows("knights_knaves", num_train=1, num_test=0, min_people=1)


# ---------------------------------------------------------------------------- the command line
def test_lmrl_tasks_command(tmp_path, capsys):
    assert cli_main(["tasks"]) == 0
    assert capsys.readouterr().out.split() == sorted(TASKS)
    out = tmp_path / "digits"
    assert (
        cli_main(
            [
                "tasks",
                "digits",
                "--out",
                str(out),
                "--seed",
                "3",
                "--num-train",
                "8",
                "--num-test",
                "4",
            ]
        )
        == 0
    )
    assert (out / "train.parquet").is_file() and (out / "test.parquet").is_file()
    assert cli_main(["tasks", "sudoku", "--out", str(out)]) == 2
    assert "tasks: add, arithmetic, compare" in capsys.readouterr().err


def test_write_task_into_a_file_is_refused_and_leaves_it(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    with pytest.raises(DataError, match=r"notes\.txt is a file, not a directory"):
        write_task("digits", target, num_train=2, num_test=1)
    assert target.read_text() == "keep me"
    with pytest.raises(DataError, match="cannot write the digits task"):  # a file as a parent
        write_task("digits", target / "sub", num_train=2, num_test=1)


def test_bad_task_arguments_are_data_errors():
    for kwargs in ({"name": "sudoku"}, {"name": "digits", "num_train": -1}):
        with pytest.raises(DataError):
            generate_rows(**kwargs)


def test_search_qa_needs_its_corpus_and_holds_test_people_out(tmp_path):
    """Every answer is in the corpus it writes, and no person asked about in test is asked
    about in train (so answers learned by heart do not help on test)."""
    import pyarrow.parquet as pq

    paths = write_task("search_qa", tmp_path, seed=1, num_train=400, num_test=100, two_hop=0.5)
    corpus = {r["title"]: r["text"] for r in pq.read_table(paths["corpus"]).to_pylist()}
    people = {}
    for split in ("train", "test"):
        rows = pq.read_table(paths[split]).to_pylist()
        people[split] = {r["extra_info"]["queries"][0] for r in rows}
        for r in rows:
            queries, facts = r["extra_info"]["queries"], r["extra_info"]["facts"]
            assert len(queries) == r["extra_info"]["hops"]
            for query, fact in zip(queries, facts, strict=True):
                assert f"{query} lives in" in corpus[query] and fact in corpus[query]
            assert r["reward_model"]["ground_truth"]["target"] == [facts[-1]]
    assert not people["train"] & people["test"]
    hops = [r["extra_info"]["hops"] for r in pq.read_table(paths["train"]).to_pylist()]
    assert 0.35 < sum(h == 2 for h in hops) / len(hops) < 0.65
