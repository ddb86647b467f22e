"""What the HTTP app needs from whatever serves its requests: one engine in this process
(:class:`~slimkv.server.async_engine.AsyncEngine`) or N engine replicas on Ray Serve
(:class:`slimkv.cluster.ingress.ClusterBackend`). The app, its error shapes, SSE and
authentication are the same for both."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from slimkv.engine.outputs import RequestOutput
from slimkv.model.protocol import Tokenizer
from slimkv.options.tool_formats import ToolCallFormat

if TYPE_CHECKING:
    from slimkv.server.async_engine import GenerateRequest

T = TypeVar("T")
REPLICA_HEADER = "X-Slimkv-Replica"  # names the cluster replica that served a response


class Backend(Protocol):
    model_name: str
    max_model_len: int
    tool_format: ToolCallFormat   # how the model writes tool calls (the reply parser's)

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; raises ``APIError`` on failure; closing
        the iterator early aborts the request (its KV blocks are freed). When the request
        ``wants_prompt``, ``request.prompt_info`` is set before its first output."""

    async def tokenizer_call(self, fn: Callable[[Tokenizer], T]) -> T:
        """``fn`` applied to the served model's tokenizer, where the backend keeps it."""

    async def cache_state(self, blocks: bool = True) -> dict[str, Any]:
        """The ``/v1/cache/state`` snapshot."""

    async def exposition(self) -> bytes:
        """Prometheus text for ``/metrics``."""
