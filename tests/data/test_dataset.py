"""RLDataset: the formats it reads, the errors it raises (naming file, row and column),
overlong prompts, and the collated batch."""

from __future__ import annotations

import json
import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lmrl.data import RLDataset
from lmrl.errors import DataError
from lmrl.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def row(content="reverse 123", truth="321", index=None, **extra):
    info = {"split": "train"} if index is None else {"split": "train", "index": index}
    return {
        "data_source": "digits",
        "prompt": [{"role": "user", "content": content}],
        "ability": "digits",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": info,
        **extra,
    }


ROWS = [row("reverse 123", "321"), row("reverse 4567", "7654", index=7), row("reverse 89", "98")]


def write(path, rows):
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows))
    return path


def template(content):
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".json"])
def test_formats_read_the_same_rows(tmp_path, tok, suffix):
    ds = RLDataset(write(tmp_path / f"d{suffix}", ROWS), tok)
    assert len(ds) == 3
    first = ds[0]
    assert tok.decode(first["input_ids"]) == template("reverse 123")
    assert first["raw_prompt"] == [{"role": "user", "content": "reverse 123"}]
    assert (first["data_source"], first["ground_truth"], first["ability"]) == (
        "digits",
        "321",
        "digits",
    )
    assert first["extra_info"]["split"] == "train"  # parquet adds "index": None, JSON does not
    assert [ds[i]["index"] for i in range(3)] == [0, 7, 2]  # extra_info.index, else the row


def test_hf_dataset_saved_to_disk_and_a_list_of_paths(tmp_path, tok):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    jsonl = write(tmp_path / "more.jsonl", [row("reverse 5", "5")])
    ds = RLDataset([tmp_path / "saved", jsonl], tok)
    assert len(ds) == 4
    assert [ds[i]["ground_truth"] for i in range(4)] == ["321", "7654", "98", "5"]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(
        str(tmp_path / "dd")
    )
    with pytest.raises(
        ValueError, match=r"holds a DatasetDict; point at one split's directory: .*dd/train"
    ):
        RLDataset(tmp_path / "dd", tok)


def test_json_lines_in_a_json_file_and_plain_string_prompts(tmp_path, tok):
    path = tmp_path / "lines.json"
    path.write_text(
        "\n".join(json.dumps(r) for r in [{"data_source": "digits", "prompt": "reverse 12 ->"}] * 2)
    )
    ds = RLDataset(path, tok)
    # a plain-string prompt is one user turn under the chat template, as lmrl sft renders it
    assert tok.decode(ds[0]["input_ids"]) == template("reverse 12 ->")
    assert ds[0]["raw_prompt"] == "reverse 12 ->"  # the row's own value
    assert ds[0]["ground_truth"] is None and ds[0]["extra_info"] == {}
    assert (ds.layout.renderings, ds.layout.message_prompts) == (("chat",), False)
    ds = RLDataset(path, tok, prompt_template="verbatim")
    assert tok.decode(ds[0]["input_ids"]) == "reverse 12 ->"  # data.prompt_template=verbatim
    assert ds.layout.renderings == ("verbatim",)
    bare = build_tokenizer()
    bare.chat_template = None
    assert tok.decode(RLDataset(path, bare)[0]["input_ids"]) == "reverse 12 ->"  # no template


def test_configurable_column_names(tmp_path, tok):
    rows = [{"question": [{"role": "user", "content": "hi"}], "source": "digits"}]
    ds = RLDataset(
        write(tmp_path / "c.jsonl", rows), tok, prompt_key="question", reward_fn_key="source"
    )
    assert ds[0]["data_source"] == "digits"
    with pytest.raises(
        ValueError,
        match=r"c\.jsonl: row 0: column 'prompt': missing \(columns there: \['question', 'source'\]\)",
    ):
        RLDataset(tmp_path / "c.jsonl", tok)


BAD = [
    ({"data_source": "digits"}, "row 1: column 'prompt': missing"),
    ({"prompt": "hi"}, "row 1: column 'data_source': missing"),
    ({"prompt": "  ", "data_source": "d"}, "row 1: column 'prompt': empty prompt"),
    ({"prompt": [], "data_source": "d"}, "row 1: column 'prompt': empty prompt"),
    (
        {"prompt": [{"role": "user", "content": ""}], "data_source": "d"},
        "row 1: column 'prompt': empty prompt",
    ),
    (
        {"prompt": [{"role": "user", "content": 5}], "data_source": "d"},
        "row 1: column 'prompt': message 0 'content' must be a string, got int",
    ),
    (
        {"prompt": [{"role": "user", "content": [{"type": "text"}]}], "data_source": "d"},
        "row 1: column 'prompt': message 0 'content' must be a string, got list",
    ),
    (
        {"prompt": [{"content": "hi"}], "data_source": "d"},
        "row 1: column 'prompt': message 0 has no 'role'",
    ),
    ({"prompt": ["hi"], "data_source": "d"}, "row 1: column 'prompt': message 0 must be a dict"),
    (
        {"prompt": {"role": "user"}, "data_source": "d"},
        "row 1: column 'prompt': a prompt must be a list of chat messages or a string",
    ),
    (
        {"prompt": "hi", "data_source": ""},
        "row 1: column 'data_source': must be a non-empty string",
    ),
    (
        {"prompt": "hi", "data_source": "d", "reward_model": {"style": "rule"}},
        "row 1: column 'reward_model.ground_truth'",
    ),
    (
        {"prompt": "hi", "data_source": "d", "extra_info": [1]},
        "row 1: column 'extra_info': must be a dict",
    ),
    (["not", "a", "row"], "row 1: must be an object with columns"),
]


@pytest.mark.parametrize(("bad", "message"), BAD)
def test_bad_rows_name_file_row_and_column(tmp_path, tok, bad, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row()) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"bad.jsonl: {message}")):
        RLDataset(path, tok)


