"""The peers' two-route gateway the threaded way (the "before" of pipework's seeds): Flask
on waitress, a WSGI server with a fixed pool of threads, and one shared ``httpx.Client``.
A request holds its thread for the whole backend call."""

from __future__ import annotations

import httpx
from flask import Flask, Response, jsonify

#: The same per-call time limit as the pipework gateway's services.
TIMEOUT = 5.0


def create_app(a_url: str, b_url: str) -> Flask:
    app = Flask(__name__)
    client = httpx.Client(timeout=TIMEOUT)

    def call(url: str) -> tuple[Response, int]:
        try:
            answer = client.get(url)
            answer.raise_for_status()
        except httpx.TimeoutException:
            return jsonify({"error": "backend timed out"}), 504
        except httpx.HTTPError:
            return jsonify({"error": "backend failed"}), 502
        return jsonify(answer.json()), 200

    def route_a() -> tuple[Response, int]:
        return call(f"{a_url}/a")

    def route_b() -> tuple[Response, int]:
        return call(f"{b_url}/b")

    app.add_url_rule("/a", "a", route_a)
    app.add_url_rule("/b", "b", route_b)
    return app
