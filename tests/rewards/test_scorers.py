"""The built-in scorers on hand-written completions, adversarial ones included."""

from __future__ import annotations

import pytest

from lmrl.rewards.scorers import (
    SCORERS,
    BuiltinScorer,
    countdown,
    default_compute_score,
    digits,
    gsm8k,
    knights_knaves,
    math_boxed,
    small_tasks,
)

BIG = 100_000  # characters in the "100 kB completion" cases


# ---------------------------------------------------------------------------- digits
@pytest.mark.parametrize(
    ("response", "score", "acc"),
    [
        ("31284", 1.0, 1.0),
        ("31284<|im_end|>", 1.0, 1.0),
        ("  31284\n", 1.0, 1.0),
        ("31284<|im_end|>99999", 1.0, 1.0),  # everything after the end marker is ignored
        ("31280", 0.8, 0.0),  # 4 of 5 positions
        ("48213", 0.2, 0.0),  # the prompt itself: only the middle 2 matches
        ("3128", 0.8, 0.0),  # one short: 4 matches / max(4, 5)
        ("312845", 5 / 6, 0.0),  # one extra: 5 matches / 6
        ("", 0.0, 0.0),
        ("3 1 2 8 4", 1 / 9, 0.0),  # inner spaces are characters: only '3' matches
        ("３１２８４", 0.0, 0.0),  # fullwidth digits are not the answer
    ],
)
def test_digits_partial_credit(response, score, acc):
    out = digits.compute_score(response, "31284")
    assert out["score"] == pytest.approx(score)
    assert out["acc"] == acc


def test_digits_long_completion_is_penalised_by_its_length():
    out = digits.compute_score("3" * BIG, "31284")
    assert out["score"] == pytest.approx(1 / BIG)  # one position right out of 100k
    assert out["acc"] == 0.0


def test_digits_binary_scores_the_exact_match_only():
    assert digits.compute_score("31280", "31284", binary=True) == {"score": 0.0, "acc": 0.0}
    assert digits.compute_score("31284<|im_end|>", "31284", binary=True)["score"] == 1.0


# ---------------------------------------------------------------------------- small tasks
@pytest.mark.parametrize(
    ("name", "response", "truth", "extra", "score"),
    [
        ("count", "3<|im_end|>", "3", None, 1.0),
        ("count", " 3\n", "3", None, 1.0),
        ("count", "4", "3", None, 0.1),  # another number: the format's 0.1
        ("count", "03", "3", None, 0.1),
        ("count", "three", "3", None, 0.0),
        ("count", "3 4", "3", None, 0.0),
        ("count", "", "0", None, 0.0),
        ("sort", "abdf", "abdf", None, 1.0),
        ("sort", "abfd", "abdf", None, 0.5),  # 2 of 4 positions
        ("sort", "abd", "abdf", None, 0.75),  # one short
        ("sort", "abdff", "abdf", None, 0.8),  # one extra: 4 / 5
        ("add", "132", "132", None, 1.0),
        ("add", "122", "132", None, 2 / 3),  # one wrong carry, units and hundreds right
        ("add", "32", "132", None, 2 / 3),  # the carry out dropped: aligned from the right
        ("add", "1320", "132", None, 0.0),  # shifted left: nothing lines up
        ("add", "", "132", None, 0.0),
        ("compare", "81", "81", {"numbers": ["47", "5", "81"]}, 1.0),
        ("compare", "47", "81", {"numbers": ["47", "5", "81"]}, 0.25),  # second of 3
        ("compare", "5", "81", {"numbers": ["47", "5", "81"]}, 0.0),  # the smallest
        ("compare", "05", "81", {"numbers": ["47", "5", "81"]}, 0.0),  # not as listed
        ("compare", "99", "81", {"numbers": ["47", "5", "81"]}, 0.0),  # not listed
        ("compare", "47", "81", None, 0.0),  # no list: only the exact answer earns
    ],
)
def test_small_task_partial_credit(name, response, truth, extra, score):
    out = default_compute_score(name, response, truth, extra)
    assert out["score"] == pytest.approx(score)
    assert out["acc"] == float(score == 1.0)
    binary = SCORERS[name](response, truth, extra, binary=True)
    assert binary == {"score": out["acc"], "acc": out["acc"]}


def test_positional_credit_alignment():
    assert small_tasks.positional_credit("", "") == 1.0
    assert small_tasks.positional_credit("12", "123") == pytest.approx(2 / 3)
    assert small_tasks.positional_credit("23", "123", from_right=True) == pytest.approx(2 / 3)
    assert small_tasks.positional_credit("9" * BIG, "123", from_right=True) == pytest.approx(0)


