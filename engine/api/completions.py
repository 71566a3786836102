"""`/v1/chat/completions` and `/v1/completions`: a request becomes one engine request per prompt
(n samples each), whose deltas become OpenAI's response, streamed as server-sent events or whole.

A request's `cache_salt` is the caller's own: the engine gets it under the caller's name
(`api:<caller>:<salt>`, engine/api/access.py's `api_caller`), so no API caller can name a salt the
chat page gives its users (`anon:…`, `hf:…`) or another key's, and so test guesses about their
prompts by what hits the prefix cache.

Choice `i` of a text completion with several prompts is prompt `i // n`, sample `i % n`, as in
OpenAI's API. A client that disconnects cancels the handler's task: the engine client aborts its
requests at once and their blocks return (non-streaming requests are watched for it too).

A constraint on the reply (engine/api/output_format.py) goes to the engine as
`SamplingParams.structured_outputs`. A chat with tools is written into its prompt
(engine/api/tool_prompt.py), and each choice's text is read for calls as it comes
(engine/api/tool_call_parser.py).
"""
from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from engine.api.access import api_caller
from engine.api.errors import APIError, bad_request
from engine.api.output_format import Constraint, constraint_of
from engine.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from engine.api.tool_call_parser import TAG, CallStart, Content, Event, ReplyParser, parse_reply
from engine.api.tool_choice import ToolChoice, tool_choice_of
from engine.api.tool_prompt import chat_prompt, uses_tools
from engine.frontend.delta_stream import AsyncDeltaStream
from engine.runtime.streaming_client import StreamingClient
from engine.core.sampling_params import MAX_LOGPROBS, InvalidStructuredOutputsError, SamplingParams
from engine.outputs import Delta, Usage

DISCONNECT_CHECK_S = 0.5  # how often a non-streaming request checks that its client is still there
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Choice:
    """One sample's output so far."""
    index: int
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    usage: Usage | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)  # (sampled id, top ids' logprobs)


