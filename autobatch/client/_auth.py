"""The bearer token a client sends: trimmed, checked, never shown.

A token read from a Secret written with ``echo`` ends in a newline, which no HTTP header may
carry: httpx then fails with a message quoting the header, token and all. Every client
(:class:`~autobatch.client.AutobatchClient`, :func:`~autobatch.client.publish_profile`, and so
the CLI, ``autobatch plan --env`` and the node's publisher) builds its header here: the token is
trimmed, and one still holding a character a header cannot carry is a
:class:`~autobatch.errors.ConfigError` that does not show it.

Example::

    bearer_headers("s3cret\\n")    # {"Authorization": "Bearer s3cret"}
    bearer_headers(None)          # {}
"""

from __future__ import annotations

from autobatch.errors import ConfigError

__all__ = ["bearer_headers"]


def bearer_headers(token: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <token>"}`` for ``token`` trimmed of surrounding whitespace;
    ``{}`` for None or a blank token (no token sent).

    Raises:
        ConfigError: the trimmed token holds a control character or a non-ASCII one (the
            message says so, without the token).
    """
    text = (token or "").strip()
    if not text:
        return {}
    if not (text.isascii() and text.isprintable()):
        raise ConfigError(
            "the API token is malformed: it holds a control or non-ASCII character, which an "
            "HTTP header cannot carry; check AUTOBATCH_API_TOKEN or the token's file (a token "
            "is printable ASCII, e.g. from `openssl rand -hex 32`)"
        )
    return {"Authorization": f"Bearer {text}"}
