"""The APIs agents speak beside chat completions: Anthropic's Messages and OpenAI's Responses, both read out of the
chat machinery (one rendering, one tool grammar, one output reader) into their own typed parts."""
