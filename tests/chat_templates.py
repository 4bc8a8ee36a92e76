"""Chat templates shaped like the families' published ones, for the tool-calling and reasoning tests.

Each keeps what the server reads from a real one (how tools reach the prompt, how calls, tool results and thinking
are written) and drops the prose; they render with the tiny models' tokenizer, whose ``<s>``/``</s>`` stand in for
each family's own begin and end tokens (so the model's end-of-sequence token ends a turn).
"""

from __future__ import annotations

#: Qwen2.5 (Hermes-style): tools listed in <tools></tools> in the system turn; calls as <tool_call> JSON blocks;
#: tool results as <tool_response> in a user turn.
QWEN25 = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- set tool_call = tool_call.function %}
{{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' + (tool_call.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

#: Qwen3: Qwen2.5's tools plus thinking: <think>...</think> before the answer; ``enable_thinking=false`` closes an
#: empty block in the generation prompt; earlier turns keep only their answer.
QWEN3 = QWEN25.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}",
).replace(
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}",
    "{%- set content = message.content or '' %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if content %}{{- '\\n' + content }}{%- endif %}",
)

#: Llama 3.1: "Environment: ipython" system header; tools as JSON in the last user turn; a call is the whole
#: assistant turn, {"name": ..., "parameters": {...}}; tool results in an ipython turn.
LLAMA31 = r"""
{{- bos_token }}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}{{- 'Environment: ipython\n' }}{%- endif %}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}
{{- '<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
{%- if tools and loop.last %}
{{- 'Given the following functions, respond with a JSON for a function call with its proper arguments.\n\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\n\n' }}
{%- for t in tools %}{{- t | tojson + '\n\n' }}{%- endfor %}
{%- endif %}
{{- message.content + '<|eot_id|>' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + tool_call.name + '", "parameters": ' }}
{{- tool_call.arguments | tojson + '}<|eot_id|>' }}
{%- elif message.role == 'assistant' %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- elif message.role in ['tool', 'ipython'] %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

#: Mistral (v3 tokenizer): [AVAILABLE_TOOLS] before the last user turn; calls as [TOOL_CALLS] and a JSON array;
#: results as [TOOL_RESULTS].
MISTRAL = r"""
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{{- '[INST] ' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '[TOOL_CALLS] [' }}
{%- for call in message.tool_calls %}
{{- '{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + ', "id": "' + call.id + '"}' }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- elif message.role == 'assistant' %}
{{- ' ' + message.content + eos_token }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS] {"content": ' + (message.content | tojson) + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}
"""

#: gpt-oss (harmony): a system message with the reasoning effort, tools as a TypeScript-like ``functions``
#: namespace in the developer message, past calls as ``<|start|>assistant to=functions.NAME<|channel|>commentary
#: json<|message|>{args}<|call|>``, their results from ``functions.NAME to=assistant``, past reasoning on the
#: analysis channel, answers on the final channel; the generation prompt is ``<|start|>assistant``. Its markers are
#: special tokens of the tiny harmony model's tokenizer (:func:`tests.models.harmony_model_dir`).
GPT_OSS = r"""
{%- set ns = namespace(last_call='') %}
{{- '<|start|>system<|message|>You are a tiny test model.\nReasoning: ' + (reasoning_effort or 'medium') + '\n\n' }}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}
{%- if tools %}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}{%- endif %}
{{- '<|end|>' }}
{%- if tools or messages[0].role in ['system', 'developer'] %}
{{- '<|start|>developer<|message|>' }}
{%- if messages[0].role in ['system', 'developer'] %}{{- '# Instructions\n\n' + messages[0].content + '\n\n' }}{%- endif %}
{%- if tools %}
{{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' }}
{%- for tool in tools %}
{{- '// ' + (tool.function.description or '') + '\ntype ' + tool.function.name + ' = (_: ' }}
{{- tool.function.parameters | tojson }}{{- ') => any;\n\n' }}
{%- endfor %}
{{- '} // namespace functions' }}
{%- endif %}
{{- '<|end|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
{%- elif message.role == 'assistant' %}
{%- if message.reasoning_content %}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.reasoning_content + '<|end|>' }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set ns.last_call = call.function.name %}
{{- '<|start|>assistant to=functions.' + call.function.name + '<|channel|>commentary json<|message|>' }}
{{- call.function.arguments | tojson }}{{- '<|call|>' }}
{%- endfor %}
{%- if message.content and not message.tool_calls %}
{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}
{%- endif %}
{%- elif message.role == 'tool' %}
{{- '<|start|>functions.' + ns.last_call + ' to=assistant<|channel|>commentary<|message|>' + message.content }}
{{- '<|end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""

#: The markers harmony writes, each one token in gpt-oss's tokenizer.
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]

TEMPLATES = {"qwen25": QWEN25, "qwen3": QWEN3, "llama31": LLAMA31, "mistral": MISTRAL}
