"""Tests of `lmrl.batch`: the Batch container and the padding helpers."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from lmrl.batch import Batch, lengths_to_mask, pad_2d
from lmrl.batch.schema import ENV


@pytest.fixture(autouse=True)
def _any_key(monkeypatch):
    """The container under placeholder keys ("a", "x", "score"): the schema's check is off
    here and tested in test_batch_schema.py."""
    monkeypatch.setenv(ENV, "0")


def make_batch(n: int = 5) -> Batch:
    return Batch(
        tensors={
            "input_ids": torch.arange(n * 3).view(n, 3),
            "response_mask": torch.arange(n * 2).view(n, 2) % 2 == 0,
            "score": torch.arange(n, dtype=torch.float32),
        },
        non_tensors={
            "uid": [f"u{i}" for i in range(n)],
            "extra_info": [{"index": i} for i in range(n)],
        },
        meta={"temperature": 0.7},
    )


def test_construction_and_access():
    b = make_batch(4)
    assert len(b) == 4 and b.batch_size == 4
    assert b.keys() == ["input_ids", "response_mask", "score", "uid", "extra_info"]
    assert "uid" in b and "score" in b and "nope" not in b
    assert b["uid"].dtype == object and b["uid"].shape == (4,)
    assert b["extra_info"][2] == {"index": 2}
    assert b["input_ids"].shape == (4, 3)
    assert b.meta == {"temperature": 0.7}
    with pytest.raises(KeyError, match=r"nope"):
        b["nope"]
    assert b.get("nope", 3) == 3


def test_list_elements_stay_elements():
    # a column of lists is 1-D of list objects, not a 2-D array
    b = Batch(non_tensors={"ground_truth": [[1, 2], [3, 4], [5, 6]]})
    assert b["ground_truth"].shape == (3,)
    assert b["ground_truth"][1] == [3, 4]
    assert len(b) == 3


def test_setitem_checks_rows_and_moves_keys():
    b = make_batch(3)
    b["values"] = torch.zeros(3, 2)
    b["data_source"] = np.array(["a", "b", "c"])
    assert b["data_source"].dtype == object
    with pytest.raises(ValueError, match=r"'bad'.*4 rows"):
        b["bad"] = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"'bad_col'.*2 rows"):
        b["bad_col"] = ["x", "y"]
    with pytest.raises(ValueError, match=r"'s'"):
        b["s"] = "abc"
    with pytest.raises(ValueError, match=r"'z'.*0-d"):
        b["z"] = torch.tensor(1.0)
    # a key lives in one place: a tensor replaces a column of the same name
    b["uid"] = torch.arange(3)
    assert "uid" in b.tensor_keys() and "uid" not in b.non_tensor_keys()
    b["uid"] = ["p", "q", "r"]
    assert "uid" in b.non_tensor_keys() and "uid" not in b.tensor_keys()
    assert b.pop("uid").tolist() == ["p", "q", "r"] and "uid" not in b


def test_empty_batch_takes_n_from_first_value():
    b = Batch()
    assert len(b) == 0 and b.keys() == []
    b["uid"] = ["a", "b"]
    b["x"] = torch.ones(2, 4)
    assert len(b) == 2
    with pytest.raises(ValueError, match=r"'y'"):
        b["y"] = torch.ones(3)


def test_constructor_errors_name_the_key():
    with pytest.raises(ValueError, match=r"'b' has 2 rows, expected 3"):
        Batch({"a": torch.zeros(3, 1), "b": torch.zeros(2, 1)})
    with pytest.raises(ValueError, match=r"'uid' has 2 rows, expected 3"):
        Batch({"a": torch.zeros(3, 1)}, {"uid": ["x", "y"]})
    with pytest.raises(ValueError, match=r"'a'.*both"):
        Batch({"a": torch.zeros(3, 1)}, {"a": [1, 2, 3]})
    with pytest.raises(ValueError, match=r"'a' must be a torch.Tensor"):
        Batch({"a": [1, 2, 3]})


def test_index_reorders_filters_and_keeps_meta():
    b = make_batch(5)
    picked = b.index([4, 0, 0])
    assert picked["input_ids"].tolist() == [[12, 13, 14], [0, 1, 2], [0, 1, 2]]
    assert picked["uid"].tolist() == ["u4", "u0", "u0"]
    assert picked.meta == {"temperature": 0.7}
    by_mask = b.index(torch.tensor([True, False, True, False, False]))
    assert by_mask["uid"].tolist() == ["u0", "u2"]
    assert by_mask["score"].tolist() == [0.0, 2.0]
    assert b.index(slice(1, 3))["uid"].tolist() == ["u1", "u2"]
    assert b.index(slice(None, None, -2))["score"].tolist() == [4.0, 2.0, 0.0]
    assert b.index(np.array([-1]))["uid"].tolist() == ["u4"]
    assert len(b.index([])) == 0
    with pytest.raises(ValueError, match=r"bool idx has length 2"):
        b.index(np.array([True, False]))
    with pytest.raises(IndexError):
        b.index([5])


def test_split_concat_round_trip():
    b = make_batch(7)
    pieces = b.split(3)
    assert [len(p) for p in pieces] == [3, 3, 1]
    back = Batch.concat(pieces)
    assert len(back) == 7
    for key in b.tensor_keys():
        assert torch.equal(back[key], b[key])
    for key in b.non_tensor_keys():
        assert back[key].tolist() == b[key].tolist()
    assert back.meta == b.meta
    with pytest.raises(ValueError, match=r"split size"):
        b.split(0)


def test_chunk_sizes():
    b = make_batch(7)
    assert [len(p) for p in b.chunk(3)] == [3, 2, 2]
    assert [p["uid"].tolist() for p in b.chunk(3)][1] == ["u3", "u4"]
    assert [len(p) for p in make_batch(2).chunk(3)] == [1, 1, 0]
    with pytest.raises(ValueError, match=r"chunk count"):
        b.chunk(0)


def test_concat_errors():
    a = Batch({"x": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match=r"'x'.*trailing shape"):
        Batch.concat([a, Batch({"x": torch.zeros(2, 4)})])
    with pytest.raises(ValueError, match=r"'x'.*trailing shape"):
        Batch.concat([a, Batch({"x": torch.zeros(2, 3, dtype=torch.long)})])
    with pytest.raises(ValueError, match=r"keys"):
        Batch.concat([a, Batch({"y": torch.zeros(2, 3)})])
    with pytest.raises(ValueError, match=r"at least one"):
        Batch.concat([])


def test_repeat_interleave_groups_contiguously():
    b = make_batch(2)
    r = b.repeat_interleave(3)
    assert r["uid"].tolist() == ["u0"] * 3 + ["u1"] * 3
    assert r["input_ids"][:, 0].tolist() == [0, 0, 0, 3, 3, 3]
    # the copies are independent object references only for immutable items; dicts shared
    assert r["extra_info"][0] == {"index": 0}
    with pytest.raises(ValueError):
        b.repeat_interleave(0)


def test_select_and_union():
    b = make_batch(3)
    s = b.select("input_ids", "uid")
    assert s.keys() == ["input_ids", "uid"] and len(s) == 3
    assert s.meta == b.meta
    with pytest.raises(KeyError, match=r"nope"):
        b.select("input_ids", "nope")
    only_cols = b.select("uid")
    assert len(only_cols) == 3 and only_cols.tensor_keys() == []

    other = Batch(
        {"values": torch.ones(3, 2)}, {"uid": [f"u{i}" for i in range(3)]}, meta={"step": 4}
    )
    u = b.union(other)
    assert set(u.keys()) == set(b.keys()) | {"values"}
    assert u.meta == {"temperature": 0.7, "step": 4}
    assert "values" not in b  # union returns a new batch
    with pytest.raises(ValueError, match=r"'uid'.*different values"):
        b.union(Batch(non_tensors={"uid": ["a", "b", "c"]}))
    with pytest.raises(ValueError, match=r"3 and 2 rows"):
        b.union(Batch({"values": torch.ones(2, 2)}))


def test_to_and_pickle():
    b = make_batch(3)
    moved = b.to("cpu")
    assert torch.equal(moved["input_ids"], b["input_ids"])
    back = pickle.loads(pickle.dumps(b))
    assert torch.equal(back["response_mask"], b["response_mask"])
    assert back["uid"].tolist() == b["uid"].tolist() and back.meta == b.meta


def test_pad_2d_left_and_right():
    seqs = [[1, 2, 3], [4], []]
    assert pad_2d(seqs, 0, "left").tolist() == [[1, 2, 3], [0, 0, 4], [0, 0, 0]]
    assert pad_2d(seqs, -1, "right").tolist() == [[1, 2, 3], [4, -1, -1], [-1, -1, -1]]
    assert pad_2d([torch.tensor([True])], False, length=2).tolist() == [[True, False]]
    assert pad_2d([torch.tensor([1.5])], 0.0, length=2).dtype == torch.float32
    with pytest.raises(ValueError, match=r"side"):
        pad_2d(seqs, 0, "middle")
    with pytest.raises(ValueError, match=r"length=2"):
        pad_2d(seqs, 0, length=2)


def test_lengths_to_mask():
    assert lengths_to_mask([1, 3]).tolist() == [[True, False, False], [True, True, True]]
    assert lengths_to_mask([1, 0], length=2, side="left").tolist() == [
        [False, True],
        [False, False],
    ]
    with pytest.raises(ValueError, match=r"lengths"):
        lengths_to_mask([3], length=2)
