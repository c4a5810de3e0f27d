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
import os
import signal
import threading
from pathlib import Path

from tpkit.commands.common import add_knobs, group, knob_values
from tpkit.host.exit import Stopped
from tpkit.host.web import bound_socket, listen, warn_if_exposed
from tpkit.launch import SpawnError, is_rank0, launch
from tpkit.mesh import ParallelMesh
from tpkit.serve.adapters import Adapters, read_all
from tpkit.serve.config import ServeConfig
from tpkit.serve.embedder import Embedder
from tpkit.serve.engine import Engine
from tpkit.serve.loop import serve_watched
from tpkit.serve.workers import follow, load
from tpkit.spec.errors import UserError
from tpkit.spec.transport import add_comm_argument, comm_choice
from tpkit.weights.pooling import read_pooling
from tpkit.weights.sources import open_source, source_tokenizer
from tpkit.weights.tokenizer import load_tokenizer

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SERVE_NEEDS = ("pydantic", "fastapi", "uvicorn", "prometheus_client")  # the serve extra


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tpkit serve`: --checkpoint, then one flag per knob of `ServeConfig`
    (`tpkit.serve.config`), under the shared headings (`tpkit.commands.common`)."""
    group(parser, "model").add_argument(
        "--checkpoint", required=True, help="tpkit checkpoint dir, run folder (its latest "
        "valid checkpoint), full .safetensors, or Hugging Face dir")
    add_knobs(parser, ServeConfig)
    add_comm_argument(group(parser, "parallelism"))


def config(args: argparse.Namespace) -> ServeConfig:
    """The server's `ServeConfig` from its flags, checked (UserError: every problem)."""
    return ServeConfig(**knob_values(args, ServeConfig)).check()


def api_key(cfg: ServeConfig) -> str | None:
    """The key requests need: --api-key, else $TPKIT_API_KEY, else none."""
    key = cfg.api_key if cfg.api_key is not None else os.environ.get("TPKIT_API_KEY")
    if key is not None and not key.strip():
        raise UserError("--api-key (or TPKIT_API_KEY) must not be empty")
    return key


def run(args: argparse.Namespace) -> int:
    """Load the model on every rank, serve on rank 0 until a signal or a worker's death."""
    cfg = config(args)
    api_key(cfg)  # an empty key is refused before any loading
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
    adapters = read_all(list(cfg.lora), source.config, _name(cfg, args.checkpoint)) \
        if is_rank0() else None  # refused in one line before any process
    sock = listen(lambda: bound_socket(cfg.host, cfg.port), cfg.host,
                  cfg.port) if is_rank0() else None  # a busy port fails before any loading
    # rank 0's tokenizer before any process (seconds: transformers' import): once loaded,
    # the followers wait for its first heartbeat only while it builds the engine
    tokenizer = load_tokenizer(source_tokenizer(source)) if is_rank0() else None
    try:  # rank 0 serves here, the others follow (spawned, or torchrun's)
        launch(_serve, cfg, args.checkpoint, source, sock, pooling, tokenizer, adapters,
               ranks=cfg.tp, mesh=dict(tp=cfg.tp, comm=comm), follow=(follow, (source, cfg)),
               lead_here=True, collective_timeout=cfg.collective_timeout)
        return 0
    finally:
        if sock is not None:
            sock.close()


def _name(cfg: ServeConfig, checkpoint: str) -> str:
    """The model id clients send: --served-model-name, else the checkpoint folder's name."""
    return cfg.served_model_name or Path(str(checkpoint).rstrip("/")).resolve().name


def _engine(cfg: ServeConfig, checkpoint: str, model, pooling, tokenizer, adapters
            ) -> Engine | Embedder:
    """Rank 0's engine: an encoder's `Embedder` (`pooling`), else the generating `Engine`
    (`adapters`: --lora's, read)."""
    if pooling is None:
        return Engine(model, tokenizer=tokenizer, **cfg.engine_options(model, tokenizer),
                      adapters=Adapters(model, adapters) if adapters else None)
    if cfg.speculative is not None:
        raise UserError(f"--speculative={cfg.speculative}: {checkpoint} is an "
                        f"embedding model (it generates no tokens)")
    return Embedder(model, pooling, **cfg.embedder_options())


def _serve(mesh: ParallelMesh, cfg: ServeConfig, checkpoint: str, source, sock, pooling,
           tokenizer, adapters, followers=None) -> None:
    """Rank 0: load, build the server complete, serve until a signal (`Stopped`) or a
    follower's death (SpawnError). `pooling`: an encoder's (it embeds), else None;
    `adapters`: --lora's, read (`serve.adapters`)."""
    from tpkit.serve.http import App, make_server  # lazy: the serve extra is optional

    engine = _engine(cfg, checkpoint, load(source, mesh, cfg), pooling, tokenizer, adapters)
    name = _name(cfg, checkpoint)
    app = App(engine, name, tokenizer, max_body=cfg.max_body_bytes, timeout=cfg.timeout,
              api_key=api_key(cfg), metrics_need_key=cfg.metrics_need_key)
    app.peers = followers  # /health: 503 while one is gone or stopped
    server = make_server(app, cfg.host, cfg.port, allowed_hosts=cfg.allowed_host,
                         allowed_origins=cfg.allow_origin, sock=sock)
    stop, got = threading.Event(), []

    def on_signal(signum, _frame):
        got.append(signum)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in _SIGNALS}
    host, port = server.server_address[:2]
    warn_if_exposed("tpkit serve", cfg.host, "the model")
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
              f"{'on' if cfg.prefix_cache else 'off'}", flush=True)
    if app.lora:
        print("tpkit serve: LoRA adapters (model: folder): " + ", ".join(
            f"{n}: {f}" for n, (_, f) in app.lora.items()), flush=True)
    try:
        line = serve_watched(app.engine, stop, followers, cfg.drain_seconds)
    finally:
        server.shutdown()
        app.wait_handlers(2.0)  # the answers (503s included) get written
        for s, h in previous.items():
            signal.signal(s, h)
    if line is not None:
        raise SpawnError(line, run_failed=True)
    if got:
        raise Stopped(got[0])
