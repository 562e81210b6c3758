"""Rank 0's OpenAI-compatible HTTP API: its state and admission (service.py, phase.py), the routes and HTTP
plumbing (routes.py, handler.py), the request models (requests.py, messages.py), the answers' types and ApiError
(wire.py), what the model and the plan allow a request (openai.py) and its preparation
off the step loop (admission.py), the answers (respond.py), tool calls and reasoning (tools.py, splitter.py)."""
