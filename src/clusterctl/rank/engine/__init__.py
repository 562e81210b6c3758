"""What every rank runs: the step loop and its meeting schedule (steploop.py, schedule.py; its decisions, pure of
MLX: scheduler.py), lockstep batches (batch.py) and overlapped micro-batches (overlap.py, runhooks.py, prefill.py),
the group's control collectives (group.py), the model's layers and forward pass (loading.py, adapter.py, stage.py,
offload.py), sampling (sampling.py, rollout.py, logprobs.py, promptlogprobs.py; the grammars it applies: ../grammar/), the prompt cache (promptcache.py), the quantized KV cache (kvquant.py) and the requests queued
for it (requestqueue.py). docs/rank.md."""
