"""The agent runtime: the sans-IO core made live inside a training or spare process.

One asyncio loop in a background thread owns the sockets (UDP gossip, TCP for large messages),
the timers that drive the core, the HTTP status page and the NVML health monitor (docs/design.md
sections 3, 9, 10). The training thread talks to it through :class:`.api.Agent`.
"""
