"""``response.append``: continue a chain over WebSocket with only the new input items.

A client that sent a request and got its response may send just what it appends::

    {"type": "response.append", "previous_response_id": "resp_...", "input": [...new items...]}

The request it stands for is the previous response's request with the same non-input
fields (model, instructions, tools, tool_choice, sampling, text format,
``prompt_cache_key``, ...; :meth:`ResponsesRequest.non_input_fields`), the new ``input``
and ``previous_response_id``; ``store`` and ``metadata`` may be given again (they are not
inherited). Changing any other field needs a full ``response.create``. A previous response
that is missing, expired, another tenant's, or another connection's ``store: false`` one
is a ``previous_response_not_found`` error: the client resends in full.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from loopstack.api.errors import APIError

if TYPE_CHECKING:
    from loopstack.api.auth import Principal
    from loopstack.api.store import ResponseStore, StoredResponse

__all__ = ["APPEND_FIELDS", "append_request_fields"]

APPEND_FIELDS = ("type", "previous_response_id", "input", "store", "metadata")


def append_request_fields(message: Mapping[str, Any], store: ResponseStore, principal: Principal,
                          local: Mapping[str, StoredResponse] | None) -> dict[str, Any]:
    """The request fields a ``response.append`` message stands for.

    Raises:
        APIError: an unknown field (``invalid_message``), no ``previous_response_id``, or one
            this principal cannot see (``previous_response_not_found``).
    """
    unknown = sorted(set(message) - set(APPEND_FIELDS))
    if unknown:
        raise APIError(f"response.append takes only {', '.join(APPEND_FIELDS)}; got {', '.join(unknown)} "
                       "(send response.create to change other fields)", param=unknown[0], code="invalid_message")
    previous = message.get("previous_response_id")
    if not isinstance(previous, str) or not previous:
        raise APIError("response.append needs a previous_response_id", param="previous_response_id",
                       code="invalid_message")
    record = local.get(previous) if local is not None and previous in local else None
    if record is None:
        record = store.get(previous, tenant=principal.tenant)
    if record is None:
        raise APIError(f"Previous response with id '{previous}' not found.", param="previous_response_id",
                       code="previous_response_not_found")
    fields = {**record.request, "input": message.get("input", []), "previous_response_id": previous}
    for name in ("store", "metadata"):
        if name in message:
            fields[name] = message[name]
    return fields
