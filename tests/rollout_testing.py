"""Test helpers for the rollout side: a tiny offline HF tokenizer and a fake SGLang /generate server.

The fake server answers with SGLang's payload shape (text, output_ids, meta_info with
finish_reason, output_token_logprobs [[logprob, id, None], ...], weight_version) and records
every request, so tests can check what the rollout code sent.
"""
from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp import web

from slime.config import defaults_namespace
from slime.utils.ports import find_free_port

WORDS = "what is the answer a b c d one two three four five six seven eight nine 1 2 3 4 5 6 7 8 9 + = ?".split()
CHAT_TEMPLATE = (
    "{% if tools %}<tools> {% for t in tools %}{{ t['name'] }} {% endfor %}{% endif %}"
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def write_tokenizer(out_dir: Path, max_position_embeddings: int | None = None) -> Path:
    """A word-level tokenizer (whitespace split) with a ChatML-like chat template, saved HF-style."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[UNK]", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(specials + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    if max_position_embeddings is not None:
        (out_dir / "config.json").write_text(json.dumps({"max_position_embeddings": max_position_embeddings}))
    return out_dir


def rollout_args(tokenizer_dir, prompt_path, port: int | None = None, **overrides) -> SimpleNamespace:
    """The parser's defaults for a rollout of `prompt_path` ("prompt" and "label" keys, 2 samples a prompt, --seed
    alone orders them) tokenized by `tokenizer_dir`; with a port, generating up to 16 tokens a sample through the
    router at 127.0.0.1:port; `overrides` on top."""
    fields = dict(prompt_data=str(prompt_path), hf_checkpoint=tokenizer_dir, input_key="prompt", label_key="label",
                  rollout_seed=None, n_samples_per_prompt=2)
    if port is not None:
        fields.update(sglang_router_ip="127.0.0.1", sglang_router_port=port, rollout_max_response_len=16)
    return defaults_namespace(**{**fields, **overrides})


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


@dataclass
class FakeEngine:
    """Replies with `response_text` and `response_ids`, cut at max_new_tokens (finish 'length').

    It also answers as its own router (sglang-router's GET /workers, the project router's GET /list_workers)
    and honours /abort_request {"abort_all": true}:
    a request waiting out `delay_s` then returns its first `aborted_tokens` ids with finish 'abort'.
    """

    response_text: str = "the answer is 7"
    response_ids: list[int] = field(default_factory=lambda: [5, 6, 7, 8])
    weight_version: str = "3"
    delay_s: float = 0.0
    requests: list[dict] = field(default_factory=list)
    max_inflight: int = 0
    _inflight: int = 0
    port: int = 0
    aborted_tokens: int = 2
    abort_calls: int = 0
    _server: "AppThread | None" = None

    async def _wait_or_abort(self) -> bool:
        """Sleep delay_s; True when an abort arrived meanwhile."""
        calls = self.abort_calls
        loop = asyncio.get_running_loop()
        end = loop.time() + self.delay_s
        while loop.time() < end:
            if self.abort_calls != calls:
                return True
            await asyncio.sleep(0.01)
        return False

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        self._inflight += 1
        self.max_inflight = max(self.max_inflight, self._inflight)
        try:
            aborted = await self._wait_or_abort() if self.delay_s else False
        finally:
            self._inflight -= 1
        limit = body["sampling_params"]["max_new_tokens"]
        ids = self.response_ids[:min(limit, self.aborted_tokens) if aborted else limit]
        finish = {"type": "length", "length": limit} if len(self.response_ids) > limit else {"type": "stop", "matched": 2}
        if aborted:
            finish = {"type": "abort", "message": "aborted"}
        meta = {
            "finish_reason": finish,
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids),
            "weight_version": self.weight_version,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.25 * (i + 1), tok, None] for i, tok in enumerate(ids)]
        text = self.response_text if len(ids) == len(self.response_ids) else " ".join(self.response_text.split()[: len(ids)])
        return web.json_response({"text": text, "output_ids": ids, "meta_info": meta})

    async def _abort(self, request: web.Request) -> web.Response:
        self.abort_calls += 1
        return web.json_response({"success": True})

    async def _list_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"urls": [f"http://127.0.0.1:{self.port}"]})

    async def _workers(self, request: web.Request) -> web.Response:
        return web.json_response({"workers": [{"id": "fake-0", "url": f"http://127.0.0.1:{self.port}"}]})

    def start(self) -> "FakeEngine":
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_get("/list_workers", self._list_workers)
        app.router.add_get("/workers", self._workers)
        self._server = AppThread(app).start()
        self.port = self._server.port
        return self

    def stop(self) -> None:
        self._server.stop()


class AppThread:
    """Serves an aiohttp app on 127.0.0.1 (free port) from a background thread; `stop()` has deadlines."""

    def __init__(self, app: web.Application):
        self.app = app
        self.port = find_free_port()
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app)
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._started = threading.Event()

    def _main(self) -> None:
        async def serve() -> None:
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            self._started.set()

        self._loop.run_until_complete(serve())
        self._loop.run_forever()

    def start(self) -> "AppThread":
        self._thread.start()
        if not self._started.wait(timeout=30):
            raise RuntimeError("test server did not start within 30 s")
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


# ----- fixtures shared by the rollout tests (import them into the test module) -----------------------
@pytest.fixture(autouse=True)
def fresh_generate_state():
    """GenerateState is a process-wide singleton (upstream's): each test starts with its own args."""
    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils.misc import SingletonMeta

    SingletonMeta.reset(GenerateState)
    yield
    SingletonMeta.reset(GenerateState)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return str(write_tokenizer(tmp_path_factory.mktemp("tok"), max_position_embeddings=64))


@pytest.fixture
def engine():
    fake = FakeEngine().start()
    yield fake
    fake.stop()
