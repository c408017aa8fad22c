"""Supervised examples for ``lmrl sft``: rows -> token sequences with a loss mask.

``SFTDataset`` reads, checks and tokenizes every row up front; ``collate`` right-pads a
micro-batch. Three row layouts, chosen per row: (a) ``prompt`` + ``response`` columns
(``data.prompt_key``, ``data.response_key``); (b) a whole chat in ``data.messages_key``, every
assistant turn trained on; (c) verl RL-format rows (``data.response_from_ground_truth``), the
response being ``reward_model.ground_truth`` as a string (the built-in tasks' files).

The choice this module makes: tokens are laid out exactly as RL will see them. A chat prompt
is rendered with the tokenizer's template and ``add_generation_prompt=True``, then each
assistant turn is the text the template adds for it, tokenized on its own, as the rollout
engine generates it after the templated prompt: ``31284<|im_end|>`` for ChatML. The loss
covers the turn up to and including its last special token (the end-of-turn the engine stops
at); what the template writes after it (ChatML's ``\\n``) is context, and dropped at the end
of a sequence. A plain-string prompt follows ``prompt_template``, the rule
``lmrl.data.RLDataset`` follows too (``lmrl.data.layout``): by default it is one user turn under
the chat template (verl's SFT rule), its response that turn's assistant answer, so a
string-prompt SFT file and a chat-message RL file show the model the same prompt tokens; with
``verbatim`` (or a tokenizer without a chat template) it is used as it is, special tokens
added, and its response is followed by the tokenizer's EOS token. ``SFTDataset.layout`` says
which renderings the prompts got; ``lmrl sft`` records it with the exported model, and ``lmrl
train`` checks its own prompts against that record.

Bad rows raise ``lmrl.errors.DataError`` naming the file, the row and the column.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

from lmrl.data.dataset import check_prompt, read_records
from lmrl.data.layout import PromptLayout, as_chat
from lmrl.errors import DataError, ModelError

log = logging.getLogger(__name__)

TRUNCATIONS = ("error", "left", "right")

_T = TypeVar("_T")


class Segment(NamedTuple):
    """One piece of an example's text.

    Attributes:
        text: the text, tokenized on its own.
        trained: the loss is on it (an assistant turn or a response).
        special_tokens: tokenized with ``add_special_tokens=True`` (a plain-string prompt).
        eos: the tokenizer's EOS id follows it, trained on (a plain-string response).
    """

    text: str
    trained: bool
    special_tokens: bool = False
    eos: bool = False


def _as_data_error(read: Callable[..., _T], *args: Any) -> _T:
    """``read(*args)``, its ``ValueError`` (a bad file or prompt, named) as a ``DataError``."""
    try:
        return read(*args)
    except DataError:
        raise
    except ValueError as err:
        raise DataError(str(err)) from err


# ---------------------------------------------------------------------------- rows -> segments
def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as err:
        raise DataError(f"{where}: the chat template failed ({err})") from err


def chat_segments(tokenizer: Any, messages: list[dict], where: str) -> list[Segment]:
    """Split a templated chat into context text and assistant-turn text.

    For assistant message ``k``: the context is what the template renders for ``messages[:k]``
    with the generation prompt (beyond what earlier turns rendered), the turn is what it adds
    for message ``k`` itself.

    Args:
        tokenizer: a tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]`` with at least one assistant message.
        where: ``"<file>: row <i>: column <c>"`` for error messages.
    Returns:
        The segments in order: context, assistant turn, context, assistant turn...
    Raises:
        DataError: no assistant message, no chat template, or a template that does not
            render a conversation as the concatenation of its turns.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{where}: chat messages need a tokenizer with a chat template; this one has none "
            "(give plain-string prompts instead)"
        )
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise DataError(f"{where}: no assistant message to train on")
    segments: list[Segment] = []
    done = ""
    for k in turns:
        try:
            prefix = _render(tokenizer, messages[:k], True, where)
        except DataError:
            if k:
                raise
            prefix = ""  # a template that cannot render an empty chat: nothing comes before
        full = _render(tokenizer, messages[: k + 1], False, where)
        if not prefix.startswith(done) or not full.startswith(prefix):
            raise DataError(
                f"{where}: the chat template does not render assistant turn {k} as an "
                "extension of the conversation before it, so its tokens cannot be told apart; "
                "use the prompt/response layout (data.prompt_key, data.response_key)"
            )
        segments += [Segment(prefix[len(done) :], False), Segment(full[len(prefix) :], True)]
        done = full
    return segments


