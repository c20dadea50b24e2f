"""The resilience benchmark's service and gateways (run by ``benchmarks/bench_resilience.py``).

:mod:`.replica` is one replica of the service, whose behaviour can be switched while it
serves (hang, fail a share of calls, go down, answer a share slowly); pipework serves
``gateway.toml`` (:mod:`.serve` runs it in its own process) and HAProxy, from Debian's
packages, the configuration :mod:`.haproxy` writes, with the same resilience settings.
"""
