"""Chat templates render in killable processes (`ChatTemplateRenderer`): a template of nested loops
answers 400 within the time limit and leaves the renderer serving, one tenant's slow renders
never take every process from another tenant, and what a template renders is bounded in size
(and, on upload, tried on a short conversation first)."""

from __future__ import annotations

import asyncio
import time

import pytest

from loraplex.platform.api.errors import APIError
from loraplex.platform.api.openai.chat_template_renderer import ChatTemplateRenderer

TIMEOUT_S = 1.5  # long beside a render, even on a busy machine
BOMB = "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}" + (
    "{% endfor %}{% endfor %}{% endfor %}"
)
SIMPLE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ eos_token }}"
CONTEXT = {"messages": [{"role": "user", "content": "hi"}], "eos_token": "</s>"}


@pytest.fixture
def renderer():
    renderer = ChatTemplateRenderer(workers=2, timeout_s=TIMEOUT_S)

    def run(coro):
        async def with_close():
            try:
                return await coro
            finally:
                await renderer.close()

        return asyncio.run(with_close())

    return renderer, run


async def _failure(coro) -> tuple[int, str | None, float]:
    start = time.monotonic()
    with pytest.raises(APIError) as caught:
        await coro
    return caught.value.status, caught.value.code, time.monotonic() - start


def test_a_template_renders_as_the_tokenizer_renders_it(renderer):
    renderer, run = renderer

    async def main():
        return await renderer.render(SIMPLE, CONTEXT, 1000, "alpha")

    assert run(main()) == "<user>hi</s>"


def test_a_template_bomb_answers_400_in_time_while_another_tenant_is_served(renderer):
    renderer, run = renderer

    async def other_tenant() -> list[float]:
        await asyncio.sleep(0.05)  # the bombs hold their processes by now
        took = []
        for _ in range(5):
            start = time.monotonic()
            assert await renderer.render(SIMPLE, CONTEXT, 1000, "beta") == "<user>hi</s>"
            took.append(time.monotonic() - start)
        return took

    async def main():
        await renderer.start()
        bombs = [_failure(renderer.render(BOMB, CONTEXT, 1000, "mallory")) for _ in range(8)]
        return await asyncio.gather(*bombs, other_tenant())

    *bombs, served = run(main())
    statuses = sorted((status, code) for status, code, _ in bombs)
    # the first bomb renders and is killed at the limit; the others wait for mallory's one
    # process and are turned away at the same limit
    assert statuses == [(400, "chat_template_timeout")] + [(429, "chat_template_busy")] * 7
    assert all(took < TIMEOUT_S + 2.0 for _, _, took in bombs), bombs
    assert max(served) < TIMEOUT_S, served  # beta never waited for mallory's renders


def test_the_renderer_serves_again_after_a_killed_render(renderer):
    renderer, run = renderer

    async def main():
        status, code, _ = await _failure(renderer.render(BOMB, CONTEXT, 1000, "alpha"))
        assert (status, code) == (400, "chat_template_timeout")
        return await renderer.render(SIMPLE, CONTEXT, 1000, "alpha")

    assert run(main()) == "<user>hi</s>"


@pytest.mark.parametrize(
    ("template", "code", "words"),
    [
        ("{% for i in range(100000) %}{{ 'x' * 64 }}{% endfor %}", "context_length_exceeded",
         "more than 5000 characters"),
        ("{{ 'x' * 100000000 }}", None, "`*` would build"),
        ("{{ 'x' | center(2000000000) }}", None, "too much memory"),
        ("{{ 2 ** 100000 }}", None, "exponent"),
        ("{% for x in %}", None, "not a valid Jinja template"),
        ("{{ raise_exception('system messages are not supported') }}", None,
         "system messages are not supported"),
        ("{{ messages.__class__.__base__ }}", None, "is unsafe"),
        ("{{ messages.append(1) }}", None, "is unsafe"),  # the sandbox is immutable
    ],
)  # fmt: skip
def test_what_a_template_may_not_do_answers_400(renderer, template, code, words):
    renderer, run = renderer
    with pytest.raises(APIError) as caught:
        run(renderer.render(template, CONTEXT, 5000, "alpha"))
    assert caught.value.status == 400 and caught.value.code == code
    assert caught.value.param == "messages" and words in caught.value.message


def test_the_upload_probe_refuses_slow_and_broken_templates_only(renderer):
    renderer, run = renderer

    async def probe(template: str) -> str | None:
        try:
            await renderer.probe(template, "<s>", "</s>", 5000)
        except APIError as error:
            assert (error.status, error.code) == (400, "invalid_adapter")
            return error.message
        return None

    async def main():
        return [await probe(t) for t in (BOMB, "{% for x in %}", SIMPLE,
                                         "{{ raise_exception('no system role') }}")]  # fmt: skip

    slow, broken, simple, refusing = run(main())
    assert "took longer than" in slow and "not a valid Jinja template" in broken
    assert simple is None and refusing is None  # it may refuse the probe's conversation
