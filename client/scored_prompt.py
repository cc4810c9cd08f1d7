"""A prompt's logprobs as they arrive from the scheduler (`SamplingParams.prompt_logprobs`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.common.messages import PromptLogprobs, TokenLogprobs


@dataclass
class ScoredPrompt:
    """The logprob of each prompt token given the ones before it, its rank and the top k at its position:
    `logprobs[t - 1]` and `ranks[t - 1]` are token t's (token 0 has none, as it follows nothing)."""

    logprobs: list[TokenLogprobs] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    def add(self, chunk: PromptLogprobs) -> None:
        """Appends the next positions. The scheduler sends each position once, in order; a chunk that does
        not start at the next position (a scheduler of another version, say) is refused."""
        if chunk.start != len(self.logprobs) + 1:
            raise ValueError(f"prompt logprobs from token {chunk.start}, expected {len(self.logprobs) + 1}")
        self.logprobs.extend(chunk.logprobs)
        self.ranks.extend(chunk.ranks)

    def __len__(self) -> int:
        return len(self.logprobs)
