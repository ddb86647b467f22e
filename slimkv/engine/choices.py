"""A request's ``n`` choices: one sequence each. The first runs at once; the others are
held until it has prefilled, then take the prompt's full blocks from the prefix cache, so
n choices cost one prefill (plus each one's last, partial block)."""

from __future__ import annotations

from slimkv.engine.sequence import Sequence


class Choices:
    def __init__(self) -> None:
        self.groups: dict[str, list[Sequence]] = {}  # a request's sequences, by request id
        self.held: dict[str, list[Sequence]] = {}    # choices 2..n, until choice 1 prefilled

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def add(self, group: list[Sequence]) -> None:
        self.groups[group[0].parent_id] = group
        if len(group) > 1:
            self.held[group[0].parent_id] = group[1:]

    def of(self, request_id: str) -> list[Sequence]:
        return list(self.groups.get(request_id, ()))

    def ready(self) -> list[Sequence]:
        """Held choices whose first choice has now prefilled (they leave the hold)."""
        done = [r for r, seqs in self.held.items()
                if self.groups[r][0].num_computed_tokens >= seqs[0].num_prompt_tokens]
        return [seq for r in done for seq in self.held.pop(r)]

    def finished(self, seq: Sequence) -> None:
        held = self.held.get(seq.parent_id, [])
        if seq in held:
            held.remove(seq)
        if all(s.is_finished for s in self.groups[seq.parent_id]):
            del self.groups[seq.parent_id]
            self.held.pop(seq.parent_id, None)
