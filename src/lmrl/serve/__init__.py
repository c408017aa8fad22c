"""The OpenAI-compatible endpoint over an engine (``lmrl serve``; external agents).

`Endpoint` holds an engine with its batcher (`lmrl.serve.batcher`: concurrent requests
gathered into the engine's calls), the episodes' keys (`lmrl.serve.keys`) and the capture of
every call (`lmrl.serve.capture`: token-exact trajectories with their masks, log-probs and
weights versions); `lmrl.serve.app.build_app` is the FastAPI app over it and
`serve_in_thread` runs it under uvicorn. FastAPI, uvicorn and pydantic come with the ``serve``
extra; the names below are imported on first use (PEP 562).
"""

from lmrl._lazy import lazy_exports

_EXPORTS = {
    "SPLITS": "lmrl.serve.capture",
    "Capture": "lmrl.serve.capture",
    "Trajectory": "lmrl.serve.capture",
    "to_batch": "lmrl.serve.capture",
    "Endpoint": "lmrl.serve.endpoint",
    "load_endpoint": "lmrl.serve.endpoint",
    "Episode": "lmrl.serve.keys",
    "EpisodeKeys": "lmrl.serve.keys",
    "Running": "lmrl.serve.server",
    "serve_in_thread": "lmrl.serve.server",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
