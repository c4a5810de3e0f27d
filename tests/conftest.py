"""Shared fixtures: one pool of gloo worker processes per world size, for the session.

Starting a process costs seconds (importing torch); a pool runs many checks.
`run_tp(fn, tp, *args)` runs `fn(mesh, *args)` on `tp` ranks (a ParallelMesh with
tp=tp) and returns the per-rank results; tp=1 runs in this process on
`ParallelMesh.single()` — the very same code, with a group of one.
`openai_server`: `tpkit serve`'s HTTP front and serving loop at tp=1 in this process,
shared by the files that test it through HTTP. `tiny_mount(size, ro=False)`: a small
tmpfs (a full or read-only disk), unmounted after the test.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
from pathlib import Path

import pytest

from tpkit.host import forkserver
from tpkit.launch import WorkerPool
from tpkit.mesh import ParallelMesh

# One forkserver per pytest process forks every rank here (the pools' and those of the
# commands run through `tpkit.cli.main`): whoever starts it, it preloads what `tpkit
# train`'s ranks import, as `tpkit train` has its own preload (otherwise each rank of the
# many in-process train runs imports Dynamo itself: 2 s of CPU a rank).
forkserver.preload(*forkserver.COMMANDS["train"])

# `make test` runs the files on two pytest-xdist workers (`-n 2 --dist loadgroup`): a
# file's tests stay together on one worker (its module fixtures built once), the files
# that start torchrun agents take turns (each an agent and its workers; two at once
# slowed each other threefold here), and the longest go first so that neither worker is
# left alone with one at the end. The groups go to xdist through its scheduler hook:
# its own `xdist_group` marks reach it through the test ids, which pytest 9 no longer
# lets a plugin change (every test was its own group, a module fixture built on both).
TAKE_TURNS = {"test_restart", "test_two_node", "test_torchrun_flags",
              "test_two_hosts"}
FIRST = ["test_stop_save", "test_restart", "test_two_node", "test_two_hosts",
         "test_readme_lines", "test_shutdown", "test_run_safety", "test_quiz_web",
         "test_determinism", "test_compile", "test_hf_families", "test_workflow"]


def _group(nodeid: str) -> str:
    """The test's file, or "torchrun" for the files that take turns."""
    path = nodeid.split("::")[0]
    return "torchrun" if Path(path).stem in TAKE_TURNS else path


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = Path(str(item.fspath)).stem
        return FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: one work unit per `_group`, handed out in collection order."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # not by count of tests: FIRST's order

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ByGroup(config, log)


class Pools:
    """Lazily started worker pools keyed by world size."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def get(self, n: int) -> WorkerPool:
        if n not in self._pools:
            self._pools[n] = WorkerPool(n, timeout=120, threads=1, pg_timeout_s=60)
        return self._pools[n]

    def run(self, fn, world: int, *args, mesh: dict | None = None):
        if world == 1 and mesh is not None:
            return [fn(ParallelMesh.single(), *args)]
        return self.get(world).run(fn, *args, mesh=mesh)

    def close(self) -> None:
        for p in self._pools.values():
            p.close()


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()


@pytest.fixture(scope="session")
def run_tp(pools):
    """run_tp(fn, tp, *args, pp=1, dp=1, cp=1) -> per-rank results of fn(mesh, *args)."""

    def run(fn, tp, *args, pp: int = 1, dp: int = 1, cp: int = 1):
        mesh = dict(tp=tp, pp=pp, dp=dp, **(dict(cp=cp) if cp > 1 else {}))
        return pools.run(fn, tp * pp * dp * cp, *args, mesh=mesh)

    return run


@pytest.fixture(autouse=True)
def _in_own_folder(tmp_path_factory, monkeypatch):
    """Every test runs in a fresh empty working folder: a default `--out runs/train`, a run
    lock or a log lands there, never in the repository (or a user's earlier run there)."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


SERVE_SLOTS = 4  # of the openai_server's engine


@pytest.fixture(scope="session")
def chat_llama(tmp_path_factory):
    """A tiny Llama folder with a BPE tokenizer and a chat template, its weights drawn
    wider than transformers' default: varied greedy text, no repeats."""
    from hf_folders import tiny_llama_folder, with_chat_template

    llama = tiny_llama_folder(tmp_path_factory.mktemp("serve") / "llama", initializer_range=0.3)
    return with_chat_template(llama)


@contextlib.contextmanager
def serving(engine, name: str, tok, **app_kw):
    """`engine` (an Engine or an Embedder) served as `name` on a free loopback port, its
    HTTP front and serving loop in threads: (base URL, OpenAI client, engine). `app_kw`:
    the App's (api_key=...)."""
    import openai

    from tpkit.serve.http import App, make_server
    from tpkit.serve.loop import serve_loop

    httpd = make_server(App(engine, name, tok, timeout=10.0, **app_kw), "127.0.0.1", 0)
    stop = threading.Event()
    threads = [threading.Thread(target=httpd.serve_forever, daemon=True),
               threading.Thread(target=serve_loop, args=(engine, stop), daemon=True)]
    for t in threads:
        t.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key=app_kw.get("api_key", "none"),
                                 max_retries=0, timeout=60), engine
    finally:
        stop.set()
        httpd.shutdown()
        httpd.server_close()
        threads[1].join(timeout=10)


@pytest.fixture(scope="session")
def serve_in_threads():
    """`serving` (a context manager) for the test files that start their own server."""
    return serving


@pytest.fixture(scope="session")
def openai_server(chat_llama):
    """A tp=1 server of `chat_llama` as "llama" on a free loopback port, its HTTP front
    and serving loop in threads: (base URL, OpenAI client, engine)."""
    from tpkit.serve import Engine
    from tpkit.weights.sources import load_model
    from tpkit.weights.tokenizer import load_tokenizer

    model = load_model(chat_llama, ParallelMesh.single())
    tok = load_tokenizer(chat_llama)
    engine = Engine(model, tokenizer=tok, max_batch=SERVE_SLOTS, decode_chunk=8)  # invariant
    with serving(engine, "llama", tok) as served:
        yield served


@pytest.fixture
def tiny_mount(tmp_path):
    """mount(size, ro=False) -> a fresh tmpfs under tmp_path (we run as root here)."""
    mounted: list[Path] = []

    def mount(size: str, ro: bool = False) -> Path:
        where = tmp_path / f"mnt{len(mounted)}"
        where.mkdir()
        opts = f"size={size}" + (",ro" if ro else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): "
                        f"{r.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:  # lazily if a file there is still open: never left mounted
        if subprocess.run(["umount", str(where)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(where)], check=False)
