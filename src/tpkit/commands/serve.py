"""`tpkit serve`: a model at a tensor-parallel layout behind an OpenAI-compatible endpoint.

    tpkit serve --checkpoint hf-dir --tp 2                  # http://127.0.0.1:8000/v1
    tpkit serve --checkpoint runs/x --max-batch 16 --port 0 # a free port (printed)

CKPT is anything `tpkit generate` takes. An encoder (a BERT-family folder, such as
sentence-transformers' all-MiniLM-L6-v2) is served on POST /v1/embeddings instead,
pooled as its sentence-transformers files say (`tpkit.weights.pooling`). This process is rank 0 (the HTTP front, the
engine, the sampler); `--tp N` starts ranks 1..N-1 as local processes that follow it
(`tpkit.serve.workers`); under torchrun, rank 0 serves and the others follow.
SIGTERM, SIGINT or SIGHUP: stop accepting (503), let running requests finish for
`--drain-seconds`, cancel the rest, stop the workers, exit 128 + the signal, whatever
the workers do (a step a stuck worker holds up is given up, its requests get 503, one
line names the rank). A worker that dies, or is stuck past the collective timeout:
every waiting request gets 503 and the server exits 1 naming the rank (/health says
503 as soon as a worker is gone or stopped); a request the server fails on gets 500
alone. Whatever `--host`, the Host header must be one of the server's names
(`--allowed-host` adds one), a browser page of another origin is refused unless
`--allow-origin` names it, and with `--api-key KEY` (or TPKIT_API_KEY) every /v1/
request needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import threading
from pathlib import Path

import torch

from tpkit.comm.failure import DEFAULT_COLLECTIVE_TIMEOUT_S
from tpkit.commands.common import (
    add_pool_arguments,
    check_speculative,
    decode_chunk,
    follower,
    group,
    speculator,
)
from tpkit.host.exit import Stopped
from tpkit.host.web import ALLOWED_HOST_HELP, HOST, bound_socket, listen, warn_if_exposed
from tpkit.launch import SpawnError, is_rank0, launch
from tpkit.mesh import ParallelMesh
from tpkit.serve.embedder import Embedder
from tpkit.serve.engine import PREFILL_PER_STEP, Engine
from tpkit.serve.loop import serve_watched
from tpkit.serve.openai_api import MAX_BODY
from tpkit.serve.pacing import ITL_RATIO, check_ratio
from tpkit.serve.scheduler import FLOOR
from tpkit.spec.errors import UserError
from tpkit.spec.transport import add_comm_argument, comm_choice
from tpkit.weights.pooling import read_pooling
from tpkit.weights.sources import load_model, open_source, source_tokenizer
from tpkit.weights.tokenizer import load_tokenizer

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SERVE_NEEDS = ("pydantic", "fastapi", "uvicorn", "prometheus_client")  # the serve extra


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tpkit serve`, under the shared headings (`tpkit.commands.common`)."""
    group(parser, "model").add_argument(
        "--checkpoint", required=True, help="tpkit checkpoint dir, run folder (its latest "
        "valid checkpoint), full .safetensors, or Hugging Face dir")
    group(parser, "model").add_argument(
        "--served-model-name", default=None, metavar="NAME",
        help="the model id clients send (default: the checkpoint folder's name)")
    p = group(parser, "parallelism")
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel processes")
    p.add_argument("--collective-timeout", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT_S,
                   metavar="S", help="seconds a step may wait for a stuck worker; then its "
                   "requests get 503 and the server exits 1 naming the rank")
    add_comm_argument(p)
    g = group(parser, "serving")
    g.add_argument("--host", default=HOST, help="address to listen on (127.0.0.1: this "
                   "machine only)")
    g.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed)")
    g.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help=ALLOWED_HOST_HELP)
    g.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web page's origin (http://app.example:3000; *: any) whose "
                        "browser requests are served, with CORS headers; repeatable "
                        "(default: none, cross-origin requests are refused)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="every /v1/ request needs 'Authorization: Bearer KEY' (401 "
                        "otherwise; /health stays open); default: the environment "
                        "variable TPKIT_API_KEY, else no key")
    g.add_argument("--metrics-need-key", action="store_true",
                   help="/metrics needs the API key too (default: open, as /health)")
    add_pool_arguments(g, 8, "sequences generated at once: KV slots per rank")
    g.add_argument("--prefill-per-step", type=int, default=PREFILL_PER_STEP, metavar="T",
                   help="prompt tokens prefilled per step, at most (a longer prompt alone; "
                        "0: no limit): the running requests decode in between")
    g.add_argument("--itl-ratio", type=float, default=0.0, metavar="R",
                   help="while requests decode, a step computes only the prompt tokens that "
                        "keep it within R x a decode-only step (learnt from the steps' "
                        f"times; at least {FLOOR} tokens a step): the decoding streams' "
                        "inter-token latency bought with a long prompt's time to first "
                        f"token, and throughput when many clients start at once (e.g. "
                        f"{ITL_RATIO}; default 0: off, --prefill-per-step alone; not used "
                        "with --batch-invariant)")
    g.add_argument("--max-tokens-in-flight", type=int, default=None, metavar="T",
                   help="prompt + max_tokens summed over the running requests; more waits "
                        "in the queue (an encoder: padded tokens of one embedding forward) "
                        "(default: max-batch x max-len)")
    g.add_argument("--kv-cache-bytes", type=int, default=None, metavar="N",
                   help="bytes of KV blocks per rank, at most (default: what max-batch x "
                        "max-len tokens take); taken as requests need them, never up front")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="compute every prompt in full (default: a prompt's full 16-token "
                        "blocks that an earlier request computed are reused)")
    g.add_argument("--max-body-bytes", type=int, default=MAX_BODY, metavar="N",
                   help="largest request body")
    g.add_argument("--timeout", type=float, default=30.0, metavar="S",
                   help="seconds an idle connection is kept")
    g.add_argument("--drain-seconds", type=float, default=5.0, metavar="S",
                   help="on SIGTERM, how long running requests may still finish")


