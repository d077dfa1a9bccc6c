"""The OpenAI Agents SDK (``openai-agents``) through ``/responses`` (issue 26): an agent with a function tool
runs against a live gateway over the scripted tool-capable upstream, which asks for the tool; the SDK runs it,
sends its output back, and the upstream's answer is the run's final output. Buffered and streamed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.gateway.service_harness import CLIENT_KEY, Live, live
from tests.gateway.upstream import Behavior

agents = pytest.importorskip("agents")  # the dev extra's openai-agents

from openai import AsyncOpenAI  # noqa: E402

WEATHER_ARGS = '{"city": "Paris"}'


@pytest.fixture(scope="module")
def lv() -> Live:
    agents.set_tracing_disabled(True)  # no export to OpenAI's trace endpoint
    upstream = Behavior(tool_name="get_weather", tool_args=WEATHER_ARGS, answer_tool_results=True,
                        pieces=("Sunny", " in Paris."))
    with live({"up-beta-tools": upstream}) as running:
        yield running  # type: ignore[misc]


def _agent(lv: Live, seen: list[str]) -> Any:
    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"{city}: 21C, sunny"

    client = AsyncOpenAI(base_url=lv.base_url, api_key=CLIENT_KEY, max_retries=0, timeout=15)
    model = agents.OpenAIResponsesModel(model="beta-tools", openai_client=client)
    return agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                        model=model)


def _check_upstream(lv: Live, before: int) -> None:
    calls = [c["body"] for c in lv.script.calls[before:]]
    assert len(calls) == 2  # the tool call, then the answer to its result
    assert calls[0]["tools"][0]["function"]["name"] == "get_weather"
    last = calls[1]["messages"]
    assert last[-2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": WEATHER_ARGS}
    assert last[-1]["role"] == "tool" and last[-1]["content"] == "Paris: 21C, sunny"


@pytest.mark.timeout(120)
def test_agent_runs_its_function_tool_through_responses(lv: Live) -> None:
    seen: list[str] = []
    before = len(lv.script.calls)
    result = asyncio.run(agents.Runner.run(_agent(lv, seen), "Weather in Paris?"))
    assert result.final_output == "Sunny in Paris."
    assert seen == ["Paris"]  # the SDK ran the tool the upstream asked for
    _check_upstream(lv, before)


@pytest.mark.timeout(120)
def test_agent_runs_its_function_tool_streamed(lv: Live) -> None:
    seen: list[str] = []
    before = len(lv.script.calls)

    async def run() -> tuple[Any, list[str]]:
        result = agents.Runner.run_streamed(_agent(lv, seen), "Weather in Paris?")
        kinds = [ev.type async for ev in result.stream_events()]
        return result, kinds

    result, kinds = asyncio.run(run())
    assert result.final_output == "Sunny in Paris."
    assert seen == ["Paris"] and "raw_response_event" in kinds
    assert all(c["body"]["stream"] is True for c in lv.script.calls[before:])
    _check_upstream(lv, before)
