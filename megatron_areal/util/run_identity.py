"""Which servers belong to a run: a per-run nonce, and a challenge only the run's own servers can answer.

A port that answers is not proof that the process behind it is the one the run started: two jobs on one
machine can plan the same ports, and a server that failed to bind leaves its port to whoever holds it. So
the launcher draws a random nonce per run and hands it to its servers and trainer in the environment
(never argv, never a file). ``GET /run_identity?challenge=C`` answers ``{"proof": HMAC-SHA256(nonce, C)}``;
the registry (``run/registry.py``) and the trainer's re-admission of a restarted server
(``rollout/client.py``) send a fresh random challenge and admit the server only when the proof matches.
The route needs no API key, and it is asked before any request that carries the key: a process that is
not the run's learns nothing from it (the nonce never leaves the run's processes), and gets no key either.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import urllib.error
import urllib.parse
import urllib.request

NONCE_ENV = "MEGATRON_AREAL_RUN_NONCE"
ROUTE = "/run_identity"
MAX_CHALLENGE = 128  # characters: a challenge is 32 hex digits; anything longer is refused


def new_nonce() -> str:
    return secrets.token_hex(16)


def run_nonce() -> str | None:
    """This process's run nonce (set by the launcher), or None outside a launched run."""
    return os.environ.get(NONCE_ENV) or None


def proof(nonce: str, challenge: str) -> str:
    return hmac.new(nonce.encode(), challenge.encode(), hashlib.sha256).hexdigest()


def answer(challenge: str, nonce: str | None = None) -> tuple[int, dict[str, str]]:
    """(HTTP status, JSON body) of ``/run_identity`` on a server: 404 when it was started without a nonce."""
    nonce = nonce if nonce is not None else run_nonce()
    if not nonce:
        return 404, {"error": "this server was started without a run nonce"}
    if not challenge or len(challenge) > MAX_CHALLENGE:
        return 400, {"error": f"challenge must be 1..{MAX_CHALLENGE} characters"}
    return 200, {"proof": proof(nonce, challenge)}


def check_reply(nonce: str, challenge: str, status: int, body: bytes) -> str | None:
    """None when a server's reply to ``challenge`` proves it holds ``nonce``; else why not."""
    if status != 200:
        return f"answers {ROUTE} with HTTP {status}"
    try:
        given = json.loads(body)["proof"]
    except (ValueError, KeyError, TypeError):
        return f"answers {ROUTE} without a proof"
    if not isinstance(given, str) or not hmac.compare_digest(given, proof(nonce, challenge)):
        return "answers with another run's proof"
    return None


def identity_problem(url: str, nonce: str, timeout_s: float = 5.0) -> str | None:
    """None when the server at ``url`` proves it is this run's; else the reason, naming the url."""
    challenge = secrets.token_hex(16)
    query = urllib.parse.urlencode({"challenge": challenge})
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}{ROUTE}?{query}", timeout=timeout_s) as r:
            status, body = r.status, r.read(4096)
    except urllib.error.HTTPError as e:
        status, body = e.code, b""
    except (urllib.error.URLError, OSError) as e:
        return f"{url} does not answer ({getattr(e, 'reason', e)})"
    problem = check_reply(nonce, challenge, status, body)
    return None if problem is None else f"{url} {problem}: not a server this run started"