def _check_args(args: argparse.Namespace) -> None:
    bad = [f"--{k.replace('_', '-')}={getattr(args, k)} must be >= 1"
           for k in ("tp", "max_batch") if getattr(args, k) < 1]
    bad += [f"--{k.replace('_', '-')}={getattr(args, k)} must be >= 1"
            for k in ("max_len", "max_tokens_in_flight", "max_body_bytes", "kv_cache_bytes")
            if getattr(args, k) is not None and getattr(args, k) < 1]
    if args.prefill_per_step < 0:
        bad.append(f"--prefill-per-step={args.prefill_per_step} must be >= 0 (0: no limit)")
    try:
        check_ratio(args.itl_ratio, "--itl-ratio")
    except UserError as e:
        bad.append(str(e))
    if not 0 <= args.port <= 65535:
        bad.append(f"--port={args.port} must be in [0, 65535]")
    if not 0 < args.collective_timeout < float("inf"):
        bad.append(f"--collective-timeout={args.collective_timeout} must be a number > 0")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        bad.append(f"--timeout={args.timeout} must be a number of seconds > 0")
    if not (math.isfinite(args.drain_seconds) and args.drain_seconds >= 0):
        bad.append(f"--drain-seconds={args.drain_seconds} must be a number of seconds >= 0")
    if bad:
        raise UserError("; ".join(bad))
    decode_chunk(args)  # --decode-chunk needs --batch-invariant
    check_speculative(args)


def api_key(args: argparse.Namespace) -> str | None:
    """The key requests need: --api-key, else $TPKIT_API_KEY, else none."""
    key = args.api_key if args.api_key is not None else os.environ.get("TPKIT_API_KEY")
    if key is not None and not key.strip():
        raise UserError("--api-key (or TPKIT_API_KEY) must not be empty")
    return key


