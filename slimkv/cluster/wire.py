"""What travels between the ingress and an engine replica (pickled by Ray): the request,
the routing hint the request router reads, and errors (``APIError`` itself does not
pickle: its constructor takes more than the message)."""

from __future__ import annotations

from dataclasses import dataclass, field

from slimkv.cluster.policy import RouteKeys
from slimkv.engine.sampling import SamplingParams
from slimkv.server.errors import APIError


@dataclass(frozen=True, slots=True)
class RouteHint:
    """First argument of every call to a replica; the request router reads it.
    ``target`` pins the call to one replica (the ingress's per-replica fan-out)."""

    keys: RouteKeys = field(default_factory=RouteKeys)
    target: str | None = None


@dataclass(frozen=True, slots=True)
class WireRequest:
    """A request tokenized by the ingress (the replica does not tokenize again)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    session_id: str | None = None
    prompt_logprobs: int | None = None  # the replica scores the prompt (slimkv.server.scoring)


@dataclass(frozen=True, slots=True)
class WireError:
    status: int
    message: str
    code: str
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, exc: APIError) -> WireError:
        return cls(exc.status, exc.message, exc.code, exc.param, dict(exc.headers))

    def error(self) -> APIError:
        return APIError(self.status, self.message, self.code, self.param, self.headers)
