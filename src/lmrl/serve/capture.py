"""Every call an episode makes, token-exact, stitched into trajectories for training.

Each call records the ids the engine was given (the prompt), the ids it sampled for each
choice with their log-probs, the weights version that sampled them and the episode. A call
*extends* an earlier choice when its messages begin with that call's messages and the
assistant message that choice was answered with (the tools and template arguments the same).
Its prompt is then built, not re-tokenized: the earlier prompt, the sampled ids, and the
template's delta after them, the same delta `lmrl.rollout.chat` computes for the agent loop::

    g = render(H, generation prompt)                 # the earlier call's template prompt
    s = render(H + [assistant])                      # the reply as the last message
    cut = len(g) + s[len(g):] up to its first end-of-turn token (included when the model
          wrote one; a turn cut by a stop string or max_tokens gets the template's as glue)
    check t[:cut] == s[:cut] for t = render(messages, generation prompt);  delta = t[cut:]

so the engine reads exactly the tokens the trajectory holds: what the model wrote is its own
ids, whatever the text would re-tokenize to, and the tool results, user turns and the
template's glue are the template's tokens. A trajectory is a chain of calls, each extending a
choice of the one before; its ``responses`` are the sampled ids with the deltas between them,
``response_mask`` True on the sampled ids only (Search-R1's state masking).

A call that extends nothing starts a new trajectory of the episode, and when the episode had
calls before it is a *split*, counted by reason (`SPLITS`): ``edit`` (its history is no earlier
call's history and reply: a message dropped, rewritten or reordered), ``fork`` (it extends a
reply that a later call already extended: history cut back to that reply and continued
otherwise, a later message dropped or rewritten; its prompt is still built from the sampled
ids), ``template`` (the template renders the earlier conversation
otherwise once more messages follow, e.g. Qwen3 dropping earlier ``<think>`` blocks, so the
tokens cannot extend). Nothing is ever re-tokenized silently. Raw completions
(``/v1/completions``) extend at the token level: a prompt whose ids begin with an earlier
prompt's and completion's.

A call with ``n`` choices branches: every choice not extended by a later call ends a
trajectory, and tokens sampled before the branching call are in each branch's trajectory.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lmrl.batch import Batch
from lmrl.serve.messages import Renderer, canonical

__all__ = ["SPLITS", "Call", "Capture", "Choice", "Prompt", "Trajectory", "to_batch"]

#: why a call starts a new trajectory of an episode that had calls before it
SPLITS = ("edit", "fork", "template")


@dataclass
class Choice:
    """One sampled completion of a call."""

    ids: list[int]
    log_probs: list[float]
    key: str | None = None  # the conversation it ends (chat calls): what a later call extends
    ended: bool = True  # its last id is an end-of-turn token
    extended: bool = False


@dataclass
class Call:
    """One request's record.

    Attributes:
        index: its place among the episode's calls.
        prompt: the ids the engine was given.
        template_prompt: the template's rendering of its messages (chat calls), for deltas.
        choices: its sampled completions.
        version: the weights version that sampled them.
        parent: the (call, choice) it extends, or None (a trajectory starts here).
        split: why it starts a new trajectory of an episode with earlier calls, or None.
    """

    index: int
    prompt: list[int]
    template_prompt: list[int] | None
    choices: list[Choice]
    version: int
    parent: tuple[int, int] | None = None
    split: str | None = None


@dataclass
class Prompt:
    """What `Capture.prompt` plans for a call before it runs."""

    ids: list[int]
    template_prompt: list[int] | None
    parent: tuple[int, int] | None
    split: str | None


@dataclass
class Trajectory:
    """A chain of calls, ready for training.

    Attributes:
        episode: its episode.
        prompt: the first call's prompt ids (P,).
        responses: every later token (T,): sampled ids and the deltas between calls.
        response_mask: True on the sampled ids (T,).
        log_probs: the engine's log-prob of each sampled id, 0 on the deltas (T,).
        versions: the weights version of each call of the chain.
        calls: the calls' indices.
    """

    episode: str
    prompt: list[int]
    responses: list[int] = field(default_factory=list)
    response_mask: list[bool] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)


@dataclass
class _Episode:
    calls: list[Call] = field(default_factory=list)
    chats: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (call, choice)
    splits: Counter = field(default_factory=Counter)


class Capture:
    """The calls of every episode (thread-safe: the endpoint records, a trainer reads).

    Args:
        renderer: the model's chat template (`lmrl.serve.messages.Renderer`).
    """

    def __init__(self, renderer: Renderer) -> None:
        self.renderer = renderer
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ planning a call
    def chat_prompt(self, episode: str, messages: list[dict], tools=None, kwargs=None) -> Prompt:
        """The prompt ids of a chat call (the module docstring's rules).

        Raises:
            APIError: 400 when the template refuses the messages.
        """
        r = self.renderer
        t = r.render(messages, tools, True, kwargs)
        call, k, j = None, 0, 0
        with self._lock:
            ep = self._episodes.get(episode) or _Episode()
            earlier = bool(ep.calls)
            for k in range(len(messages) - 1, -1, -1):
                if messages[k]["role"] != "assistant":
                    continue
                where = ep.chats.get(canonical(messages[: k + 1], tools, kwargs))
                if where is not None:
                    call, j = ep.calls[where[0]], where[1]
                    break
        if call is None:
            return Prompt(t, t, None, "edit" if earlier else None)
        choice = call.choices[j]
        g = call.template_prompt or []
        s = r.render(messages[: k + 1], tools, False, kwargs)
        tail = s[len(g) :] if s[: len(g)] == g else None
        end = next((i for i, x in enumerate(tail or []) if x in r.end_ids), None)
        if tail is None or end is None:
            return Prompt(t, t, None, "template")
        cut = len(g) + end + (1 if choice.ended else 0)
        if t[:cut] != s[:cut]:
            return Prompt(t, t, None, "template")
        ids = [*call.prompt, *choice.ids, *t[cut:]]
        if choice.extended:
            return Prompt(ids, t, None, "fork")
        return Prompt(ids, t, (call.index, j), None)

    def completion_prompt(self, episode: str, ids: Sequence[int]) -> Prompt:
        """The prompt of a raw completion call: ``ids`` as given, extending the latest
        earlier (call, choice) whose prompt and completion its ids begin with."""
        ids = list(ids)
        with self._lock:
            ep = self._episodes.get(episode)
            if ep is None or not ep.calls:
                return Prompt(ids, None, None, None)
            for call in reversed(ep.calls):
                if call.template_prompt is not None:
                    continue
                for j, choice in enumerate(call.choices):
                    whole = call.prompt + choice.ids
                    if len(whole) <= len(ids) and ids[: len(whole)] == whole:
                        if choice.extended:
                            return Prompt(ids, None, None, "fork")
                        return Prompt(ids, None, (call.index, j), None)
        return Prompt(ids, None, None, "edit")

    # ------------------------------------------------------------ recording
    def record(
        self,
        episode: str,
        prompt: Prompt,
        choices: Sequence[Choice],
        version: int,
        keys: Sequence[str | None] | None = None,
    ) -> Call:
        """Record a call that ran: its prompt (`chat_prompt` / `completion_prompt`), its
        choices (``keys``: each one's conversation, for chat calls) and weights version."""
        with self._lock:
            ep = self._episodes.setdefault(episode, _Episode())
            call = Call(
                len(ep.calls),
                prompt.ids,
                prompt.template_prompt,
                list(choices),
                version,
                prompt.parent,
                prompt.split,
            )
            if prompt.parent is not None:
                c, j = prompt.parent
                parent = ep.calls[c].choices[j]
                if parent.extended:  # a concurrent call extended it first
                    call.parent, call.split = None, "fork"
                parent.extended = True
            if call.split is not None:
                ep.splits[call.split] += 1
            for j, choice in enumerate(call.choices):
                choice.key = keys[j] if keys is not None else None
                if choice.key is not None:
                    ep.chats.setdefault(choice.key, (call.index, j))
            ep.calls.append(call)
        return call

    # ------------------------------------------------------------ reading
    def episodes(self) -> list[str]:
        with self._lock:
            return list(self._episodes)

    def calls(self, episode: str) -> list[Call]:
        with self._lock:
            ep = self._episodes.get(episode)
            return list(ep.calls) if ep else []

    def splits(self, episode: str) -> dict[str, int]:
        """How many calls started a new trajectory of ``episode``, by reason (`SPLITS`)."""
        with self._lock:
            ep = self._episodes.get(episode)
            return {reason: (ep.splits[reason] if ep else 0) for reason in SPLITS}

    def trajectories(self, episode: str) -> list[Trajectory]:
        """``episode``'s trajectories: one per choice no later call extended, in call order."""
        with self._lock:
            ep = self._episodes.get(episode)
            calls = list(ep.calls) if ep else []
        out = []
        for call in calls:
            for j, choice in enumerate(call.choices):
                if not choice.extended:
                    out.append(self._chain(episode, calls, call, j))
        return out

    def pop(self, episode: str) -> list[Trajectory]:
        """``episode``'s trajectories, its record then dropped (a finished episode)."""
        found = self.trajectories(episode)
        with self._lock:
            self._episodes.pop(episode, None)
        return found

    @staticmethod
    def _chain(episode: str, calls: list[Call], last: Call, j: int) -> Trajectory:
        chain = [(last, j)]
        while chain[-1][0].parent is not None:
            c, k = chain[-1][0].parent
            chain.append((calls[c], k))
        chain.reverse()
        first = chain[0][0]
        out = Trajectory(episode, list(first.prompt))
        end = len(first.prompt)  # where the sequence so far ends
        for call, k in chain:
            delta = call.prompt[end:]
            choice = call.choices[k]
            out.responses += delta + choice.ids
            out.response_mask += [False] * len(delta) + [True] * len(choice.ids)
            out.log_probs += [0.0] * len(delta) + list(choice.log_probs)
            out.versions.append(call.version)
            out.calls.append(call.index)
            end = len(call.prompt) + len(choice.ids)
        return out


def to_batch(trajectories: Sequence[Trajectory], pad_id: int) -> Batch:
    """Trajectories in the rollout's layout (`lmrl.rollout.base`): ``prompts`` left-padded,
    ``responses`` right-padded, ``input_ids``, ``attention_mask``, ``position_ids``,
    ``response_mask`` (False on what the model did not write), ``rollout_log_probs``,
    ``weights_version`` (a row's oldest call's) and ``uid`` (the episode).
    """
    if not trajectories:
        raise ValueError("no trajectories")
    p = max(len(t.prompt) for t in trajectories)
    w = max(max(len(t.responses) for t in trajectories), 1)
    b = len(trajectories)
    prompts = torch.full((b, p), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(b, p, dtype=torch.bool)
    responses = torch.full((b, w), pad_id, dtype=torch.long)
    attention = torch.zeros(b, w, dtype=torch.bool)
    response_mask = torch.zeros(b, w, dtype=torch.bool)
    log_probs = torch.zeros(b, w, dtype=torch.float32)
    for i, t in enumerate(trajectories):
        n = len(t.prompt)
        prompts[i, p - n :] = torch.tensor(t.prompt, dtype=torch.long)
        prompt_mask[i, p - n :] = True
        m = len(t.responses)
        if m:
            responses[i, :m] = torch.tensor(t.responses, dtype=torch.long)
            attention[i, :m] = True
            response_mask[i, :m] = torch.tensor(t.response_mask)
            log_probs[i, :m] = torch.tensor(t.log_probs, dtype=torch.float32)
    mask = torch.cat([prompt_mask, attention], dim=1)
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": mask,
            "position_ids": (mask.long().cumsum(dim=1) - 1).clamp(min=0),
            "response_mask": response_mask,
            "rollout_log_probs": log_probs,
            "weights_version": torch.tensor([min(t.versions) for t in trajectories]),
        },
        {"uid": np.array([t.episode for t in trajectories], dtype=object)},
    )
