"""SFTDataset: the three row layouts and the loss mask they give, bad rows named by file,
row and column, truncation. Runs on the tiny model's byte tokenizer."""

from __future__ import annotations

import json

import pytest

from lmrl.data import SFTDataset
from lmrl.errors import DataError
from lmrl.models import build_tiny_model, load_tokenizer

IM_START, IM_END, PAD = 257, 258, 256  # the byte tokenizer's special ids


def byte_ids(text: str) -> list[int]:
    """The byte tokenizer maps every ASCII character to its byte value."""
    return list(text.encode())


def chatml_prompt(user: str) -> list[int]:
    """``<|im_start|>user\\n{user}<|im_end|>\\n<|im_start|>assistant\\n``, by hand."""
    return [
        IM_START,
        *byte_ids(f"user\n{user}"),
        IM_END,
        *byte_ids("\n"),
        IM_START,
        *byte_ids("assistant\n"),
    ]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_tiny_model(tmp_path_factory.mktemp("tiny"), size="tiny", seed=0))


# ---------------------------------------------------------------------------- layouts
def test_ground_truth_row_masks_exactly_the_answer_and_end_of_turn(tmp_path, tokenizer):
    rows = [
        {
            "prompt": [{"role": "user", "content": "reverse 48213"}],
            "reward_model": {"ground_truth": "31284"},
            "data_source": "digits",
        }
    ]
    data = SFTDataset(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer,
                      response_from_ground_truth=True)  # fmt: skip
    (ids, mask), = data.examples  # fmt: skip
    prompt = chatml_prompt("reverse 48213")
    # the template's "\n" after <|im_end|> is context, and dropped at the end of the sequence
    assert ids == prompt + byte_ids("31284") + [IM_END]
    assert mask == [False] * len(prompt) + [True] * 6
    assert data.stats["loss_tokens"] == 6


def test_prompt_response_layout_with_chat_and_string_prompts(tmp_path, tokenizer):
    rows = [
        {"prompt": [{"role": "user", "content": "hi"}], "response": "yo"},
        {"prompt": "Q: 2+2=", "response": "4"},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    data = SFTDataset(path, tokenizer)
    (chat_ids, chat_mask), (text_ids, text_mask) = data.examples
    assert chat_ids == chatml_prompt("hi") + byte_ids("yo") + [IM_END]
    assert sum(chat_mask) == 3 and chat_mask[-3:] == [True] * 3
    # a plain-string prompt is one user turn under the chat template (verl's SFT rule)
    assert text_ids == chatml_prompt("Q: 2+2=") + byte_ids("4") + [IM_END]
    assert text_mask == [False] * len(chatml_prompt("Q: 2+2=")) + [True, True]
    assert data.layout.renderings == ("chat",) and data.layout.message_prompts
    # data.prompt_template=verbatim: the string as it is; its response ends with the EOS token
    data = SFTDataset(path, tokenizer, prompt_template="verbatim")
    (chat_ids, _), (text_ids, text_mask) = data.examples
    assert chat_ids == chatml_prompt("hi") + byte_ids("yo") + [IM_END]  # messages: templated
    assert text_ids == byte_ids("Q: 2+2=") + byte_ids("4") + [tokenizer.eos_token_id]
    assert text_mask == [False] * 7 + [True, True]
    assert data.layout.renderings == ("chat", "verbatim")


def test_mask_pattern_leaves_tool_observations_untrained(tmp_path, tokenizer):
    """Multi-turn demonstrations: the observations are read as context, as RL's state masking
    reads them; every other response token (and the end of turn / EOS) is trained."""
    response = "<search>A</search>\n<information>obs</information>\n<answer>B</answer>"
    rows = [
        {"prompt": [{"role": "user", "content": "q"}], "response": response},
        {"prompt": "Q:", "response": "<search>A</search><information>o</information>"},
    ]
    data = SFTDataset(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer,
                      mask_pattern=r"(?s)<information>.*?</information>")  # fmt: skip
    (chat_ids, chat_mask), (text_ids, text_mask) = data.examples
    prompt = chatml_prompt("q")
    assert chat_ids == prompt + byte_ids(response) + [IM_END]  # the same tokens as unmasked
    trained = [t for t, m in zip(chat_ids, chat_mask, strict=True) if m]
    assert trained == [*byte_ids("<search>A</search>\n\n<answer>B</answer>"), IM_END]
    trained = [t for t, m in zip(text_ids, text_mask, strict=True) if m]
    assert trained == [*byte_ids("<search>A</search>"), tokenizer.eos_token_id]
    assert text_ids[-1] == tokenizer.eos_token_id


def test_messages_layout_trains_every_assistant_turn(tmp_path, tokenizer):
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "B1"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "D2"},
    ]
    data = SFTDataset(write_jsonl(tmp_path / "d.jsonl", [{"messages": chat}]), tokenizer)
    (ids, mask), = data.examples  # fmt: skip
    full = tokenizer.apply_chat_template(chat, tokenize=False)
    assert tokenizer.decode(ids) == full.rstrip("\n")  # the whole conversation, in order
    trained = [t for t, m in zip(ids, mask, strict=True) if m]
    assert trained == [*byte_ids("B1"), IM_END, *byte_ids("D2"), IM_END]
    # the "\n<|im_start|>user\nc<|im_end|>..." between the two turns is context
    first_end = ids.index(IM_END, ids.index(ord("B")))
    assert not any(mask[first_end + 1 : ids.index(ord("D"))])


