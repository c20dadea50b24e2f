"""Backend calls from pipes: the built-in HTTP pipe (services, call templates, and the
clients that make the calls: a keep-alive pool over h11, httpx for https). Built on
``pipes``; nothing below it knows of HTTP."""