# ---------------------------------------------------------------------------- gsm8k / arithmetic
@pytest.mark.parametrize(
    ("response", "truth", "strict", "flexible"),
    [
        ("3 + 4 = 7. #### 7", "7", 1.0, 1.0),
        ("#### 7.", "7", 1.0, 1.0),
        ("#### 1,234", "1234", 1.0, 1.0),
        ("#### $18.00", "18", 1.0, 1.0),
        ("#### -5", "-5", 1.0, 1.0),
        ("#### 8", "7", 0.0, 0.0),
        ("#### 7\n#### 8", "7", 0.0, 0.0),  # two answers: strict refuses both
        ("#### 8\n#### 7", "7", 0.0, 1.0),
        ("The answer is 7", "7", 0.0, 1.0),  # no ####: only flexible reads it
        ("I had 7 then 9", "7", 0.0, 0.0),  # flexible takes the last number
        ("#### ７", "7", 0.0, 0.0),  # fullwidth digit
        ("#### ٧", "7", 0.0, 0.0),  # Arabic-Indic digit
        ("#### 7٣", "7", 0.0, 0.0),  # ASCII digit followed by a unicode one: not a number
        ("#### 7<|im_end|>#### 8", "7", 1.0, 1.0),  # text after the end marker ignored
        ("#### 7", 7, 1.0, 1.0),  # an int ground truth
        ("no answer", "7", 0.0, 0.0),
    ],
)
def test_gsm8k_strict_and_flexible(response, truth, strict, flexible):
    assert gsm8k.compute_score(response, truth)["score"] == strict
    assert gsm8k.compute_score(response, truth, method="flexible")["score"] == flexible


def test_gsm8k_format_score_and_bad_ground_truth():
    assert gsm8k.compute_score("#### 8", "7", format_score=0.1)["score"] == 0.1
    assert gsm8k.compute_score("no answer", "7", format_score=0.1)["score"] == 0.0
    with pytest.raises(ValueError, match="not a number"):
        gsm8k.compute_score("#### 7", "seven")
    with pytest.raises(ValueError, match="method"):
        gsm8k.extract_answer("#### 7", method="lenient")


def test_gsm8k_scores_a_100kb_completion():  # its time: benchmarks/bounded_calls.py
    response = "1 " * (BIG // 2) + "#### 42"
    assert gsm8k.compute_score(response, "42")["score"] == 1.0
    assert gsm8k.compute_score(response, "42", method="flexible")["score"] == 1.0


# ---------------------------------------------------------------------------- math
def test_last_boxed_reads_balanced_braces():
    assert math_boxed.last_boxed(r"so \boxed{\frac{1}{\sqrt{2}}} done") == r"\frac{1}{\sqrt{2}}"
    assert math_boxed.last_boxed(r"\boxed{1} or rather \boxed{2}") == "2"
    assert math_boxed.last_boxed(r"\fbox{3}") == "3"
    assert math_boxed.last_boxed(r"\boxed 5$") == "5"
    assert math_boxed.last_boxed(r"\boxed{1") is None
    assert math_boxed.last_boxed("no box") is None


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
        (r"$\boxed{0.5}$", r"\frac{1}{2}", 1.0),
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
        (r"\boxed{3} no wait \boxed{4}", "4", 1.0),
        (r"\boxed{3} no wait \boxed{4}", "3", 0.0),
        (r"\boxed{5}", "4", 0.0),
        ("4", "4", 0.0),  # no box, no answer
        (r"\boxed{}", "4", 0.0),
    ],
)
def test_math_scorer(response, truth, score):
    out = math_boxed.compute_score(response, truth)
    assert out["score"] == score
    assert out["acc"] == score


# ---------------------------------------------------------------------------- countdown
CD = {"target": 16, "numbers": [5, 3, 2]}


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("<think>8 * 2</think><answer>(5 + 3) * 2</answer>", 1.0),
        ("<answer>2*(3+5)</answer>", 1.0),
        ("<answer>(5 + 3) * 2 = 16</answer>", 1.0),
        ("<answer>(5 + 3) * 2 = 15</answer>", 0.1),  # wrong right-hand side
        ("<answer>5 * 3 + 2</answer>", 0.1),  # 17
        ("<answer>(5 + 5) + 3 * 2</answer>", 0.1),  # 5 used twice (and 2 once)
        ("<answer>5 + 3 + 2 + 6</answer>", 0.1),  # a number that is not given
        ("<answer>(5 + 3)</answer>", 0.1),  # 2 not used
        ("<answer>-5 + 3 * 7</answer>", 0.1),  # unary minus (and 7) refused
        ("<answer>(٥ + 3) * 2</answer>", 0.1),  # unicode digit
        ("<answer>__import__('os').system('true')</answer>", 0.1),  # never eval'd
        ("<answer>5 / (3 - 3) + 2</answer>", 0.1),  # division by zero
        ("<answer>(5 + 3) * 2</answer><answer>5 * 3 + 2</answer>", 0.1),  # the last answer counts
        ("(5 + 3) * 2", 0.0),  # no <answer>
        ("<answer>(5 + 3) * 2", 0.0),  # no </answer>
    ],
)
def test_countdown_scorer(response, score):
    out = countdown.compute_score(response, CD)
    assert out["score"] == score
    assert out["acc"] == float(score == 1.0)


