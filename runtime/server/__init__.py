"""`ft-run serve`: OpenAI- and Anthropic-compatible HTTP API over the scheduler, and a control API.

fastapi and uvicorn are imported only by the modules that build and run the app, so the rest
of the runtime works without them.
"""
