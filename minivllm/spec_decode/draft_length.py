"""AdaptiveDraftLength: how many drafts to verify this step, chosen by measuring.

Verifying k drafts is free only while a step's cost does not grow with the tokens it
scores. With one request on a CPU the step is bound by reading the weights, and scoring
1 + k tokens costs little more than scoring one: drafts pay. With 32 requests the step is
already bound by arithmetic, every scored token costs about as much as a generated one,
and drafts the target rejects are pure loss: speculation makes the engine slower.

Where the break-even lies depends on the machine, the model, the attention path and how
often drafts are right, so the engine does not predict it: it measures. For each batch
size band (1, 2-3, 4-7, 8-15, ... requests decoding) and each candidate draft length (0,
about k/2, and k) it keeps a running average of what it got: output tokens per second
of model time, over the steps that only decoded (a prompt chunk in the step would be
counted as if it were output). Each step it uses the draft length with the best average
for the current band. A length never measured in a band is tried first, and every
``EXPLORE_EVERY``-th step in a band re-tries the length measured longest ago, so a
workload that changes (its acceptance, its context lengths) is noticed.

It is a small bandit: the price of knowing is an occasional step at the worse length.
And a short run is a weak measurement: a band visited for a dozen steps has measured
each length once or twice, and one noisy step can decide. That is why it is off by
default (``"adaptive": True`` turns it on).
Nothing in it is tuned to one machine; on a GPU, where verifying drafts is nearly free
at any batch size, the same code keeps k everywhere.

In vLLM: V1 does not adapt the draft length on its own. V0's
``speculative_disable_by_batch_size`` turned speculation off above a fixed batch size
that the operator had to choose; V1 never read it, and vLLM deleted it from
``SpeculativeConfig`` (PR 35060). minivllm's ``SpeculativeConfig`` keeps it as
``disable_by_batch_size`` (honoured here too), to compare the two rules.
"""

from __future__ import annotations

EXPLORE_EVERY = 16
"""In each band, one step in this many re-measures the length measured longest ago."""
SMOOTHING = 0.3
"""Weight of the newest step in a running average of tokens per second."""


def band(num_requests: int) -> int:
    """Batch sizes within a factor of two share measurements: 1, 2-3, 4-7, 8-15, ..."""
    return num_requests.bit_length()


class AdaptiveDraftLength:
    def __init__(self, num_speculative_tokens: int) -> None:
        k = num_speculative_tokens
        self.lengths = sorted({0, (k + 1) // 2, k}, reverse=True)
        """The candidate draft lengths, longest first (tried in this order)."""
        self.tokens_per_s: dict[tuple[int, int], float] = {}
        """(band, draft length) -> running average of output tokens per model second."""
        self.measured_at: dict[tuple[int, int], int] = {}
        """(band, draft length) -> the step count when it was last measured."""
        self.steps_in_band: dict[int, int] = {}
        self._pending: tuple[int, int] | None = None
        """(band, length) chosen for the step about to run."""

    def choose(self, num_requests: int) -> int:
        """The draft length for the next step, with ``num_requests`` requests decoding."""
        b = band(num_requests)
        count = self.steps_in_band[b] = self.steps_in_band.get(b, 0) + 1
        untried = [n for n in self.lengths if (b, n) not in self.tokens_per_s]
        if untried:
            length = untried[0]
        elif count % EXPLORE_EVERY == 0:
            length = min(self.lengths, key=lambda n: self.measured_at[(b, n)])
        else:
            length = max(self.lengths, key=lambda n: self.tokens_per_s[(b, n)])
        self._pending = (b, length)
        return length

    def observe_step(self, num_output_tokens: int, model_time: float, decode_only: bool) -> None:
        """What the step run with the last chosen length gave. Steps with a prompt chunk
        are not counted (their tokens are mostly prompt, not output)."""
        key, self._pending = self._pending, None
        if key is None or not decode_only or model_time <= 0:
            return
        rate = num_output_tokens / model_time
        old = self.tokens_per_s.get(key)
        self.tokens_per_s[key] = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate
        self.measured_at[key] = self.steps_in_band[key[0]]

    def best_lengths(self) -> dict[int, int]:
        """Band -> the draft length measured best there so far (for plots and tests)."""
        out = {}
        for b in sorted({b for b, _ in self.tokens_per_s}):
            measured = [n for n in self.lengths if (b, n) in self.tokens_per_s]
            out[b] = max(measured, key=lambda n: self.tokens_per_s[(b, n)])
        return out
