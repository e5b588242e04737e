"""Chat with a tool: the model sees the tool's schema (made from the function's type hints and docstring), may
answer with a <tool_call>; the call is run and its result sent back for the final answer.

    python examples/chat_tool_call.py --model Qwen/Qwen3-0.6B
"""
import argparse
import json
import re

import qwen_rt
from qwen_rt.tools import tool_schema


def get_temperature(city: str, unit: str = "celsius") -> float:
    """The current temperature in a city.

    Args:
        city: the city's name
        unit: "celsius" or "fahrenheit"
    """
    celsius = {"paris": 21.0, "tokyo": 26.5}.get(city.lower(), 15.0)  # a stand-in for a weather service
    return celsius if unit == "celsius" else celsius * 9 / 5 + 32


TOOLS = {"get_temperature": get_temperature}
# Qwen's chat template asks for calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def tool_calls(text: str) -> list[dict]:
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue
        if call.get("name") in TOOLS and isinstance(call.get("arguments"), dict):
            calls.append(call)
    return calls


p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--model", default="Qwen/Qwen3-0.6B", help="local folder or Hub id (with a chat template)")
p.add_argument("--device", default="auto")
p.add_argument("--max-tokens", type=int, default=256)
args = p.parse_args()

print("tool schema:", json.dumps(tool_schema(get_temperature)))
with qwen_rt.Generator(args.model, device=args.device) as gen:
    template = {"tools": list(TOOLS.values()), "enable_thinking": False}
    messages = [{"role": "user", "content": "How warm is it in Paris right now?"}]
    reply = gen.chat(messages, max_tokens=args.max_tokens, temperature=0, chat_template_kwargs=template)
    print("assistant:", reply.text)
    calls = tool_calls(reply.text)
    if not calls:
        print("(no tool call in the reply)")
    else:
        messages.append({"role": "assistant", "content": reply.text})
        for call in calls:
            result = TOOLS[call["name"]](**call["arguments"])
            print(f"tool {call['name']}({call['arguments']}) -> {result}")
            messages.append({"role": "tool", "content": json.dumps(result)})
        final = gen.chat(messages, max_tokens=args.max_tokens, temperature=0, chat_template_kwargs=template)
        print("assistant:", final.text)
