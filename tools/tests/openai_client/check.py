"""Drives a running `serve` with the official `openai` package, unmodified.

Usage: check.py BASE_URL MODEL API_KEY   (BASE_URL like http://127.0.0.1:8080/v1)
Exits non-zero with a message on the first mismatch.
"""

import sys

import openai


def main() -> int:
    base_url, model, api_key = sys.argv[1:4]
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    checks = 0

    models = [m.id for m in client.models.list()]
    assert models == [model], f"models.list gave {models}"
    checks += 1

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = dict(model=model, messages=messages, temperature=0, max_tokens=16)
    whole = client.chat.completions.create(**params)
    choice = whole.choices[0]
    assert whole.object == "chat.completion", whole
    assert choice.message.role == "assistant", choice
    assert choice.finish_reason in ("stop", "length"), choice
    assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0, whole.usage
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    whole_reasoning = getattr(choice.message, "reasoning_content", None) or ""
    whole_content = choice.message.content or ""
    assert whole_reasoning or whole_content, "an empty answer"
    checks += 1

    stream = client.chat.completions.create(
        **params, stream=True, stream_options={"include_usage": True}
    )
    reasoning, content, finish, usage, chunks = "", "", None, None, 0
    for chunk in stream:
        chunks += 1
        assert chunk.object == "chat.completion.chunk", chunk
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            if c.finish_reason is not None:
                finish = c.finish_reason
    assert chunks > 2, f"only {chunks} chunks"
    assert (reasoning, content) == (whole_reasoning, whole_content), (
        f"stream {(reasoning, content)!r} != whole {(whole_reasoning, whole_content)!r}"
    )
    assert finish == choice.finish_reason, (finish, choice.finish_reason)
    assert usage is not None, "no usage chunk despite include_usage"
    assert usage.completion_tokens == whole.usage.completion_tokens, usage
    # The repeat shares the first request's prompt blocks (prefix caching).
    # The server runs with blocks of 16: every whole block before the prompt's last token.
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16, usage
    assert usage.prompt_tokens_details.cached_tokens > 0, usage
    checks += 1

    comp = client.completions.create(model=model, prompt="Hello world", max_tokens=8, temperature=0)
    assert comp.object == "text_completion", comp
    assert isinstance(comp.choices[0].text, str)
    assert comp.choices[0].finish_reason in ("stop", "length")
    assert comp.usage.completion_tokens <= 8
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="Hello world", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == comp.choices[0].text, (streamed, comp.choices[0].text)
    checks += 1

    try:
        client.chat.completions.create(model=model, messages=messages, temperature=5)
        raise AssertionError("temperature=5 was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "temperature" in str(e), e
    try:
        client.chat.completions.create(model="no-such-model", messages=messages)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert "no-such-model" in str(e), e
    bad = openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0)
    try:
        bad.models.list()
        raise AssertionError("a wrong API key was accepted")
    except openai.AuthenticationError:
        pass
    checks += 1

    print(f"openai {openai.__version__}: {checks} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