class Completions:
    """The two completion endpoints over one engine client. `tokenizer` is the API's own copy
    (the engine's stays on its loop thread): it turns logprob token ids into text, and renders a
    chat with tools by a chat template that takes them (off the event loop)."""

    def __init__(self, client: StreamingClient, tokenizer, model_name: str) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name

    # ---- the endpoints -------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_request(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        try:
            messages = body.chat()
        except ValueError as error:
            raise bad_request(str(error), "messages") from None
        tools = tool_choice_of(body)
        constraint = constraint_of(body, tools.constraint() if tools is not None else None)
        params = self._params(body, max_tokens, logprobs, self.client.info().max_model_len, constraint)
        if tools is not None and tools.mode == "auto" and self._tool_tags_are_special:
            params.skip_special_tokens = False  # else the reply's text would lose the tags, and its calls with them
        prompt, shared = await self._chat_prompt(messages, tools, body.num_shared_messages)
        reply = _Reply("chatcmpl", self.model_name, body.n, chat=True, top=body.top_logprobs or 0, decode=self._token,
                       parse=tools.parser() if tools is not None else None)
        return await self._answer(reply, [prompt], params, body, request, shared, constraint)

    async def text(self, body: CompletionRequest, request: Request):
        self._check_request(body)
        if body.echo:
            raise bad_request("echo is not supported", "echo")
        prompts = _prompts(body.prompt)
        constraint = constraint_of(body)
        params = self._params(body, body.max_tokens, body.logprobs, COMPLETIONS_DEFAULT_MAX_TOKENS, constraint)
        reply = _Reply("cmpl", self.model_name, body.n, chat=False, top=body.logprobs or 0, decode=self._token)
        return await self._answer(reply, prompts, params, body, request, 0, constraint)

    @functools.cached_property
    def _tool_tags_are_special(self) -> bool:
        """Whether the tokenizer holds `<tool_call>` as a special token (Hermes-2-Pro's does;
        SmolLM2's has no such token, Qwen2.5's an ordinary one), which decoding would skip."""
        special = set(self.tokenizer.all_special_tokens)
        special |= {t.content for t in getattr(self.tokenizer, "added_tokens_decoder", {}).values() if t.special}
        return TAG in special

    # ---- shared ---------------------------------------------------------------------------------
    def _check_request(self, body: SamplingFields) -> None:
        unknown = body.unknown_fields()
        if unknown:
            raise bad_request(f"unsupported field(s): {', '.join(unknown)}. This server does not implement them, "
                              "and does not drop what a request asks for unread.", unknown[0])
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist. This server serves `{self.model_name}`.",
                           "not_found_error", "model", "model_not_found")

    def _params(self, body: SamplingFields, max_tokens: int | None, logprobs: int | None, default: int,
                constraint: Constraint | None) -> SamplingParams:
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", "logprobs")
        try:
            params = body.sampling_params(max_tokens, logprobs, default,
                                          constraint.params if constraint is not None else None)
        except ValueError as error:
            message = str(error)
            raise bad_request(message, message.split(" ", 1)[0]) from None  # the message starts with the name
        vocabulary = len(self.tokenizer)
        beyond = sorted(token for token in params.logit_bias or {} if token >= vocabulary)
        if beyond:
            raise bad_request(f"logit_bias keys must be token ids below the vocabulary's size, {vocabulary}; "
                              f"got {', '.join(map(str, beyond[:5]))}", "logit_bias")
        return params

    async def _chat_prompt(self, messages: list[dict], tools: ToolChoice | None,
                           num_shared_messages: int) -> tuple[str | list[dict], int]:
        """The prompt the engine takes for a chat, and how many of its messages are shared: the
        messages as they are, or as engine/api/tool_prompt.py writes a chat with tools (on a
        thread: a chat template's render of a long chat takes a while)."""
        functions = tools.tools if tools is not None else None
        shared = min(num_shared_messages, len(messages))
        if not uses_tools(messages, functions):
            return messages, shared
        try:
            return await asyncio.to_thread(chat_prompt, self.tokenizer, messages, functions, shared)
        except Exception as error:  # a template's own checks (roles, order) raise what they like
            raise bad_request(f"the model's chat template cannot render these messages: {error}", "messages") from None

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def _answer(self, reply: _Reply, prompts: list, params: SamplingParams, body: SamplingFields,
                      request: Request, shared: int, constraint: Constraint | None):
        streams: list[AsyncDeltaStream] = []

        def close_all() -> None:  # a stream closed aborts its request if it still runs
            for stream in streams:
                stream.close()

        try:
            salt = callers_salt(api_caller(request), body.cache_salt)
            for i, prompt in enumerate(prompts):
                streams.append(await self.client.asubmit(prompt, params, request_id=f"{reply.id}-{i}",
                                                         cache_salt=salt, num_shared_messages=shared))
        except InvalidStructuredOutputsError as error:  # a schema, regex or grammar that does not compile
            close_all()
            field = constraint.error_field if constraint is not None else None
            raise bad_request(f"{field}: {error}" if field else str(error), field) from None
        except ValueError as error:  # a prompt the engine refuses: empty, or longer than it can hold
            close_all()  # the prompts before it were taken
            raise bad_request(str(error), "messages" if reply.chat else "prompt") from None
        except BaseException:
            close_all()
            raise
        deltas = _merged(streams, params.n)
        if constraint is not None:
            # A core in a process of its own checks the constraint itself (the serving process
            # holds no grammar library): one that does not compile is the request's first output.
            deltas, first = await _peeked(deltas)
            refused = _refused_constraint(first)
            if refused is not None:
                await deltas.aclose()
                close_all()
                field = constraint.error_field
                raise bad_request(f"{field}: {refused}", field)
        if body.stream:
            # A client gone before the body starts leaves the events generator unstarted, so its
            # cleanup never runs; the background task runs however the response ended.
            return StreamingResponse(reply.events(deltas, body.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(close_all))
        collect = asyncio.ensure_future(reply.collect(deltas))
        try:
            while not collect.done():
                await asyncio.wait({collect}, timeout=DISCONNECT_CHECK_S)
                if not collect.done() and await request.is_disconnected():
                    collect.cancel()
                    await asyncio.gather(collect, return_exceptions=True)
                    return JSONResponse({}, status_code=499)  # nobody reads it
            return collect.result()
        finally:
            collect.cancel()
            close_all()


class _Reply:
    """One API request's choices, as OpenAI's JSON: whole, or as streamed chunks. With `parse`
    (a chat with tools), each choice's text is read for tool calls by a parser of its own."""

    def __init__(self, prefix: str, model: str, n: int, chat: bool, top: int, decode: Callable[[int], str],
                 parse: Callable[[], ReplyParser] | None = None) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.model = model
        self.n = n
        self.chat = chat
        self.top = top
        self.decode = decode
        self.parse = parse
        self.created = int(time.time())
        self.choices: dict[int, Choice] = {}

    def choice(self, index: int) -> Choice:
        if index not in self.choices:
            self.choices[index] = Choice(index)
        return self.choices[index]

    def add(self, index: int, delta: Delta) -> Choice:
        choice = self.choice(index)
        choice.text += delta.text
        choice.token_ids += delta.token_ids
        if delta.logprobs is not None:
            choice.logprobs += zip(delta.token_ids, delta.logprobs)
        if delta.finish_reason is not None:
            choice.finish_reason, choice.error, choice.usage = delta.finish_reason, delta.error, delta.usage
        return choice

    # ---- whole ----------------------------------------------------------------------------------
    async def collect(self, deltas: AsyncIterator[tuple[int, Delta]]) -> JSONResponse:
        async for index, delta in deltas:
            self.add(index, delta)
        failed = [c for c in self.choices.values() if c.finish_reason == "error"]
        if failed:
            raise APIError(500, f"The engine failed this request: {failed[0].error}", "internal_server_error")
        choices = [self._whole(self.choices[i]) for i in sorted(self.choices)]
        body = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage()}
        return JSONResponse(body)

    def _whole(self, choice: Choice) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": choice.text}
            finish_reason = choice.finish_reason
            if self.parse is not None:
                parsed = parse_reply(self.parse(), choice.text, stopped=finish_reason == "stop")
                message["content"] = parsed.content
                if parsed.tool_calls:
                    message["tool_calls"] = parsed.tool_calls
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            return {"index": choice.index, "message": message,
                    "logprobs": self._chat_logprobs(choice.logprobs) if choice.logprobs else None,
                    "finish_reason": finish_reason}
        return {"index": choice.index, "text": choice.text,
                "logprobs": self._text_logprobs(choice.logprobs, 0) if choice.logprobs else None,
                "finish_reason": choice.finish_reason}

    def usage(self) -> dict:
        """Prompt tokens once per prompt (its first sample's), completion tokens of every sample."""
        prompt = cached = completion = 0
        for index, choice in self.choices.items():
            if choice.usage is None:
                continue
            completion += choice.usage.completion_tokens
            if index % self.n == 0:
                prompt += choice.usage.prompt_tokens
                cached += choice.usage.cached_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # ---- streamed -------------------------------------------------------------------------------
    async def events(self, deltas: AsyncIterator[tuple[int, Delta]], include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk per delta with something in it, then the usage chunk if
        asked for, then `[DONE]`. An engine failure ends the stream with an error event."""
        parsers: dict[int, ReplyParser] = {}
        try:
            async for index, delta in deltas:
                first = index not in self.choices
                choice = self.add(index, delta)
                if delta.finish_reason == "error":
                    yield _event({"error": {"message": f"The engine failed this request: {delta.error}",
                                            "type": "internal_server_error", "param": None, "code": None}})
                    return
                if first and self.chat:
                    yield _event(self._chunk(index, {"role": "assistant", "content": ""}, None, None))
                logprobs = None
                if delta.logprobs:
                    pairs = list(zip(delta.token_ids, delta.logprobs))
                    offset = len(choice.text) - len(delta.text)
                    logprobs = self._chat_logprobs(pairs) if self.chat else self._text_logprobs(pairs, offset)
                if self.parse is not None:
                    if index not in parsers:
                        parsers[index] = self.parse()
                    for chunk in self._parsed_chunks(index, parsers[index], delta, logprobs):
                        yield _event(chunk)
                elif delta.text or delta.finish_reason is not None or delta.logprobs:
                    content = {"content": delta.text} if self.chat and delta.text else ({} if self.chat else delta.text)
                    yield _event(self._chunk(index, content, delta.finish_reason, logprobs))
            if include_usage:
                yield _event({"id": self.id, "object": self._chunk_object(), "created": self.created,
                              "model": self.model, "choices": [], "usage": self.usage()})
            yield "data: [DONE]\n\n"
        finally:
            await deltas.aclose()  # a client gone mid-stream: its requests are aborted now

    def _parsed_chunks(self, index: int, parser: ReplyParser, delta: Delta, logprobs: dict | None) -> list[dict]:
        """A delta of a chat with tools, read by its choice's parser: a chunk per content piece
        or call delta (a delta's logprobs with the first), and the finish reason in a chunk of
        its own ("tool_calls" for a reply that stopped after calls)."""
        events = parser.feed(delta.text) if delta.text else []
        if delta.finish_reason is not None:
            events += parser.finish(stopped=delta.finish_reason == "stop")
        pieces = [_message_delta(event) for event in _joined_content(events)]
        if logprobs and not pieces:
            pieces = [{}]
        chunks = [self._chunk(index, piece, None, logprobs if i == 0 else None) for i, piece in enumerate(pieces)]
        if delta.finish_reason is not None:
            finish_reason = "tool_calls" if parser.calls and delta.finish_reason == "stop" else delta.finish_reason
            chunks.append(self._chunk(index, {}, finish_reason, None))
        return chunks

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, index: int, content, finish_reason: str | None, logprobs: dict | None) -> dict:
        choice = ({"index": index, "delta": content} if self.chat else {"index": index, "text": content})
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return {"id": self.id, "object": self._chunk_object(), "created": self.created, "model": self.model,
                "choices": [choice]}

    # ---- logprobs ---------------------------------------------------------------------------------
    def _chat_logprobs(self, pairs: list[tuple[int, dict[int, float]]]) -> dict:
        content = []
        for token_id, logprobs in pairs:
            top = sorted(((t, lp) for t, lp in logprobs.items()), key=lambda item: -item[1])[:self.top]
            content.append({**self._entry(token_id, logprobs[token_id]),
                            "top_logprobs": [self._entry(t, lp) for t, lp in top]})
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _text_logprobs(self, pairs: list[tuple[int, dict[int, float]]], offset: int) -> dict:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, logprobs in pairs:
            text = self.decode(token_id)
            tokens.append(text)
            token_logprobs.append(logprobs[token_id])
            top = sorted(logprobs.items(), key=lambda item: -item[1])[:self.top]
            top_logprobs.append({self.decode(t): lp for t, lp in top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}


def callers_salt(caller: str, cache_salt: str | None) -> str | None:
    """The engine's salt for a request's `cache_salt`, in the API's namespace under its caller;
    None (no salt: the prefix cache shared, as on vLLM) stays None."""
    return None if cache_salt is None else f"api:{caller}:{cache_salt}"


def _joined_content(events: list[Event]) -> list[Event]:
    """Adjacent content pieces as one."""
    joined: list[Event] = []
    for event in events:
        if isinstance(event, Content) and joined and isinstance(joined[-1], Content):
            joined[-1] = Content(joined[-1].text + event.text)
        else:
            joined.append(event)
    return joined


def _message_delta(event: Event) -> dict:
    """A parser's event as OpenAI's streamed `delta`."""
    if isinstance(event, Content):
        return {"content": event.text}
    if isinstance(event, CallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _prompts(prompt: str | list) -> list[str | list[int]]:
    """A text completion's prompts: one text, texts, one token list, or token lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


async def _peeked(deltas: AsyncIterator[tuple[int, Delta]]) -> tuple[AsyncIterator[tuple[int, Delta]], Delta | None]:
    """The first delta (None if there is none), and the deltas again from it on."""
    try:
        first = await deltas.__anext__()
    except StopAsyncIteration:
        return deltas, None

    async def again() -> AsyncIterator[tuple[int, Delta]]:
        try:
            yield first
            async for item in deltas:
                yield item
        finally:
            await deltas.aclose()
    return again(), first[1]


def _refused_constraint(delta: Delta | None) -> str | None:
    """Why the engine refused the request's constraint, if that is how it ended."""
    prefix = f"{InvalidStructuredOutputsError.__name__}: "
    if delta is not None and delta.finish_reason == "error" and (delta.error or "").startswith(prefix):
        return delta.error[len(prefix):]
    return None


async def _merged(streams: list[AsyncDeltaStream], n: int) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from every prompt's stream as the deltas come. Closing this closes
    every stream, which aborts the requests still running."""
    if len(streams) == 1:
        try:
            async for delta in streams[0]:
                yield delta.index, delta
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(prompt_index: int, stream: AsyncDeltaStream) -> None:
        try:
            async for delta in stream:
                await queue.put((prompt_index * n + delta.index, delta))
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in streams:
            while (item := await queue.get()) is not None:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
