"""The frameworks agents are built with, used as their documentation shows, pointed at kvgate
(the shared ``stack``: a real worker on the real vLLM CPU engine): LangChain's ``ChatOpenAI``
and the OpenAI Agents SDK. The dev model's random weights never choose a tool by themselves, so
each test forces one (see ``tests/test_agent_api.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from pydantic import BaseModel

from tests.conftest import Stack

MODEL = "kvgate-dev"
QUESTION = "what is the weather in paris?"


class Weather(BaseModel):
    """The weather in a city."""

    city: Literal["paris", "rome", "oslo"]
    metric: bool


@pytest.fixture
def chat_model(stack: Stack) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=stack.base_url + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        model=MODEL,
        max_tokens=120,  # type: ignore[call-arg]
        max_retries=0,
    )


async def test_langchain_bind_tools_with_a_forced_tool(chat_model: ChatOpenAI) -> None:
    reply = await chat_model.bind_tools([Weather], tool_choice="Weather").ainvoke(QUESTION)
    assert reply.tool_calls, reply
    call = reply.tool_calls[0]
    assert call["name"] == "Weather"
    Weather.model_validate(call["args"])


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
async def test_langchain_with_structured_output(chat_model: ChatOpenAI, method: str) -> None:
    structured = chat_model.with_structured_output(Weather, method=method)  # type: ignore[arg-type]
    answer = await structured.ainvoke(QUESTION)
    assert isinstance(answer, Weather)


@pytest.fixture
def no_agent_tracing() -> Iterator[None]:
    # The SDK would export its traces to OpenAI's servers; nothing leaves this machine.
    set_tracing_disabled(True)
    yield
    set_tracing_disabled(False)


async def test_openai_agents_sdk_runs_a_function_tool(stack: Stack, no_agent_tracing: None) -> None:
    asked: list[tuple[str, bool]] = []

    @function_tool
    def get_weather(city: Literal["paris", "rome", "oslo"], metric: bool) -> str:
        """The weather in a city."""
        asked.append((city, metric))
        return "sunny, 21 degrees"

    client = AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
    try:
        agent = Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            tools=[get_weather],
            model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
            # The first turn must call this tool (by name: "required" would let the random
            # weights add calls until max_tokens); the SDK then lets the model answer.
            model_settings=ModelSettings(tool_choice="get_weather", max_tokens=120),
        )
        result = await Runner.run(agent, QUESTION, max_turns=4)
    finally:
        await client.close()
    assert asked, [item.raw_item for item in result.new_items]
    assert asked[0][0] in ("paris", "rome", "oslo")
    assert isinstance(result.final_output, str)