def test_bad_rows_name_the_row_and_the_column(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "answer": "y"}])
    with pytest.raises(ValueError, match=r"d.jsonl: row 0: neither a 'response' column"):
        SFTDataset(path, tokenizer)
    path = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "x", "reward_model": {"ground_truth":
                                                                                {"a": 1}}}])  # fmt: skip
    with pytest.raises(ValueError, match=r"row 0: column 'reward_model.ground_truth' is a dict"):
        SFTDataset(path, tokenizer, response_from_ground_truth=True)
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(ValueError, match="row 0: column 'messages': no assistant message"):
        SFTDataset(path, tokenizer)


def test_truncation(tmp_path, tokenizer):
    rows = [{"prompt": "abcdef", "response": "xyz"}, {"prompt": "a" * 20, "response": "b"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    kw = {"prompt_template": "verbatim", "max_length": 12}
    with pytest.raises(ValueError, match=r"row 1: the example has 22 tokens, more than"):
        SFTDataset(path, tokenizer, **kw)
    left = SFTDataset(path, tokenizer, truncation="left", **kw)
    assert [len(ids) for ids, _ in left.examples] == [10, 12]
    # right truncation cuts row 1's response away: the row is dropped
    right = SFTDataset(path, tokenizer, truncation="right", **kw)
    assert right.stats == {"rows": 2, "truncated": 1, "dropped": 1, "examples": 1,
                           "loss_tokens": 4}  # fmt: skip


def test_bad_input_is_a_data_error_naming_file_row_and_column(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "answer": "y"}])
    with pytest.raises(DataError, match=r"d.jsonl: row 0: neither a 'response' column"):
        SFTDataset(path, tokenizer)
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok", "response": "a"},
                                              {"prompt": [], "response": "b"}])  # fmt: skip
    with pytest.raises(DataError, match=r"p.jsonl: row 1: column 'prompt': empty prompt"):
        SFTDataset(path, tokenizer)
    path = write_jsonl(tmp_path / "s.jsonl", [{"messages": "hi"}])
    with pytest.raises(DataError, match=r"s.jsonl: row 0: column 'messages' must be a list"):
        SFTDataset(path, tokenizer)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x", "response": "y"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad.jsonl: line 2 is not valid JSON"):
        SFTDataset(tmp_path / "bad.jsonl", tokenizer)
    with pytest.raises(DataError, match=r"data file .*missing.jsonl does not exist"):
        SFTDataset(tmp_path / "missing.jsonl", tokenizer)
    with pytest.raises(DataError, match=r"row 1: the example has 22 tokens"):
        rows = [{"prompt": "abcdef", "response": "xyz"}, {"prompt": "a" * 20, "response": "b"}]
        SFTDataset(write_jsonl(tmp_path / "t.jsonl", rows), tokenizer, max_length=12,
                   prompt_template="verbatim")  # fmt: skip
