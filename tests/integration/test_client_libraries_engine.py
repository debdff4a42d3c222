"""Client libraries that do not install with the project's pins, against the
session's real gateway, each run in a venv of its own (built once under the
user cache): the OpenAI Agents SDK (`openai-agents` pins websockets<17; the
project has 17) runs an agent with one function tool through chat
completions and through the Responses API, and Hugging Face's
`text-generation` client (huggingface-hub<1.0; the project has 2.x) calls
TGI's routes (`POST /` with and without `stream`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import EMBEDDED, GatewayProcess

pytestmark = pytest.mark.engine
PINS = ["openai-agents==0.24.0", "text-generation==0.7.0"]

AGENT = r'''
import asyncio, json, sys
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)
from openai import AsyncOpenAI

set_tracing_disabled(True)
url, model_name, api = sys.argv[1:4]
calls = []

@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    calls.append(city)
    return f"It is sunny in {city}."

client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
Model = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
agent = Agent(name="weather", instructions="Use the tool to answer.", tools=[get_weather],
              model=Model(model=model_name, openai_client=client), tool_use_behavior="stop_on_first_tool",
              model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60))
result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=2))
print(json.dumps({"calls": calls, "final": str(result.final_output)}))
'''

TGI = r'''
import json, sys
from text_generation import Client

client = Client(sys.argv[1], timeout=120)
whole = client.generate("The capital of France is", max_new_tokens=8)
streamed = list(client.generate_stream("The capital of France is", max_new_tokens=8))
print(json.dumps({"text": whole.generated_text, "tokens": whole.details.generated_tokens,
                  "reason": str(whole.details.finish_reason.value),
                  "stream": [r.token.text for r in streamed], "last": streamed[-1].generated_text}))
'''


@pytest.fixture(scope="module")
def clients_python() -> str:
    """A venv with the pinned client libraries (reused while the pins match)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "npu-gateway-tests" / "clients-venv"
    python = base / "bin" / "python"
    stamp = base / "pins.txt"
    if not (python.exists() and stamp.exists() and stamp.read_text() == "\n".join(PINS)):
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(base)], check=True)
        r = subprocess.run([str(python), "-m", "pip", "install", "-q", *PINS], capture_output=True, text=True,
                           timeout=900)
        if r.returncode != 0:
            pytest.fail(f"pip install {' '.join(PINS)} failed:\n{r.stderr[-3000:]}")
        stamp.write_text("\n".join(PINS))
    return str(python)


def run(python: str, script: str, *args: str) -> dict[str, object]:
    r = subprocess.run([python, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_an_agent_calls_its_function_tool(clients_python: str, real_gateway: GatewayProcess, api: str) -> None:
    got = run(clients_python, AGENT, real_gateway.url, EMBEDDED, api)
    calls = got["calls"]
    assert isinstance(calls, list) and len(calls) == 1, got
    assert got["final"] == f"It is sunny in {calls[0]}."  # the tool's output ends the run


def test_the_tgi_client_generates_and_streams(clients_python: str, real_gateway: GatewayProcess) -> None:
    got = run(clients_python, TGI, real_gateway.url)
    stream = got["stream"]
    assert isinstance(stream, list) and stream and isinstance(got["tokens"], int) and got["tokens"] > 0
    assert got["text"] and got["last"] == got["text"] == "".join(stream)  # greedy: the same text
    assert got["reason"] in ("length", "eos_token")