def row_segments(
    row: Any,
    tokenizer: Any,
    where: str,
    *,
    prompt_key: str = "prompt",
    response_key: str = "response",
    messages_key: str = "messages",
    response_from_ground_truth: bool = False,
    prompt_template: str = "chat",
) -> list[Segment]:
    """The text segments of one row, in whichever layout it has (see the module docstring).

    Args:
        row: a row as read (a dict).
        tokenizer: the model's tokenizer.
        where: ``"<file>: row <i>"`` for error messages.
        prompt_key, response_key, messages_key: the column names.
        response_from_ground_truth: take the response from ``reward_model.ground_truth``.
        prompt_template: how a plain-string prompt is rendered (``lmrl.data.layout``):
            ``"chat"`` (one user turn, when the tokenizer has a chat template) or
            ``"verbatim"``.
    Returns:
        The row's segments: the templated chat split into context and assistant turns, or a
        verbatim plain-string prompt (special tokens added) and its response (EOS appended).
    Raises:
        DataError: a missing or malformed column, naming the row and the column.
    """
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: must be an object with columns, got {type(row).__name__}")
    if response_from_ground_truth:
        reward_model = row.get("reward_model")
        if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
            raise DataError(
                f"{where}: column 'reward_model.ground_truth': missing, needed by "
                f"data.response_from_ground_truth=true (columns there: {sorted(row)})"
            )
        truth = reward_model["ground_truth"]
        if isinstance(truth, bool) or not isinstance(truth, str | int | float):
            raise DataError(
                f"{where}: column 'reward_model.ground_truth' is a {type(truth).__name__}; "
                "data.response_from_ground_truth needs a string (or a number) to train on"
            )
        response, response_col = str(truth), "reward_model.ground_truth"
    elif response_key in row:
        response, response_col = row[response_key], response_key
    elif messages_key in row:
        column = f"{where}: column {messages_key!r}"
        messages = _as_data_error(check_prompt, row[messages_key], column)
        if isinstance(messages, str):
            raise DataError(f"{column} must be a list of chat messages, got a string")
        return chat_segments(tokenizer, messages, column)
    else:
        raise DataError(
            f"{where}: neither a {response_key!r} column (data.response_key) nor a "
            f"{messages_key!r} column (data.messages_key) (columns there: {sorted(row)}); for "
            "verl RL-format rows set data.response_from_ground_truth=true"
        )
    if not isinstance(response, str) or not response.strip():
        raise DataError(
            f"{where}: column {response_col!r} must be a non-empty string, got {response!r:.60}"
        )
    if prompt_key not in row:
        raise DataError(f"{where}: column {prompt_key!r}: missing (columns there: {sorted(row)})")
    column = f"{where}: column {prompt_key!r}"
    prompt = as_chat(_as_data_error(check_prompt, row[prompt_key], column), tokenizer,
                     prompt_template)  # fmt: skip
    if isinstance(prompt, str):
        return [Segment(prompt, False, special_tokens=True), Segment(response, True, eos=True)]
    return chat_segments(tokenizer, [*prompt, {"role": "assistant", "content": response}], column)


