"""The model the api serves, learnt from the scheduler once it is ready, with its tokenizer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from api.errors import ApiError, unavailable
from client import AsyncEngineClient
from client.detokenizer import TokenStrings
from common.config import ApiConfig
from common.log import get_logger

log = get_logger(component="api.model")
INFO_TIMEOUT_S = 1.0  # a scheduler slower than this to answer counts as unavailable


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked and rendered against."""

    name: str  # the name clients put in "model"
    root: str  # the checkpoint directory the worker loaded
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int  # tokens the whole KV pool holds; 0 when the scheduler does not say
    tokenizer: Any
    token_strings: TokenStrings  # per-token text and bytes for logprobs
    longest_token_chars: int = 64  # characters of the vocabulary's longest token (its piece, as stored)

    @property
    def max_prompt_chars(self) -> int:
        """Characters beyond which a text cannot fit the context: every token covers at most
        longest_token_chars of it. Assumes the tokenizer's normalizer does not shrink text (collapsing
        whitespace, say), which holds for the byte-level and SentencePiece tokenizers of LLMs."""
        return self.max_model_len * self.longest_token_chars


def longest_token_chars(tokenizer: Any) -> int:
    """The length of the longest token piece, added tokens included. A piece holds at least as many
    characters as its token stands for in the text: byte-level pieces have a character per byte, and
    SentencePiece pieces keep the leading space as "\u2581"."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(p) for p in pieces if isinstance(p, str)), default=1) or 1


class ModelState:
    """Finds the served model on first need (or from the warm-up task) and keeps it."""

    def __init__(self, config: ApiConfig, client: AsyncEngineClient) -> None:
        self._config = config
        self._client = client
        self._model: ServedModel | None = None
        self._lock = asyncio.Lock()

    @property
    def loaded(self) -> ServedModel | None:
        return self._model

    async def get(self) -> ServedModel:
        """The served model. Raises ApiError 503 while the scheduler is not ready or does not answer."""
        if self._model is not None:
            return self._model
        async with self._lock:
            if self._model is None:
                self._model = await self._load()
            return self._model

    async def serving(self) -> ServedModel:
        """The served model, once the scheduler confirms that a worker serves it now: the model stays known
        after its worker died, so this asks. Raises ApiError 503 otherwise."""
        try:
            info = await self._client.info(timeout=INFO_TIMEOUT_S)
        except TimeoutError:
            raise unavailable("the scheduler does not answer") from None
        if not info.ready:
            raise unavailable("no worker is ready; try again shortly")
        return await self.get()

    async def _load(self) -> ServedModel:
        try:
            info = await self._client.info(timeout=INFO_TIMEOUT_S)
        except TimeoutError:
            raise unavailable("the scheduler does not answer") from None
        if not info.ready:
            raise unavailable("the model is still loading; try again shortly")
        tokenizer = await self._client.get_tokenizer()
        if tokenizer is None:
            raise unavailable("no tokenizer could be loaded for the model")
        model = ServedModel(
            name=self._config.served_model_name or info.model_name,
            root=info.model_root,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            kv_capacity_tokens=info.num_kv_blocks * info.block_size,
            tokenizer=tokenizer,
            token_strings=TokenStrings(tokenizer),
            longest_token_chars=await asyncio.to_thread(longest_token_chars, tokenizer),
        )
        log.info("model_ready", model=model.name, root=model.root, max_model_len=model.max_model_len)
        return model

    async def warm_up(self, interval_s: float = 0.5) -> None:
        """Polls until the model is known, so that the first request does not pay for the tokenizer."""
        while self._model is None:
            try:
                await self.get()
            except ApiError:
                await asyncio.sleep(interval_s)
            except Exception:  # a broken checkpoint must not end the server: requests will report it
                log.exception("model_load_failed")
                await asyncio.sleep(10 * interval_s)
