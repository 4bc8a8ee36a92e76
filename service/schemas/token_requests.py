"""``POST /tokenize`` and ``POST /detokenize`` bodies, in TGI's shape and vLLM's, and the answers they ask for.

TGI's clients send ``{"inputs": ...}`` and read each token's id and span; vLLM's (and the tools written against
it) send ``{"prompt": ...}`` or ``{"messages": [...]}`` and read ``{"tokens", "count", "max_model_len"}``. One
route takes both: the key sent says which answer is wanted. Messages are rendered by the chat template exactly as
``/v1/chat/completions`` renders them (:func:`~service.schemas.openai_requests.render_chat`), so the count is the
prompt's real size.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from service.errors import RequestValidationError
from service.schemas.openai_requests import ChatMessage, render_chat
from service.schemas.validation import refuse_unknown, request_model_config


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: ``inputs`` (TGI), or ``prompt`` or ``messages`` (vLLM); exactly one of them."""

    model_config = request_model_config(
        {"inputs": "Hello world"}, {"prompt": "Hello world"}, {"messages": [{"role": "user", "content": "Hi"}]}
    )

    inputs: str | None = Field(None, description="TGI's shape: answered with each token's id, text and span.")
    prompt: str | None = Field(None, description="vLLM's shape: answered with {tokens, count, max_model_len}.")
    messages: list[ChatMessage] | None = Field(None, description="vLLM's shape: the chat prompt's tokens.")
    add_special_tokens: bool | None = Field(
        None, description="Add the tokenizer's special tokens (default: true for text, false for messages)."
    )
    model: str | None = Field(None, description="Accepted as vLLM's clients send it; the served model answers.")


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape): token ids to text."""

    model_config = request_model_config({"tokens": [1, 2, 3]})

    tokens: list[int]
    model: str | None = None


def tokenize_shape(body: TokenizeRequest) -> str:
    """Which of ``inputs``, ``prompt`` and ``messages`` the body sets (exactly one must be)."""
    refuse_unknown(body)
    given = [k for k in ("inputs", "prompt", "messages") if getattr(body, k) is not None]
    if len(given) != 1:
        raise RequestValidationError(
            'Send exactly one of "inputs" (TGI\'s shape), "prompt" or "messages" (vLLM\'s shape)'
            + (f"; got {', '.join(given)}." if given else ".")
        )
    if given[0] != "messages" and not getattr(body, given[0]):
        raise RequestValidationError(f"{given[0]} is empty; send the text to tokenize.")
    if given[0] == "messages" and not body.messages:
        raise RequestValidationError("messages is empty; send at least one message.")
    return given[0]


def vllm_tokens(tokenizer: Any, body: TokenizeRequest, max_model_len: int) -> dict[str, Any]:
    """vLLM's ``/tokenize`` answer for ``prompt`` or ``messages``."""
    if body.messages is not None:
        for i, message in enumerate(body.messages):
            refuse_unknown(message, f"messages[{i}].")
        text = render_chat(tokenizer, body.messages)
        ids = tokenizer(text, add_special_tokens=bool(body.add_special_tokens))["input_ids"]
    else:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tokenizer(body.prompt, add_special_tokens=add)["input_ids"]
    tokens = [int(t) for t in ids]
    return {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len}


def detokenized(tokenizer: Any, vocab_size: int, body: DetokenizeRequest) -> dict[str, str]:
    refuse_unknown(body)
    bad = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestValidationError(f"tokens holds {bad}, outside the vocabulary (0..{vocab_size - 1}).")
    return {"prompt": tokenizer.decode(body.tokens)}
