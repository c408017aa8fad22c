"""Prompt datasets in verl's preprocessed layout: reading, checking, templating, collating.

Rows come from local parquet, JSON Lines (``.jsonl``), JSON (``.json``: a list of objects, or
JSON Lines) files, or a Hugging Face ``datasets.Dataset`` saved with ``save_to_disk``; one
path or a list. The columns are verl's:

- ``prompt`` (``prompt_key``): a list of chat messages ``[{"role": ..., "content": str}]``,
  rendered with the tokenizer's chat template and the generation prompt; or a plain string,
  rendered by ``prompt_template`` (``lmrl.data.layout``, the rule ``lmrl sft`` follows too):
  as one user turn under the chat template (``chat``, the default, as verl's SFT does) or
  verbatim with the tokenizer's own special tokens (``verbatim``);
- ``data_source`` (``reward_fn_key``): picks the scorer;
- ``reward_model.ground_truth``: anything (a string, a dict...); a file without a
  ``reward_model`` column has no ground truth (None);
- ``extra_info``: a dict (``index`` defaults to the row's position in its file);
- ``ability``: optional.

Choice: everything is read, checked and tokenized when the dataset is built, so bad input (a
missing file or column, an empty prompt, a non-string message content, a malformed message,
an overlong prompt with ``truncation="error"``, a byte that is not UTF-8) stops the run
before training with a ``lmrl.errors.DataError`` naming the file, the row (or line) and the
column. Overlong prompts are either dropped (``filter_overlong_prompts``, counted in
``stats`` and logged once) or truncated on the ``left``/``right``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lmrl.batch import Batch, lengths_to_mask, pad_2d
from lmrl.data.layout import PromptLayout, as_chat
from lmrl.errors import DataError, ModelError

log = logging.getLogger("lmrl.data")

TRUNCATIONS = ("error", "left", "right")
SUFFIXES = (".parquet", ".jsonl", ".json")


# ---------------------------------------------------------------------------- reading
def _decode(path: Path, data: bytes, line_no: int | None = None) -> str:
    """``data`` as UTF-8 text; a ``DataError`` naming the file, line and column if it is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        if line_no is None:  # the whole file: count the lines before the bad byte
            line_no = data.count(b"\n", 0, err.start) + 1
            column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        else:
            column = err.start + 1
        raise DataError(
            f"{path}: line {line_no}: byte 0x{data[err.start]:02x} at column {column} is not "
            "UTF-8; save the file as UTF-8"
        ) from None


def _read_json(path: Path) -> list[Any]:
    text = _decode(path, path.read_bytes())
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg != "Extra data":  # not JSON Lines either
            raise DataError(f"{path}: not valid JSON ({err})") from err
        return _read_jsonl(path)
    if not isinstance(data, list):
        raise DataError(
            f"{path}: a .json data file must hold a list of rows, got {type(data).__name__}"
        )
    return data


def _read_jsonl(path: Path) -> list[Any]:
    rows = []
    with path.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            line = _decode(path, raw, line_no)
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataError(f"{path}: line {line_no} is not valid JSON ({err})") from err
    return rows


def read_records(path: str | Path) -> list[Any]:
    """The rows of one data file (or saved ``datasets`` directory), as Python objects.

    Args:
        path: a ``.parquet``, ``.jsonl`` or ``.json`` file, or a directory written by
            ``datasets.Dataset.save_to_disk``.

    Returns:
        One object per row (a dict for well-formed data; checked later).

    Raises:
        DataError: a missing path, an unsupported format, a ``DatasetDict`` directory (the
            message lists its splits), or unreadable content (bad JSON, a byte that is not
            UTF-8: the line too); always naming the path.
    """
    path = Path(path).expanduser()
    try:
        return _read_records(path)
    except OSError as err:  # unreadable: permissions, a lost mount...
        raise DataError(f"{path}: cannot read ({err.strerror or err})") from None


def _read_records(path: Path) -> list[Any]:
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
            raise DataError(
                f"{path} holds a DatasetDict; point at one split's directory: "
                + ", ".join(str(path / s) for s in splits)
            )
        if not (path / "dataset_info.json").is_file() and not (path / "state.json").is_file():
            raise DataError(
                f"{path} is a directory but not a dataset saved with datasets.save_to_disk; "
                f"give {'/'.join(SUFFIXES)} files"
            )
        import datasets

        try:
            dataset = datasets.load_from_disk(str(path))
        except Exception as err:
            raise DataError(f"{path}: cannot load the saved dataset ({err})") from err
        return dataset.to_list()
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as err:
            raise DataError(f"{path}: cannot read parquet ({err})") from err
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json(path)
    raise DataError(f"{path}: unsupported data file type {suffix!r}; use one of {list(SUFFIXES)}")


