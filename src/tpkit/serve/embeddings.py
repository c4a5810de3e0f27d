"""POST /v1/embeddings (OpenAI's API): its answer's body, once `tpkit.serve.http`'s
skeleton has read, parsed and submitted it (`App.post`) and its job is done:

    {"input": "text" | ["text", ...] | [ids] | [[ids], ...], "model",
     "encoding_format": "float" | "base64", "dimensions": width, "user"}
    -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
        "model", "usage": {"prompt_tokens", "total_tokens"}}

Served by an encoder's `Embedder` (a decoder's server answers 400: not an encoder).
Texts are tokenized with the model's tokenizer (its special tokens added, as
sentence-transformers does); token ids are taken as they are. "base64" is each vector's
little-endian float32 bytes (what the openai client asks for by default and decodes).
"""

from __future__ import annotations

import base64

from tpkit.serve import openai_api as api
from tpkit.serve.app import App, Posted


def answer(app: App, posted: Posted) -> dict | api.ApiError:
    """The body of a done POST /v1/embeddings, or the error its job ended with."""
    job = posted.handles[0]
    if job.error is not None:
        return api.ApiError(*job.error)
    b64 = posted.asked.encoding_format == "base64"
    vectors = [base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() if b64
               else v.tolist() for v in job.vectors]
    return api.embeddings(app.name, vectors, job.tokens)
