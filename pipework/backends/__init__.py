"""Backend calls from pipes: the built-in HTTP pipe (services, call templates, and the
clients that make the calls: a keep-alive pool over h11, TLS for https; httpx for an
injected transport). Built on
``pipes``; nothing below it knows of HTTP."""