# ---------------------------------------------------------------------------- dataset
class SFTDataset:
    """Examples for SFT, read, checked and tokenized up front.

    Args:
        paths: one data file / saved-dataset directory, or a list of them.
        tokenizer: the model's tokenizer (a pad or EOS token to pad with; a chat template for
            message prompts).
        prompt_key, response_key, messages_key, response_from_ground_truth: the layout (see
            the module docstring).
        prompt_template: how a plain-string prompt is rendered: ``"chat"`` (one user turn
            under the chat template, when the tokenizer has one) or ``"verbatim"``.
        mask_pattern: a regex; the parts of a trained segment it matches become context
            (tool observations in multi-turn demonstrations); None = train everything.
        max_length: the most tokens per example; None = no limit.
        truncation: for longer examples: ``"error"`` (raise, naming the row), ``"right"`` (cut
            the end) or ``"left"`` (cut the start). An example left with no trained token is
            dropped (counted in ``stats["dropped"]``).
        keep: ``keep(file, row)`` says whether a row is read (``row`` 0-based in its file;
            a held-out split, `held_out_rows`); None = every row.

    Attributes:
        examples: ``(input_ids, loss_mask)`` per example: lists of ints and bools, the mask
            True at tokens the loss is on (never the first token, which nothing predicts).
        stats: ``{"rows", "truncated", "dropped", "examples", "loss_tokens"}``.
        layout: how the prompts were rendered (`lmrl.data.layout.PromptLayout`), recorded
            with the exported model.

    Raises:
        ValueError: bad arguments. DataError: bad input, naming the file, the row and the
            column. ModelError: a tokenizer without an EOS token.
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        response_key: str = "response",
        messages_key: str = "messages",
        response_from_ground_truth: bool = False,
        mask_pattern: str | None = None,
        max_length: int | None = None,
        truncation: str = "error",
        prompt_template: str = "chat",
        keep: Callable[[str, int], bool] | None = None,
    ) -> None:
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {list(TRUNCATIONS)}, got {truncation!r}")
        if max_length is not None and max_length < 2:
            raise ValueError(f"max_length must be >= 2 or None, got {max_length}")
        if isinstance(paths, str | Path):
            paths = [paths]
        if not paths:
            raise ValueError("no data files given")
        pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        if pad is None or tokenizer.eos_token_id is None:
            raise ModelError("the tokenizer needs an eos token (the end of a plain-text response)")
        self.pad_token_id = int(pad)
        mask = re.compile(mask_pattern) if mask_pattern is not None else None

        rows: list[list[Segment]] = []
        where: list[str] = []
        message_prompts = False
        for path in paths:
            for i, raw in enumerate(_as_data_error(read_records, path)):
                if keep is not None and not keep(str(path), i):
                    continue
                at = f"{path}: row {i}"
                segments = row_segments(
                    raw, tokenizer, at, prompt_key=prompt_key, response_key=response_key,
                    messages_key=messages_key,
                    response_from_ground_truth=response_from_ground_truth,
                    prompt_template=prompt_template,
                )  # fmt: skip
                whole_chat = not response_from_ground_truth and response_key not in raw
                message_prompts |= whole_chat or not isinstance(raw[prompt_key], str)
                rows.append(mask_segments(segments, mask) if mask is not None else segments)
                where.append(at)
        if not rows:
            raise DataError(f"no rows in {[str(p) for p in paths]}")
        # a verbatim prompt is the one segment tokenized with the tokenizer's special tokens
        self.layout = PromptLayout.of(
            prompt_template,
            ("verbatim" if segs[0].special_tokens else "chat" for segs in rows),
            message_prompts,
        )

        self.examples: list[tuple[list[int], list[bool]]] = []
        truncated = dropped = 0
        for (input_ids, loss_mask), at in zip(_tokenize(rows, tokenizer), where, strict=True):
            _drop_untrained_tail(input_ids, loss_mask)
            if max_length is not None and len(input_ids) > max_length:
                if truncation == "error":
                    raise DataError(
                        f"{at}: the example has {len(input_ids)} tokens, more than "
                        f"data.max_length={max_length}; raise it or set data.truncation="
                        "left/right"
                    )
                cut = slice(0, max_length) if truncation == "right" else slice(-max_length, None)
                input_ids, loss_mask = input_ids[cut], loss_mask[cut]
                _drop_untrained_tail(input_ids, loss_mask)
                truncated += 1
            if loss_mask:
                loss_mask[0] = False  # the first token has no prediction
            if not any(loss_mask):
                dropped += 1
                continue
            self.examples.append((input_ids, loss_mask))
        if truncated:
            log.warning(
                "truncated %d examples to %d tokens (%s)", truncated, max_length, truncation
            )
        if dropped:
            log.warning("dropped %d examples with no response token left", dropped)
        if not self.examples:
            raise DataError(f"no example with a response token in {[str(p) for p in paths]}")
        self.stats = {
            "rows": len(rows),
            "truncated": truncated,
            "dropped": dropped,
            "examples": len(self.examples),
            "loss_tokens": sum(sum(m) for _, m in self.examples),
        }

    def __len__(self) -> int:
        return len(self.examples)

    def collate(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Right-pad the examples at ``indices`` to their longest.

        Returns:
            ``input_ids`` (B, L) long (padded with the pad id), ``attention_mask`` (B, L) bool,
            ``loss_mask`` (B, L) bool (True at trained tokens).
        """
        if len(indices) == 0:
            raise ValueError("collate needs at least one index")
        picked = [self.examples[i] for i in indices]
        width = max(len(ids) for ids, _ in picked)
        input_ids = torch.full((len(picked), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(picked), width), dtype=torch.bool)
        loss_mask = torch.zeros((len(picked), width), dtype=torch.bool)
        for r, (ids, mask) in enumerate(picked):
            input_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[r, : len(ids)] = True
            loss_mask[r, : len(ids)] = torch.tensor(mask, dtype=torch.bool)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def _tokenize(rows: list[list[Segment]], tokenizer: Any) -> list[tuple[list[int], list[bool]]]:
    """``(input_ids, loss_mask)`` of each row's segments, untruncated.

    One tokenizer call per ``add_special_tokens`` setting, over every segment of every row. A
    chat turn is trained up to its last special token (the end of turn); a plain response and
    the EOS appended to it are trained whole.
    """
    flat = [seg for segs in rows for seg in segs]
    ids: list[list[int]] = [[] for _ in flat]
    for add_special in (False, True):
        picked = [j for j, g in enumerate(flat) if g.special_tokens is add_special and g.text]
        if picked:
            encoded = tokenizer([flat[j].text for j in picked], add_special_tokens=add_special)
            for j, tokens in zip(picked, encoded["input_ids"], strict=True):
                ids[j] = list(tokens)
    special = set(tokenizer.all_special_ids)
    out = []
    j = 0
    for segs in rows:
        input_ids: list[int] = []
        loss_mask: list[bool] = []
        for seg in segs:
            tokens = ids[j]
            j += 1
            if not seg.trained:
                end = 0
            elif seg.eos:
                tokens = [*tokens, tokenizer.eos_token_id]
                end = len(tokens)
            else:  # a chat turn: trained up to its last special token (end of turn)
                marks = [k for k, t in enumerate(tokens) if t in special]
                end = marks[-1] + 1 if marks else len(tokens)
            input_ids += tokens
            loss_mask += [True] * end + [False] * (len(tokens) - end)
        out.append((input_ids, loss_mask))
    return out


