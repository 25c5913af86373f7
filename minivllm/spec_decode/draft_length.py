"""AdaptiveDraftLength: how many drafts to verify this step, from the engine's own measurements.

Verifying k drafts is free only while a step's cost does not grow with the tokens it
scores. With one request on a CPU the step is bound by reading the weights, and scoring
1 + k tokens costs little more than scoring one: drafts pay. With 32 requests the step is
already bound by arithmetic, each scored token costs about as much as a generated one,
and drafts the target rejects are pure loss: speculation makes the engine slower.

So before each step the engine compares, for every draft length ``k`` from 0 to
``num_speculative_tokens``, the tokens it expects against the time it expects:

* **expected tokens** = one per decoding request (the target's own token) plus, for
  each draft position ``j < k``, the measured chance that position ``j`` is accepted
  (``p_j``: accepted / proposed at that position, over recent drafts);
* **expected time** = ``a + b * tokens scored``, a line fitted by least squares to the
  recent steps' measured model time against the tokens they scored.

It picks the ``k`` with the most tokens per second and cuts every request's drafts to
it (0: no speculation this step). Nothing here is tuned to one machine: on a GPU the
fitted ``b`` is small and long drafts win; on a 2-core CPU under load ``b`` dominates
and drafts are turned off. Until the line can be fitted (too few steps, or all of one
size) it verifies the full ``k``, which is also how it measures.

Deliberately simple: one ``k`` for the whole batch, a line rather than the true cost
curve, and the prefill chunks that will share the step are ignored (they add the same
cost with or without drafts).

In vLLM: nothing adapts the draft length on its own in V1; V0's
``speculative_disable_by_batch_size`` (kept in ``SpeculativeConfig`` as
``disable_by_batch_size``, honoured here too) turns speculation off above a fixed
batch size that the operator has to choose.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

WINDOW = 64
"""Recent steps the cost line is fitted to."""
MIN_STEPS = 8
"""Fewer measured steps than this: no fit yet, verify the full k."""
DECAY = 0.998
"""Each verification fades the older acceptance counts by this factor (a half-life of
about 350 drafts), so the estimate follows a workload that changes."""


class AdaptiveDraftLength:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens
        self.steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        """(tokens scored, model seconds) of the most recent steps."""
        self.proposed = [0.0] * num_speculative_tokens
        self.accepted = [0.0] * num_speculative_tokens

    # -- measurements in ------------------------------------------------------------
    def observe_step(self, num_tokens: int, model_time: float) -> None:
        self.steps.append((num_tokens, model_time))

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification: positions below ``num_draft_tokens`` were proposed,
        the first ``num_accepted_tokens`` of them accepted."""
        for j in range(self.k):
            self.proposed[j] *= DECAY
            self.accepted[j] *= DECAY
        for j in range(num_draft_tokens):
            self.proposed[j] += 1
        for j in range(num_accepted_tokens):
            self.accepted[j] += 1

    # -- the estimates --------------------------------------------------------------
    def cost_line(self) -> tuple[float, float] | None:
        """(a, b): model seconds of a step ≈ a + b * tokens scored; None until fitted."""
        if len(self.steps) < MIN_STEPS or len({n for n, _ in self.steps}) < 2:
            return None
        b, a = statistics.linear_regression([n for n, _ in self.steps], [t for _, t in self.steps])
        return max(a, 0.0), max(b, 0.0)

    def acceptance_by_position(self) -> list[float]:
        """p_j, the chance a draft at position j is accepted; a position never proposed
        yet gets 0.5 (an even bet, so that it is tried)."""
        return [(a + 0.5) / (p + 1.0) for a, p in zip(self.accepted, self.proposed)]

    def choose(self, draft_lengths: Sequence[int]) -> int:
        """The draft length for this step, given how many drafts each decoding request
        has (0 for a request with none). Ties go to the shorter length."""
        line = self.cost_line()
        if line is None:
            return self.k
        a, b = line
        if b == 0:  # a step costs the same whatever it scores: verify all
            return self.k
        p = self.acceptance_by_position()
        best_k, best_rate = 0, 0.0
        for k in range(self.k + 1):
            scored = sum(1 + min(k, n) for n in draft_lengths)
            expected = sum(1 + sum(p[: min(k, n)]) for n in draft_lengths)
            rate = expected / (a + b * scored)
            if rate > best_rate * (1 + 1e-9):
                best_k, best_rate = k, rate
        return best_k
