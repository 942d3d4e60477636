"""What this server assumes of a2a-sdk beyond its public interface, checked so that an a2a-sdk
that changed it fails here, loudly, rather than somewhere in a task.

One assumption only: ``RequestContext`` keeps its call context in ``_call_context`` and reads
it only from there (``callmeta._DeferredRequestContext`` makes it on first read, so a task
parked in ``execute()`` does not hold a pydantic model it may never read).
"""

from __future__ import annotations

import inspect
import re

from a2a.server.agent_execution import RequestContext

from a2a_grpc_server._internal.model.caller import Caller, request_context
from a2a_grpc_server._internal.rpc.auth import Principal


def test_request_context_reads_its_call_context_only_from_the_private_attribute() -> None:
    source = inspect.getsource(RequestContext)
    uses = re.findall(r"\w*call_context\w*", source)
    assert set(uses) <= {"call_context", "_call_context", "ServerCallContext"}, (
        f"a2a-sdk's RequestContext changed how it keeps its call context ({set(uses)}): "
        "review callmeta._DeferredRequestContext before using this a2a-sdk"
    )
    assert "self._call_context = call_context" in source, (
        "a2a-sdk's RequestContext no longer stores its call context in _call_context: "
        "review callmeta._DeferredRequestContext before using this a2a-sdk"
    )


def test_the_deferred_call_context_is_what_the_executor_reads() -> None:
    call = Caller((("a2a-extensions", "urn:x"), ("x-h", "v")), 5.0, Principal("alice"), tenant="t1")
    context = request_context(call, task_id="t", context_id="c")
    assert call._context is None, "not made before it is read"
    assert context.call_context is call.server_context()
    assert context.tenant == "t1"
    assert context.requested_extensions == {"urn:x"}
    assert context.call_context.user.user_name == "alice"
    assert context.call_context.state["headers"]["x-h"] == "v"
