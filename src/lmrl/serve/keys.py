"""Episode keys: every episode gets its own API key, and a request is that episode's call.

An agent is given a base URL and a key (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``); the key
names its episode, so the endpoint knows whose calls to stitch together. An episode may also
be addressed by its own base URL, ``/episodes/<id>/v1``: there a key of another episode is
refused, so two agents that swapped keys cannot mix their trajectories. A closed episode's key
is refused from then on. Only keys' SHA-256 digests are held.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from dataclasses import dataclass

from lmrl.serve.errors import APIError, unauthorized

__all__ = ["Episode", "EpisodeKeys"]


@dataclass(frozen=True)
class Episode:
    """An episode's id and its API key."""

    id: str
    key: str


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


class EpisodeKeys:
    """The open episodes and their keys (thread-safe)."""

    def __init__(self) -> None:
        self._episodes: dict[str, str] = {}  # key digest -> episode id
        self._digests: dict[str, str] = {}  # episode id -> key digest
        self._count = 0
        self._lock = threading.Lock()

    def open(self, episode: str | None = None, key: str | None = None) -> Episode:
        """A new episode with a fresh key (or ``key``, for a served model's fixed key).

        Raises:
            ValueError: ``episode`` is already open, or ``key`` is another episode's.
        """
        key = key or "lmrl-" + secrets.token_urlsafe(24)
        digest = _digest(key)
        with self._lock:
            self._count += 1
            episode = episode or f"ep{self._count:06d}"
            if episode in self._digests:
                raise ValueError(f"episode {episode!r} is already open")
            if digest in self._episodes:
                raise ValueError("that key belongs to another episode")
            self._episodes[digest], self._digests[episode] = episode, digest
        return Episode(episode, key)

    def close(self, episode: str) -> None:
        """Refuse ``episode``'s key from now on (an unknown episode: nothing happens)."""
        with self._lock:
            digest = self._digests.pop(episode, None)
            if digest is not None:
                del self._episodes[digest]

    def episode(self, authorization: str | None, claimed: str | None = None) -> str:
        """The episode of a request's ``Authorization: Bearer <key>`` header.

        Args:
            authorization: the header's value (None: no header).
            claimed: the episode of the URL (``/episodes/<id>/v1``), or None.
        Raises:
            APIError: 401 when there is no key, the key is no open episode's, or it is
                another episode's than ``claimed``.
        """
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise unauthorized(
                "no API key: send it as 'Authorization: Bearer <key>' (the openai client sends "
                "OPENAI_API_KEY)"
            )
        with self._lock:
            episode = self._episodes.get(_digest(key.strip()))
        if episode is None:
            raise unauthorized("unknown API key: it is no open episode's key")
        if claimed is not None and claimed != episode:
            raise APIError(
                401,
                f"this key is another episode's, not episode {claimed!r}'s: give each agent "
                "its own episode's key",
                code="invalid_api_key",
            )
        return episode
