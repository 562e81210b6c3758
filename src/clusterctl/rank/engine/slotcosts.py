"""What a slot's prompt work may cost while rows decode, pure of MLX: rank 0's measured costs and the budget it
sends with each slot's control (overlap.py ``Control.budget``; ``scheduler.prefill_plan`` spends it).

A budget in time, not in tokens: what a prompt token costs against a decode step differs by 10-50x between this
CPU (about one step a token on the ~100M bench model: bench/README.md) and Apple silicon, so a fixed token budget
either stalls the streams for seconds here or starves the prompt there (vLLM's token budget, in seconds)."""

from __future__ import annotations

from clusterctl.rank.engine.scheduler import DECODE_BUDGET

STALL_STEPS = 2.0  # while rows decode, a slot's prompt work may cost this many of their decode steps (expected time)


class SlotCosts:
    """Rank 0's moving averages of a decode step (of a slot with no prompt work) and of a prompt token (of a pass
    under a budget: at the small chunks a budget cuts, their fixed cost included; a whole prompt's large chunks,
    spread over the stages while nothing decodes, would promise a cheaper token), and from them ``budget``. Rank 0's
    wall times hold its waits for the stages before it, as the streams' gaps do. A chunk of n tokens that takes
    t(n) = a + c·n settles where t(n) = ``stall`` steps (each budget is what the last cost allows: n' = stall·step·n
    / t(n), which converges while a < stall·step, else stays at 1 token). Rank 0 alone decides: the budget travels
    in the slot's control, so every rank cuts the same chunks in the same order."""

    def __init__(self, stall: float = STALL_STEPS, cap: int = DECODE_BUDGET, weight: float = 0.3):
        self.stall, self.cap, self.weight = stall, cap, weight  # weight: the newest observation's
        self.step_s: float | None = None
        self.token_s: float | None = None

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    def stepped(self, seconds: float) -> None:
        """A decode step of a slot that processed no prompt took ``seconds``."""
        if seconds > 0:
            self.step_s = self._mix(self.step_s, seconds)

    def prompted(self, tokens: int, seconds: float) -> None:
        """A slot processed ``tokens`` (rows x columns) of prompt under a budget in ``seconds``."""
        if tokens > 0 and seconds > 0:
            self.token_s = self._mix(self.token_s, seconds / tokens)

    def budget(self) -> int:
        """The prompt tokens the next slot may process while rows decode: what fits ``stall`` steps, from 1 to
        ``cap``. Until both are measured a prompt token is taken to cost a step (this CPU's case; where tokens
        are cheaper the budget grows from there, slot after slot)."""
        if self.step_s is None or self.token_s is None:
            return max(1, min(self.cap, int(self.stall)))
        return max(1, min(self.cap, int(self.stall * self.step_s / self.token_s)))
