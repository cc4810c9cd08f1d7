"""The model the api serves: its tokenizer, which the api loads itself from its `--model` directory at start
(no worker needed), and its limits (context length, KV capacity), learnt from the scheduler once a worker is
ready.

Without `--model` (ApiConfig.model empty), the tokenizer is that of the checkpoint the first ready worker
announces (InfoReply.model_root), as a ZeroMQ client without a tokenizer does. Either way a worker that
serves another checkpoint than the one the tokenizer came from gets 503s, not a mismatched tokenizer.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from pagedserve.api.chat_template import server_template
from pagedserve.api.errors import ApiError, unavailable
from pagedserve.api.generation_config import GenerationDefaults, load_generation_defaults
from pagedserve.api.tool_parsers.detect import detect_tool_parser, template_text
from pagedserve.client import AsyncEngineClient
from pagedserve.client.detokenizer import TokenStrings
from pagedserve.common.config import ApiConfig
from pagedserve.common.log import get_logger
from pagedserve.common.messages import InfoReply

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
    scheduling_policy: str = "fcfs"  # the scheduler's: under fcfs a request's priority would change nothing
    # what a request that leaves a sampling field out gets (api/generation_config.py)
    generation_defaults: GenerationDefaults = GenerationDefaults()
    # the tool-call format the chat template writes (api/tool_parsers/detect.py); "" when none is known
    tool_call_parser: str = ""

    @property
    def max_prompt_chars(self) -> int:
        """Characters beyond which a text cannot fit the context: every token covers at most
        longest_token_chars of it. Assumes the tokenizer's normalizer does not shrink text (collapsing
        whitespace, say), which holds for the byte-level and SentencePiece tokenizers of LLMs."""
        return self.max_model_len * self.longest_token_chars


@dataclass(frozen=True)
class ModelTokenizer:
    """A checkpoint's tokenizer and what the api derives from it once."""

    root: str  # the checkpoint directory it came from, as a real path
    tokenizer: Any
    token_strings: TokenStrings
    longest_token_chars: int


