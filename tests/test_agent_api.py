"""What agents send reaches vLLM's own serving layer through kvgate: tool calls, structured
output, logprobs, ``n``, completions, with the official ``openai`` client, on the real worker
and the real vLLM CPU engine (the shared ``stack``).

The development model has random weights, so it never chooses to call a tool; a named or
``required`` ``tool_choice`` and ``response_format`` force valid output through vLLM's
structured decoding. Random weights would fill the grammar's optional whitespace until
``max_tokens``: the dev model is built so that whitespace-only tokens are all but never
sampled (``workers/devmodel.py``), as a trained model writes compact JSON. Where a grammar
lets output grow without end (a list of calls, a free JSON object), the tests favour the
closing tokens with ``logit_bias``, an OpenAI field vLLM honours.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from tests.conftest import Stack

MODEL = "kvgate-dev"

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["paris", "rome", "oslo"]},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "metric"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}


def tool(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": schema,
            "strict": True,
        },
    }


TOOLS = [tool("get_weather", WEATHER), tool("get_time", CLOCK)]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "what is the weather in paris?"}]


@pytest.fixture(scope="module")
def json_bias(dev_model: Path) -> dict[str, int]:
    """``logit_bias`` for structured output on the random-weight dev model (see the module
    doc): "]", "}" and the end of sequence favoured, so that a list, an object or a run of
    tool calls closes as soon as the grammar allows instead of growing until ``max_tokens``."""
    tokenizer = Tokenizer.from_file(str(dev_model / "tokenizer.json"))
    bias: dict[str, int] = {}
    for closer in ("]", "}", "</s>"):
        token = tokenizer.token_to_id(closer)
        assert token is not None
        bias[str(token)] = 100
    return bias


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
    try:
        yield c
    finally:
        await c.close()


async def chat(client: openai.AsyncOpenAI, **request: Any) -> Any:
    """``client.chat.completions.create``, untyped: the tests pass plain dicts."""
    return await client.chat.completions.create(**request)


async def complete(client: openai.AsyncOpenAI, **request: Any) -> Any:
    return await client.completions.create(**request)


async def message(client: anthropic.AsyncAnthropic, **request: Any) -> Any:
    return await client.messages.create(**request)


def stream_message(client: anthropic.AsyncAnthropic, **request: Any) -> Any:
    return client.messages.stream(**request)


def check_call(name: str, arguments: str) -> None:
    """The call names one of the tools and its arguments satisfy that tool's schema."""
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


async def test_a_named_tool_choice_gives_a_valid_call(
    client: openai.AsyncOpenAI, json_bias: dict[str, int]
) -> None:
    await named_tool_choice(client, json_bias)


async def named_tool_choice(client: openai.AsyncOpenAI, json_bias: dict[str, int]) -> None:
    request = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 120,
    }
    reply = await chat(client, **request)
    calls = reply.choices[0].message.tool_calls
    assert calls, reply.model_dump_json()
    assert calls[0].function.name == "get_weather"
    check_call("get_weather", calls[0].function.arguments)

    # Streamed: the deltas assemble into a call just as valid.
    stream = await chat(client, **request, stream=True)
    name, arguments = "", ""
    async for chunk in stream:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta.function is not None:
                name += delta.function.name or ""
                arguments += delta.function.arguments or ""
    assert name == "get_weather"
    check_call(name, arguments)


async def test_required_tool_choice_calls_a_tool_and_none_calls_none(
    client: openai.AsyncOpenAI, json_bias: dict[str, int]
) -> None:
    await required_and_none(client, json_bias)


async def required_and_none(client: openai.AsyncOpenAI, json_bias: dict[str, int]) -> None:
    reply = await chat(
        client,
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=160,
        logit_bias=json_bias,
    )
    calls = reply.choices[0].message.tool_calls
    assert calls, reply.model_dump_json()
    for call in calls:
        check_call(call.function.name, call.function.arguments)

    plain = await chat(
        client,
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
    )
    assert not plain.choices[0].message.tool_calls


async def test_tool_calls_and_results_in_the_history_reach_the_prompt(
    client: openai.AsyncOpenAI, json_bias: dict[str, int]
) -> None:
    await history_in_prompt(client, json_bias)


async def history_in_prompt(client: openai.AsyncOpenAI, json_bias: dict[str, int]) -> None:
    async def prompt_tokens(messages: list[dict[str, Any]]) -> int:
        reply = await chat(
            client,
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            max_tokens=1,
        )
        assert reply.usage is not None
        return int(reply.usage.prompt_tokens)

    arguments = json.dumps({"city": "oslo", "metric": True})
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": arguments},
            }
        ],
    }
    result = {"role": "tool", "tool_call_id": "call_1", "content": "minus four, snowing"}
    base = await prompt_tokens(ASK)
    with_call = await prompt_tokens([*ASK, call])
    with_result = await prompt_tokens([*ASK, call, result])
    # The call's name and arguments, then the result's text, are rendered into the prompt.
    assert with_call >= base + len(arguments) // 4
    assert with_result >= with_call + 4


async def test_response_format_json_schema_and_json_object(
    client: openai.AsyncOpenAI, json_bias: dict[str, int]
) -> None:
    await response_format(client, json_bias)


