"""The two function tools the tool-calling tests offer, defined once; each API's tests wrap them in that API's shape
(OpenAI chat: ``{"type": "function", "function": ...}``, Responses: flat, Anthropic: ``input_schema``)."""

from __future__ import annotations

from typing import Any

WEATHER_TOOL: dict[str, Any] = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME_TOOL: dict[str, Any] = {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]},
}
