"""Tool calls and structured outputs through the official `openai` package, unmodified.

Usage: agent.py BASE_URL MODEL API_KEY   (BASE_URL like http://127.0.0.1:8080/v1)

On random weights the text is noise, so everything checked here is what the grammar guarantees:
a required call's arguments validate against the declared schema (whole and streamed), and each
of 50 random JSON schemas gets a response that validates and stops at its closing brace.
Exits non-zero with a message on the first mismatch.
"""

import json
import random
import sys

import jsonschema
import openai

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                   "b": {"type": "integer", "minimum": -99, "maximum": 99}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Adds two numbers",
                                      "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def check_call(name, arguments):
    assert name in SCHEMAS, f"unknown function {name!r}"
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def tool_calls(client, model):
    checks = 0
    messages = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
    params = dict(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                  temperature=0, max_tokens=1000, extra_body=NO_THINKING)
    whole = client.chat.completions.create(**params)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls, f"no tool_calls: {choice.message}"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_"), c
        check_call(c.function.name, c.function.arguments)
    assert len({c.id for c in calls}) == len(calls), "call ids repeat"
    checks += 1

    # Streamed: the same calls, each opened by a delta with its id and name, then arguments.
    got = {}
    finish = None
    for chunk in client.chat.completions.create(**params, stream=True):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                if tc.index not in got:
                    assert tc.id and tc.function.name, f"a call opened without id and name: {tc}"
                    got[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                got[tc.index]["arguments"] += tc.function.arguments or ""
            if c.finish_reason is not None:
                finish = c.finish_reason
    assert finish == "tool_calls", finish
    streamed = [(got[i]["name"], got[i]["arguments"]) for i in sorted(got)]
    assert streamed == [(c.function.name, c.function.arguments) for c in calls], (streamed, calls)
    checks += 1

    # A named function, one call only.
    named = client.chat.completions.create(
        **{**params, "tool_choice": {"type": "function", "function": {"name": "add"}},
           "parallel_tool_calls": False})
    calls = named.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "add", calls
    check_call("add", calls[0].function.arguments)
    checks += 1

    # The agent loop's next turn: the call and its result in the history.
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function",
             "function": {"name": "add", "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "5"},
    ]
    nxt = client.chat.completions.create(model=model, messages=history, tools=TOOLS,
                                         temperature=0, max_tokens=8)
    assert nxt.choices[0].finish_reason in ("stop", "length", "tool_calls"), nxt
    checks += 1
    return checks


def random_schema(rng, depth=0):
    kinds = ["string", "integer", "number", "boolean", "enum"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 8)}
    if kind == "integer":
        lo = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 5000)}
    if kind == "number":
        lo = rng.randint(-100, 100)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 200)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        pool = ["red", "green", "blue", 1, 2.5, None, True, "x y"]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1),
                "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    return random_object(rng, depth + 1)


def random_object(rng, depth=0):
    n = rng.randint(1, 4)
    props = {f"k{i}_{rng.choice('abcxyz')}": random_schema(rng, depth) for i in range(n)}
    required = sorted(rng.sample(list(props), rng.randint(0, n)))
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def json_schemas(client, model):
    rng = random.Random(2026)
    for i in range(50):
        schema = random_object(rng)
        r = client.chat.completions.create(
            model=model, temperature=0.7, seed=i, max_tokens=400, extra_body=NO_THINKING,
            messages=[{"role": "user", "content": f"Give me object number {i} as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        choice = r.choices[0]
        text = choice.message.content
        assert choice.finish_reason == "stop", f"schema {i} {schema}: {choice.finish_reason} {text!r}"
        assert text.endswith("}"), f"schema {i}: does not stop at its closing brace: {text!r}"
        try:
            value = json.loads(text)
            jsonschema.validate(value, schema)
        except Exception as e:
            raise AssertionError(f"schema {i} {json.dumps(schema)}: {text!r}: {e}") from e
    # n > 1: each choice has its own constraint.
    schema = random_object(rng)
    r = client.chat.completions.create(
        model=model, temperature=1.0, seed=11, max_tokens=400, n=3, extra_body=NO_THINKING,
        messages=[{"role": "user", "content": "Three objects."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "n3", "schema": schema, "strict": True}})
    assert [c.index for c in r.choices] == [0, 1, 2], r.choices
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), schema)
    # json_object: any object.
    r = client.chat.completions.create(
        model=model, temperature=0.7, seed=7, max_tokens=400, extra_body=NO_THINKING,
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict), r
    return 52


def errors(client, model):
    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "strict": True, "schema": {"type": "object", "properties": {
                    "a": {"type": "strin"}}}}})
    except openai.BadRequestError as e:
        assert e.body["param"] == "response_format.json_schema.schema", e.body
        return 1
    raise AssertionError("a schema llguidance refuses was accepted")


def main() -> int:
    base_url, model, api_key = sys.argv[1:4]
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    checks = tool_calls(client, model) + json_schemas(client, model) + errors(client, model)
    print(f"{checks} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