async def response_format(client: openai.AsyncOpenAI, json_bias: dict[str, int]) -> None:
    reply = await chat(
        client,
        model=MODEL,
        messages=ASK,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": WEATHER, "strict": True},
        },
        max_tokens=80,
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), WEATHER)

    reply = await chat(
        client,
        model=MODEL,
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=40,
        logit_bias=json_bias,
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


async def test_logprobs_and_n(client: openai.AsyncOpenAI, json_bias: dict[str, int]) -> None:
    await logprobs_and_n(client, json_bias)


async def logprobs_and_n(client: openai.AsyncOpenAI, json_bias: dict[str, int]) -> None:
    reply = await chat(
        client,
        model=MODEL,
        messages=ASK,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        assert len(choice.logprobs.content) == 4
        for entry in choice.logprobs.content:
            assert entry.logprob <= 0
            assert len(entry.top_logprobs) == 2
    assert reply.usage is not None and reply.usage.completion_tokens == 8


async def test_completions_streamed_and_not(
    client: openai.AsyncOpenAI, json_bias: dict[str, int]
) -> None:
    await completions(client, json_bias)


async def completions(client: openai.AsyncOpenAI, json_bias: dict[str, int]) -> None:
    reply = await complete(
        client, model=MODEL, prompt="the agent calls", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert reply.object == "text_completion"
    assert reply.choices[0].text and reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 5

    stream = await complete(
        client,
        model=MODEL,
        prompt="the agent calls",
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        usage = chunk.usage or usage
    assert text
    assert usage is not None and usage.completion_tokens == 5


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        pytest.param({"priority": 0}, "priority", id="priority-is-the-tier's"),
        pytest.param({"frobnicate": True}, "frobnicate", id="a-field-vllm-would-ignore"),
    ],
)
async def test_a_field_kvgate_cannot_honour_is_refused_by_name(
    stack: Stack, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, **extra}
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http:
        for stream in (False, True):
            resp = await http.post("/v1/chat/completions", json={**body, "stream": stream})
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert (error["code"], error["param"]) == ("unsupported_parameter", param)
            assert param in error["message"]


async def test_vllm_refusals_reach_the_caller_as_its_4xx(stack: Stack) -> None:
    # vLLM's own check: logprobs beyond what the server allows.
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, "logprobs": True, "top_logprobs": 99}
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http:
        resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert "logprobs" in resp.json()["error"]["message"]


FEATURES = [
    named_tool_choice,
    required_and_none,
    history_in_prompt,
    response_format,
    logprobs_and_n,
    completions,
]


@pytest.mark.parametrize("tier", ["guaranteed", "standard", "besteffort"])
async def test_every_feature_in_a_session_under_each_tier(
    stack: Stack, json_bias: dict[str, int], tier: str
) -> None:
    """Each check above again, as calls of one admitted session at ``tier``."""
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http:
        created = await http.post(
            "/v1/sessions",
            json={
                "tier": tier,
                "max_parallel": 2,
                "expected_calls": 20,
                "est_prompt_tokens": 300,
                "est_output_tokens": 160,
            },
        )
        assert created.status_code == 201, created.text
        session = created.json()["id"]
        in_session = openai.AsyncOpenAI(
            base_url=stack.base_url + "/v1",
            api_key="unused",
            max_retries=0,
            default_headers={"X-Kvgate-Session": session},
        )
        try:
            for feature in FEATURES:
                await feature(in_session, json_bias)
            used = (await http.get(f"/v1/sessions/{session}")).json()
            assert used["calls_started"] == 12, used  # every call of the checks, in the session
        finally:
            await in_session.close()
            await http.delete(f"/v1/sessions/{session}")


async def test_several_prompts_in_one_completion_are_refused_by_name(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": ["one", "two"], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http:
        resp = await http.post("/v1/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "prompt"


async def test_anthropic_messages_with_the_official_client(stack: Stack) -> None:
    client = anthropic.AsyncAnthropic(base_url=stack.base_url, api_key="unused", max_retries=0)
    try:
        reply = await message(client, model=MODEL, max_tokens=6, messages=ASK)
        assert reply.type == "message" and reply.role == "assistant"
        assert reply.content and reply.content[0].type == "text"
        assert 0 < reply.usage.output_tokens <= 6

        async with stream_message(client, model=MODEL, max_tokens=6, messages=ASK) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
        assert text == "".join(b.text for b in final.content if b.type == "text")
        assert 0 < final.usage.output_tokens <= 6

        # Tool use, forced: the input satisfies the tool's schema.
        forced = await message(
            client,
            model=MODEL,
            max_tokens=120,
            messages=ASK,
            tools=[{"name": "get_weather", "description": "weather", "input_schema": WEATHER}],
            tool_choice={"type": "tool", "name": "get_weather"},
        )
        uses = [b for b in forced.content if b.type == "tool_use"]
        assert uses, forced.model_dump_json()
        assert uses[0].name == "get_weather"
        assert isinstance(uses[0].input, dict), forced.model_dump_json()
        jsonschema.validate(uses[0].input, WEATHER)
        assert forced.stop_reason == "tool_use"

        # Errors in Anthropic's shape, which its client reads.
        with pytest.raises(anthropic.BadRequestError) as refused:
            await message(
                client,
                model=MODEL,
                max_tokens=4,
                messages=ASK,
                extra_body={"frobnicate": 1},
            )
        body: Any = refused.value.body
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert "frobnicate" in body["error"]["message"]
        with pytest.raises(anthropic.NotFoundError):
            await message(client, model="claude-nope", max_tokens=4, messages=ASK)
    finally:
        await client.close()
