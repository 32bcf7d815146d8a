"""`ChatTemplateRenderer`: chat templates rendered in child processes that can be killed.

A chat template is code, and an adapter may carry its tenant's own. Rendered in the API process
(or a thread of it), a template of nested loops would hold a thread forever, and a thread cannot
be stopped. So every render goes to one of a few render processes (`_chat_template_child.py`:
jinja2's immutable sandbox, bounded `*` / `**`, an address-space limit, output stopped at
`max_chars`), and a render that takes longer than `timeout_s` ends with a 400
`chat_template_timeout` and the process is killed and started again. One tenant's renders use at
most all but one of the processes at once, so another tenant's renders always find one; a
render that waits longer than `timeout_s` for its tenant's turn answers 429 (the tenant's own
renders hold them), one that waits that long for a free process 503. Nothing here runs on the
event loop's default thread pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import sys
from pathlib import Path
from typing import Any

from loraplex.platform.api.errors import APIError, bad_request

logger = logging.getLogger(__name__)

_CHILD = Path(__file__).with_name("_chat_template_child.py")
_HEADER = struct.Struct(">I")
#: the address space of one render process: the interpreter, jinja2 and a prompt's text
RENDER_MEMORY_MIB = 1024
_START_TIMEOUT_S = 60.0  # a render process's interpreter and imports, on a loaded machine
#: the conversation an adapter's template is tried on at upload
PROBE_MESSAGES = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi. How can I help?"},
    {"role": "user", "content": "What is 2 + 2?"},
)


def template_timeout(timeout_s: float) -> APIError:
    return bad_request(
        f"The chat template took longer than {timeout_s:g} s to render (--chat-template-timeout).",
        param="messages",
        code="chat_template_timeout",
    )


class _RenderProcess:
    """One render process, started on demand and again after it was killed or died."""

    def __init__(self, memory_mib: int) -> None:
        self.memory_mib = memory_mib
        self._process: asyncio.subprocess.Process | None = None
        self._reaping: set[asyncio.Future[int]] = set()  # killed processes, until they exit

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.returncode is None

    async def start(self) -> None:
        """Start the process (if it is not running) and wait until it is ready to render."""
        if self.running:
            return
        self.kill()
        paths = [os.path.abspath(p) for p in sys.path if p]
        self._process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", str(_CHILD), str(self.memory_mib), json.dumps(paths),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            ready = await asyncio.wait_for(self._reply(), _START_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise
        if ready != {"ready": True}:
            self.kill()
            raise RuntimeError(f"the chat template render process did not start: {ready!r}")

    async def exchange(self, job: dict[str, Any]) -> dict[str, Any]:
        """Send one job and read its reply (the process must be running)."""
        assert self._process is not None and self._process.stdin
        data = json.dumps(job).encode()
        self._process.stdin.write(_HEADER.pack(len(data)) + data)
        await self._process.stdin.drain()
        return await self._reply()

    async def _reply(self) -> dict[str, Any]:
        assert self._process is not None and self._process.stdout
        (size,) = _HEADER.unpack(await self._process.stdout.readexactly(_HEADER.size))
        return json.loads(await self._process.stdout.readexactly(size))

    def kill(self) -> None:
        """Stop the process now; the next `start` runs a fresh one."""
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.kill()
            reaped = asyncio.ensure_future(process.wait())
            self._reaping.add(reaped)
            reaped.add_done_callback(self._reaping.discard)

    async def stop(self) -> None:
        """Kill the process and wait until it and every one killed before have exited."""
        self.kill()
        if self._reaping:
            await asyncio.gather(*self._reaping, return_exceptions=True)


class ChatTemplateRenderer:
    """Renders chat templates in `workers` processes, each render within `timeout_s`."""

    def __init__(self, workers: int, timeout_s: float, memory_mib: int = RENDER_MEMORY_MIB) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.timeout_s = timeout_s
        self.per_tenant = max(1, workers - 1)
        self._processes = [_RenderProcess(memory_mib) for _ in range(workers)]
        self._idle: asyncio.Queue[_RenderProcess] | None = None
        self._tenants: dict[str, asyncio.Semaphore] = {}

    async def start(self) -> None:
        """Start the render processes now (a warm-up), rather than on the first render."""
        await asyncio.gather(*(process.start() for process in self._processes))

    async def render(
        self, template: str, context: dict[str, Any], max_chars: int, tenant: str
    ) -> str:
        """`template` rendered with `context` (JSON values), at most `max_chars` characters;
        APIError: 400 when the template fails, refuses the conversation, is too slow or its
        text too long, 503 when no render process frees up in time."""
        reply = await self._run(tenant, {"template": template, "context": context,
                                         "max_chars": max_chars})  # fmt: skip
        if "text" in reply:
            text = reply["text"]
            if not isinstance(text, str) or len(text) > max_chars:
                raise bad_request("The chat template rendered an invalid text.", param="messages")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request(
                    "The chat template rendered invalid Unicode text.", param="messages"
                ) from None
            return text
        kind, message = reply.get("error"), str(reply.get("message", ""))
        if kind == "too_long":
            raise bad_request(
                f"The chat template rendered more than {max_chars} characters, more than the "
                "context can hold.",
                param="messages",
                code="context_length_exceeded",
            )
        if kind == "syntax":
            message = f"not a valid Jinja template ({message})"
        elif kind == "memory":
            message = "it used too much memory"
        raise bad_request(f"The chat template failed: {message}", param="messages")

    async def probe(self, template: str, bos_token: str, eos_token: str, max_chars: int) -> None:
        """Try an adapter's template on a short conversation, as an upload is checked: 400
        (`invalid_adapter`) if it is not a template, or is too slow, too large or too greedy on
        it. A template that refuses this conversation (`raise_exception`) passes: it may well
        serve the conversations its tenant sends."""
        context = {"messages": list(PROBE_MESSAGES), "add_generation_prompt": True,
                   "tools": None, "bos_token": bos_token, "eos_token": eos_token}  # fmt: skip
        try:
            reply = await self._run("", {"template": template, "context": context,
                                         "max_chars": max_chars})  # fmt: skip
        except APIError as error:
            if error.status == 503:
                raise
            reply = {"error": "timeout"}
        kind = reply.get("error")
        if kind in (None, "template"):
            return
        why = {
            "syntax": f"is not a valid Jinja template ({reply.get('message')})",
            "timeout": f"took longer than {self.timeout_s:g} s on a four-message conversation",
            "too_long": f"rendered more than {max_chars} characters of a four-message conversation",
            "memory": "used too much memory on a four-message conversation",
        }.get(str(kind), "failed")
        raise bad_request(f"The adapter's chat template {why}.", code="invalid_adapter")

    async def close(self) -> None:
        await asyncio.gather(*(process.stop() for process in self._processes))

    async def _run(self, tenant: str, job: dict[str, Any]) -> dict[str, Any]:
        """One job on a free process, within the time limits (see the module's docstring)."""
        turn = self._tenants.get(tenant)
        if turn is None:
            turn = self._tenants[tenant] = asyncio.Semaphore(self.per_tenant)
        try:
            await asyncio.wait_for(turn.acquire(), self.timeout_s)
        except asyncio.TimeoutError:
            raise APIError(
                429,
                f"This tenant's chat template renders ({self.per_tenant} at a time) did not "
                f"free up within {self.timeout_s:g} s; try again shortly.",
                type="rate_limit_error",
                code="chat_template_busy",
                headers={"Retry-After": "1"},
            ) from None
        try:
            idle = self._idle_queue()
            try:
                process = await asyncio.wait_for(idle.get(), self.timeout_s)
            except asyncio.TimeoutError:
                raise APIError(
                    503,
                    "Every chat template render process is busy; try again shortly.",
                    type="service_unavailable",
                    code="chat_template_busy",
                    headers={"Retry-After": "1"},
                ) from None
            try:
                return await self._exchange(process, job)
            finally:
                idle.put_nowait(process)
        finally:
            turn.release()

    async def _exchange(self, process: _RenderProcess, job: dict[str, Any]) -> dict[str, Any]:
        # NOTE: starting a process is not the template's time; its render is.
        try:
            await process.start()
        except (OSError, RuntimeError, asyncio.TimeoutError) as error:
            logger.error("a chat template render process did not start: %s", error)
            raise APIError(
                503,
                "The chat template renderer is unavailable; try again shortly.",
                type="service_unavailable",
                code="chat_template_unavailable",
                headers={"Retry-After": "5"},
            ) from None
        try:
            return await asyncio.wait_for(process.exchange(job), self.timeout_s)
        except asyncio.TimeoutError:
            process.kill()
            raise template_timeout(self.timeout_s) from None
        except (asyncio.IncompleteReadError, ConnectionError):
            process.kill()
            raise bad_request(
                "The chat template failed: its render process died.", param="messages"
            ) from None
        except BaseException:  # cancelled mid-exchange: the process's reply would be stray
            process.kill()
            raise

    def _idle_queue(self) -> asyncio.Queue[_RenderProcess]:
        if self._idle is None:  # made in the event loop that renders
            self._idle = asyncio.Queue()
            for process in self._processes:
                self._idle.put_nowait(process)
        return self._idle
