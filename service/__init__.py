"""The inference server: FastAPI app (TGI + OpenAI routes, /plan), the batching engine and the ``loadmaster`` CLI.

``create_app(settings)`` lives in :mod:`service.http.app`; the console script is :func:`service.cli.main.main`.
"""
