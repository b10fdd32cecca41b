"""The chat route builds its output parser from the request: `parallel_tool_calls: false` keeps
the first of the model's tool calls (the parser's own tests cover each family's markup)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.gateway.routes.chat import _output_parser
from services.gateway.schemas import ChatCompletionRequest
from services.gateway.settings import GatewaySettings
from tests.parsing.model_outputs import ExpectedCall, ExpectedMessage, render_output, tools_for

CALLS = (ExpectedCall("get_weather", {"city": "Paris"}), ExpectedCall("get_time", {}))


@pytest.mark.parametrize(("parallel_tool_calls", "expected_names"),
                         [(None, ["get_weather", "get_time"]), (True, ["get_weather", "get_time"]),
                          (False, ["get_weather"])])
def test_parallel_tool_calls_reaches_the_output_parser(parallel_tool_calls: bool | None,
                                                       expected_names: list[str]) -> None:
    backend = SimpleNamespace(settings=GatewaySettings(tool_call_parser="deepseek_v4",
                                                       reasoning_parser="deepseek_v4"))
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 tools=tools_for(CALLS), parallel_tool_calls=parallel_tool_calls)
    parser = _output_parser(backend, body, is_thinking=False)  # type: ignore[arg-type]
    assert parser is not None
    parser.feed(render_output("deepseek_v4", ExpectedMessage(content="Two calls.", calls=CALLS),
                              think_style="chat"))
    parser.finish()
    assert [call.name for call in parser.message().tool_calls] == expected_names
