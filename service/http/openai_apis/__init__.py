"""OpenAI's face of the server under ``/v1``: completions, chat completions, models, and what every ``/v1`` route
shares (:mod:`service.http.openai_apis.v1_common`, which the Responses and Messages APIs build on too)."""
