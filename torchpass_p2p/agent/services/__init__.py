"""The services an :class:`~torchpass_p2p.agent.runtime.AgentRuntime` runs beside its loop driver.

Each module holds one job, mostly as a small class given exactly the values and callbacks it
needs, so that it can be built and read alone: ``directory`` (who serves what, over the
authenticated TCP port), ``keys`` (reloading the key file, and checking whether the members
still accept this member's key), ``pulse_watch`` (this process's pulse responder, and pointing
the prober at the core's subjects), ``watchdog`` (a training loop that makes no progress),
``gpu_health`` (the health monitor's faults), ``addresses`` (where former members and joiners
are), ``events`` (what the core's events become: the log, the status page's recent events, the
host's changes), ``telemetry`` (counters and metrics), ``seeds`` (the configuration to join),
``status_page`` (the status server and the member table) and ``drain_guard`` (whether an
operator may drain this rank now).

What must stay true: no service holds the runtime (the status server alone is handed it, as
the narrow :class:`~torchpass_p2p.agent.http.StatusSource` it serves); a service's long-lived
tasks are started in the runtime's one :class:`~torchpass_p2p.tasks.OwnedTasks` (handed to
it), never on their own, so that stopping the runtime reaches every one; and a service hands
anything for the core back through a callback that runs on the runtime's loop, where the
runtime puts it into the core under its lock.
"""
