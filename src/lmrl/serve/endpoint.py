"""The endpoint's state: an engine, its batcher, the episode keys and the capture.

`Endpoint` is what the app serves and what a trainer holds: it opens episodes (a key each),
stamps samples with the weights version (`Endpoint.set_version`), stops taking requests
(`Endpoint.stop`, answered 503) and hands the captured trajectories over
(`Endpoint.capture`). `load_endpoint` builds one over a model directory (``lmrl serve``);
`lmrl.serve.server.serve_in_thread` serves it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmrl.rollout.base import RolloutEngine
from lmrl.serve.batcher import Batcher
from lmrl.serve.capture import Capture
from lmrl.serve.keys import Episode, EpisodeKeys
from lmrl.serve.messages import Renderer

__all__ = ["Endpoint", "load_endpoint"]

log = logging.getLogger("lmrl.serve")


class Endpoint:
    """What the OpenAI-compatible app serves.

    Args:
        engine: the generation engine (`lmrl.rollout.build_engine`).
        tokenizer: its tokenizer (chat template, decoding).
        model_name: the ``model`` requests must name.
        context_length: most tokens of a prompt and its completion.
        pad_id: the engine's padding id.
        eos_ids: ids that end a completion (the engine's EOS ids).
        model: the module the engine generates with, when its weights version
            (`lmrl.models.loading.weights_version`) is the samples' version.
        capture: record every call (training); False for serving alone.
        max_rows: most rows of one engine call.
        max_body_bytes: largest request body (413 above it).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        model_name: str,
        context_length: int,
        pad_id: int,
        eos_ids: Sequence[int] = (),
        model=None,
        capture: bool = True,
        max_rows: int = 256,
        max_body_bytes: int = 16 * 2**20,
    ) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.context_length, self.pad_id, self.model = context_length, pad_id, model
        self.max_body_bytes = max_body_bytes
        self.renderer = Renderer(tokenizer, eos_ids)
        self.capture = Capture(self.renderer) if capture else None
        self.keys = EpisodeKeys()
        self.created = int(time.time())
        self.stopping = False
        self._version: int | None = None
        self.batcher = Batcher(engine, pad_id, self.version, max_rows=max_rows)

    def version(self) -> int:
        """The weights version samples are stamped with: the last `set_version`, else the
        model's own count of updates (0 without a model)."""
        if self._version is not None:
            return self._version
        if self.model is None:
            return 0
        from lmrl.models.loading import weights_version

        return weights_version(self.model)

    def set_version(self, version: int) -> None:
        """Stamp the samples of every engine call that starts from now on with ``version``
        (a trainer that hands the engine new weights calls it inside ``batcher.hold()``)."""
        self._version = int(version)

    def open_episode(self, episode: str | None = None, key: str | None = None) -> Episode:
        """A new episode and its key (`lmrl.serve.keys.EpisodeKeys.open`)."""
        return self.keys.open(episode, key)

    def close_episode(self, episode: str) -> None:
        """Refuse ``episode``'s key from now on (its capture stays until popped)."""
        self.keys.close(episode)

    def stop(self) -> None:
        """Take no new request (503); the queued ones are served, then the batcher stops."""
        self.stopping = True
        self.batcher.close()


def load_endpoint(
    model_path: str | Path,
    *,
    load_weights: Callable[[Any], None] | None = None,
    device: str = "auto",
    dtype: str | None = None,
    engine: str = "hf",
    model_name: str | None = None,
    context_length: int | None = None,
    capture: bool = False,
    seed: int | None = None,
) -> Endpoint:
    """An endpoint over the model directory ``model_path`` (``lmrl serve``).

    Args:
        load_weights: loads other weights into the model once built (a checkpoint's).
        device, dtype: where and in what the model runs (`lmrl.models.loading`).
        engine: the engine's name (`lmrl.rollout.engines.ENGINES`).
        model_name: the ``model`` requests name; default the directory's name.
        context_length: most tokens of a prompt and its completion; default the model's
            ``max_position_embeddings``.
        capture: record the calls (`Endpoint`).
        seed: the engine's seed for requests without one.

    Raises:
        ModelError: the model cannot be loaded (named).
    """
    from lmrl.models.loading import load_causal_lm, load_tokenizer, resolve_device
    from lmrl.rollout.base import stop_and_pad_ids
    from lmrl.rollout.engines import build_engine

    dev = resolve_device(device)
    tokenizer = load_tokenizer(model_path)
    model = load_causal_lm(model_path, dtype=dtype, device=dev)
    if load_weights is not None:
        load_weights(model)
    model.eval()
    eos, pad = stop_and_pad_ids(model, tokenizer, None, None)
    options: dict[str, Any] = {"seed": seed} if engine == "hf" else {}
    built = build_engine(engine, model, tokenizer, **options)
    limit = context_length or int(getattr(model.config, "max_position_embeddings", 0) or 4096)
    name = model_name or Path(model_path).resolve().name
    return Endpoint(built, tokenizer, name, limit, pad, eos, model=model, capture=capture)
