"""The demo gateway's Python pipes; pipework.toml names them by import path.

Each takes the job's context. The HTTP calls of the demo are declared in the file; these
functions do what a file cannot: combine answers, report progress, hand a backend a
signed callback URL and suspend until it calls.
"""

from __future__ import annotations

import functools
import os
import tomllib
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

import httpx

import pipework as pw

__all__ = [
    "build_report",
    "confirm_payment",
    "make_receipt",
    "payment_callback",
    "reports_url",
    "summarize_order",
    "wait_for_payment",
]

#: Overrides the reports service's address (run.py sets it when it picks free ports).
REPORTS_URL_ENV: Final = "PIPEWORK_DEMO_REPORTS_URL"
MAX_SECTIONS: Final = 10


class Refused(Exception):
    """The request asked for something this pipe will not do (a 422 to the client)."""

    http_status = 422


async def summarize_order(ctx: pw.Context) -> None:
    """Combine what the all_of stage fetched from users, quotes and inventory."""
    user, quote_, stock = ctx.state["user"], ctx.state["quote"], ctx.state["stock"]
    ctx.state["order"] = {
        "user": user["name"],
        "sku": quote_["sku"],
        "qty": quote_["qty"],
        "total": quote_["total"],
        "in_stock": stock["available"] >= quote_["qty"],
    }


async def make_receipt(ctx: pw.Context) -> None:
    """After the checkout graph: gold customers get 10% off the held price."""
    user, quote_, hold = ctx.state["user"], ctx.state["quote"], ctx.state["hold"]
    discount = 0.1 if user["tier"] == "gold" else 0.0
    ctx.state["receipt"] = {
        "user": user["name"],
        "tier": user["tier"],
        "sku": quote_["sku"],
        "qty": quote_["qty"],
        "total": round(quote_["total"] * (1 - discount), 2),
        "hold_id": hold["hold_id"],
    }


@functools.cache
def _configured_reports_url() -> str:
    with open(Path(__file__).with_name("pipework.toml"), "rb") as file:
        url: str = tomllib.load(file)["services"]["reports"]["base_url"]
    return url


def reports_url() -> str:
    """The reports service's base URL: ``$PIPEWORK_DEMO_REPORTS_URL``, else the one in
    pipework.toml beside this module."""
    # A Python pipe sees only its job, not the gateway's service clients, so it learns
    # the address the way other code learns its settings.
    return os.environ.get(REPORTS_URL_ENV) or _configured_reports_url()


async def build_report(ctx: pw.Context) -> None:
    """Fetch a report section by section from the reports service, reporting progress
    after each (``GET /jobs/{id}`` shows it while the job runs)."""
    sections = ctx.state.get("sections", 4)
    if not isinstance(sections, int) or not 1 <= sections <= MAX_SECTIONS:
        raise Refused(f"'sections' must be a whole number from 1 to {MAX_SECTIONS}")
    user = ctx.state["user"]
    # The calls share the job's deadline, so the client's timeout never outlives it.
    timeout = httpx.Timeout(min(2.0, ctx.remaining))
    parts: list[Any] = []
    async with httpx.AsyncClient(base_url=reports_url(), timeout=timeout, trust_env=False) as c:
        for n in range(1, sections + 1):
            await ctx.progress(n - 1, sections, f"fetching section {n} of {sections}")
            path = f"/reports/{quote(str(user['id']), safe='')}/sections/{n}"
            try:
                response = await c.get(path)
            except httpx.HTTPError as exc:
                raise pw.BackendError(
                    f"service 'reports' failed: {type(exc).__name__}", service="reports"
                ) from exc
            if response.status_code != 200:
                raise pw.BackendError(
                    f"service 'reports' answered {response.status_code}",
                    service="reports",
                    status=response.status_code,
                )
            parts.append(response.json())
    await ctx.progress(sections, sections, "done")
    ctx.state["report"] = {"user": user["name"], "sections": parts}


async def payment_callback(ctx: pw.Context) -> None:
    """A signed URL that resumes this job with signal 'paid'; the `charge` pipe sends
    it to the payments service."""
    ctx.state["callback_url"] = ctx.callback_url("paid", ttl=60)


async def wait_for_payment(ctx: pw.Context) -> None:
    """Park the job until the payments service posts to the callback URL: no worker is
    held meanwhile. Its body lands in state['payment']."""
    await ctx.suspend("paid", timeout=8, into="payment")


async def confirm_payment(ctx: pw.Context) -> None:
    payment, charge = ctx.state["payment"], ctx.state["charge"]
    if payment.get("charge_id") != charge["charge_id"]:
        raise pw.BackendError("payments called back for another charge", service="payments")
    ctx.state["paid"] = {
        "status": payment["status"],
        "charge_id": charge["charge_id"],
        "amount": payment["amount"],
        "sku": ctx.state["quote"]["sku"],
    }