def test_bad_files(tmp_path, tok):
    with pytest.raises(ValueError, match=r"data file .*missing\.parquet does not exist"):
        RLDataset(tmp_path / "missing.parquet", tok)
    (tmp_path / "d.csv").write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match=r"d\.csv: unsupported data file type '\.csv'"):
        RLDataset(tmp_path / "d.csv", tok)
    (tmp_path / "broken.jsonl").write_text(json.dumps(row()) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"broken\.jsonl: line 2 is not valid JSON"):
        RLDataset(tmp_path / "broken.jsonl", tok)
    (tmp_path / "obj.json").write_text(json.dumps({"rows": ROWS}))
    with pytest.raises(ValueError, match=r"obj\.json: a \.json data file must hold a list"):
        RLDataset(tmp_path / "obj.json", tok)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no rows"):
        RLDataset(tmp_path / "empty.jsonl", tok)
    with pytest.raises(ValueError, match="truncation must be one of"):
        RLDataset(write(tmp_path / "ok.jsonl", ROWS), tok, truncation="middle")


def test_bad_files_are_data_errors(tmp_path, tok):
    """The CLI prints a DataError as one line; every bad file is one."""
    (tmp_path / "broken.jsonl").write_text("{oops\n")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    for name in ("missing.jsonl", "broken.jsonl", "bad.parquet"):
        with pytest.raises(DataError, match=re.escape(name)):
            RLDataset(tmp_path / name, tok)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_byte_that_is_not_utf8_names_file_line_and_column(tmp_path, tok, suffix):
    path = tmp_path / f"latin1{suffix}"
    good = json.dumps(row()).encode()
    bad = json.dumps(row("reverse 12")).encode().replace(b"reverse", b"r\xe9verse")
    text = good + b"\n" + bad + b"\n" if suffix == ".jsonl" else b"[" + good + b",\n" + bad + b"]"
    path.write_bytes(text)
    with pytest.raises(DataError) as err:
        RLDataset(path, tok)
    column = bad.index(b"\xe9") + 1
    expected = f"{path}: line 2: byte 0xe9 at column {column} is not UTF-8"
    assert str(err.value).startswith(expected), str(err.value)


def test_message_prompts_need_a_chat_template(tmp_path, tok):
    bare = build_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match=r"row 0: column 'prompt': .*no chat template"):
        RLDataset(write(tmp_path / "d.jsonl", ROWS), bare)


def test_overlong_prompts_filtered_and_logged_once(tmp_path, tok, caplog):
    # byte-level tokenizer: 3 special tokens + "user\n" (5) + "\n" (1) + "assistant\n" (10)
    # + one token per character of the content: 19 + len(content)
    lengths = [
        len(tok(template(r["prompt"][0]["content"]), add_special_tokens=False)["input_ids"])
        for r in ROWS
    ]
    assert lengths == [19 + 11, 19 + 12, 19 + 10]
    path = write(tmp_path / "d.parquet", ROWS)
    with caplog.at_level(logging.WARNING, logger="lmrl.data"):
        ds = RLDataset(path, tok, max_prompt_length=30, filter_overlong_prompts=True)
    assert [r["ground_truth"] for r in ds.rows] == ["321", "98"]
    assert ds.stats == {"rows_read": 3, "filtered": 1, "truncated": 0, "rows": 2}
    assert len(caplog.records) == 1 and "dropped 1 of 3 prompts" in caplog.records[0].getMessage()
    with pytest.raises(ValueError, match="every prompt is longer"):
        RLDataset(path, tok, max_prompt_length=10, filter_overlong_prompts=True)


def test_overlong_prompts_truncated_or_refused(tmp_path, tok):
    path = write(tmp_path / "d.parquet", ROWS)
    with pytest.raises(
        ValueError,
        match=r"d\.parquet: row 1: column 'prompt': prompt has 31 tokens, more than max_prompt_length=30",
    ):
        RLDataset(path, tok, max_prompt_length=30)
    full = tok(template("reverse 4567"), add_special_tokens=False)["input_ids"]
    left = RLDataset(path, tok, max_prompt_length=30, truncation="left")
    right = RLDataset(path, tok, max_prompt_length=30, truncation="right")
    assert left[1]["input_ids"] == full[1:] and right[1]["input_ids"] == full[:30]
    assert left.stats["truncated"] == 1 and left[0]["input_ids"] == right[0]["input_ids"]


def test_collate_left_pads(tmp_path, tok):
    ds = RLDataset(write(tmp_path / "d.jsonl", ROWS), tok)
    batch = ds.collate([ds[2], ds[1], ds[0]])  # 29, 31, 30 tokens
    assert batch["input_ids"].shape == (3, 31)
    assert batch["attention_mask"].dtype == torch.bool
    assert batch["attention_mask"].sum(-1).tolist() == [29, 31, 30]
    assert batch["attention_mask"][0].tolist() == [False, False] + [True] * 29
    assert batch["input_ids"][0, :2].tolist() == [tok.pad_token_id] * 2
    assert batch["input_ids"][0, 2:].tolist() == ds[2]["input_ids"]
    assert batch["position_ids"][0, :4].tolist() == [0, 0, 0, 1]
    assert batch["position_ids"][1].tolist() == list(range(31))
    assert list(batch["ground_truth"]) == ["98", "7654", "321"]
    assert list(batch["index"]) == [2, 7, 0]
    assert list(batch["data_source"]) == ["digits"] * 3
    assert batch["raw_prompt"][0] == [{"role": "user", "content": "reverse 89"}]
    assert batch["extra_info"][1]["index"] == 7
    with pytest.raises(ValueError, match="at least one row"):
        ds.collate([])
