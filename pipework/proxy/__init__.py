"""Proxy routes: requests passed through to a service as they came, streamed both ways."""