def mask_segments(segments: list[Segment], pattern: re.Pattern) -> list[Segment]:
    """Cut every trained segment at the matches of ``pattern``: the matches become context
    (not trained), the rest stays trained; a response's EOS stays on its last piece."""
    out: list[Segment] = []
    for seg in segments:
        if not seg.trained:
            out.append(seg)
            continue
        pieces, last = [], 0
        for match in pattern.finditer(seg.text):
            if match.end() == match.start():
                continue  # an empty match masks nothing
            pieces += [(seg.text[last : match.start()], True), (match.group(0), False)]
            last = match.end()
        pieces.append((seg.text[last:], True))
        out += [Segment(text, trained, seg.special_tokens) for text, trained in pieces if text]
        if seg.eos:  # the EOS after the response is trained, whatever ends the response
            out.append(Segment("", True, seg.special_tokens, eos=True))
    return out


def _drop_untrained_tail(input_ids: list[int], loss_mask: list[bool]) -> None:
    """Remove trailing context tokens in place: they predict nothing trained."""
    while loss_mask and not loss_mask[-1]:
        loss_mask.pop()
        input_ids.pop()


def held_out_rows(
    paths: str | Path | Sequence[str | Path], split: float, seed: int
) -> frozenset[tuple[str, int]]:
    """The rows ``data.val_split`` holds out of the training files for validation.

    Args:
        paths: the training files, in order.
        split: a share of their rows (< 1, rounded to the nearest row) or a number of rows.
        seed: the draw's seed (the same rows for the same files and seed, on every machine).

    Returns:
        The held-out rows as ``(file, row)`` pairs (``row`` 0-based in its file).

    Raises:
        DataError: the split holds out no row, or every row.
    """
    paths = [paths] if isinstance(paths, str | Path) else list(paths)
    origins = [(str(p), i) for p in paths for i in range(len(_as_data_error(read_records, p)))]
    n = round(split * len(origins)) if split < 1 else int(split)
    if not 1 <= n < len(origins):
        raise DataError(
            f"data.val_split={split:g} holds out {n} of the {len(origins)} training rows; "
            "it must leave at least one row on each side"
        )
    order = torch.randperm(len(origins), generator=torch.Generator().manual_seed(seed))
    return frozenset(origins[i] for i in order[:n].tolist())


__all__ = [
    "TRUNCATIONS",
    "SFTDataset",
    "Segment",
    "chat_segments",
    "held_out_rows",
    "mask_segments",
    "row_segments",
]
