"""POST /v1/embeddings (OpenAI's API), the route `tpkit.serve.http` registers:

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

import asyncio
import base64
import sys

from fastapi import Request as HttpRequest
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from tpkit.serve import openai_api as api
from tpkit.serve.app import App


async def embeddings(app: App, request: HttpRequest, read_body, error, ok, hung_up
                     ) -> Response:
    """The answer to one POST /v1/embeddings (`read_body`, `error`, `ok`, `hung_up`: the
    HTTP layer's body reader, responses and watch on the client)."""
    refusal = app.not_served(embeddings=True)
    if refusal is not None:
        return error(request, refusal)
    app.enter()
    job = gone = None
    try:
        try:
            raw = await read_body(app, request)
        except api.ApiError as e:
            return error(request, e, close=e.status == 413)  # the body is not read
        loop, finished = asyncio.get_running_loop(), asyncio.Event()

        def on_done() -> None:  # the loop's thread -> this request's coroutine
            try:
                loop.call_soon_threadsafe(finished.set)
            except RuntimeError:
                pass  # the event loop has ended (the server stopped)

        try:
            asked, inputs = await run_in_threadpool(app.parse_embeddings, raw)
            job = app.embed(inputs, on_done)
        except api.ApiError as e:
            return error(request, e)
        gone = hung_up(request)
        while not finished.is_set():
            try:
                await asyncio.wait_for(finished.wait(), 0.2)
            except TimeoutError:
                if gone.done():
                    job.cancel()
                    return Response(status_code=499)
        if job.error is not None:
            return error(request, api.ApiError(*job.error))
        b64 = asked.encoding_format == "base64"
        vectors = [base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() if b64
                   else v.tolist() for v in job.vectors]
        return ok(request, api.embeddings(app.name, vectors, job.tokens))
    except Exception as e:  # noqa: BLE001 - this request fails alone; the server goes on
        if job is not None:
            job.cancel()
        why = f"the server failed on this request ({type(e).__name__}: {e})"
        print(f"tpkit serve: error: {why}", file=sys.stderr, flush=True)
        return error(request, api.ApiError(500, why), close=True)
    finally:
        if gone is not None:
            gone.cancel()
        app.leave()
