"""The request checks of every state-changing POST (replay, purge, reconcile,
approve, reject), and who acts.

Authentication is Flower's own: the pages subclass Flower's ``BaseHandler``
and the API its ``BaseApiHandler``, and every method is ``@web.authenticated``.
So ``--basic-auth`` and ``--auth`` (OAuth) protect the page and its actions,
and the API answers only when authentication is configured or
``FLOWER_UNAUTHENTICATED_API`` is set, as Flower's own API does.

Cross-site request forgery is NOT left to Flower: a browser that has cached
the operator's basic-auth credentials sends them with a form that another
site submits, and Flower's ``check_xsrf_cookie`` does not stop it. Flower
2.0 never turns tornado's ``xsrf_cookies`` setting on, so tornado checks no
POST at all; Flower 2.2 turns it on but overrides ``check_xsrf_cookie`` to
check no token under ``--basic-auth`` (only the ``Sec-Fetch-Site`` and
``Origin`` headers) and nothing at all without authentication. So the
replay, purge, approve and reject handlers check for themselves, whatever
Flower's settings, after authentication and before anything is looked up or
changed (the rules below, for the approvals' URLs as for the dead letters'):

- every replay and purge POST (page and API) from a browser must come from
  Flower's own origin: ``Sec-Fetch-Site`` must be ``same-origin`` (or
  ``none``), or, when a browser sends no ``Sec-Fetch-Site``, its ``Origin``
  must name the request's ``Host``; otherwise 403. (Behind a reverse proxy,
  pass the original ``Host`` on.) Clients that send neither header are not
  browsers, and are not what forgery abuses;
- the page's forms (``POST /dead-letters/<task_id>/(replay|purge)``) must
  carry a valid ``_xsrf`` token: tornado's own ``check_xsrf_cookie`` (the
  ``_xsrf`` form field, or an ``X-XSRFToken`` header, must match the ``_xsrf``
  cookie set when the page is rendered; the forms carry the field through
  ``xsrf_form_html()``); otherwise 403;
- the API's replay and purge take a JSON body only, sent with
  ``Content-Type: application/json`` (an empty body means the defaults),
  which an HTML form cannot send and a cross-origin script can send only
  after a CORS preflight: any other content type (form-encoded, multipart,
  ``text/plain``, none) is refused with 415, and a body that is not a JSON
  object with 400.

Who acted (the authenticated user, else ``anonymous``, and the client address)
is written in the audit event of every replay, purge, approval and rejection.
"""

from __future__ import annotations

import base64
import json
from typing import Any, cast
from urllib.parse import urlsplit

from tornado import web

#: The only media type the API's replay and purge accept (an HTML form cannot send it).
JSON_MEDIA_TYPE = "application/json"


class RequestChecks:
    """Who acts, and the checks of a state-changing POST, for a Flower handler."""

    application: Any
    request: Any
    current_user: Any

    def actor(self) -> str:
        """Who acts, for the audit: the authenticated user (else ``anonymous``) and
        the client's address, e.g. ``ops (flower 10.0.0.7)``."""
        user = self.current_user
        name = user if isinstance(user, str) and user else ""
        if not name and self.application.options.basic_auth:
            name = basic_auth_user(self.request.headers.get("Authorization", ""))
        return f"{name or 'anonymous'} (flower {self.request.remote_ip})"

    def refuse_cross_origin(self) -> None:
        """403 for a request that a browser says comes from another origin."""
        error = cross_origin_error(self.request.headers)
        if error is not None:
            raise web.HTTPError(403, error)

    def check_xsrf_token(self) -> None:
        """Tornado's own ``_xsrf`` check (403 when the token is missing or wrong).

        Called explicitly, since tornado calls ``check_xsrf_cookie`` only when
        the ``xsrf_cookies`` setting is on (Flower 2.0 leaves it off), and
        tornado's method, since Flower 2.2's override checks no token under
        ``--basic-auth``.
        """
        web.RequestHandler.check_xsrf_cookie(cast(web.RequestHandler, self))

    def json_body(self) -> dict[str, Any]:
        """The request's JSON object ({} for an empty body); 415 unless it is sent as JSON.

        Only ``Content-Type: application/json`` is accepted: an HTML form can
        send ``application/x-www-form-urlencoded``, ``multipart/form-data`` and
        ``text/plain`` (which can carry a body that looks like JSON) to any
        site, never ``application/json``.
        """
        content_type = self.request.headers.get("Content-Type", "")
        if content_type.split(";", 1)[0].strip().lower() != JSON_MEDIA_TYPE:
            raise web.HTTPError(
                415, f"Send a JSON object with Content-Type: {JSON_MEDIA_TYPE} "
                     f"(got {content_type or 'no Content-Type'})")
        raw = self.request.body
        if not raw.strip():
            return {}
        try:
            data = json.loads(raw)
        except ValueError as exc:  # UnicodeDecodeError included
            raise web.HTTPError(400, f"invalid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise web.HTTPError(400, "the body must be a JSON object")
        return data


def cross_origin_error(headers: Any) -> str | None:
    """Why a state-changing request with these headers is refused as cross-origin, or None.

    Browsers send ``Sec-Fetch-Site`` (to HTTPS and loopback addresses): only
    ``same-origin`` and ``none`` (the user's own navigation) are accepted.
    Without it, a browser still sends ``Origin`` with a POST, which must then
    name the ``Host`` the request was sent to. A request with neither header
    does not come from a browser: forgery needs a browser, so it passes (to
    the token and content-type rules).
    """
    site = headers.get("Sec-Fetch-Site")
    origin = headers.get("Origin")
    if site is not None:
        if site.strip().lower() in ("same-origin", "none"):
            return None
        return f"Cross-origin request refused (Sec-Fetch-Site: {site}, Origin: {origin})"
    if origin is None:
        return None
    host = (headers.get("Host") or "").strip().lower()
    if host and urlsplit(origin.strip()).netloc.lower() == host:
        return None
    return f"Cross-origin request refused (Origin: {origin})"


def basic_auth_user(header: str) -> str:
    """The user name of a basic ``Authorization`` header ("" for any other)."""
    try:
        scheme, credentials = header.split(None, 1)
        if scheme.lower() != "basic":
            return ""
        return base64.b64decode(credentials).decode("utf-8", "replace").split(":", 1)[0]
    except (ValueError, UnicodeError):
        return ""
