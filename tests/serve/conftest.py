"""Endpoints served in-process on 127.0.0.1 (a port the system picks) for the serve tests."""

from __future__ import annotations

import pytest
import torch

from lmrl.rollout.base import RolloutEngine, SamplingParams, finish_rollout


class ScriptedEngine(RolloutEngine):
    """An engine that "samples" the token lists it is handed (``script``), one per row, with
    log-prob -0.5 each; it keeps the prompts it was given."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id
        self.script: list[list[int]] = []
        self.prompts: list[list[int]] = []

    def generate(self, prompts, n=1, sampling=None, *, prompt_offset=0):
        sampling = sampling or SamplingParams()
        mask = prompts["attention_mask"].bool()
        for i in range(len(prompts)):
            self.prompts.append(prompts["input_ids"][i][mask[i]].tolist())
        rows = [self.script.pop(0)[: sampling.max_new_tokens] for _ in range(len(prompts) * n)]
        width = max(len(r) for r in rows)
        responses = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        response_mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, r in enumerate(rows):
            responses[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            response_mask[i, : len(r)] = True
        log_probs = torch.where(response_mask, -0.5, 0.0)
        return finish_rollout(prompts, n, responses, response_mask, log_probs,
                              sampling.logprob_temperature)  # fmt: skip

    def sync_weights(self, state_dict=None) -> None:
        pass


@pytest.fixture(scope="module")
def tiny_server(tiny_workspace):
    """The tiny Qwen2 behind the endpoint (context length 256, bodies up to 64 KB)."""
    from lmrl.serve import load_endpoint, serve_in_thread

    endpoint = load_endpoint(tiny_workspace / "model", device="cpu", model_name="tiny",
                             context_length=256, capture=True, seed=0)  # fmt: skip
    endpoint.max_body_bytes = 64 * 1024
    running = serve_in_thread(endpoint)
    yield running
    running.close()


@pytest.fixture(scope="module")
def scripted_server():
    """A scripted engine under Qwen2.5's chat template (tool calls in ``<tool_call>``)."""
    from tests.rollout.chat_templates import tokenizer_for

    from lmrl.serve import Endpoint, serve_in_thread

    tok = tokenizer_for("qwen2.5")
    engine = ScriptedEngine(tok.pad_token_id)
    endpoint = Endpoint(engine, tok, "scripted", 4096, tok.pad_token_id, [tok.eos_token_id])
    running = serve_in_thread(endpoint)
    yield running
    running.close()


def client_for(running, episode=None, base_url=None):
    """An ``openai`` client of a new episode (or ``episode``), no retries."""
    import openai

    episode = episode or running.endpoint.open_episode()
    client = openai.OpenAI(base_url=base_url or running.base_url, api_key=episode.key,
                           max_retries=0, timeout=120)  # fmt: skip
    return client, episode
