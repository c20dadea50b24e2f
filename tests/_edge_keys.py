"""Signing keys made in the test (RSA, EC P-256, Ed25519), their JWKS, tokens signed with
them, the usual forgeries, and a small JWKS server on trio that counts its fetches."""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import jwt
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

__all__ = [
    "AUDIENCE",
    "ISSUER",
    "JwksServer",
    "Signer",
    "claims",
    "forged_hs256",
    "jwks",
    "serving_jwks",
    "unsigned",
]

ISSUER = "https://id.example"
AUDIENCE = "orders"


@dataclass
class Signer:
    """A private key, its algorithm and its kid."""

    alg: str
    kid: str
    private: Any

    @classmethod
    def make(cls, alg: str, kid: str) -> Signer:
        if alg == "RS256":
            private: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        elif alg == "ES256":
            private = ec.generate_private_key(ec.SECP256R1())
        elif alg == "EdDSA":
            private = ed25519.Ed25519PrivateKey.generate()
        else:
            raise ValueError(alg)
        return cls(alg, kid, private)

    def jwk(self) -> dict[str, Any]:
        public = self.private.public_key()
        algorithm: Any = {"RS256": RSAAlgorithm, "ES256": ECAlgorithm, "EdDSA": OKPAlgorithm}[
            self.alg
        ]
        found: dict[str, Any] = algorithm.to_jwk(public, as_dict=True)
        return {**found, "kid": self.kid, "use": "sig"}

    def public_pem(self) -> bytes:
        key: bytes = self.private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return key

    def sign(self, payload: dict[str, Any], **header: Any) -> str:
        return jwt.encode(
            payload, self.private, algorithm=self.alg, headers={"kid": self.kid, **header}
        )


def jwks(*signers: Signer) -> dict[str, Any]:
    return {"keys": [s.jwk() for s in signers]}


def claims(**more: Any) -> dict[str, Any]:
    now = int(time.time())
    return {
        "sub": "alice",
        "iss": ISSUER,
        "aud": AUDIENCE,
        "iat": now,
        "nbf": now,
        "exp": now + 600,
        "tenant": "acme",
        "scope": "orders:read",
        **more,
    }


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _segments(header: dict[str, Any], payload: dict[str, Any]) -> str:
    return _b64(json.dumps(header).encode()) + "." + _b64(json.dumps(payload).encode())


def unsigned(payload: dict[str, Any], kid: str) -> str:
    """``alg: none``: no signature at all."""
    return _segments({"alg": "none", "typ": "JWT", "kid": kid}, payload) + "."


def forged_hs256(payload: dict[str, Any], signer: Signer) -> str:
    """HS256 with the (public) verification key's PEM as the HMAC secret: the classic
    algorithm-confusion forgery, made by hand (PyJWT refuses to make it)."""
    signing_input = _segments({"alg": "HS256", "typ": "JWT", "kid": signer.kid}, payload)
    mac = hmac.new(signer.public_pem(), signing_input.encode(), hashlib.sha256).digest()
    return signing_input + "." + _b64(mac)


@dataclass
class JwksServer:
    """A JWKS at ``url``; ``document`` is served as it is at each fetch, ``fetches`` counts
    them (``fetched`` is set at each)."""

    document: dict[str, Any]
    url: str = ""
    fetches: int = 0
    fetched: trio.Event = field(default_factory=trio.Event)

    async def handle(self, stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            chunk = await stream.receive_some(4096)
            if not chunk:
                return
            request += chunk
        self.fetches += 1
        self.fetched.set()
        self.fetched = trio.Event()
        body = json.dumps(self.document).encode()
        head = (
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        await stream.send_all(head + body)
        await stream.aclose()


@asynccontextmanager
async def serving_jwks(document: dict[str, Any]) -> AsyncIterator[JwksServer]:
    server = JwksServer(document)
    async with trio.open_nursery() as nursery:
        serve = functools.partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1")
        listeners = await nursery.start(serve)
        port = listeners[0].socket.getsockname()[1]
        server.url = f"http://127.0.0.1:{port}/jwks.json"
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()
