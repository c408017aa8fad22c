"""How a prompt becomes tokens: one rule for SFT, RL and validation, and its record.

A chat-message prompt (``[{"role", "content"}, ...]``) is always rendered with the tokenizer's
chat template and the generation prompt. A plain-string prompt follows ``data.prompt_template``,
the same key in ``lmrl sft`` and ``lmrl train``:

- ``chat`` (the default; verl's SFT rule): the string is one user turn,
  ``[{"role": "user", "content": prompt}]``, rendered as a chat-message prompt is, when the
  tokenizer has a chat template (without one it is used verbatim);
- ``verbatim``: the string as it is, the tokenizer's own special tokens (a BOS) added.

So an SFT file with string prompts and an RL file with the same prompts as one user message
give the model the same tokens. ``lmrl sft`` records the renderings its training prompts got
in ``final/lmrl_prompt_layout.json`` (`write_layout`); ``lmrl train`` warm-started from that
directory refuses, before its first step, prompts rendered in a way the warm start never saw
(`check_warm_start`): such a model scores as if untrained, and RL from ~0 reward learns nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmrl.errors import DataError

PROMPT_TEMPLATES = ("chat", "verbatim")

#: the record's file name in an exported model directory
LAYOUT_FILE = "lmrl_prompt_layout.json"

#: what each rendering is, for messages and the record
RENDERINGS = {
    "chat": "with the chat template (a plain string as one user turn, generation prompt added)",
    "verbatim": "verbatim (a plain string as it is)",
}


def has_chat_template(tokenizer: Any) -> bool:
    """The tokenizer has a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def as_chat(prompt: str | list[dict], tokenizer: Any, prompt_template: str) -> str | list[dict]:
    """The prompt as the rule renders it: chat messages (templated) or a string (verbatim).

    Args:
        prompt: a checked prompt (`lmrl.data.dataset.check_prompt`).
        tokenizer: the model's tokenizer.
        prompt_template: ``"chat"`` or ``"verbatim"`` (``data.prompt_template``).
    Raises:
        ValueError: an unknown ``prompt_template``.
    """
    if prompt_template not in PROMPT_TEMPLATES:
        raise ValueError(
            f"prompt_template must be one of {list(PROMPT_TEMPLATES)}, got {prompt_template!r}"
        )
    if isinstance(prompt, str) and prompt_template == "chat" and has_chat_template(tokenizer):
        return [{"role": "user", "content": prompt}]
    return prompt


@dataclass(frozen=True)
class PromptLayout:
    """How a dataset's prompts were rendered.

    Attributes:
        prompt_template: the ``data.prompt_template`` it was built with.
        renderings: the renderings its prompts got, sorted: ``("chat",)``, ``("verbatim",)``
            or both (keys of ``RENDERINGS``).
        message_prompts: some prompts are chat messages (templated whatever the key says).
    """

    prompt_template: str
    renderings: tuple[str, ...]
    message_prompts: bool

    @classmethod
    def of(
        cls, prompt_template: str, renderings: Iterable[str], message_prompts: bool
    ) -> PromptLayout:
        """The layout of prompts that got ``renderings`` (one per prompt, repeats allowed)."""
        return cls(prompt_template, tuple(sorted(set(renderings))), message_prompts)

    def merged(self, other: PromptLayout | None) -> PromptLayout:
        """The layout of both datasets' prompts (training and validation)."""
        if other is None:
            return self
        return PromptLayout(
            self.prompt_template,
            tuple(sorted({*self.renderings, *other.renderings})),
            self.message_prompts or other.message_prompts,
        )

    def describe(self) -> str:
        return " and ".join(RENDERINGS[r] for r in self.renderings)


def write_layout(model_dir: str | Path, layout: PromptLayout) -> Path:
    """Write the record of the prompts a model was fine-tuned on into ``model_dir``."""
    path = Path(model_dir) / LAYOUT_FILE
    record = {
        "prompt_template": layout.prompt_template,
        "renderings": list(layout.renderings),
        "message_prompts": layout.message_prompts,
        "describe": layout.describe(),
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read_layout(model_dir: str | Path) -> PromptLayout | None:
    """The record in ``model_dir`` (an ``lmrl sft`` export), or None where there is none.

    Raises:
        DataError: a record that cannot be read, naming the file.
    """
    path = Path(model_dir) / LAYOUT_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        layout = PromptLayout(
            str(record["prompt_template"]),
            tuple(sorted(str(r) for r in record["renderings"])),
            bool(record["message_prompts"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path}: not a prompt layout record ({err}); delete it") from err
    unknown = [r for r in layout.renderings if r not in RENDERINGS]
    if unknown:
        raise DataError(f"{path}: unknown renderings {unknown}; known: {sorted(RENDERINGS)}")
    return layout


def check_warm_start(model_dir: str | Path, layout: PromptLayout) -> None:
    """Refuse prompts rendered in a way the warm start in ``model_dir`` was not trained on.

    Args:
        model_dir: ``model.path`` of the RL run; a directory without a record passes.
        layout: how the run renders its prompts (training and validation together).
    Raises:
        DataError: one line naming both layouts and the ``data.prompt_template`` that aligns
            them.
    """
    recorded = read_layout(model_dir)
    if recorded is None:
        return
    unseen = [r for r in layout.renderings if r not in recorded.renderings]
    if not unseen:
        return
    because = f"data.prompt_template={layout.prompt_template}"
    if unseen == ["chat"] and layout.message_prompts:  # chat messages are always templated
        because = "its chat-message prompts"
        fix = "rerun lmrl sft with data.prompt_template=chat"
    elif unseen == ["chat"]:
        fix = (
            "set data.prompt_template=verbatim, as the lmrl sft run did, or rerun lmrl sft with "
            "data.prompt_template=chat"
        )
    else:
        fix = "set data.prompt_template=chat, as the lmrl sft run did"
    raise DataError(
        f"model.path={model_dir} was fine-tuned by lmrl sft on prompts rendered "
        f"{recorded.describe()} ({LAYOUT_FILE}), but this run renders prompts "
        f"{' and '.join(RENDERINGS[r] for r in unseen)} ({because}), a layout the warm start "
        f"never saw; {fix}"
    )


__all__ = [
    "LAYOUT_FILE",
    "PROMPT_TEMPLATES",
    "RENDERINGS",
    "PromptLayout",
    "as_chat",
    "check_warm_start",
    "has_chat_template",
    "read_layout",
    "write_layout",
]
