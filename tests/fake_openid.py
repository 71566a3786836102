"""A small OpenID Connect provider standing in for huggingface.co in the Space tests: the
discovery document, an authorize page where the browser picks who signs in, and the token,
userinfo and key-set endpoints. It speaks the authorization-code flow as Hugging Face does for a
Space (`OPENID_PROVIDER_URL`, `OAUTH_CLIENT_ID`, `OAUTH_CLIENT_SECRET`, `OAUTH_SCOPES`), so
Gradio's real OAuth routes and authlib run against it unchanged; it checks the client's secret,
the redirect URI and the code, and signs an RS256 ID token that authlib verifies against /jwks.
"""
from __future__ import annotations

import base64
import hmac
import html
import secrets
import time
import urllib.parse
from dataclasses import dataclass

from fastapi import FastAPI, Form, Header, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from joserfc import jwt
from joserfc.jwk import RSAKey

KEY_ID = "fake-openid-1"
TOKEN_LIFETIME_S = 8 * 3600


@dataclass(frozen=True)
class Grant:
    username: str
    client_id: str
    redirect_uri: str
    nonce: str | None
    scope: str


class FakeOpenID:
    """The provider's state and its FastAPI app; `issuer` is set once it is served."""

    def __init__(self, client_id: str, client_secret: str, usernames: list[str]) -> None:
        self.client_id, self.client_secret = client_id, client_secret
        self.users = {name: {"sub": f"sub-{name}", "name": name.title(), "preferred_username": name,
                             "profile": f"https://huggingface.co/{name}",
                             "picture": f"https://huggingface.co/avatars/{name}.png"} for name in usernames}
        self.issuer = ""
        self.key = RSAKey.generate_key(2048, parameters={"kid": KEY_ID})
        self.grants: dict[str, Grant] = {}  # authorization code -> who, for which client
        self.tokens: dict[str, str] = {}  # access token -> username
        self.signed_in: list[str] = []  # every completed token exchange, in order
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/.well-known/openid-configuration")
        def discovery():
            return {"issuer": self.issuer, "authorization_endpoint": f"{self.issuer}/oauth/authorize",
                    "token_endpoint": f"{self.issuer}/oauth/token", "userinfo_endpoint": f"{self.issuer}/oauth/userinfo",
                    "jwks_uri": f"{self.issuer}/oauth/jwks", "response_types_supported": ["code"],
                    "subject_types_supported": ["public"], "id_token_signing_alg_values_supported": ["RS256"],
                    "scopes_supported": ["openid", "profile"],
                    "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post"]}

        @app.get("/favicon.ico")
        def favicon():
            return Response(status_code=204)

        @app.get("/oauth/jwks")
        def jwks():
            return {"keys": [self.key.as_dict(private=False)]}

        @app.get("/oauth/authorize", response_class=HTMLResponse)
        def authorize(request: Request, client_id: str, redirect_uri: str, response_type: str, state: str,
                      scope: str = "", nonce: str | None = None):
            if client_id != self.client_id or response_type != "code":
                raise HTTPException(400, f"unknown client {client_id!r} or response type {response_type!r}")
            query = dict(request.query_params)
            buttons = "".join(
                f'<a class="user" href="/oauth/approve?{html.escape(urllib.parse.urlencode({**query, "user": name}))}">'
                f"Sign in as {html.escape(name)}</a><br>" for name in self.users)
            return f"<html><body><h1>Fake Hugging Face sign-in</h1>{buttons}</body></html>"

        @app.get("/oauth/approve")
        def approve(client_id: str, redirect_uri: str, state: str, user: str, scope: str = "",
                    nonce: str | None = None):
            if client_id != self.client_id or user not in self.users:
                raise HTTPException(400, "unknown client or user")
            code = secrets.token_urlsafe(16)
            self.grants[code] = Grant(user, client_id, redirect_uri, nonce, scope)
            separator = "&" if "?" in redirect_uri else "?"
            return RedirectResponse(f"{redirect_uri}{separator}{urllib.parse.urlencode({'code': code, 'state': state})}",
                                    status_code=302)

        @app.post("/oauth/token")
        def token(grant_type: str = Form(...), code: str = Form(...), redirect_uri: str = Form(...),
                  authorization: str | None = Header(None), client_id: str | None = Form(None),
                  client_secret: str | None = Form(None)):
            given_id, given_secret = _client_credentials(authorization, client_id, client_secret)
            if not (given_id == self.client_id and hmac.compare_digest(given_secret, self.client_secret)):
                return JSONResponse({"error": "invalid_client"}, status_code=401)
            grant = self.grants.pop(code, None)
            if grant_type != "authorization_code" or grant is None or grant.redirect_uri != redirect_uri:
                return JSONResponse({"error": "invalid_grant"}, status_code=400)
            access_token = secrets.token_urlsafe(24)
            self.tokens[access_token] = grant.username
            self.signed_in.append(grant.username)
            now = int(time.time())
            claims = {**self.users[grant.username], "iss": self.issuer, "aud": self.client_id, "iat": now,
                      "exp": now + TOKEN_LIFETIME_S}
            if grant.nonce:
                claims["nonce"] = grant.nonce
            id_token = jwt.encode({"alg": "RS256", "kid": KEY_ID}, claims, self.key)
            return {"access_token": access_token, "token_type": "Bearer", "expires_in": TOKEN_LIFETIME_S,
                    "scope": grant.scope, "id_token": id_token}

        @app.get("/oauth/userinfo")
        def userinfo(authorization: str = Header("")):
            username = self.tokens.get(authorization.removeprefix("Bearer ").strip())
            if username is None:
                raise HTTPException(401, "invalid token")
            return self.users[username]

        return app


def _client_credentials(authorization: str | None, client_id: str | None,
                        client_secret: str | None) -> tuple[str, str]:
    """client_secret_basic (authlib's default) or client_secret_post."""
    if authorization and authorization.startswith("Basic "):
        decoded = base64.b64decode(authorization.removeprefix("Basic ")).decode()
        given_id, _, given_secret = decoded.partition(":")
        return urllib.parse.unquote(given_id), urllib.parse.unquote(given_secret)
    return client_id or "", client_secret or ""
