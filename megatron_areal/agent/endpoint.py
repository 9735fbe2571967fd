"""The OpenAI-compatible endpoint an agent talks to: ``/episodes/<id>/v1/chat/completions``.

Each episode gets its own base URL, so the agent needs nothing but a standard client
(``openai.AsyncOpenAI(base_url=...)``) and every completion is recorded on its episode. A request's
messages are rendered with the model's chat template (``render``), the prompt's token ids go to the
fleet through the episode's ``generate`` (the rollout loop's interruptible ``/generate``), and the
reply comes back as an OpenAI chat completion with ``tool_calls`` parsed in the template's format.

Sampling is the episode's, not the request's: the trainer recomputes the behaviour policy's
logprobs at the rollout temperature, so an agent's ``temperature`` or ``top_p`` is ignored.
Streaming and ``n > 1`` are refused with a 400, as are turns past the episode's limits.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from megatron_areal.agent.render import ChatRenderer, RenderError, normalise
from megatron_areal.agent.session import EpisodeSession, LimitReached, Turn
from megatron_areal.agent.tool_calls import assistant_message, parse_reply
from megatron_areal.rollout.request import SampleError, SampleOutput

log = logging.getLogger(__name__)

# prompt ids, max new tokens, request id -> the reply, generated through any interruptions
Generate = Callable[[list[int], int, str], Awaitable[SampleOutput]]


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class AgentEndpoint:
    """Serves the episodes opened on it, on the event loop that runs them (``start`` inside it)."""

    def __init__(self, renderer: ChatRenderer, model_name: str = "policy", host: str = "127.0.0.1") -> None:
        self.renderer, self.model_name, self.host = renderer, model_name, host
        self._episodes: dict[str, tuple[EpisodeSession, Generate]] = {}
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        """Listen on a free port of ``host``."""
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._chat)
        app.router.add_get("/episodes/{episode}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # aiohttp exposes the bound port only here
        self.url = f"http://{self.host}:{port}"
        log.info("agent endpoint listening on %s", self.url)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, session: EpisodeSession, generate: Generate) -> str:
        """Serve ``session``; returns its base URL for ``AsyncOpenAI(base_url=...)``."""
        if session.episode_id in self._episodes:
            raise ValueError(f"episode {session.episode_id} is already open")
        self._episodes[session.episode_id] = (session, generate)
        return f"{self.url}/episodes/{session.episode_id}/v1"

    def close_episode(self, episode_id: str, reason: str) -> None:
        """No more turns for this episode (a request still generating is not recorded)."""
        entry = self._episodes.pop(episode_id, None)
        if entry is not None:
            entry[0].closed = reason or "ended"

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "created": 0, "owned_by": "megatron-areal"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        entry = self._episodes.get(request.match_info["episode"])
        if entry is None:
            return _error(404, f"no open episode {request.match_info['episode']!r}", "not_found_error")
        session, generate = entry
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return _error(400, f"request body is not JSON: {e}", "invalid_request_error")
        except ConnectionError:  # the agent went away (its episode was cancelled): nobody to answer
            return _error(499, "client closed the connection", "client_closed")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        if body.get("stream"):
            return _error(400, "stream=true is not supported", "invalid_request_error")
        if body.get("n", 1) != 1:
            return _error(400, "only n=1 is supported (run several episodes for several samples)",
                          "invalid_request_error")
        wanted = body.get("max_completion_tokens") or body.get("max_tokens") or session.max_new_tokens
        if not isinstance(wanted, int) or wanted < 1:
            return _error(400, f"max_tokens must be a positive integer, got {wanted!r}", "invalid_request_error")
        tools = body.get("tools")
        try:
            messages = normalise(body.get("messages"))
            prompt = self.renderer.render(messages, tools, session.previous)
            max_new = session.budget(len(prompt.ids), wanted)
        except RenderError as e:
            return _error(400, str(e), "invalid_request_error")
        except LimitReached as e:
            return _error(400, str(e), "limit_reached")
        try:
            out = await generate(prompt.ids, max_new, f"{session.episode_id}.t{len(session.turns)}")
        except SampleError as e:
            return _error(502, f"generation failed: {e}", "server_error")
        return web.json_response(self._reply(session, messages, prompt.ids, prompt.extends, out))

    def _reply(self, session: EpisodeSession, messages: list[dict[str, Any]], prompt_ids: list[int],
               extends: bool, out: SampleOutput) -> dict[str, Any]:
        parsed = parse_reply(self.renderer.reply_text(out.output_ids))
        turn_no = len(session.turns)
        message = assistant_message(parsed, f"call_{turn_no}")
        if parsed.malformed:
            log.debug("episode %s turn %d: malformed tool call returned as text: %s",
                      session.episode_id, turn_no, parsed.malformed)
        session.record(Turn(prompt_ids=prompt_ids, output_ids=out.output_ids, output_logprobs=out.output_logprobs,
                            output_versions=out.output_versions, extends=extends and turn_no > 0,
                            finish_reason=out.finish_reason, interruptions=out.interruptions,
                            tool_calls=len(parsed.tool_calls), malformed_call=bool(parsed.malformed)),
                       messages, normalise([message])[0])
        reason = "tool_calls" if parsed.tool_calls else ("length" if out.finish_reason == "length" else "stop")
        return {"id": f"chatcmpl-{session.episode_id}-{turn_no}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(out.output_ids),
                          "total_tokens": len(prompt_ids) + len(out.output_ids)}}