def test_countdown_exact_fractions_and_repeated_numbers():
    # 6 / 4 * 2 = 3 exactly (a float-free evaluation)
    assert (
        countdown.compute_score("<answer>6 / 4 * 2</answer>", {"target": 3, "numbers": [6, 4, 2]})[
            "score"
        ]
        == 1.0
    )
    # a repeated given number must be used as often as it is given
    gt = {"target": 14, "numbers": [3, 3, 5]}
    assert countdown.compute_score("<answer>3 * 3 + 5</answer>", gt)["score"] == 1.0
    assert countdown.compute_score("<answer>3 * 5 - 1</answer>", gt)["score"] == 0.1
    with pytest.raises(ValueError, match="target"):
        countdown.compute_score("<answer>1</answer>", [1, 2])


def test_countdown_refuses_a_100kb_answer():  # its time: benchmarks/bounded_calls.py
    deep = "<answer>" + "(" * (BIG // 2) + "5" + ")" * (BIG // 2) + "</answer>"
    assert countdown.compute_score(deep, CD)["score"] == 0.1  # no RecursionError
    assert countdown.compute_score("x" * BIG, CD)["score"] == 0.0


# ---------------------------------------------------------------------------- knights and knaves
KK = {"solution_text_format": "(1) Zoey is a knight\n(2) Oliver is a knave"}
RIGHT = "(1) Zoey is a knight\n(2) Oliver is a knave"


@pytest.mark.parametrize(
    ("response", "score", "acc"),
    [
        (f"<think>reasoning</think><answer>{RIGHT}</answer>", 3.0, 1.0),
        (
            f"reasoning</think>\n<answer>\n{RIGHT}\n</answer><|im_end|>",
            3.0,
            1.0,
        ),  # <think> in the prompt
        (f"<answer>{RIGHT}</answer>", 3.0, 1.0),
        ("<answer>Oliver is a knave, and Zoey is a knight</answer>", 3.0, 1.0),
        ("<answer>(1) Zoey is a knave\n(2) Oliver is a knave</answer>", -0.5, 0.0),
        ("<answer>Zoey is a knight or a knave; Oliver is a knave</answer>", -1.0, 0.0),  # hedged
        ("<answer>(1) Zoey is a knight</answer>", -1.0, 0.0),  # incomplete
        ("<answer></answer>", -1.0, 0.0),
        (RIGHT, -3.0, 0.0),  # <answer> missing
        (f"<answer>{RIGHT}</answer><answer>{RIGHT}</answer>", -3.0, 0.0),  # two answers
        (f"<answer>{RIGHT}</answer></think>", -3.0, 0.0),  # think closed after the answer
        (f"</answer>{RIGHT}<answer>", -3.0, 0.0),  # tags reversed
        (f"<think>x<answer>{RIGHT}</answer>", -3.0, 0.0),  # think never closed
    ],
)
def test_knights_knaves_logic_rl_scheme(response, score, acc):
    out = knights_knaves.compute_score(response, KK)
    assert out["score"] == score
    assert out["acc"] == acc


def test_knights_knaves_ground_truth_forms():
    ours = {"names": ["Zoey", "Oliver"], "solution": [True, False]}
    assert knights_knaves.parse_ground_truth(ours) == {"Zoey": "knight", "Oliver": "knave"}
    assert knights_knaves.parse_ground_truth(KK) == {"Zoey": "knight", "Oliver": "knave"}
    assert knights_knaves.compute_score(f"<answer>{RIGHT}</answer>", ours)["score"] == 3.0
    with pytest.raises(ValueError, match="solution_text_format"):
        knights_knaves.parse_ground_truth({"names": ["Zoey"]})
    big = "<answer>" + "Zoey is a knight " * (BIG // 17) + "</answer>"
    assert knights_knaves.compute_score(big, KK)["score"] == -1.0


# ---------------------------------------------------------------------------- dispatch
def test_dispatch_by_data_source_and_aliases():
    assert default_compute_score("openai/gsm8k", "#### 3", "3")["score"] == 1.0
    assert default_compute_score("arithmetic", "#### 3", "3")["score"] == 1.0
    assert default_compute_score("kk_logic", f"<answer>{RIGHT}</answer>", KK)["score"] == 3.0
    assert default_compute_score("digits", "12", "12")["acc"] == 1.0
    with pytest.raises(ValueError, match=r"valid names: .*countdown"):
        default_compute_score("nope", "x", "y")
    names = ("gsm8k", "arithmetic", "math", "countdown", "knights_knaves", "digits", "count")
    for name in (*names, "sort", "add", "compare"):
        assert name in SCORERS


def test_builtin_scorer_options():
    flexible = BuiltinScorer({"gsm8k": {"method": "flexible"}})
    assert flexible("gsm8k", "it is 3", "3")["score"] == 1.0
    assert flexible("arithmetic", "it is 3", "3")["score"] == 0.0  # options are per name
    with pytest.raises(ValueError, match="unknown data_source 'gsm9k'"):
        BuiltinScorer({"gsm9k": {}})
    binary = BuiltinScorer({"sort": {"binary": True}})
    assert binary("sort", "abfd", "abdf")["score"] == 0.0
    assert binary("digits", "31280", "31284")["score"] == pytest.approx(0.8)
