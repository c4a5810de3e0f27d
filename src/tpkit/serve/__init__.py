"""Serving: continuous batching over a paged KV cache with prefix caching (`Engine`: a
scheduler, an executor and an output processor), the tp workers that follow rank 0
(`runner`, `workers`), an encoder's `Embedder` (embeddings, pooled as
sentence-transformers does), and an OpenAI-compatible HTTP front on FastAPI (`http`).

    from tpkit.serve import Embedder, Engine, SamplingParams
"""

from tpkit.serve.embedder import Embedder
from tpkit.serve.engine import Engine, TooLong
from tpkit.serve.params import SamplingParams
from tpkit.serve.request import Request, RequestFailed

__all__ = ["Embedder", "Engine", "Request", "RequestFailed", "SamplingParams", "TooLong"]
