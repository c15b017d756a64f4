"""What every /v1 request passes before FastAPI reads its body: the API
key first (401 whatever the body holds, as OpenAI answers), for an admin
endpoint that the key is an admin's (403), then, for a JSON body, that its
text is Unicode text."""

from __future__ import annotations

import re

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from gateway.errors import bad_request
from gateway.serving import Gateway

# A UTF-16 surrogate on its own: JSON's \ud800 escape decodes to one, which
# is no Unicode text (it cannot be encoded, tokenized or echoed).
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate_at(body) -> str | None:
    """The path of the first string (or key) in a parsed JSON body that holds
    a lone surrogate. Iterative: a body may nest as deep as the JSON parser allows."""
    todo = [("body", body)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                return where
        elif isinstance(value, dict):
            for key, item in value.items():
                path = key if where == "body" else f"{where}.{key}"
                if _LONE_SURROGATE.search(key):
                    return path
                todo.append((path, item))
        elif isinstance(value, list):
            todo.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
    return None


async def _check_unicode(request: Request) -> None:
    try:
        body = await request.json()  # cached: FastAPI reads the same parse
    except Exception:
        return  # not JSON: FastAPI's own check answers 400
    where = _lone_surrogate_at(body)
    if where is not None:
        raise bad_request(f"{where}: not Unicode text (it holds a lone UTF-16 surrogate)", "invalid_value",
                          re.split(r"[.\[]", where)[0])


# The `endpoint` label of a REST route in the metrics: its handler's name, but for chat's,
# which shares the label the pipeline has always used.
_ENDPOINT_LABELS = {"chat_completions": "chat"}


def endpoint_label(request: Request) -> str:
    """The metrics' `endpoint` of a request: its route's, or "" for a path the API does not have."""
    route = request.scope.get("route")
    name = getattr(route, "name", "") or ""
    return _ENDPOINT_LABELS.get(name, name)


def authenticated_route(gateway: Gateway, admin: bool = False) -> type[APIRoute]:
    """`admin`: the routes also need an admin's key (Gateway.check_admin)."""

    class AuthenticatedRoute(APIRoute):
        """Authenticates before FastAPI reads the body, so a request without
        a valid key gets 401 whatever its body holds (and learns nothing of
        the API from the validation errors); an admin route refuses other
        keys (403) before the body too."""

        def get_route_handler(self):
            handler = super().get_route_handler()

            async def route(request: Request) -> Response:
                endpoint = endpoint_label(request)
                request.state.tenant = gateway.authenticate(request.headers.get("authorization"), endpoint)
                if admin:
                    gateway.check_admin(request.state.tenant, endpoint)
                if request.method == "POST":
                    await _check_unicode(request)
                return await handler(request)

            return route

    return AuthenticatedRoute
