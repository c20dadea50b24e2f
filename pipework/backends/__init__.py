"""Backend calls from pipes: the built-in HTTP pipe on httpx (services, call templates and
the clients that make the calls). Built on ``pipes``; nothing below it knows of HTTP."""
