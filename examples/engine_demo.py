"""A small, real, in-process run of the pipework engine.

An order chain loads a user and a quote under their own admission keys, waits for a
payment signal (holding no worker meanwhile), then confirms. Run it with `make run`.
"""

from __future__ import annotations

import trio

import pipework as pw

engine = pw.Engine(
    pool=pw.WeightedPool(8, keys={"users": pw.Weights(reserve=2)}), default_timeout=10
)


@engine.pipe(key="users")
async def load_user(ctx: pw.Context) -> None:
    await trio.sleep(0.05)  # stands in for a backend call
    ctx.state["user"] = {"id": ctx.state["user_id"], "name": "Ada"}


@engine.pipe(key="quotes", timeout=1.0)
async def load_quote(ctx: pw.Context) -> None:
    await trio.sleep(0.02)
    ctx.state["quote"] = {"sku": ctx.state["sku"], "price": 12.5}


# The "payment provider": it learns which job to call back, and signals it when paid.
payments_send, payments_receive = trio.open_memory_channel[tuple[str, float]](100)


@engine.pipe
async def wait_for_payment(ctx: pw.Context) -> None:
    await ctx.progress(2, 3, "waiting for payment")
    price = ctx.state["quote"]["price"] if ctx.state["sku"] != "unpaid" else -1.0
    await payments_send.send((ctx.job_id, price))
    await ctx.suspend("paid", timeout=5, into="payment")


async def payment_provider() -> None:
    async for job_id, amount in payments_receive:
        if amount < 0:
            continue  # this customer never pays
        view = await engine.status(job_id)
        print(
            f"  provider: job {job_id[:8]}... is {view.status.value}, "
            f"progress {view.progress}; paying {amount}"
        )
        await trio.sleep(0.1)  # the customer takes a moment
        await engine.signal(job_id, "paid", {"amount": amount})


@engine.pipe
async def confirm(ctx: pw.Context) -> None:
    paid = ctx.state["payment"]["amount"]
    ctx.state["confirmation"] = {
        "user": ctx.state["user"]["name"],
        "sku": ctx.state["sku"],
        "paid": paid,
        "ok": paid >= ctx.state["quote"]["price"],
    }


engine.chain("order", load_user, load_quote, wait_for_payment, confirm, result="confirmation")


async def main() -> None:
    async with engine, trio.open_nursery() as nursery:
        nursery.start_soon(payment_provider)
        print("one order: load user, load quote, suspend for payment, confirm")
        print("  result:", await engine.run("order", {"user_id": 7, "sku": "tea"}))

        print("\nfive orders at once; a suspended order holds no worker slot:")
        async with trio.open_nursery() as orders:
            for n in range(5):
                orders.start_soon(one_order, n)

        print("\nan order nobody pays for expires at its deadline:")
        try:
            await engine.run("order", {"user_id": 1, "sku": "unpaid"}, timeout=0.5)
        except pw.DeadlineExceeded as exc:
            print(f"  {type(exc).__name__}: {exc}")
        nursery.cancel_scope.cancel()


async def one_order(n: int) -> None:
    result = await engine.run("order", {"user_id": n, "sku": f"sku-{n}"})
    print(f"  order {n}: {result}")


if __name__ == "__main__":
    trio.run(main)