def run(args: argparse.Namespace) -> int:
    """Load the model on every rank, serve on rank 0 until a signal or a worker's death."""
    _check_args(args)
    api_key(args)  # an empty key is refused before any loading
    try:
        import prometheus_client  # noqa: F401 - /metrics (lazy: the serve extra is optional)

        import tpkit.serve.http  # noqa: F401 - pydantic, fastapi, uvicorn
    except ModuleNotFoundError as e:
        if e.name not in SERVE_NEEDS:
            raise
        raise UserError(f"tpkit serve needs {', '.join(SERVE_NEEDS)}; {e.name} is not "
                        f"installed: pip install 'tpkit[serve]'") from None
    comm = comm_choice(getattr(args, "comm", None))
    source = open_source(args.checkpoint)  # once, before any process
    pooling = None if getattr(source.config, "causal", True) else \
        read_pooling(getattr(source, "root", None))  # an encoder's; refused before any process
    sock = listen(lambda: bound_socket(args.host, args.port), args.host,
                  args.port) if is_rank0() else None  # a busy port fails before any loading
    # rank 0's tokenizer before any process (seconds: transformers' import): once loaded,
    # the followers wait for its first heartbeat only while it builds the engine
    tokenizer = load_tokenizer(source_tokenizer(source)) if is_rank0() else None
    try:  # rank 0 serves here, the others follow (spawned, or torchrun's)
        launch(_serve, args, source, sock, pooling, tokenizer, ranks=args.tp, mesh=dict(tp=args.tp, comm=comm),
               follow=follower(args, source), lead_here=True,
               collective_timeout=args.collective_timeout)
        return 0
    finally:
        if sock is not None:
            sock.close()


def _serve(mesh: ParallelMesh, args, source, sock, pooling, tokenizer, followers=None
           ) -> None:
    """Rank 0: load, build the server complete, serve until a signal (`Stopped`) or a
    follower's death (SpawnError). `pooling`: an encoder's (it embeds), else None."""
    from tpkit.serve.http import App, make_server  # lazy: the serve extra is optional

    model = load_model(source, mesh, dtype=getattr(torch, args.dtype), decode=True,
                       quantize=args.quantize)
    if pooling is not None:
        if args.speculative is not None:
            raise UserError(f"--speculative={args.speculative}: {args.checkpoint} is an "
                            f"embedding model (it generates no tokens)")
        engine = Embedder(model, pooling, max_batch=args.max_batch, max_len=args.max_len,
                          tokens_per_forward=args.max_tokens_in_flight)
    else:
        engine = Engine(model, tokenizer=tokenizer, max_batch=args.max_batch,
                        max_len=args.max_len, max_tokens_in_flight=args.max_tokens_in_flight,
                        prefill_per_step=args.prefill_per_step,
                        decode_chunk=decode_chunk(args), itl_ratio=args.itl_ratio,
                        kv_cache_bytes=args.kv_cache_bytes,
                        prefix_caching=not args.no_prefix_cache,
                        speculator=speculator(args, model, tokenizer))
    name = args.served_model_name or Path(str(args.checkpoint).rstrip("/")).resolve().name
    app = App(engine, name, tokenizer, max_body=args.max_body_bytes, timeout=args.timeout,
              api_key=api_key(args), metrics_need_key=args.metrics_need_key)
    app.peers = followers  # /health: 503 while one is gone or stopped
    server = make_server(app, args.host, args.port, allowed_hosts=args.allowed_host,
                         allowed_origins=args.allow_origin, sock=sock)
    stop, got = threading.Event(), []

    def on_signal(signum, _frame):
        got.append(signum)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in _SIGNALS}
    host, port = server.server_address[:2]
    warn_if_exposed("tpkit serve", args.host, "the model")
    thread = threading.Thread(target=server.serve_forever, name="tpkit-http", daemon=True)
    thread.start()
    shown = f"[{host}]" if ":" in host else host
    batch = "" if pooling else f" max_batch={engine.max_batch}"
    print(f"tpkit serve: http://{shown}:{port}/v1 model={app.name!r} tp={mesh.tp_size}"
          f"{batch} max_len={engine.max_len}", flush=True)
    if pooling is not None:
        print(f"tpkit serve: an encoder: POST /v1/embeddings only, {pooling.describe()}, at "
              f"most {engine.max_len} tokens an input ({engine.limit_text()}), "
              f"{engine.tokens_per_forward} padded tokens a forward", flush=True)
    else:
        print(f"tpkit serve: KV cache: at most {engine.kv_cache_bytes / 2**20:.1f} MiB per "
              f"rank ({engine.pool.max_blocks - 1} blocks of {engine.pool.block_size} "
              f"tokens), taken as tokens arrive; prefix cache "
              f"{'off' if args.no_prefix_cache else 'on'}", flush=True)
    try:
        line = serve_watched(app.engine, stop, followers, args.drain_seconds)
    finally:
        server.shutdown()
        app.wait_handlers(2.0)  # the answers (503s included) get written
        for s, h in previous.items():
            signal.signal(s, h)
    if line is not None:
        raise SpawnError(line, run_failed=True)
    if got:
        raise Stopped(got[0])