def longest_token_chars(tokenizer: Any) -> int:
    """The length of the longest token piece, added tokens included. A piece holds at least as many
    characters as its token stands for in the text: byte-level pieces have a character per byte, and
    SentencePiece pieces keep the leading space as "\u2581"."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(p) for p in pieces if isinstance(p, str)), default=1) or 1


class ModelState:
    """The api's tokenizer and served model: the tokenizer loaded at start (or on first need), the model
    once the scheduler reports a ready worker, and whether that worker serves the tokenizer's checkpoint.

    The tokenizer object is the client's (create_app gives the client ApiConfig.model), so that prompts
    are tokenized here and outputs detokenized there by the same one.
    """

    def __init__(self, config: ApiConfig, client: AsyncEngineClient) -> None:
        self._config = config
        self._client = client
        self._tokenizer: ModelTokenizer | None = None
        self._tokenizer_error = ""  # why the configured checkpoint's tokenizer did not load (logged once)
        self._model: ServedModel | None = None
        self._mismatch = ""  # why the ready worker cannot be served with our tokenizer; "" when it can
        self._foreign = ""  # why the scheduler that answers is not this api's (another instance's), or ""
        self._tokenizer_lock = asyncio.Lock()
        self._model_lock = asyncio.Lock()

    @property
    def loaded(self) -> ServedModel | None:
        return self._model

    @property
    def loaded_tokenizer(self) -> ModelTokenizer | None:
        return self._tokenizer

    @property
    def misconfiguration(self) -> str:
        """Why the api cannot serve until its settings change: the --model directory has no loadable
        tokenizer, or the worker serves another checkpoint than the tokenizer's. "" when neither is known."""
        if self._tokenizer is None:
            return self._tokenizer_error
        return self._mismatch

    async def tokenizer(self) -> ModelTokenizer:
        """The api's tokenizer. With ApiConfig.model it comes from that directory and the scheduler is not
        asked; without, from the checkpoint a ready worker announced. Raises ApiError 503 until it loads."""
        if self._tokenizer is not None:
            return self._tokenizer
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = await self._load_tokenizer()
            return self._tokenizer

    async def _load_tokenizer(self) -> ModelTokenizer:
        root = self._config.model
        if not root:  # learnt from the worker: the client loads what the scheduler names
            info = await self._info()
            if not info.ready:
                raise unavailable("the model is still loading; try again shortly")
            root = info.model_root
        elif not os.path.isdir(root):  # else transformers would take it for a Hub name and try to download
            raise self._load_failed(root, "no such directory")
        try:
            tokenizer = await self._client.get_tokenizer()
        except TimeoutError:
            raise unavailable("the scheduler does not answer") from None
        except (OSError, ValueError) as e:  # a broken checkpoint directory
            raise self._load_failed(root, str(e)) from None
        if tokenizer is None:
            raise unavailable("no tokenizer could be loaded for the model")
        loaded = ModelTokenizer(
            root=os.path.realpath(root),
            tokenizer=tokenizer,
            token_strings=TokenStrings(tokenizer),
            longest_token_chars=await asyncio.to_thread(longest_token_chars, tokenizer),
        )
        log.info("tokenizer_ready", model=loaded.root, configured=bool(self._config.model))
        return loaded

    def _load_failed(self, root: str, reason: str) -> ApiError:
        message = f"the tokenizer of {root} could not be loaded: {reason}"
        if message != self._tokenizer_error:  # logged once, not at every retry of the warm-up
            log.error("tokenizer_load_failed", model=root, error=reason)
            self._tokenizer_error = message
        return unavailable(message)

    def check(self, info: InfoReply) -> None:
        """Notes whether the checkpoint a ready worker serves (as `info` reports it) is the tokenizer's."""
        if self._tokenizer is None or not info.ready or not info.model_root:
            return
        ours = self._tokenizer.root
        if os.path.realpath(info.model_root) == ours:
            if self._mismatch:
                log.info("model_matches_tokenizer", model=ours)
            self._mismatch = ""
            return
        message = (
            f"the worker serves the checkpoint {info.model_root}, but the api's tokenizer is that of {ours}:"
            " start the api and the worker with the same --model (PAGEDSERVE_MODEL)"
        )
        if message != self._mismatch:
            log.error("model_mismatch", worker_model=info.model_root, api_model=ours)
        self._mismatch = message

    async def get(self) -> ServedModel:
        """The served model. Raises ApiError 503 while the scheduler is not ready or does not answer, and
        while the worker serves another checkpoint than the tokenizer's."""
        if self._model is None:
            async with self._model_lock:
                if self._model is None:
                    self._model = await self._load()
        if self._mismatch:
            raise unavailable(self._mismatch)
        return self._model

    async def serving(self) -> ServedModel:
        """The served model, once the scheduler confirms that a worker serves it now: the model stays known
        after its worker died, so this asks. Raises ApiError 503 otherwise."""
        info = await self._info()
        if not info.ready:
            raise unavailable("no worker is ready; try again shortly")
        self.check(info)
        return await self.get()

    def foreign_scheduler(self, info: InfoReply) -> str:
        """Why the scheduler that sent `info` is not this api's: it belongs to another server instance
        (both instance ids known, and different), as when a second server on the host took the first one's
        address. "" when it is this api's (or either side names no instance)."""
        ours, theirs = self._config.instance_id, info.instance_id
        message = ""
        if ours and theirs and ours != theirs:
            message = (
                f"the scheduler at {self._config.scheduler_address} belongs to another pagedserve instance "
                f"({theirs}; this api's is {ours}): give the api its own scheduler's --scheduler-address"
            )
            if message != self._foreign:  # logged once, not at every probe
                log.error("scheduler_of_another_instance", scheduler_instance=theirs, api_instance=ours)
        self._foreign = message
        return message

    async def _info(self) -> InfoReply:
        try:
            info = await self._client.info(timeout=INFO_TIMEOUT_S)
        except TimeoutError:
            raise unavailable("the scheduler does not answer") from None
        if self.foreign_scheduler(info):
            raise unavailable(self._foreign)
        return info

    async def _load(self) -> ServedModel:
        tokenizer = await self.tokenizer()  # first: with ApiConfig.model, it does not wait for a worker
        info = await self._info()
        if not info.ready:
            raise unavailable("the model is still loading; try again shortly")
        self.check(info)
        if self._mismatch:
            raise unavailable(self._mismatch)
        model = ServedModel(
            name=self._config.served_model_name or info.model_name,
            root=info.model_root,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            kv_capacity_tokens=info.num_kv_blocks * info.block_size,
            tokenizer=tokenizer.tokenizer,
            token_strings=tokenizer.token_strings,
            longest_token_chars=tokenizer.longest_token_chars,
            scheduling_policy=info.scheduling_policy,
            tool_call_parser=self._detected_tool_parser(tokenizer.tokenizer),
            generation_defaults=await asyncio.to_thread(
                load_generation_defaults, tokenizer.root, self._config.generation_config
            ),
        )
        log.info("model_ready", model=model.name, root=model.root, max_model_len=model.max_model_len)
        if model.tool_call_parser and not self._config.tool_call_parser:
            log.info("tool_call_parser_detected", parser=model.tool_call_parser)
        return model

    def _detected_tool_parser(self, tokenizer: Any) -> str:
        """The tool-call parser the chat template asks for (--chat-template's, else the tokenizer's)."""
        try:
            template = server_template(self._config.chat_template)
        except ValueError:  # reported where chat requests render it
            return ""
        return detect_tool_parser(template or template_text(getattr(tokenizer, "chat_template", None)))

    async def warm_up(self, interval_s: float = 0.5) -> None:
        """Loads the tokenizer, then polls until the model is known, so that the first request pays for
        neither."""
        while self._model is None:
            try:
                await self.get()
            except ApiError:
                await asyncio.sleep(interval_s)
            except Exception:  # a broken checkpoint must not end the server: requests will report it
                log.exception("model_load_failed")
                await asyncio.sleep(10 * interval_s)