# ---------------------------------------------------------------------------- checking
def check_prompt(value: Any, where: str) -> str | list[dict[str, str]]:
    """A prompt as a stripped-of-None message list or a string; raise naming ``where``."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: empty prompt")
        return value
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        if len(value) == 0:
            raise DataError(f"{where}: empty prompt (no messages)")
        messages = []
        for j, message in enumerate(value):
            if not isinstance(message, Mapping):
                raise DataError(
                    f"{where}: message {j} must be a dict with 'role' and 'content', "
                    f"got {type(message).__name__}"
                )
            for key in ("role", "content"):
                if key not in message:
                    raise DataError(f"{where}: message {j} has no {key!r} (keys {sorted(message)})")
                if not isinstance(message[key], str):
                    raise DataError(
                        f"{where}: message {j} {key!r} must be a string, got "
                        f"{type(message[key]).__name__}"
                    )
            messages.append({k: v for k, v in message.items() if v is not None})
        if not any(m["content"].strip() for m in messages):
            raise DataError(f"{where}: empty prompt (every message content is empty)")
        return messages
    raise DataError(
        f"{where}: a prompt must be a list of chat messages or a string, got {type(value).__name__}"
    )


def check_row(
    row: Any,
    file: str,
    row_index: int,
    prompt_key: str = "prompt",
    reward_fn_key: str = "data_source",
) -> dict[str, Any]:
    """Check one raw row and return its normalised fields.

    Args:
        row: the row as read.
        file: its file, for messages.
        row_index: its position in the file (0-based), for messages.
        prompt_key, reward_fn_key: the prompt and data-source column names.

    Returns:
        ``{"raw_prompt", "data_source", "ground_truth", "extra_info", "ability", "index"}``.

    Raises:
        DataError: ``"<file>: row <i>: column '<name>': <what is wrong>"``.
    """
    if not isinstance(row, Mapping):
        raise DataError(
            f"{file}: row {row_index}: must be an object with columns, got {type(row).__name__}"
        )

    def where(column: str) -> str:
        return f"{file}: row {row_index}: column {column!r}"

    for column in (prompt_key, reward_fn_key):
        if column not in row:
            raise DataError(f"{where(column)}: missing (columns there: {sorted(row)})")
    prompt = check_prompt(row[prompt_key], where(prompt_key))
    data_source = row[reward_fn_key]
    if not isinstance(data_source, str) or not data_source:
        raise DataError(f"{where(reward_fn_key)}: must be a non-empty string, got {data_source!r}")
    ground_truth = None
    if "reward_model" in row:
        reward_model = row["reward_model"]
        if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
            raise DataError(
                f"{where('reward_model.ground_truth')}: reward_model must be a dict with a "
                f"'ground_truth', got {reward_model!r:.100}"
            )
        ground_truth = reward_model["ground_truth"]
    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, Mapping):
        raise DataError(f"{where('extra_info')}: must be a dict, got {type(extra_info).__name__}")
    extra_info = dict(extra_info)
    index = extra_info.get("index")
    return {
        "raw_prompt": prompt,
        "data_source": data_source,
        "ground_truth": ground_truth,
        "extra_info": extra_info,
        "ability": row.get("ability"),
        "index": row_index if index is None else index,
    }


# ---------------------------------------------------------------------------- dataset
class RLDataset:
    """Prompts for RL training, checked and tokenized up front.

    Args:
        paths: one data file / saved-dataset directory, or a list of them (rows concatenated
            in order).
        tokenizer: a ``transformers`` tokenizer; needs a chat template for message prompts,
            and a pad (or eos) token for `collate`.
        prompt_key: the prompt column (verl's ``data.prompt_key``).
        reward_fn_key: the data-source column (verl's ``data.reward_fn_key``).
        max_prompt_length: the most prompt tokens (after templating); None = no limit.
        filter_overlong_prompts: drop longer prompts (counted in ``stats["filtered"]``, logged
            once) instead of applying ``truncation``.
        truncation: for longer prompts when not filtering: ``"error"`` (raise, naming the row),
            ``"left"`` (keep the last tokens) or ``"right"`` (keep the first tokens).
        chat_template_kwargs: extra keyword arguments for ``apply_chat_template``.
        prompt_template: how a plain-string prompt is rendered: ``"chat"`` (one user turn
            under the chat template, when the tokenizer has one) or ``"verbatim"``
            (``lmrl.data.layout``).

    Attributes:
        stats: ``{"rows_read", "filtered", "truncated", "rows"}``.
        layout: how the prompts were rendered (`lmrl.data.layout.PromptLayout`), checked
            against a warm start's record.

    Raises:
        DataError: bad input, naming the file, the row and the column.
        ModelError: a tokenizer with neither a pad nor an eos token.
        ValueError: bad arguments (``truncation``, ``max_prompt_length``).
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        reward_fn_key: str = "data_source",
        max_prompt_length: int | None = None,
        filter_overlong_prompts: bool = False,
        truncation: str = "error",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        prompt_template: str = "chat",
    ):
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {list(TRUNCATIONS)}, got {truncation!r}")
        if max_prompt_length is not None and max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 or None, got {max_prompt_length}")
        if isinstance(paths, str | Path):
            paths = [paths]
        if not paths:
            raise DataError("no data files given")
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.reward_fn_key = reward_fn_key
        self.max_prompt_length = max_prompt_length
        pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        if pad is None:
            raise ModelError("the tokenizer has neither a pad token nor an eos token to pad with")
        self.pad_token_id = int(pad)

        rows: list[dict[str, Any]] = []
        where: list[str] = []
        for path in paths:
            for i, raw in enumerate(read_records(path)):
                rows.append(check_row(raw, str(path), i, prompt_key, reward_fn_key))
                where.append(f"{path}: row {i}: column {prompt_key!r}")
                rows[-1]["origin"] = (str(path), i)
        rows_read = len(rows)
        if not rows:
            raise DataError(f"no rows in {[str(p) for p in paths]}")

        prompts = [r["raw_prompt"] for r in rows]
        rendered = [as_chat(p, tokenizer, prompt_template) for p in prompts]
        ids = self._tokenize(rendered, where, dict(chat_template_kwargs or {}))
        self.layout = PromptLayout.of(
            prompt_template,
            ("verbatim" if isinstance(p, str) else "chat" for p in rendered),
            message_prompts=any(not isinstance(p, str) for p in prompts),
        )
        kept, filtered, truncated = [], 0, 0
        for row, tokens, at in zip(rows, ids, where, strict=True):
            if max_prompt_length is not None and len(tokens) > max_prompt_length:
                if filter_overlong_prompts:
                    filtered += 1
                    continue
                if truncation == "error":
                    raise DataError(
                        f"{at}: prompt has {len(tokens)} tokens, more than max_prompt_length="
                        f"{max_prompt_length}; set filter_overlong_prompts or truncation=left/right"
                    )
                tokens = (
                    tokens[-max_prompt_length:]
                    if truncation == "left"
                    else tokens[:max_prompt_length]
                )
                truncated += 1
            row["input_ids"] = tokens
            kept.append(row)
        if filtered:
            log.warning(
                "dropped %d of %d prompts longer than max_prompt_length=%d tokens",
                filtered,
                rows_read,
                max_prompt_length,
            )
        if truncated:
            log.warning(
                "truncated %d prompts to %d tokens (%s)", truncated, max_prompt_length, truncation
            )
        if not kept:
            raise DataError(f"every prompt is longer than max_prompt_length={max_prompt_length}")
        self.rows = kept
        self.stats = {
            "rows_read": rows_read,
            "filtered": filtered,
            "truncated": truncated,
            "rows": len(kept),
        }

    def _tokenize(
        self, prompts: list[Any], where: list[str], template_kwargs: dict[str, Any]
    ) -> list[list[int]]:
        chat = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
        if chat and not getattr(self.tokenizer, "chat_template", None):
            raise DataError(
                f"{where[chat[0]]}: the prompt is a list of chat messages but the tokenizer has "
                "no chat template; give plain-string prompts or a tokenizer with a template"
            )
        texts: list[str] = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                texts.append(prompt)
                continue
            try:
                texts.append(
                    self.tokenizer.apply_chat_template(
                        prompt, add_generation_prompt=True, tokenize=False, **template_kwargs
                    )
                )
            except Exception as err:
                raise DataError(f"{where[i]}: the chat template failed ({err})") from err
        ids: list[list[int]] = [[] for _ in prompts]
        plain = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        for group, special in ((chat, False), (plain, True)):
            if group:
                encoded = self.tokenizer([texts[i] for i in group], add_special_tokens=special)
                for i, tokens in zip(group, encoded["input_ids"], strict=True):
                    ids[i] = list(tokens)
        return ids

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Row ``i``: ``input_ids`` (list of ints), ``raw_prompt``, ``data_source``,
        ``ground_truth``, ``extra_info``, ``ability``, ``index``, ``origin``."""
        return self.rows[i]

    def origin(self, i: int) -> tuple[str, int]:
        """The file row ``i`` was read from and its row there (0-based), for messages."""
        return self.rows[i]["origin"]

    def collate(self, rows: Sequence[Mapping[str, Any]]) -> Batch:
        """Stack rows into a `Batch` of left-padded prompts.

        Args:
            rows: rows from ``__getitem__``.

        Returns:
            A `Batch` with tensors ``input_ids`` (B, P) long (left-padded with the pad
            token), ``attention_mask`` (B, P) bool, ``position_ids`` (B, P) long (0 on the
            padding), and non-tensor columns ``data_source``, ``ground_truth``,
            ``extra_info``, ``raw_prompt``, ``ability``, ``index``; ``P`` is the longest
            prompt of the batch.

        Raises:
            ValueError: no rows.
        """
        if not rows:
            raise ValueError("collate needs at least one row")
        ids = [r["input_ids"] for r in rows]
        input_ids = pad_2d(ids, self.pad_token_id, side="left", dtype=torch.long)
        attention_mask = lengths_to_mask([len(x) for x in ids], input_ids.shape[1], side="left")
        position_ids = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
        columns = ("data_source", "ground_truth", "extra_info", "raw_prompt", "ability", "index")
        return Batch(
            {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": position_ids,
            },
            {key: [r[key] for r in rows] for key in columns},
        )

    def get_batch(self, indices: Sequence[int]) -> Batch:
        """``collate`` of the rows at ``indices`` (e.g. one batch of a `PromptSampler`)."""
        return self.collate([self.rows[i] for i in indices])
