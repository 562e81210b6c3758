"""Structured output at the rank: a request's grammar (OpenAI's ``response_format``, a forced tool call) as a token
mask at the sampling rank (mask.py, on llguidance), compiled off the step loop within a CPU budget (compiler.py:
at admission on rank 0, on announcement on the others), and why one is refused (refusal.py). The engine's
samplers apply the masks (engine/sampling.py); the way out under max_tokens is engine/rollout.py. docs/api.md."""
