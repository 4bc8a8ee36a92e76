"""The HTTP face: the FastAPI app, TGI, OpenAI, /plan and /ui routes, auth, request limits, metrics, access log."""
